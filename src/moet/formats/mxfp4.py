"""MXFP4 (OCP microscaling FP4) as gpt-oss checkpoints store it.

For a weight [..., N, K] (K % 32 == 0):
  *_blocks  uint8 [..., N, K/32, 16]  32 e2m1 codes per group, two per byte, element 2i in
                                      the LOW nibble of byte i (as gpt-oss / transformers read it)
  *_scales  uint8 [..., N, K/32]      UE8M0 exponent byte per group: 2**(byte - 127); 255 = NaN
  value = e2m1(code) * 2**(scale - 127)
"""
from __future__ import annotations

import torch

from moet.errors import FormatError
from moet.formats import e2m1
from moet.formats._checks import label, require_dtype, require_finite, require_float
from moet.formats.fp8 import UE8M0_BIAS, UE8M0_NAN

BLOCK = 32


def validate(blocks: torch.Tensor, scales: torch.Tensor, name: str | None = None) -> None:
    require_dtype(blocks, (torch.uint8,), name, "MXFP4 blocks")
    require_dtype(scales, (torch.uint8,), name, "MXFP4 scales")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2:
        raise FormatError(f"{label(name)}: MXFP4 blocks must be [..., K/32, 16], got {tuple(blocks.shape)}")
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise FormatError(f"{label(name)}: MXFP4 scales shape {tuple(scales.shape)} does not match "
                          f"blocks {tuple(blocks.shape)} (expected {tuple(blocks.shape[:-1])})")
    if bool((scales == UE8M0_NAN).any()):
        raise FormatError(f"{label(name)}: MXFP4 scale byte 255 (NaN) present")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype = torch.float32,
               name: str | None = None) -> torch.Tensor:
    """-> [..., K] with K = groups * 32, in `dtype` (exact in float32: e2m1 x power of two)."""
    validate(blocks, scales, name)
    q = e2m1.decode(e2m1.unpack_nibbles(blocks), dtype)                     # [..., G, 32]
    q = torch.ldexp(q, (scales.to(torch.int32) - UE8M0_BIAS).unsqueeze(-1))
    return q.flatten(-2)


def quantize(w: torch.Tensor, *, name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., K] -> (blocks, scales) by the OCP MX rule: shared exponent
    floor(log2(amax)) - 2 (2 = e2m1's max exponent), clamped to [-127, 127];
    codes e2m1 nearest-even of w / 2**e, saturating at 6. All-zero groups get exponent -127."""
    require_float(w, name)
    require_finite(w, name)
    if w.shape[-1] % BLOCK:
        raise FormatError(f"{label(name)}: K={w.shape[-1]} is not divisible by the MXFP4 block {BLOCK}")
    w = w.double()
    groups = w.reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    amax = groups.abs().amax(dim=-1)
    _, exp = torch.frexp(amax)            # amax = m * 2**exp, m in [0.5, 1): floor(log2) = exp - 1
    e = torch.where(amax > 0, exp.to(torch.int32) - 1 - 2, torch.full_like(exp, -127, dtype=torch.int32))
    e = e.clamp(-127, 127)
    codes = e2m1.encode(torch.ldexp(groups, -e.unsqueeze(-1)), "nearest_even")
    return e2m1.pack_nibbles(codes), (e + UE8M0_BIAS).to(torch.uint8)
