"""numpy emulation of the PTX kernel's per-lane work, one warp at a time (CPU proof of the
layout + selector + fragment logic before any GPU exists).

Per lane and per 128-bit chunk (tile of 8 rows x 256 k) it does exactly what gen_ptx.py emits:
  words w0..w3 (fm8 codes), scale words s0..s3 (fm8 scales), x words (xfm)
  for q in 0..3 (groups j0 = 2q, j1 = 2q + 1 of the chunk):
      m = w & 0x33333333 ; h = w & 0xCCCCCCCC
      b(j0) = (prmt(LUT, 0, m),       prmt(LUT, 0, h >> 2))
      b(j1) = (prmt(LUT, 0, m >> 16), prmt(LUT, 0, h >> 18))
      per group: D = mma.m16n8k32(A = (x a0, 0, x a2, 0), B = b, C = 0)
                 acc_r = fma(D_r, f32 bits (scale_byte << 23), acc_r)   r = 0, 1 (c0, c1)
  end: warps' accumulators summed in warp order (split-K), times x_scale[token], fp32.
The mma is emulated from the per-lane fragments with the ISA's fragment -> matrix mapping
(layout.py docstring); products of e4m3 values are exact, the 32-term sum is exact in float64
and rounded once to fp32 (the hardware's internal accumulation order/precision may differ by
fp32 rounding; run_gpu.py checks against float64 with a tolerance).
"""
from __future__ import annotations

import numpy as np

from layout import LUT

U32 = np.uint32


def prmt(a, b, c):
    """PTX prmt.b32 default mode, elementwise over uint32 arrays: result byte i is byte
    (c >> 4i) & 7 of the 8-byte value {b, a} (a = bytes 0..3), or its sign replicated when
    bit 3 of that selector nibble is set. Only c bits 0..15 are read."""
    a, b, c = (np.asarray(v, dtype=np.uint64) for v in (a, b, c))
    src = a | (b << np.uint64(32))
    out = np.zeros(np.broadcast(a, b, c).shape, np.uint64)
    for i in range(4):
        sel = (c >> np.uint64(4 * i)) & np.uint64(0xF)
        byte = (src >> (np.uint64(8) * (sel & np.uint64(7)))) & np.uint64(0xFF)
        byte = np.where(sel & np.uint64(8), np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0)), byte)
        out |= byte << np.uint64(8 * i)
    return out.astype(U32)


def _e4m3_table() -> np.ndarray:
    v = np.zeros(256, np.float64)
    for b in range(256):
        s, e, m = b >> 7, (b >> 3) & 0xF, b & 7
        if e == 15 and m == 7:
            v[b] = np.nan
        elif e == 0:
            v[b] = (m / 8) * 2.0 ** -6
        else:
            v[b] = (1 + m / 8) * 2.0 ** (e - 7)
        if s:
            v[b] = -v[b]
    return v


E4M3 = _e4m3_table()


def reg_bytes(r) -> np.ndarray:
    """uint32 [...] -> e4m3 values [..., 4] (byte i = element i of the register)."""
    r = np.asarray(r, dtype=U32)
    return E4M3[(r[..., None] >> (U32(8) * np.arange(4, dtype=U32))) & U32(0xFF)]


def mma_m16n8k32(a, b, c):
    """Warp-level mma.sync.m16n8k32.row.col.f32.e4m3.e4m3.f32 from fragments:
    a uint32 [32, 4], b uint32 [32, 2], c float32 [32, 4] -> d float32 [32, 4]."""
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    A = np.full((16, 32), np.nan)
    B = np.full((32, 8), np.nan)
    av, bv = reg_bytes(a), reg_bytes(b)               # [32, 4, 4], [32, 2, 4]
    for r in range(4):
        rows = g + 8 * (r % 2)
        for i in range(4):
            A[rows, 4 * t + i + 16 * (r // 2)] = av[:, r, i]
    for r in range(2):
        for i in range(4):
            B[4 * t + i + 16 * r, g] = bv[:, r, i]
    assert not np.isnan(A).any() and not np.isnan(B).any(), "fragments do not cover the tiles"
    D = A @ B                                         # exact: e4m3 products, 32 terms
    d = np.empty((32, 4), np.float32)
    for r in range(4):
        d[:, r] = (D[g + 8 * (r // 2), 2 * t + (r % 2)] + c[:, r].astype(np.float64)).astype(np.float32)
    return d


def scale_float(byte) -> np.ndarray:
    """The kernel's UE8M0 -> fp32: bits = byte << 23 (byte 0 gives +0.0, 255 gives inf)."""
    return (np.asarray(byte, dtype=U32) << U32(23)).view(np.float32)


def fma32(a, b, c) -> np.ndarray:
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def decode_chunk(w: np.ndarray):
    """w uint32 [32, 4] (one lane row each) -> B fragments [8 groups][32, 2] exactly as the PTX."""
    out = []
    zero = np.zeros_like(w[:, 0])
    for q in range(4):
        m = w[:, q] & U32(0x33333333)
        h = w[:, q] & U32(0xCCCCCCCC)
        out.append(np.stack([prmt(LUT, zero, m), prmt(LUT, zero, h >> U32(2))], axis=1))
        out.append(np.stack([prmt(LUT, zero, m >> U32(16)), prmt(LUT, zero, h >> U32(18))], axis=1))
    return out


def warp_tile(codes_fm, scales_fm, xfm, tile: int, chunks) -> np.ndarray:
    """One warp, one tile (8 rows), the given chunks -> acc float32 [32, 2] (c0, c1 per lane)."""
    lane = np.arange(32)
    t = lane & 3
    acc = np.zeros((32, 2), np.float32)
    zero4 = np.zeros((32, 4), np.float32)
    for c in chunks:
        w = codes_fm[tile, c].view("<u4").reshape(32, 4).astype(U32)             # LDG.128 per lane
        s = scales_fm[tile, c][t].view("<u4").reshape(32, 4).astype(U32)         # LDG.128, shared by t
        xw = [xfm[4 * c + u].view("<u4").reshape(32, 4).astype(U32) for u in range(4)]  # 4 x LDG.128
        bfr = decode_chunk(w)
        for jj in range(8):
            x = xw[jj // 2]
            h = jj % 2
            a = np.stack([x[:, 2 * h], np.zeros(32, U32), x[:, 2 * h + 1], np.zeros(32, U32)], axis=1)
            d = mma_m16n8k32(a, bfr[jj], zero4)
            sw = s[:, jj // 2]
            for r in range(2):
                byte = (sw >> U32(8 * (2 * (jj % 2) + r))) & U32(0xFF)
                acc[:, r] = fma32(d[:, r], scale_float(byte), acc[:, r])
    return acc


def gemv(codes_fm, scales_fm, xfm, x_scale, n: int, k: int, t: int, warps: int = 1) -> np.ndarray:
    """Whole GEMV as the kernel computes it: per tile, `warps` warps split the chunks into
    contiguous ranges, partials summed in warp order; y float32 [T, N]."""
    nch = k // 256
    per = -(-nch // warps)
    lane = np.arange(32)
    g, tt = lane >> 2, lane & 3
    y = np.zeros((t, n), np.float32)
    xs = np.asarray(x_scale, np.float32)
    for tile in range(n // 8):
        tot = None
        for wi in range(warps):
            acc = warp_tile(codes_fm, scales_fm, xfm, tile, range(wi * per, min(nch, (wi + 1) * per)))
            tot = acc if tot is None else (tot + acc).astype(np.float32)
        for r in range(2):
            ok = g < t
            y[g[ok], 8 * tile + 2 * tt[ok] + r] = (tot[ok, r] * xs[g[ok]]).astype(np.float32)
    return y


# ----------------------------------------------------------------------------- reference side

def quantize_x(x):
    """float [T, K] (torch) -> (e4m3 bytes uint8 [T, K] numpy, x_scale float32 [T]):
    per-token scale amax / 448 (1.0 for an all-zero row), bytes = e4m3_rne(x / scale)."""
    import torch
    x = x.float()
    amax = x.abs().amax(dim=1)
    sc = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (x / sc[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).numpy().copy(), sc.numpy().astype(np.float32)


def reference(codes_v1, scales, x_bytes, x_scale) -> np.ndarray:
    """float64 y [T, N] = (decode_w2(codes, scales) @ e4m3(x_bytes)^T) * x_scale, via moet's
    torch reference decoder (the oracle the kernel must match)."""
    import torch
    from moet.kernels.reference import decode_w2
    w = decode_w2(torch.from_numpy(np.ascontiguousarray(codes_v1)), torch.from_numpy(np.ascontiguousarray(scales)))
    xv = E4M3[np.asarray(x_bytes)]
    return (xv @ w.double().numpy().T) * np.asarray(x_scale, np.float64)[:, None]
