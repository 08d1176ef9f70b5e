"""Torch reference of the NVFP4 dense GEMM (moet.kernels.nvfp4_gemm_triton implements the same
signature): y = x @ W^T for a weight as modelopt stores it

  weight          uint8          [N, K/2]   two e2m1 codes a byte, element 2i in the low nibble
  weight_scale    float8_e4m3fn  [N, K/16]  one scale per 16 elements of a row
  weight_scale_2  float32        []         one per tensor

  W = e2m1(code) * weight_scale * weight_scale_2

W4A16: the activations stay in their dtype (the checkpoint's input_scale, the calibrated
activation scale of W4A4 serving, is not used). e2m1 x e4m3 has at most 6 significant bits, so
the product is exact in bf16 / fp16 and in the fp32 accumulation; scale_2 multiplies the fp32
sums once, then the bias, then one rounding to x's dtype.
"""
from __future__ import annotations

import torch

from moet.formats import nvfp4


def check_nvfp4_weight(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       weight_scale_2: torch.Tensor) -> tuple[int, int]:
    """(N, K) of a well-formed NVFP4 weight for x [..., K]; else a ValueError naming the tensor."""
    if weight.dtype != torch.uint8 or weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"weight must be a row-major uint8 [N, K/2], got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape[0], 2 * weight.shape[1]
    if k % nvfp4.BLOCK:
        raise ValueError(f"NVFP4 weight K={k} is not a multiple of {nvfp4.BLOCK}")
    if x.shape[-1] != k:
        raise ValueError(f"x has K={x.shape[-1]}, the NVFP4 weight {k}")
    if weight_scale.dtype != torch.float8_e4m3fn or tuple(weight_scale.shape) != (n, k // nvfp4.BLOCK):
        raise ValueError(f"weight_scale must be float8_e4m3fn [{n}, {k // nvfp4.BLOCK}], "
                         f"got {weight_scale.dtype} {tuple(weight_scale.shape)}")
    if weight_scale_2.dtype != torch.float32 or weight_scale_2.numel() != 1:
        raise ValueError(f"weight_scale_2 must be one float32, got {weight_scale_2.dtype} {tuple(weight_scale_2.shape)}")
    return n, k


def nvfp4_gemm_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         weight_scale_2: torch.Tensor, *, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype (the numerics in the module docstring)."""
    n, k = check_nvfp4_weight(x, weight, weight_scale, weight_scale_2)
    one = torch.ones((), dtype=torch.float32, device=weight.device)
    w = nvfp4.dequantize_blocks(weight, weight_scale, one, torch.float32)          # codes x block scales: exact
    y = (x.reshape(-1, k).float() @ w.T) * weight_scale_2.reshape(()).float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], n)
