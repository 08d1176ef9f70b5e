"""FP8 block-128 as DeepSeek-V3 checkpoints store it.

  weight            float8_e4m3fn [N, K]
  weight_scale_inv  float32       [ceil(N/128), ceil(K/128)]   (a multiplier, despite the name)
  value[n, k] = weight[n, k] * weight_scale_inv[n // 128, k // 128]
Edge blocks may be partial (N or K not a multiple of 128).
"""
from __future__ import annotations

import torch

from moet.errors import FormatError
from moet.formats._checks import label, require_dtype, require_finite, require_float, require_shape
from moet.formats.fp8 import E4M3_MAX, to_e4m3

BLOCK = 128


def _expand(scale: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    return scale.repeat_interleave(block, dim=0)[:n].repeat_interleave(block, dim=1)[:, :k]


def dequantize(weight: torch.Tensor, weight_scale_inv: torch.Tensor, *, block: int = BLOCK,
               dtype: torch.dtype = torch.float32, name: str | None = None) -> torch.Tensor:
    """-> [N, K] in `dtype` (exact in float64; float32 rounds once per element)."""
    require_dtype(weight, (torch.float8_e4m3fn,), name, "FP8 weight")
    require_dtype(weight_scale_inv, (torch.float32,), name, "FP8 weight_scale_inv")
    if weight.dim() != 2:
        raise FormatError(f"{label(name)}: FP8 weight must be 2-D [N, K], got {tuple(weight.shape)}")
    n, k = weight.shape
    require_shape(weight_scale_inv, (-(-n // block), -(-k // block)), name, "FP8 weight_scale_inv")
    require_finite(weight_scale_inv, f"{name}.weight_scale_inv" if name else "weight_scale_inv")
    w = weight.to(dtype)
    if bool(torch.isnan(w).any()):
        require_finite(w, name)
    return w * _expand(weight_scale_inv.to(dtype), n, k, block)


def quantize(w: torch.Tensor, *, block: int = BLOCK, name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (weight e4m3, weight_scale_inv fp32): per block scale = amax / 448
    (1.0 for an all-zero block), weight = e4m3(w / scale) nearest even."""
    require_float(w, name)
    require_finite(w, name)
    if w.dim() != 2:
        raise FormatError(f"{label(name)}: expected a 2-D [N, K] tensor, got {tuple(w.shape)}")
    w = w.float()
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w
    amax = padded.reshape(nb, block, kb, block).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = to_e4m3(w / _expand(scale, n, k, block))
    return q, scale
