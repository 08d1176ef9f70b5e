"""W2: moet's sign-symmetric 2-bit code for routed-expert weights (SPEC 2.1).

Value of element (n, k) = LEVELS[code[n, k]] * 2**(scale[n, k // 32] - 127), with
  LEVELS = (-4, -1, +1, +4)   code 0: -4, 1: -1, 2: +1, 3: +4
  scale  = one UE8M0 byte per 32 consecutive K elements (exponent + 127)
Reference byte layout ("row-major v1", docs/formats.md):
  codes  uint8 [N, K/4]   element k = 4j + i sits in bits 2i..2i+1 of byte j (first element
                          in the low bits)
  scales uint8 [N, K/32]
2.25 bits per weight.

Re-quantization (the "published" scale rule), exact on float64 input:
  block exponent e = round(log2(amax / 6)) clamped to [-127, 127]; all-zero blocks: -127
  u = |w| / 2**e snapped to e2m1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} (ties to the lower,
  saturating at 6); {0, .5, 1, 1.5, 2} -> 1 and {3, 4, 6} -> 4; the sign bit is kept, so +0
  -> +1 and -0 -> -1. Because the snap ties to the lower value, this is exactly
  "level 4 iff |w| > 2.5 * 2**e", which is what the fast path computes.
Zero-sign modes for exact zeros: "sign" keeps each zero's sign bit; "alt" gives zeros at even
k the + sign and at odd k the - sign; "auto" uses "alt" when more than 95% of the tensor's
exact zeros share one sign (an exporter that writes every zero as +0 would otherwise bias the
tensor by +1 level per zero), else "sign".

Two implementations: `quantize` (vectorised torch, CPU or GPU) and `quantize_reference`
(a literal per-block float64/Fraction transcription of the rule above, for tests). They agree
bit for bit for scale_rule="published".
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch

from moet.errors import FormatError
from moet.formats import e2m1
from moet.formats._checks import label, require_2d_divisible, require_finite, require_float
from moet.formats.row_tiles import TILE_ROWS, TILE_WEIGHTS, tile_rows, untile_rows  # noqa: F401 (nb8t, re-exported)

LEVELS: tuple[float, ...] = (-4.0, -1.0, 1.0, 4.0)
BLOCK = 32
CODES_PER_BYTE = 4
ZERO_MODES = ("auto", "sign", "alt")
# published: e = round(log2(amax/6)) (the original design's rule, default: its measured
# quality and pack compatibility). mse: per block, the exponent among e-2..e+3 with the least
# squared error for these four levels (docs/formats.md has the measured gain).
SCALE_RULES = ("published", "mse")
AUTO_ZERO_SHARE = 0.95
MIN_EXP, MAX_EXP = -127, 127
_MSE_OFFSETS = (0, 1, -1, 2, -2, 3)  # order = tie-break preference (published first)


def _smallest_double_above_3sqrt2_over_8() -> float:
    """round(log2(amax/6)) = j - 4 + [m > 3*sqrt(2)/8] for amax = m * 2**j, m in [0.5, 1).
    The threshold is irrational, so for a double m: m > T  <=>  m >= (smallest double > T).
    Found exactly with rationals (T**2 = 9/32)."""
    d = 3 * math.sqrt(2) / 8
    while Fraction(d) ** 2 < Fraction(9, 32):
        d = math.nextafter(d, 1.0)
    while Fraction(math.nextafter(d, 0.0)) ** 2 > Fraction(9, 32):
        d = math.nextafter(d, 0.0)
    return d


_ROUND_UP_MANTISSA = _smallest_double_above_3sqrt2_over_8()


@dataclass(slots=True)
class W2Tensor:
    codes: torch.Tensor    # uint8 [N, K/4]
    scales: torch.Tensor   # uint8 [N, K/32]
    zero_mode: str = "sign"        # the mode actually applied ("auto" resolved to "sign"/"alt")
    scale_rule: str = "published"

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * CODES_PER_BYTE

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel()

    def to(self, device: torch.device | str) -> "W2Tensor":
        return W2Tensor(self.codes.to(device), self.scales.to(device), self.zero_mode, self.scale_rule)


# ----------------------------------------------------------------------------- packing

def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes in 0..3 -> [N, K/4] bytes (element 4j+i in bits 2i..2i+1 of byte j)."""
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 4, 4)
    return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/4] bytes -> [N, K] codes in 0..3."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 3).flatten(-2)


# ----------------------------------------------------------------------------- kernel layout nb8
# The layout the Triton MoE kernels read (docs/formats.md, "Kernel layout nb8"): codes as
# little-endian 16-bit units, unit u of a row = elements 8u .. 8u+7 (slot p = element 8u + p),
# each element as two bits neg (1 = negative) and big (1 = |level| 4): slot p < 7 at bits
# (big 8 - p, neg 15 - p), slot 7 at (big 0, neg 1). Same size as v1; scales unchanged. A
# 32-bit pair of units then decodes to the bf16 pair of slot p as ((w & M_p) << p) + scale
# term: one LOP3 + one IMAD per two weights (docs/kernels.md, W2 decode).
NB8_BIG_BIT = (8, 7, 6, 5, 4, 3, 2, 0)
NB8_NEG_BIT = (15, 14, 13, 12, 11, 10, 9, 1)


def to_nb8(codes: torch.Tensor) -> torch.Tensor:
    """v1 codes uint8 [..., K/4] -> nb8 codes uint8 [..., K/4] (bit-exact, invertible; K % 8 == 0)."""
    if codes.dtype != torch.uint8 or codes.shape[-1] % 2:
        raise FormatError(f"to_nb8 needs uint8 codes with an even last dimension, got {codes.dtype} {tuple(codes.shape)}")
    b = codes.to(torch.int32)
    v = b[..., 0::2] | (b[..., 1::2] << 8)               # 8 codes per 16-bit unit, element 8u+p at bits 2p
    out = torch.zeros_like(v)
    for p in range(8):
        c = (v >> (2 * p)) & 3
        neg = 1 - (c >> 1)                                # codes 0, 1 are negative
        big = 1 - ((c ^ (c >> 1)) & 1)                    # codes 0, 3 are |4|
        out |= (big << NB8_BIG_BIT[p]) | (neg << NB8_NEG_BIT[p])
    return torch.stack((out & 0xFF, out >> 8), dim=-1).flatten(-2).to(torch.uint8)


def from_nb8(nb: torch.Tensor) -> torch.Tensor:
    """Inverse of to_nb8: nb8 codes uint8 [..., K/4] -> v1 codes uint8 [..., K/4]."""
    if nb.dtype != torch.uint8 or nb.shape[-1] % 2:
        raise FormatError(f"from_nb8 needs uint8 codes with an even last dimension, got {nb.dtype} {tuple(nb.shape)}")
    b = nb.to(torch.int32)
    u = b[..., 0::2] | (b[..., 1::2] << 8)
    v = torch.zeros_like(u)
    for p in range(8):
        big = (u >> NB8_BIG_BIT[p]) & 1
        neg = (u >> NB8_NEG_BIT[p]) & 1
        v |= ((1 - neg) * 2 + (big ^ neg)) << (2 * p)     # -4: 0, -1: 1, +1: 2, +4: 3
    return torch.stack((v & 0xFF, v >> 8), dim=-1).flatten(-2).to(torch.uint8)


# ----------------------------------------------------------------------------- kernel layout nb8t
# nb8 codes and the scales with their rows tiled: tile_rows / untile_rows (moet.formats.row_tiles,
# docs/formats.md "Kernel layout nb8t"), the same bytes permuted, bit-exact both ways.
NB8T_ROWS, NB8T_WEIGHTS = TILE_ROWS, TILE_WEIGHTS


def dequantize(t: W2Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W2Tensor -> [N, K] values (exact in float32: +-1/+-4 times a power of two >= 2**-127)."""
    n, k = t.shape
    if t.scales.shape != (n, k // BLOCK):
        raise FormatError(f"W2 scales shape {tuple(t.scales.shape)} does not match codes for [{n}, {k}]")
    levels = torch.tensor(LEVELS, dtype=dtype, device=t.codes.device)
    vals = levels[unpack_codes(t.codes).long()].reshape(n, k // BLOCK, BLOCK)
    exps = (t.scales.to(torch.int32) - 127).unsqueeze(-1)
    return torch.ldexp(vals, exps).reshape(n, k).to(dtype)


# ----------------------------------------------------------------------------- fast path

def published_exponent(amax: torch.Tensor) -> torch.Tensor:
    """round(log2(amax / 6)) per block, exact, as int32; all-zero blocks -> -127; clamped."""
    m, j = torch.frexp(amax.double())
    e = j.to(torch.int32) - 4 + (m >= _ROUND_UP_MANTISSA).to(torch.int32)
    e = torch.where(amax > 0, e, torch.full_like(e, MIN_EXP))
    return e.clamp(MIN_EXP, MAX_EXP)


def _magnitude_is_4(absw: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """[N, B, 32] |w| (float64) and [N, B] exponents -> bool: level 4 (else 1)."""
    thr = torch.ldexp(torch.full(e.shape, 2.5, dtype=torch.float64, device=e.device), e)
    return absw > thr.unsqueeze(-1)


def _mse_exponent(absw: torch.Tensor, e0: torch.Tensor) -> torch.Tensor:
    best_err, best_e = None, None
    for d in _MSE_OFFSETS:
        e = (e0 + d).clamp(MIN_EXP, MAX_EXP)
        big = _magnitude_is_4(absw, e)
        recon = torch.ldexp(torch.where(big, 4.0, 1.0).to(torch.float64), e.unsqueeze(-1))
        err = ((absw - recon) ** 2).sum(dim=-1)
        if best_err is None:
            best_err, best_e = err, e
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_e = torch.where(better, e, best_e)
    return best_e


def resolve_zero_mode(w: torch.Tensor, zero_mode: str) -> str:
    """'auto' -> 'alt' when > 95% of the exact zeros of w share one sign, else 'sign'."""
    return _resolve_zero_mode_from_masks(w == 0, torch.signbit(w), zero_mode)


def _encode(big: torch.Tensor, neg: torch.Tensor, zero: torch.Tensor, mode: str, k: int) -> torch.Tensor:
    """Shared tail of every path: bool tensors [N, K] (or [N, K/b, b]) -> packed codes [N, K/4].
    code = 2*(not neg) + (big xor neg): 0 = -4, 1 = -1, 2 = +1, 3 = +4. Bool tensors are viewed as
    uint8 (no copies): this tail runs once per weight and dominates CPU conversion time."""
    n = big.shape[0]
    big, neg, zero = big.reshape(n, k), neg.reshape(n, k), zero.reshape(n, k)
    if mode == "alt":
        odd_k = torch.arange(k, device=neg.device) % 2 == 1
        neg = torch.where(zero, odd_k, neg)
    code = (big ^ neg).view(torch.uint8) | ((~neg).view(torch.uint8) << 1)
    return pack_codes(code)


def _resolve_zero_mode_from_masks(zero: torch.Tensor, neg: torch.Tensor, zero_mode: str) -> str:
    if zero_mode not in ZERO_MODES:
        raise FormatError(f"unknown zero_mode {zero_mode!r}; choose one of {', '.join(ZERO_MODES)}")
    if zero_mode != "auto":
        return zero_mode
    n_zero = int(torch.count_nonzero(zero))
    if n_zero == 0:
        return "sign"
    n_neg = int(torch.count_nonzero(zero & neg))
    return "alt" if max(n_neg, n_zero - n_neg) > AUTO_ZERO_SHARE * n_zero else "sign"


def _check_scale_rule(scale_rule: str) -> None:
    if scale_rule not in SCALE_RULES:
        raise FormatError(f"unknown scale_rule {scale_rule!r}; choose one of {', '.join(SCALE_RULES)}")


def quantize(w: torch.Tensor, *, zero_mode: str = "auto", scale_rule: str = "published",
             name: str | None = None) -> W2Tensor:
    """float [N, K] (K % 32 == 0) -> W2Tensor, on w's device, exact for any float dtype.

    float64 input is compared in float64. bf16/fp16/fp32 input is compared in float32, which is
    exact too: |w| is exact and 2.5 * 2**e is a float32 for every exponent such input can
    produce (e <= 125 because amax <= float32 max)."""
    require_float(w, name)
    n, k = require_2d_divisible(w, BLOCK, name)
    require_finite(w, name)
    _check_scale_rule(scale_rule)
    work = torch.float64 if w.dtype == torch.float64 else torch.float32
    wb = w.to(work).reshape(n, k // BLOCK, BLOCK)
    absw = wb.abs()
    e = published_exponent(absw.amax(dim=-1))
    if scale_rule == "mse":
        e = _mse_exponent(absw.double(), e)
    thr = torch.ldexp(torch.full(e.shape, 2.5, dtype=torch.float64, device=e.device), e).to(work)
    big = absw > thr.unsqueeze(-1)
    neg = torch.signbit(w)
    zero = w == 0
    mode = _resolve_zero_mode_from_masks(zero, neg, zero_mode)
    return W2Tensor(_encode(big, neg, zero, mode, k), (e + 127).to(torch.uint8), mode, scale_rule)


def from_float64(w64: torch.Tensor, *, zero_mode: str = "auto", scale_rule: str = "published",
                 name: str | None = None) -> W2Tensor:
    """Same as quantize; named for the f64-exact pipeline (decode checkpoint -> float64 -> W2)."""
    return quantize(w64, zero_mode=zero_mode, scale_rule=scale_rule, name=name)


def _from_e2m1_codes(codes: torch.Tensor, mult: torch.Tensor, block: int, *, zero_mode: str,
                     scale_rule: str, name: str | None) -> W2Tensor:
    """W2 from e2m1 codes [N, K] with one float64 multiplier per `block` codes ([N, K/block]),
    value = e2m1(code) * mult: the common shape of NVFP4 (block 16, mult = scale * scale_2) and
    MXFP4 (block 32, mult = 2**x).

    Works in the code domain: e2m1 magnitudes have 2 significant bits and mult at most 53, so
    every product is exact in float64 and is only formed per block (8 magnitudes x K/block),
    never per element. Per element only integer compares remain: level 4 iff the magnitude
    index is >= the smallest index whose exact value exceeds 2.5 * 2**e."""
    n, k = codes.shape
    if scale_rule == "mse":   # the MSE search needs per-element values: take the float64 route
        vals = e2m1.decode(codes, torch.float64) * mult.repeat_interleave(block, dim=1)
        return quantize(vals, zero_mode=zero_mode, scale_rule=scale_rule, name=name)
    mags = torch.tensor(e2m1.MAGNITUDES, dtype=torch.float64, device=codes.device)
    mag_idx = (codes & 7).reshape(n, k // block, block)
    absmult = mult.abs()
    block_max = mags[mag_idx.amax(dim=-1).long()] * absmult                                   # exact
    amax32 = block_max.reshape(n, k // BLOCK, BLOCK // block).amax(dim=-1)
    e = published_exponent(amax32)                                                          # [N, K/32]
    thr = torch.ldexp(torch.full(e.shape, 2.5, dtype=torch.float64, device=e.device), e)
    thr = thr.repeat_interleave(BLOCK // block, dim=1)                                       # [N, K/block]
    # smallest magnitude index whose exact value exceeds the threshold (8 = none does)
    j_min = 8 - torch.count_nonzero(mags * absmult.unsqueeze(-1) > thr.unsqueeze(-1), dim=-1)
    big = mag_idx >= j_min.to(torch.uint8).unsqueeze(-1)
    # IEEE product sign: sign(code) xor sign(mult), also for zeros (-0 * 2 = -0, 0 * -2 = -0)
    neg = (codes.reshape(n, k // block, block) >= 8) ^ torch.signbit(mult).unsqueeze(-1)
    zero = (mag_idx == 0) | (absmult == 0).unsqueeze(-1)
    mode = _resolve_zero_mode_from_masks(zero, neg, zero_mode)
    return W2Tensor(_encode(big, neg, zero, mode, k), (e + 127).to(torch.uint8), mode, scale_rule)


def from_nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor, *,
               zero_mode: str = "auto", scale_rule: str = "published", name: str | None = None) -> W2Tensor:
    """modelopt NVFP4 -> W2, bit-identical to quantizing the exact float64 values
    e2m1 x e4m3 x fp32 (<= 30 significant bits), computed in the code domain."""
    from moet.formats import nvfp4
    _check_scale_rule(scale_rule)
    nvfp4.validate(weight, weight_scale, weight_scale_2, name)
    mult = weight_scale.double() * weight_scale_2.reshape(()).double()
    return _from_e2m1_codes(e2m1.unpack_nibbles(weight), mult, nvfp4.BLOCK,
                            zero_mode=zero_mode, scale_rule=scale_rule, name=name)


def from_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, *, zero_mode: str = "auto",
               scale_rule: str = "published", name: str | None = None) -> W2Tensor:
    """gpt-oss MXFP4 [N, K/32, 16] + [N, K/32] -> W2, computed in the code domain."""
    from moet.formats import mxfp4
    _check_scale_rule(scale_rule)
    mxfp4.validate(blocks, scales, name)
    if blocks.dim() != 3:
        raise FormatError(f"{label(name)}: expected MXFP4 blocks of one matrix [N, K/32, 16], got {tuple(blocks.shape)}")
    n = blocks.shape[0]
    codes = e2m1.unpack_nibbles(blocks).reshape(n, -1)
    mult = torch.ldexp(torch.ones(scales.shape, dtype=torch.float64, device=scales.device),
                       scales.to(torch.int32) - 127)
    return _from_e2m1_codes(codes, mult, mxfp4.BLOCK, zero_mode=zero_mode, scale_rule=scale_rule, name=name)


def from_fp8_block(weight: torch.Tensor, weight_scale_inv: torch.Tensor, *, zero_mode: str = "auto",
                   scale_rule: str = "published", name: str | None = None) -> W2Tensor:
    """DeepSeek FP8 block-128 -> W2 through exact float64 values (e4m3 x fp32 <= 28 bits)."""
    from moet.formats import fp8_block
    w64 = fp8_block.dequantize(weight, weight_scale_inv, dtype=torch.float64, name=name)
    return quantize(w64, zero_mode=zero_mode, scale_rule=scale_rule, name=name)


# ----------------------------------------------------------------------------- reference

def _exact_round_log2(y: Fraction) -> int:
    """round(log2(y)) for a positive rational y; log2(y) is never exactly k + 1/2 for rational y."""
    n = math.floor(math.log2(y))   # may be off by one near powers of two: fix exactly
    while Fraction(2) ** n > y:
        n -= 1
    while Fraction(2) ** (n + 1) <= y:
        n += 1
    # log2(y) >= n + 1/2  <=>  y**2 >= 2**(2n+1)
    return n + 1 if y * y >= Fraction(2) ** (2 * n + 1) else n


def _snap_e2m1_ties_lower(u: float) -> float:
    best = None
    for mag in e2m1.MAGNITUDES:           # ascending: the first of equal distances is the lower
        if best is None or abs(u - mag) < abs(u - best):
            best = mag
    return best


def quantize_reference(w: torch.Tensor, *, zero_mode: str = "auto") -> W2Tensor:
    """Literal float64 transcription of the published rule, one block at a time (slow: tests)."""
    if zero_mode not in ZERO_MODES:
        raise FormatError(f"unknown zero_mode {zero_mode!r}")
    a = w.detach().cpu().double().numpy()
    n, k = a.shape
    if k % BLOCK:
        raise FormatError(f"{label(None)}: K={k} is not divisible by {BLOCK}")
    zeros = a == 0
    negs = np.signbit(a)
    mode = zero_mode
    if mode == "auto":
        nz = int(zeros.sum())
        nneg = int((zeros & negs).sum())
        mode = "alt" if nz and max(nneg, nz - nneg) / nz > AUTO_ZERO_SHARE else "sign"
    codes = np.zeros((n, k), dtype=np.uint8)
    scales = np.zeros((n, k // BLOCK), dtype=np.uint8)
    for r in range(n):
        for b in range(k // BLOCK):
            blk = a[r, b * BLOCK:(b + 1) * BLOCK]
            amax = float(np.abs(blk).max())
            e = MIN_EXP if amax == 0 else _exact_round_log2(Fraction(amax) / 6)
            e = min(max(e, MIN_EXP), MAX_EXP)
            scales[r, b] = e + 127
            for i, x in enumerate(blk):
                col = b * BLOCK + i
                mag = _snap_e2m1_ties_lower(abs(float(x)) / 2.0 ** e)  # > 6 snaps to 6: saturation
                big = mag >= 3.0
                if x == 0 and mode == "alt":
                    negative = col % 2 == 1
                else:
                    negative = bool(np.signbit(x))
                level = (-4.0 if big else -1.0) if negative else (4.0 if big else 1.0)
                codes[r, col] = LEVELS.index(level)
    return W2Tensor(pack_codes(torch.from_numpy(codes)), torch.from_numpy(scales), mode, "published")
