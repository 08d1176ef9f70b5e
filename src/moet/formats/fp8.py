"""8-bit floats: e4m3fn (max 448, no Inf, NaN = 0x7F/0xFF) and e5m2 (IEEE-like, max 57344),
and UE8M0 scale bytes (unsigned exponent only: value 2**(byte - 127), byte 255 = NaN).

torch provides the e4m3fn / e5m2 dtypes and round-to-nearest-even casts; this module adds
saturation (torch's cast of an out-of-range value gives NaN for e4m3fn) and byte views.
"""
from __future__ import annotations

import torch

from moet.errors import FormatError

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
UE8M0_BIAS = 127
UE8M0_NAN = 255


def to_e4m3(x: torch.Tensor, saturate: bool = True) -> torch.Tensor:
    """float -> float8_e4m3fn, round to nearest even; |x| > 448 clamps to +-448 when saturate."""
    if saturate:
        x = x.clamp(-E4M3_MAX, E4M3_MAX)
    return x.to(torch.float8_e4m3fn)


def to_e5m2(x: torch.Tensor, saturate: bool = True) -> torch.Tensor:
    """float -> float8_e5m2, round to nearest even; |x| > 57344 clamps when saturate (else Inf)."""
    if saturate:
        x = x.clamp(-E5M2_MAX, E5M2_MAX)
    return x.to(torch.float8_e5m2)


def e4m3_from_bytes(b: torch.Tensor) -> torch.Tensor:
    """uint8 bytes -> float8_e4m3fn tensor (a bit view, no conversion)."""
    return b.contiguous().view(torch.float8_e4m3fn)


def e5m2_from_bytes(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float8_e5m2)


def ue8m0_decode(b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """UE8M0 bytes -> 2**(b - 127); byte 255 decodes to NaN."""
    e = b.to(torch.int32) - UE8M0_BIAS
    out = torch.ldexp(torch.ones(b.shape, dtype=dtype, device=b.device), e)
    return torch.where(b == UE8M0_NAN, torch.full_like(out, float("nan")), out)


def ue8m0_encode(exponent: torch.Tensor) -> torch.Tensor:
    """Integer exponents in [-127, 127] -> UE8M0 bytes (exponent + 127)."""
    lo, hi = int(exponent.min()) if exponent.numel() else 0, int(exponent.max()) if exponent.numel() else 0
    if lo < -127 or hi > 127:
        raise FormatError(f"UE8M0 exponent out of range [-127, 127]: min {lo}, max {hi}")
    return (exponent.to(torch.int32) + UE8M0_BIAS).to(torch.uint8)
