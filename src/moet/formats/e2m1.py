"""FP4 e2m1: 1 sign bit, 2 exponent bits, 1 mantissa bit; no Inf/NaN.

Code layout (4 bits): bit 3 = sign, bits 2..0 = magnitude index into
MAGNITUDES = (0, 0.5, 1, 1.5, 2, 3, 4, 6). All 16 codes are valid; code 8 is -0.
"""
from __future__ import annotations

import functools

import torch

MAGNITUDES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MAX = 6.0
# value of each of the 16 codes, index = code
VALUES: tuple[float, ...] = MAGNITUDES + tuple(-m for m in MAGNITUDES)
# midpoints between consecutive magnitudes; a tie at midpoint j sits between index j and j+1
_MIDPOINTS: tuple[float, ...] = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def value_table(dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 code values as a tensor (index = code); -0.0 at index 8. One tensor per (dtype,
    device), made on first use: a decode inside a CUDA graph capture (the nvfp4 KV read of a
    sparse-attention decode step) must not copy from the host; the capture's warm-up pass makes it.
    Read-only: callers index it."""
    return _value_table(dtype, torch.device(device) if device is not None else torch.device("cpu"))


@functools.lru_cache(maxsize=None)
def _value_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(VALUES, dtype=dtype, device=device)


def decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Codes (any integer dtype, values 0..15) -> their values. -0 decodes to -0.0."""
    return value_table(dtype, codes.device)[codes.long()]


def encode(x: torch.Tensor, rounding: str = "nearest_even") -> torch.Tensor:
    """Values (already divided by their scale) -> codes uint8 in 0..15.

    |x| > 6 saturates to 6. rounding:
      "nearest_even": round to nearest, ties to the even code (IEEE style; what NVFP4/MXFP4
                      encoders use),
      "nearest_lower": round to nearest, ties to the smaller magnitude (the W2 snap rule).
    The sign bit of x is kept, so -0.0 -> code 8 and tiny negatives that round to 0 -> 8.
    """
    if rounding not in ("nearest_even", "nearest_lower"):
        raise ValueError(f"unknown rounding {rounding!r}")
    m = x.abs()
    idx = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for j, mid in enumerate(_MIDPOINTS):
        idx += (m > mid).to(torch.uint8)
        # a tie at midpoint j lies between index j and j+1; ties-to-even goes up when j+1 is even
        if rounding == "nearest_even" and (j + 1) % 2 == 0:
            idx += (m == mid).to(torch.uint8)
    return idx | (torch.signbit(x).to(torch.uint8) << 3)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes; element 2i in the LOW nibble, 2i+1 in the high nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] codes (inverse of pack_nibbles)."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)
