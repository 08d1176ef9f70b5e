"""The process-wide switch for programmatic dependent launch of the small decode kernels, and the
launch keywords it gives (kernels/pdl.py explains PDL). Kept apart from pdl.py's Triton helpers so
that the model runner can set the switch in a process without Triton (a CPU-only install): nothing
here imports Triton, and pdl.py re-exports all of it for the kernels.
"""
from __future__ import annotations

from functools import lru_cache

import torch

_enabled = False


def set_small_kernel_pdl(on: bool) -> None:
    global _enabled
    _enabled = bool(on)


def small_kernel_pdl() -> bool:
    return _enabled


@lru_cache(maxsize=None)
def _supports_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_launch(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel with a `PDL: tl.constexpr` parameter that starts with
    pdl_enter(PDL): PDL on only when enabled, for CUDA tensors on sm_90+ (never under the
    interpreter, which has no griddepcontrol)."""
    if _enabled and t.is_cuda and _supports_pdl(t.device.index if t.device.index is not None
                                                  else torch.cuda.current_device()):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
