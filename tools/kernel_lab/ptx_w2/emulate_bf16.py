"""bf16-activation variant of the wgmma W2 decode GEMV (gen_wgmma_bf16.py): the byte layouts, the
converters from canonical W2 v1 codes (bit-exact, invertible; torch fast paths), and a numpy emulation
of exactly the kernel's per-lane work (README section "bf16-activation wgmma kernel").

The MMA is `wgmma.mma_async.m64n8k16.f32.bf16.bf16` with A (the weights, 64 rows per warpgroup) in
registers and B (x, bf16, NOT quantized) in shared memory. Per warp, the m64nNk16 register-A fragment is
the mma.m16n8k16 A layout (PTX ISA "Register Fragments", wgmma .m64nNk16; g = lane >> 2, t = lane & 3):
  reg r (r = 0..3) holds two bf16, half e (0 low, 1 high) = A[16 w + g + 8 (r & 1), 2 t + e + 8 (r >> 1)]
  (= CUTLASS cute ALayout_64x16: thread strides (128, 1, 16), value strides (64, 8, 512) over m + 64 k).
D (f32, N = 8): d_q = D[16 w + g + 8 (q >> 1), 2 t + (q & 1)].

Weights: bf16 bits = neg << 15 | (s + 2 big) << 7 = +-1 or +-4 times 2^(s - 127): the UE8M0 scale byte s
goes straight into the exponent field during the decode (as moet's nb8), so the MMA accumulates the
whole K in fp32 with no per-group or per-chunk FFMA and no fallback path. Contract as nb8: exact for
scale bytes 1..252; byte 0 decodes the +-1 level as +-0 (reference +-2^-127), +-4 exactly; 253..255 are
not scales (overflow into inf / the sign).

Layouts (same byte counts as v1, 2.25 bits per weight):
  codes "fb16" uint8 [N/16, K/256, 2 (block b), 32 lanes, 16 B] = per lane and block 4 little-endian
      words q = 2 hr + u (hr: row g + 8 hr of the lane's warp tile; u: which 16 k of the group).
      Word (lane (g, t), block b of chunk c, q) holds the 16 weights of row 16 i + g + 8 hr,
      k = 256 c + 32 (4 b + t) + 16 u + 2 p + e (slot p = 0..7, half e = 0, 1): lane t holds all
      32 k of group 8 c + 4 b + t (K interleave), so a lane needs one scale per (row, block).
      Bits of weight (p, e): neg at NEG_BIT[p] + 16 e, big at BIG_BIT[p] + 16 e with
      NEG_BIT = 15 - p, BIG_BIT = 8 - p for p >= 1 and BIG_BIT[0] = 0 (code 0 = -4: neg 1 big 1,
      1 = -1: neg 1, 2 = +1, 3 = +4: big 1; as moet.formats.w2.to_nb8).
  Decode of word w into the bf16 pair of slot p (S = s * 0x00800080, the scale byte in both exponents):
      p >= 1: ((w & M_p) << p) + S,  M_p = (1 << (8 - p) | 1 << (15 - p)) * 0x00010001   (LOP3 + IMAD)
      p == 0: ((w & 0x00010001) << 8) + ((w & 0x80008000) | S)                        (2 LOP3 + IMAD)
      = 17 integer ops per 16 weights (1.0625 / weight); S = (prmt byte -> [s, 0, s, 0]) << 7 per
      (row, block): 2 ops per 64 weights.
  Which register: step jj = 4 u + p // 2 of the block's 8 wgmmas, reg r = hr + 2 (p & 1).
  scales "sw8" uint8 [N/16, K/256, 32 lanes, 4] (emulate_next.to_sw8): byte 2 b + hr = s(row g + 8 hr,
      group 8 c + 4 b + t); one 32-bit load per lane and chunk.
  x "xw16" bf16 [K/16, 2, 8, 8] (the shared-memory image of the wgmma B tiles, K-major, no swizzle):
      wgmma J = 16 c + 8 b + jj reads two core matrices (8 tokens x 16 B) 128 B apart (LBO 128);
      element [J, h, n, 2 t + e] = x[n, 256 c + 32 (4 b + t) + 4 jj + 2 h + e]; tokens >= T zero.
      K * 16 bytes (K 7168: 112 KiB of shared memory per CTA).
persistent_schedule: integer model of the persistent form's producer / consumer bookkeeping (the
  per-tile result is the same computation, so gemv_wgmma_bf16 is its reference too).
"""
from __future__ import annotations

import numpy as np

from emulate import U32
from layout import pack_v1, unpack_v1

NEG_BIT = tuple(15 - p for p in range(8))
BIG_BIT = (0,) + tuple(8 - p for p in range(1, 8))
SCALE_MUL = 0x00800080
WG_ROWS = 64


def slot_mask(p: int) -> int:
    return ((1 << NEG_BIT[p]) | (1 << BIG_BIT[p])) * 0x00010001


def _check(n, k):
    if n % WG_ROWS or k % 256:
        raise ValueError(f"fb16 layouts need N % 64 == 0 and K % 256 == 0, got N={n} K={k}")


def _code_index(n, k):
    """(row, k) of the weight at [tile16, chunk, block, lane, word q, slot p, half e]."""
    ti, ci, b, lane, q, p, e = np.meshgrid(np.arange(n // 16), np.arange(k // 256), np.arange(2), np.arange(32),
                                           np.arange(4), np.arange(8), np.arange(2), indexing="ij")
    g, t = lane >> 2, lane & 3
    hr, u = q >> 1, q & 1
    row = 16 * ti + g + 8 * hr
    kk = 256 * ci + 32 * (4 * b + t) + 16 * u + 2 * p + e
    return row, kk, p, e


def _neg_big(c):
    c = np.asarray(c, np.int64)
    return 1 - (c >> 1), 1 - ((c ^ (c >> 1)) & 1)


def to_fb16_codes(codes_v1):
    """v1 codes uint8 [N, K/4] -> fb16 uint8 [N/16, K/256, 2, 32, 16]."""
    n, k = codes_v1.shape[0], codes_v1.shape[1] * 4
    _check(n, k)
    c = unpack_v1(codes_v1)
    row, kk, p, e = _code_index(n, k)
    neg, big = _neg_big(c[row, kk])
    nb = np.asarray(NEG_BIT)[p] + 16 * e
    bb = np.asarray(BIG_BIT)[p] + 16 * e
    bits = (neg << nb) | (big << bb)                                  # int64 [..., 4, 8, 2]
    words = bits.reshape(*bits.shape[:-3], 4, 16).sum(axis=-1).astype(np.uint32)
    return np.ascontiguousarray(words.astype("<u4")).view(np.uint8).reshape(n // 16, k // 256, 2, 32, 16)


def from_fb16_codes(cf, n, k):
    """Inverse of to_fb16_codes -> v1 codes uint8 [N, K/4]."""
    words = np.ascontiguousarray(cf, np.uint8).view("<u4").reshape(n // 16, k // 256, 2, 32, 4).astype(np.int64)
    row, kk, p, e = _code_index(n, k)
    w = words[..., None, None]
    neg = (w >> (np.asarray(NEG_BIT)[p] + 16 * e)) & 1
    big = (w >> (np.asarray(BIG_BIT)[p] + 16 * e)) & 1
    code = (1 - neg) * 2 + (big ^ neg)                               # -4: 0, -1: 1, +1: 2, +4: 3
    c = np.zeros((n, k), np.uint8)
    c[row, kk] = code
    return pack_v1(c)


def to_fb16_codes_torch(codes_v1):
    import torch
    n, k = codes_v1.shape[0], codes_v1.shape[1] * 4
    _check(n, k)
    sh = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=codes_v1.device)
    c = ((codes_v1.unsqueeze(-1) >> sh) & 3).reshape(n, k).to(torch.int64)
    neg, big = 1 - (c >> 1), 1 - ((c ^ (c >> 1)) & 1)
    dev = c.device
    # row = 16 i + 8 hr + g ; k = 256 ci + 128 b + 32 t + 16 u + 2 p + e
    p = torch.arange(8, device=dev).view(8, 1)
    e = torch.arange(2, device=dev).view(1, 2)
    nb = (torch.tensor(NEG_BIT, device=dev).view(8, 1) + 16 * e).reshape(16)   # index 2 p + e
    bb = (torch.tensor(BIG_BIT, device=dev).view(8, 1) + 16 * e).reshape(16)
    del p
    bits = (neg.view(n, k // 16, 16) << nb) | (big.view(n, k // 16, 16) << bb)
    words = bits.sum(-1)                                                         # [n, k/16]: (ci, b, t, u)
    w = words.reshape(n // 16, 2, 8, k // 256, 2, 4, 2)                           # i hr g ci b t u
    w = w.permute(0, 3, 4, 2, 5, 1, 6).reshape(n // 16, k // 256, 2, 32, 4)       # i ci b (g t) (hr u)
    by = (w.unsqueeze(-1) >> (8 * torch.arange(4, device=dev))) & 0xFF
    return by.to(torch.uint8).reshape(n // 16, k // 256, 2, 32, 16).contiguous()


def to_xw16(x):
    """x float [T, K] (T <= 8; values taken as bf16: rounded RNE if not already) -> bf16 bits uint16
    [K/16, 2, 8, 8] (xw16 image)."""
    xb = bf16_bits(x)
    tt, k = xb.shape
    if tt > 8 or k % 256:
        raise ValueError(f"xw16 needs T <= 8 and K % 256 == 0, got T={tt} K={k}")
    pad = np.zeros((8, k), np.uint16)
    pad[:tt] = xb
    v = pad.reshape(8, k // 256, 2, 4, 2, 4, 2, 2)                   # n c b t u jj4 h e ; 4 jj + 2 h + e = 16 u + ...
    # k = 256 c + 128 b + 32 t + 4 jj + 2 h + e with jj = 4 u + jj4
    v = v.transpose(1, 2, 4, 5, 6, 0, 3, 7)                          # c b u jj4 h n t e
    return np.ascontiguousarray(v.reshape(k // 16, 2, 8, 8))


def from_xw16(xw, t, k):
    v = np.asarray(xw, np.uint16).reshape(k // 256, 2, 2, 4, 2, 8, 4, 2)   # c b u jj4 h n t e
    return np.ascontiguousarray(v.transpose(5, 0, 1, 6, 2, 3, 4, 7).reshape(8, k))[:t]


def to_xw16_torch(x_bf16):
    """torch bf16 [T, K] -> torch bf16 [K/16, 2, 8, 8] (same layout as to_xw16)."""
    import torch
    tt, k = x_bf16.shape
    pad = torch.zeros((8, k), dtype=torch.bfloat16, device=x_bf16.device)
    pad[:tt] = x_bf16
    return pad.reshape(8, k // 256, 2, 4, 2, 4, 2, 2).permute(1, 2, 4, 5, 6, 0, 3, 7).reshape(k // 16, 2, 8, 8).contiguous()


# ----------------------------------------------------------------------------- bf16 helpers

def bf16_bits(x) -> np.ndarray:
    """float -> bf16 bits (uint16), round to nearest even (torch's conversion)."""
    import torch
    t = torch.as_tensor(np.asarray(x, np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16).copy()


def bf16_value(bits) -> np.ndarray:
    """bf16 bits (uint16/uint32 low 16) -> float64."""
    b = np.asarray(bits).astype(np.uint32) & U32(0xFFFF)
    return (b << U32(16)).view(np.float32).astype(np.float64)


# ----------------------------------------------------------------------------- per-lane decode (the PTX ops)

def scale_word(sw, idx):
    """S for byte idx of the lane's scale word: prmt(sw, 0, [idx, 4, idx, 4]) << 7."""
    from emulate import prmt
    sel = idx | 4 << 4 | idx << 8 | 4 << 12
    return (prmt(sw, np.zeros_like(sw), sel) << U32(7)).astype(U32)


def decode_slot(w, s_word, p):
    """uint32 arrays (wrap-around, as the GPU): the bf16 pair of slot p of word w with S = s_word."""
    w = np.asarray(w, U32)
    if p == 0:
        t = (w & U32(0x00010001)).astype(np.uint64) << np.uint64(8)
        v = (w & U32(0x80008000)) | s_word
        return ((t + v.astype(np.uint64)) & np.uint64(0xFFFFFFFF)).astype(U32)
    t = (w & U32(slot_mask(p))).astype(np.uint64) << np.uint64(p)
    return ((t + np.asarray(s_word, U32).astype(np.uint64)) & np.uint64(0xFFFFFFFF)).astype(U32)


def decode_block(cw, sw, b):
    """cw uint32 [..., 4] (the lane's 4 words of block b), sw uint32 [...] -> A registers uint32
    [..., 8 steps, 4 regs] of the block's 8 wgmmas."""
    S = [scale_word(sw, 2 * b + hr) for hr in range(2)]
    out = np.zeros(cw.shape[:-1] + (8, 4), U32)
    for q in range(4):
        hr, u = q >> 1, q & 1
        for p in range(8):
            out[..., 4 * u + p // 2, hr + 2 * (p & 1)] = decode_slot(cw[..., q], S[hr], p)
    return out


def wgmma_m64n8k16_bf16(a, smem16, start, lbo=128, c=None):
    """wgmma.m64n8k16.f32.bf16.bf16, A from registers (uint32 [4 warps, 32 lanes, 4]), B from shared
    memory (bf16 bits, uint16 array addressed in bytes; K-major, no swizzle): B[kl, n] = bf16 at byte
    start + (kl // 8) * lbo + 16 n + 2 (kl % 8). Products exact, sum in float64, one fp32 rounding per
    instruction. Returns D float32 [4, 32, 4]."""
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    A = np.full((64, 16), np.nan)
    for w in range(4):
        for r in range(4):
            for e in range(2):
                A[16 * w + g + 8 * (r & 1), 2 * t + e + 8 * (r >> 1)] = bf16_value(a[w, :, r] >> U32(16 * e))
    kl, nn = np.meshgrid(np.arange(16), np.arange(8), indexing="ij")
    addr = start + (kl // 8) * lbo + 16 * nn + 2 * (kl % 8)
    assert (addr % 2 == 0).all()
    B = bf16_value(smem16[addr // 2])
    assert not np.isnan(A).any()
    D = A @ B
    d = np.empty((4, 32, 4), np.float32)
    for w in range(4):
        for q in range(4):
            v = D[16 * w + g + 8 * (q >> 1), 2 * t + (q & 1)]
            if c is not None:
                v = v + c[w, :, q].astype(np.float64)
            d[w, :, q] = v.astype(np.float32)
    return d


def warpgroup_chunks(cf, sw, smem16, tile, chunks, lbo=128):
    """One warpgroup (64 rows), the given chunks -> D float32 [4, 32, 4] (one accumulator, chained)."""
    d = np.zeros((4, 32, 4), np.float32)
    for c in chunks:
        t16 = 4 * tile + np.arange(4)
        cw = cf[t16, c].view("<u4").reshape(4, 2, 32, 4).astype(U32)               # [warp, b, lane, q]
        swd = sw[t16, c].view("<u4").reshape(4, 32).astype(U32)
        for b in range(2):
            A = decode_block(cw[:, b], swd, b)                                       # [4, 32, 8, 4]
            for jj in range(8):
                d = wgmma_m64n8k16_bf16(A[:, :, jj], smem16, (16 * c + 8 * b + jj) * 256, lbo, d)
    return d


def gemv_wgmma_bf16(cf, sw, xw16, n, k, t, kg=1, lbo=128):
    """The whole w2_gemv_wgmma_bf16 from its input bytes: y float32 [T, N]. kg warpgroups split a
    64-row tile's chunks into contiguous ranges (per = ceil(nch / kg)); partials summed in kg order."""
    _check(n, k)
    nch = k // 256
    per = -(-nch // kg)
    smem16 = np.ascontiguousarray(xw16, np.uint16).reshape(-1)
    lane = np.arange(32)
    g, tq = lane >> 2, lane & 3
    y = np.zeros((t, n), np.float32)
    for tile in range(n // 64):
        parts = [warpgroup_chunks(cf, sw, smem16, tile, range(min(j * per, nch), min((j + 1) * per, nch)), lbo)
                 for j in range(kg)]
        tot = parts[0] if kg == 1 else np.zeros_like(parts[0])
        if kg > 1:
            for p in parts:
                tot = (tot + p).astype(np.float32)
        for w in range(4):
            for q in range(4):
                row = 64 * tile + 16 * w + g + 8 * (q >> 1)
                tok = 2 * tq + (q & 1)
                ok = tok < t
                y[tok[ok], row[ok]] = tot[w, ok, q]
    return y


def inputs(codes_v1, scales, x):
    """canonical v1 codes / scales + x (float [T, K], taken as bf16) -> (cf, sw, xw16) as the kernel reads them."""
    from emulate_next import to_sw8
    return to_fb16_codes(codes_v1), to_sw8(scales), to_xw16(x)


def reference(codes_v1, scales, x) -> np.ndarray:
    """float64 y [T, N] = decode_w2(codes, scales) @ bf16(x)^T (moet's torch reference decoder)."""
    import torch
    from moet.kernels.reference import decode_w2
    w = decode_w2(torch.from_numpy(np.ascontiguousarray(codes_v1)), torch.from_numpy(np.ascontiguousarray(scales)))
    xv = bf16_value(bf16_bits(x))
    return xv @ w.double().numpy().T


def decoded_weights(cf, sw, n, k) -> np.ndarray:
    """The weights exactly as the kernel's per-lane decode produces them, float64 [N, K] (for the
    exactness contract test: equals decode_w2 for scale bytes 1..252)."""
    out = np.full((n, k), np.nan)
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    for i in range(n // 16):
        for c in range(k // 256):
            cw = cf[i, c].view("<u4").reshape(2, 32, 4).astype(U32)
            swd = sw[i, c].view("<u4").reshape(32).astype(U32)
            for b in range(2):
                A = decode_block(cw[b], swd, b)                                        # [32, 8, 4]
                for jj in range(8):
                    for r in range(4):
                        for e in range(2):
                            row = 16 * i + g + 8 * (r & 1)
                            kk = 256 * c + 32 * (4 * b + t) + 4 * jj + 2 * (r >> 1) + e
                            out[row, kk] = bf16_value(A[:, jj, r] >> U32(16 * e))
    return out


def persistent_schedule(n, k, mg, kg, st, grid, aligned=False, warp=0, lane=0):
    """Integer model of the persistent kernel's producer / consumer bookkeeping (gen_wgmma_bf16.
    _gen_persistent, same formulas): per CTA and warpgroup (mgi, kgi), the code-byte offsets the
    producer issues (cp relative to the codes base, for the given warp / lane) and the (16-row tile,
    chunk) the consumer decodes at each step, with the tile ends where the epilogue runs.
    Returns {(blk, mgi, kgi): {"issued": [...], "consumed": [...], "flushed": [...]}}."""
    nch = k // 256
    nr = n // (64 * mg)
    assert nch % kg == 0 and grid <= nr
    nloc = nch // kg
    out = {}
    for blk in range(grid):
        for kgi in range(kg):
            for mgi in range(mg):
                ntc = (nr - blk + grid - 1) // grid
                c0 = kgi * nloc
                r = blk
                tile = r * mg + mgi
                t16 = tile * 4 + warp
                cp = (t16 * nch + c0) * 1024 + lane * 16
                jc = (grid * 4 * mg * nch - nloc) * 1024
                ptl = ctl = ntc
                pfc = 0
                issued, consumed, flushed = [], [], []

                def produce(check=True):
                    nonlocal cp, pfc, ptl
                    if ptl != 0:
                        issued.append(cp)
                    cp += 1024
                    pfc += 1
                    if check and pfc == nloc:
                        cp += jc
                        pfc = 0
                        ptl = max(ptl, 1) - 1
                for _ in range(st - 1):                      # prologue: predicated hop every chunk
                    produce()
                fc, f = 0, 0
                cur = (t16, c0)
                while ctl:
                    u = f % st
                    produce(check=(u == 0) if aligned else True)
                    consumed.append(cur)
                    fc += 1
                    f += 1
                    cur = (cur[0], cur[1] + 1)
                    if (u == st - 1 or not aligned) and fc == nloc:
                        flushed.append(tile)
                        ctl -= 1
                        if ctl == 0:
                            break
                        r += grid
                        tile = r * mg + mgi
                        fc = 0
                        cur = (tile * 4 + warp, c0)
                out[(blk, mgi, kgi)] = {"issued": issued, "consumed": consumed, "flushed": flushed}
    return out
