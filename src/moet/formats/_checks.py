"""Input validation shared by the format codecs: every problem becomes a FormatError that names
the tensor and says what is wrong, so a bad checkpoint never yields a silent wrong result."""
from __future__ import annotations

import torch

from moet.errors import FormatError


def label(name: str | None) -> str:
    return f"tensor {name!r}" if name else "tensor"


def require_dtype(t: torch.Tensor, dtypes: tuple[torch.dtype, ...], name: str | None, what: str) -> None:
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise FormatError(f"{label(name)}: {what} must be {allowed}, got {str(t.dtype).replace('torch.', '')}")


def require_float(t: torch.Tensor, name: str | None) -> None:
    if not t.is_floating_point():
        raise FormatError(f"{label(name)}: expected a floating-point tensor, got {t.dtype}")


def require_2d_divisible(t: torch.Tensor, block: int, name: str | None) -> tuple[int, int]:
    if t.dim() != 2:
        raise FormatError(f"{label(name)}: expected a 2-D [N, K] tensor, got shape {tuple(t.shape)}")
    n, k = t.shape
    if k % block:
        raise FormatError(f"{label(name)}: K={k} is not divisible by the block size {block}")
    return n, k


def require_finite(t: torch.Tensor, name: str | None) -> None:
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = (~torch.isfinite(t)).nonzero()[0].tolist()
        kind = "NaN" if bool(torch.isnan(t).any()) else "Inf"
        raise FormatError(f"{label(name)}: contains {kind} (first non-finite element at index {bad})")


def require_shape(t: torch.Tensor, shape: tuple[int, ...], name: str | None, what: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise FormatError(
            f"{label(name)}: {what} has shape {tuple(t.shape)}, expected {tuple(shape)} "
            "(truncated or mismatched tensor?)"
        )
