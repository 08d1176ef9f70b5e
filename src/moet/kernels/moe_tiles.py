"""Device functions the grouped MoE kernels are built from (moe_gemm's grouped GEMMs): W2 / FP4
weight tiles decoded in registers into MMA operands (inline asm on a GPU, plain Triton integer
ops under the interpreter: the same bits), the dots over the slot tensors, tile loads, the
SwiGLU. The operand layouts and the decoders' exactness are described in moe_triton's docstring.
Importing this module needs triton.
"""
from __future__ import annotations

import triton
import triton.language as tl

from moet.kernels.pdl import prefetch_l2 as _prefetch_l2


# ==================================================================================== decoders

def _nb8_asm() -> str:
    """$8: two nb8 units (u in the low half, u + 1 in the high half; one scale group),
    $9: the group's UE8M0 byte. $0..$7: slot p = 0..7 as bf16 pairs (unit u, unit u + 1):
    ((w & M_p) << p) + (s << 7 | s << 23); slot 7's bits sit at 0/1 and take two steps."""
    lines = ["{", ".reg .b32 S, t, u;", "mul.lo.u32 S, $9, 0x00800080;"]
    for p in range(7):
        m = (1 << (8 - p)) | (1 << (15 - p)) | (1 << (24 - p)) | (1 << (31 - p))
        lines.append(f"and.b32 t, $8, {m:#010x};")
        lines.append(f"mad.lo.u32 ${p}, t, {1 << p}, S;")
    lines += ["and.b32 t, $8, 0x00010001;", "mad.lo.u32 u, t, 256, S;",
              "and.b32 t, $8, 0x00020002;", "mad.lo.u32 $7, t, 16384, u;", "}"]
    return "\n".join(lines)


def _fp4_asm() -> str:
    """$4: two units of 4 e2m1 nibbles (element 4u + p at bits 4p), $5: the bf16 pair of
    multipliers (e4m3 scale * 2^118). $0..$3: slot p as bf16 pairs. e2m1 bits EM (3) go to bf16
    bits 6..8 (so the pair reads e2m1 * 2^-126, E = 0 a bf16 subnormal) and the sign to bit 15,
    then one fma.rn.bf16x2 with -0 (exact: <= 6 significant bits, result normal)."""
    lines = ["{", ".reg .b32 t, v, z;", "mov.b32 z, 0x80008000;"]
    for p in range(4):
        d_em = 6 - 4 * p           # EM bits 4p..4p+2 -> 6..8
        d_s = 12 - 4 * p           # sign bit 4p+3 -> 15
        lines.append(f"shl.b32 t, $4, {d_em};" if d_em >= 0 else f"shr.u32 t, $4, {-d_em};")
        lines.append("and.b32 t, t, 0x01C001C0;")
        lines.append(f"shl.b32 v, $4, {d_s};" if d_s > 0 else "mov.b32 v, $4;")
        lines.append("and.b32 v, v, 0x80008000;")
        lines.append("or.b32 t, t, v;")
        lines.append(f"fma.rn.bf16x2 ${p}, t, $5, z;")
    lines.append("}")
    return "\n".join(lines)


NB8_ASM = tl.constexpr(_nb8_asm())
FP4_ASM = tl.constexpr(_fp4_asm())
_TWO_109 = tl.constexpr(2.0 ** 109)
_TWO_118 = tl.constexpr(2.0 ** 118)


@triton.jit
def _nb8_plain(wi, s, p: tl.constexpr):
    """Slot p of nb8 units (int32, 16 bits used) with UE8M0 byte s -> the same value as the asm
    (fp32 bits: sign, exponent s + 2 * big)."""
    if p < 7:
        big = (wi >> (8 - p)) & 1
        neg = (wi >> (15 - p)) & 1
    else:
        big = wi & 1
        neg = (wi >> 1) & 1
    return ((neg << 31) | ((s + 2 * big) << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _fp4_plain(wi, m, p: tl.constexpr):
    """Slot p of FP4 units (int32, 16 bits used) times the multiplier m (fp32, scale * 2^118):
    e2m1 bits under an fp32 exponent bias of 2^-126, exactly as the asm builds them in bf16."""
    nib = (wi >> (4 * p)) & 15
    return (((nib & 7) << 22) | ((nib & 8) << 28)).to(tl.float32, bitcast=True) * m


@triton.jit
def _e4m3_times_2p118(b):
    """e4m3fn byte (int32) -> fp32 value * 2^118 (exact; subnormals included)."""
    e = (b >> 3) & 15
    mt = b & 7
    normal = (((e + 238) << 23) | (mt << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, mt.to(tl.float32) * _TWO_109, normal)
    return tl.where((b & 0x80) != 0, -v, v)


@triton.jit
def _scale_value(s4, FMT: tl.constexpr, USE_ASM: tl.constexpr):
    """Scale bytes [BN, G] -> W2: the UE8M0 byte as int32; FP4: the e4m3 value * 2^118 (fp32)."""
    if FMT == 0:
        v = s4.to(tl.int32)
    elif USE_ASM >= 2:   # sm_89+: the GPU's own e4m3 conversion (cvt.rn.f16x2.e4m3x2), exact;
        v = s4.to(tl.float8e4nv, bitcast=True).to(tl.float32) * _TWO_118     # sm_90 AOT: shorter FP4 loops
    else:                # the interpreter and older GPUs (no e4m3 type in Triton before sm_89)
        v = _e4m3_times_2p118(s4.to(tl.int32))
    return v


@triton.jit
def _scale_values(s4, FMT: tl.constexpr, USE_ASM: tl.constexpr, KW2: tl.constexpr):
    """_scale_value; with KW2 (GemmConfig.kwidth2) behind a branch that is always taken (program ids
    are >= 0), so the weight tiles' backward slice ends at the branch. Why: Triton (3.6,
    AccelerateMatmul computeOrigBitWidth) gives a dot operand the K packing kWidth = 32 / (the
    narrowest load it can trace the operand back to). The 8-bit scale load makes it 4, which pairs
    each activation fragment across two MMAs (two register moves an MMA, activations by LDS.64).
    Behind the branch the narrowest load is the 16-bit code units: kWidth 2, activations by
    ldmatrix, the moves gone. sm_90 AOT, DeepSeek-V3 T = 1 tiles: W2 gate/up loop 927 -> 849
    instructions, down 283 -> 257; but each thread's units then span twice the scale groups (one
    LDS.U8 per byte, twice as many) and gate/up takes 168 registers instead of 127. On the H200
    that wins on some GEMMs and loses on others, so it is a per-GEMM choice. The same
    products; the MMAs group K differently, so the fp32 sums may differ in their last bits.
    test_moe_triton's AOT test asserts the kWidth of both forms."""
    if KW2:
        if tl.program_id(2) >= 0:
            v = _scale_value(s4, FMT, USE_ASM)
        else:
            v = _scale_value(s4, FMT, USE_ASM)
    else:
        v = _scale_value(s4, FMT, USE_ASM)
    return v


@triton.jit
def _w2_weights(c, s4, BN: tl.constexpr, BKH: tl.constexpr, USE_ASM: tl.constexpr, KW2: tl.constexpr = False):
    """c int16 [BN, BKH] nb8 units, s4 uint8 [BN, BKH/4] scale bytes -> the [BN, BKH] weight tiles
    of slots 0..7 (weight 8u + p): bf16 from the asm decoder, fp32 from its plain twin."""
    s = tl.reshape(tl.broadcast_to(_scale_values(s4, 0, USE_ASM, KW2)[:, :, None], (BN, BKH // 4, 4)), (BN, BKH))
    if USE_ASM:
        w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
            NB8_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [c, s], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
    else:
        wi = c.to(tl.int32) & 0xFFFF
        w0 = _nb8_plain(wi, s, 0)
        w1 = _nb8_plain(wi, s, 1)
        w2 = _nb8_plain(wi, s, 2)
        w3 = _nb8_plain(wi, s, 3)
        w4 = _nb8_plain(wi, s, 4)
        w5 = _nb8_plain(wi, s, 5)
        w6 = _nb8_plain(wi, s, 6)
        w7 = _nb8_plain(wi, s, 7)
    return w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def _fp4_weights(c, s4, BN: tl.constexpr, BKH: tl.constexpr, USE_ASM: tl.constexpr, KW2: tl.constexpr = False):
    """c int16 [BN, BKH] FP4 units, s4 uint8 [BN, BKH/4] e4m3 scale bytes -> the [BN, BKH] tiles of
    W * 2^-8 for slots 0..3 (weight 4u + p)."""
    m4 = _scale_values(s4, 1, USE_ASM, KW2)
    m = tl.reshape(tl.broadcast_to(m4[:, :, None], (BN, BKH // 4, 4)), (BN, BKH))
    if USE_ASM:
        mb = m.to(tl.bfloat16).to(tl.int16, bitcast=True)
        w0, w1, w2, w3 = tl.inline_asm_elementwise(
            FP4_ASM, "=r,=r,=r,=r,r,r", [c, mb], dtype=(tl.bfloat16,) * 4, is_pure=True, pack=2)
    else:
        wi = c.to(tl.int32) & 0xFFFF
        w0 = _fp4_plain(wi, m, 0)
        w1 = _fp4_plain(wi, m, 1)
        w2 = _fp4_plain(wi, m, 2)
        w3 = _fp4_plain(wi, m, 3)
    return w0, w1, w2, w3


@triton.jit
def _dot(w, x, acc, USE_ASM: tl.constexpr):
    """acc [BN, BM] += w [BN, BKH] @ x [BM, BKH]^T: bf16 operands on the GPU (fp32 accumulate),
    fp32 "ieee" under the interpreter."""
    if USE_ASM:
        out = tl.dot(w, tl.trans(x), acc)
    else:
        out = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
    return out


@triton.jit
def _slot_weights(c, s4, FMT: tl.constexpr, BN: tl.constexpr, BKH: tl.constexpr, USE_ASM: tl.constexpr,
                  KW2: tl.constexpr = False):
    """The weight tiles of slots 0..7 (W2; FP4 has 0..3, the rest alias slot 0 and are never
    multiplied, as _x_slots' x4..x7)."""
    if FMT == 0:
        w0, w1, w2, w3, w4, w5, w6, w7 = _w2_weights(c, s4, BN, BKH, USE_ASM, KW2)
    else:
        w0, w1, w2, w3 = _fp4_weights(c, s4, BN, BKH, USE_ASM, KW2)
        w4 = w0
        w5 = w0
        w6 = w0
        w7 = w0
    return w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def _dot2(acc, acc2, w, x, v, y, USE_ASM: tl.constexpr):
    """One dot into each of two accumulators, issued back to back (two independent MMA chains)."""
    return _dot(w, x, acc, USE_ASM), _dot(v, y, acc2, USE_ASM)


@triton.jit
def _dots(acc, c, s4, x0, x1, x2, x3, x4, x5, x6, x7, FMT: tl.constexpr, BN: tl.constexpr, BKH: tl.constexpr,
          USE_ASM: tl.constexpr, KW2: tl.constexpr = False):
    """acc [BN, BM] += W [BN, UPW BKH] @ x^T: c int16 [BN, BKH] code units, s4 uint8 [BN, BKH/4]
    scale bytes, x_p [BM, BKH] the activations of slot p (weight UPW u + p), bf16 / fp32. FP4's
    product is W * 2^-8 (the caller's scale_2 multiply restores it)."""
    w0, w1, w2, w3, w4, w5, w6, w7 = _slot_weights(c, s4, FMT, BN, BKH, USE_ASM, KW2)
    acc = _dot(w0, x0, acc, USE_ASM)
    acc = _dot(w1, x1, acc, USE_ASM)
    acc = _dot(w2, x2, acc, USE_ASM)
    acc = _dot(w3, x3, acc, USE_ASM)
    if FMT == 0:
        acc = _dot(w4, x4, acc, USE_ASM)
        acc = _dot(w5, x5, acc, USE_ASM)
        acc = _dot(w6, x6, acc, USE_ASM)
        acc = _dot(w7, x7, acc, USE_ASM)
    return acc


@triton.jit
def _dots_pair(acc, acc2, c, s4, c2, s42, x0, x1, x2, x3, x4, x5, x6, x7, FMT: tl.constexpr, BN: tl.constexpr,
               BKH: tl.constexpr, USE_ASM: tl.constexpr, KW2: tl.constexpr = False):
    """_dots for two row sets (gate into acc, up into acc2) at once, their dots alternating: each
    accumulator gets the same dots in the same order as from _dots, so the same bits."""
    w0, w1, w2, w3, w4, w5, w6, w7 = _slot_weights(c, s4, FMT, BN, BKH, USE_ASM, KW2)
    v0, v1, v2, v3, v4, v5, v6, v7 = _slot_weights(c2, s42, FMT, BN, BKH, USE_ASM, KW2)
    acc, acc2 = _dot2(acc, acc2, w0, x0, v0, x0, USE_ASM)
    acc, acc2 = _dot2(acc, acc2, w1, x1, v1, x1, USE_ASM)
    acc, acc2 = _dot2(acc, acc2, w2, x2, v2, x2, USE_ASM)
    acc, acc2 = _dot2(acc, acc2, w3, x3, v3, x3, USE_ASM)
    if FMT == 0:
        acc, acc2 = _dot2(acc, acc2, w4, x4, v4, x4, USE_ASM)
        acc, acc2 = _dot2(acc, acc2, w5, x5, v5, x5, USE_ASM)
        acc, acc2 = _dot2(acc, acc2, w6, x6, v6, x6, USE_ASM)
        acc, acc2 = _dot2(acc, acc2, w7, x7, v7, x7, USE_ASM)
    return acc, acc2


@triton.jit
def _dots_split(acc, acc2, c, s4, x0, x1, x2, x3, x4, x5, x6, x7, FMT: tl.constexpr, BN: tl.constexpr,
                BKH: tl.constexpr, USE_ASM: tl.constexpr, KW2: tl.constexpr = False):
    """_dots with the even slots into acc and the odd ones into acc2 (two MMA chains; acc + acc2
    is _dots' sum in another fp32 order)."""
    w0, w1, w2, w3, w4, w5, w6, w7 = _slot_weights(c, s4, FMT, BN, BKH, USE_ASM, KW2)
    acc, acc2 = _dot2(acc, acc2, w0, x0, w1, x1, USE_ASM)
    acc, acc2 = _dot2(acc, acc2, w2, x2, w3, x3, USE_ASM)
    if FMT == 0:
        acc, acc2 = _dot2(acc, acc2, w4, x4, w5, x5, USE_ASM)
        acc, acc2 = _dot2(acc, acc2, w6, x6, w7, x7, USE_ASM)
    return acc, acc2


@triton.jit
def _tile_ptrs(base, r64, col, st, COLS: tl.constexpr, STEP: tl.constexpr, TCOLS: tl.constexpr,
               TILED: tl.constexpr):
    """[rows, STEP] pointers into one slot's [N, COLS] array at columns col = st * STEP + 0..STEP-1:
    row-major, or TILED (the nb8t layout, moet.formats.w2.tile_rows: 64-row x TCOLS tiles, each one
    contiguous block). With STEP a multiple of TCOLS the tile index moves by a scalar a step and the
    in-tile part is loop-invariant (hoisted); otherwise it is computed per element."""
    if TILED:
        rt = (r64[:, None] // 64) * (COLS // TCOLS)
        rin = (r64[:, None] % 64) * TCOLS
        if STEP % TCOLS == 0:
            lc = tl.arange(0, STEP)
            return base + (rt + st * (STEP // TCOLS) + lc[None, :] // TCOLS) * (64 * TCOLS) + rin + lc[None, :] % TCOLS
        else:
            return base + (rt + col[None, :] // TCOLS) * (64 * TCOLS) + rin + col[None, :] % TCOLS
    else:
        return base + r64[:, None] * COLS + col[None, :]


@triton.jit
def _rows_codes(wq, sc, rows, rmask, u, umask, g, gmask, st, UNITS: tl.constexpr, G: tl.constexpr,
                FMT: tl.constexpr, BKH: tl.constexpr, TILED: tl.constexpr):
    """Step st's code units [rows, BKH] and scale bytes [rows, BKH/4] of rows (u = st * BKH +
    0..BKH-1, g likewise in scale bytes; masked units read 0, masked scales a neutral byte).
    TILED: a row-tiled pool, nb8t or nvfp4t (256-weight tiles: 32 / 64 code units and 8 / 16 scale
    bytes a tile row)."""
    r64 = rows.to(tl.int64)
    TC: tl.constexpr = 32 if FMT == 0 else 64          # 16-bit units of a 256-weight tile row (8 / 4 weights each)
    c = tl.load(_tile_ptrs(wq, r64, u, st, UNITS, BKH, TC, TILED), mask=rmask[:, None] & umask[None, :], other=0)
    s4 = tl.load(_tile_ptrs(sc, r64, g, st, G, BKH // 4, TC // 4, TILED), mask=rmask[:, None] & gmask[None, :],
                 other=127 if FMT == 0 else 0x38)
    return c, s4


@triton.jit
def _rows_dots(acc, wq, sc, rows, rmask, u, umask, g, gmask, x0, x1, x2, x3, x4, x5, x6, x7, st,
               UNITS: tl.constexpr, G: tl.constexpr, FMT: tl.constexpr, BN: tl.constexpr, BKH: tl.constexpr,
               USE_ASM: tl.constexpr, TILED: tl.constexpr = False, KW2: tl.constexpr = False):
    """Step st of rows' dots (_rows_codes' tiles decoded and multiplied into acc)."""
    c, s4 = _rows_codes(wq, sc, rows, rmask, u, umask, g, gmask, st, UNITS, G, FMT, BKH, TILED)
    return _dots(acc, c, s4, x0, x1, x2, x3, x4, x5, x6, x7, FMT, BN, BKH, USE_ASM, KW2)


@triton.jit
def _rows_dots_pair(acc, acc2, wq, sc, rows, rows2, rmask, u, umask, g, gmask, x0, x1, x2, x3, x4, x5, x6, x7,
                    st, UNITS: tl.constexpr, G: tl.constexpr, FMT: tl.constexpr, BN: tl.constexpr,
                    BKH: tl.constexpr, USE_ASM: tl.constexpr, TILED: tl.constexpr, KW2: tl.constexpr = False):
    """_rows_dots for rows (into acc) and rows2 (into acc2) with their dots alternating (gate/up
    with GemmConfig.chains 2): the same bits as two _rows_dots calls."""
    c, s4 = _rows_codes(wq, sc, rows, rmask, u, umask, g, gmask, st, UNITS, G, FMT, BKH, TILED)
    c2, s42 = _rows_codes(wq, sc, rows2, rmask, u, umask, g, gmask, st, UNITS, G, FMT, BKH, TILED)
    return _dots_pair(acc, acc2, c, s4, c2, s42, x0, x1, x2, x3, x4, x5, x6, x7, FMT, BN, BKH, USE_ASM, KW2)


@triton.jit
def _rows_dots_split(acc, acc2, wq, sc, rows, rmask, u, umask, g, gmask, x0, x1, x2, x3, x4, x5, x6, x7, st,
                     UNITS: tl.constexpr, G: tl.constexpr, FMT: tl.constexpr, BN: tl.constexpr,
                     BKH: tl.constexpr, USE_ASM: tl.constexpr, TILED: tl.constexpr, KW2: tl.constexpr = False):
    """_rows_dots over two accumulators (even / odd slots; down with GemmConfig.chains 2): acc +
    acc2 is the one-chain sum in another fp32 order."""
    c, s4 = _rows_codes(wq, sc, rows, rmask, u, umask, g, gmask, st, UNITS, G, FMT, BKH, TILED)
    return _dots_split(acc, acc2, c, s4, x0, x1, x2, x3, x4, x5, x6, x7, FMT, BN, BKH, USE_ASM, KW2)


@triton.jit
def _x_slots(xp, step, xm, FMT: tl.constexpr):
    """The activation tiles of slots 0..7 (W2; FP4 uses 0..3, the rest alias slot 0): slot q at
    xp + q * step (step K / UPW: the rows are slot-major)."""
    x0 = tl.load(xp, mask=xm, other=0.0)
    x1 = tl.load(xp + step, mask=xm, other=0.0)
    x2 = tl.load(xp + 2 * step, mask=xm, other=0.0)
    x3 = tl.load(xp + 3 * step, mask=xm, other=0.0)
    if FMT == 0:
        x4 = tl.load(xp + 4 * step, mask=xm, other=0.0)
        x5 = tl.load(xp + 5 * step, mask=xm, other=0.0)
        x6 = tl.load(xp + 6 * step, mask=xm, other=0.0)
        x7 = tl.load(xp + 7 * step, mask=xm, other=0.0)
    else:
        x4 = x0
        x5 = x0
        x6 = x0
        x7 = x0
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _prefetch_slab(wq, sc, rows, N: tl.constexpr, u0, UNITS: tl.constexpr, G: tl.constexpr, FMT: tl.constexpr,
                   SPAN: tl.constexpr, POINTS: tl.constexpr, TILED: tl.constexpr):
    """Prefetch into L2 the code units [u0, u0 + SPAN) and their scale bytes of rows (clamped into
    the array: a duplicate point re-hits a line): POINTS per row, one per 128 bytes of a row-major
    row, one per tile row (64 / 128 bytes) of a row-tiled one."""
    TC: tl.constexpr = 32 if FMT == 0 else 64
    PSTEP: tl.constexpr = TC if TILED else 64
    r64 = tl.minimum(rows, N - 1).to(tl.int64)
    j = tl.arange(0, POINTS)
    u = tl.minimum(u0 + j * PSTEP, tl.minimum(u0 + SPAN, UNITS) - 1)
    _prefetch_l2(_tile_ptrs(wq, r64, u, 0, UNITS, 1, TC, TILED))          # STEP 1: the per-element form
    _prefetch_l2(_tile_ptrs(sc, r64, u // 4, 0, G, 1, TC // 4, TILED))


@triton.jit
def _swiglu(g, u, limit, HAS_LIMIT: tl.constexpr, alpha=1.0, HAS_ALPHA: tl.constexpr = False):
    """reference.ExpertActivation: SiLU(g) * u, the clamp first with HAS_LIMIT; HAS_ALPHA
    (gpt-oss): g * sigmoid(alpha g) * (u + 1)."""
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    if HAS_ALPHA:
        return g / (1.0 + tl.exp(-(g * alpha))) * (u + 1.0)
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _add_gate_up_bias(g, u, bias_ptr, expert, n, mask, N: tl.constexpr):
    """g, u [BN, BM] (or [BI]) + the gate / up biases of each column's expert (bias [E, 2N]:
    gate biases, then up), gathered by expert id."""
    row = bias_ptr + expert.to(tl.int64) * (2 * N)
    g = g + tl.load(row + n, mask=mask, other=0.0).to(tl.float32)
    u = u + tl.load(row + N + n, mask=mask, other=0.0).to(tl.float32)
    return g, u
