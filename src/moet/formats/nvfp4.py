"""NVFP4 in the NVIDIA modelopt checkpoint layout (what "modelopt" NVFP4 checkpoints store).

Per linear weight W [N, K] (K % 16 == 0):
  weight          uint8          [N, K/2]   two e2m1 codes per byte; element k = 2i is in the
                                            LOW nibble of byte i, k = 2i+1 in the HIGH nibble
  weight_scale    float8_e4m3fn  [N, K/16]  one scale per 16 consecutive K elements
  weight_scale_2  float32        scalar     one per tensor
  value[n, k] = e2m1(code[n, k]) * weight_scale[n, k // 16] * weight_scale_2
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moet.formats import e2m1
from moet.errors import FormatError
from moet.formats._checks import label, require_2d_divisible, require_dtype, require_finite, require_float, require_shape
from moet.formats.fp8 import E4M3_MAX, to_e4m3

BLOCK = 16


@dataclass(slots=True)
class NVFP4Tensor:
    weight: torch.Tensor          # uint8 [N, K/2]
    weight_scale: torch.Tensor    # float8_e4m3fn [N, K/16]
    weight_scale_2: torch.Tensor  # float32 scalar

    @property
    def shape(self) -> tuple[int, int]:
        n, half = self.weight.shape
        return n, half * 2


def validate(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
             name: str | None = None) -> tuple[int, int]:
    """Check dtypes and shapes of the three tensors; returns (N, K)."""
    require_dtype(weight, (torch.uint8,), name, "NVFP4 weight")
    require_dtype(weight_scale, (torch.float8_e4m3fn,), name, "NVFP4 weight_scale")
    require_dtype(weight_scale_2, (torch.float32,), name, "NVFP4 weight_scale_2")
    if weight.dim() != 2:
        raise FormatError(f"{label(name)}: NVFP4 weight must be 2-D [N, K/2], got {tuple(weight.shape)}")
    n, half = weight.shape
    k = half * 2
    if k % BLOCK:
        raise FormatError(f"{label(name)}: NVFP4 K={k} is not a multiple of the block size {BLOCK}")
    require_shape(weight_scale, (n, k // BLOCK), name, "NVFP4 weight_scale")
    if weight_scale_2.numel() != 1:
        require_shape(weight_scale_2, (), name, "NVFP4 weight_scale_2")
    scale = weight_scale.float()
    require_finite(scale, f"{name}.weight_scale" if name else "weight_scale")
    require_finite(weight_scale_2, f"{name}.weight_scale_2" if name else "weight_scale_2")
    return n, k


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
               *, dtype: torch.dtype = torch.float32, name: str | None = None) -> torch.Tensor:
    """-> [N, K] in `dtype`. In float64 the result is exact (e2m1 x e4m3 x fp32 has <= 30 bits)."""
    n, k = validate(weight, weight_scale, weight_scale_2, name)
    q = e2m1.decode(e2m1.unpack_nibbles(weight), dtype)                      # [N, K]
    s = weight_scale.to(dtype).repeat_interleave(BLOCK, dim=1)                # [N, K]
    return q * s * weight_scale_2.reshape(()).to(dtype)


def quantize(w: torch.Tensor, *, weight_scale_2: float | None = None, name: str | None = None) -> NVFP4Tensor:
    """float [N, K] -> NVFP4 the way modelopt calibrates weights:
    scale_2 = amax(W) / (6 * 448); per 16-block scale = amax_block / (6 * scale_2) rounded to
    e4m3 (nearest even); codes = e2m1(w / (scale * scale_2)), nearest even, saturating at 6.
    Computed in float32."""
    require_float(w, name)
    require_2d_divisible(w, BLOCK, name)
    require_finite(w, name)
    w = w.float()
    if weight_scale_2 is None:
        amax = float(w.abs().max()) if w.numel() else 0.0
        weight_scale_2 = amax / (e2m1.MAX * E4M3_MAX) if amax > 0 else 1.0
    s2 = torch.tensor(weight_scale_2, dtype=torch.float32, device=w.device)
    packed, scale = quantize_blocks(w, s2)
    return NVFP4Tensor(packed, scale, s2)


def quantize_blocks(x: torch.Tensor, scale_2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., K] (K % 16 == 0) with a given fp32 scale_2 (one element) -> (codes uint8
    [..., K/2], e4m3 scales [..., K/16]), quantize's arithmetic along the last dim: scale =
    e4m3(amax_block / (6 * scale_2)) (nearest even, saturating at 448), codes = e2m1(x / (scale *
    scale_2)) (nearest even, saturating at 6); a block whose scale is 0 keeps only its signs.
    float32, no checks and no host sync (the paged KV cache quantizes every token with it)."""
    x = x.float()
    k = x.shape[-1]
    s2 = scale_2.reshape(()).float()
    blocks = x.unflatten(-1, (k // BLOCK, BLOCK))
    block_amax = blocks.abs().amax(dim=-1)
    scale = to_e4m3(block_amax / (e2m1.MAX * s2))                            # [..., K/16] e4m3
    denom = (scale.float() * s2).unsqueeze(-1)
    scaled = torch.where(denom > 0, blocks / torch.where(denom > 0, denom, torch.ones_like(denom)),
                         blocks * 0.0)  # a zero scale keeps only the signs of the block
    codes = e2m1.encode(scaled.flatten(-2), "nearest_even")
    return e2m1.pack_nibbles(codes), scale


def dequantize_blocks(codes: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """quantize_blocks' inverse: codes uint8 [..., K/2], e4m3 scales [..., K/16], scale_2 -> [..., K]
    in `dtype` (exact in float64; in float32 e2m1 x e4m3 is exact and x scale_2 rounds once)."""
    q = e2m1.decode(e2m1.unpack_nibbles(codes), dtype)
    return q * scale.to(dtype).repeat_interleave(BLOCK, dim=-1) * scale_2.reshape(()).to(dtype)
