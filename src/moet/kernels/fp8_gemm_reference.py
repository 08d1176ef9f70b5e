"""Torch reference of the FP8 block-128 dense GEMM (moet.kernels.fp8_gemm_triton implements the
same signature): y = x @ W^T for a DeepSeek-style block-scaled weight

  weight            float8_e4m3fn [N, K]
  weight_scale_inv  float32       [ceil(N/128), ceil(K/128)]   value = weight * scale (a multiplier)

Two activation modes, both with fp32 accumulation and the output in x's dtype:
  "w8a16"  the activations stay in their dtype; the kernel upcasts e4m3 weights in-register
           (exact: every e4m3 value is a bf16 / fp16 value) and applies the block scale to
           each 128-wide partial sum. Numerically the exact product up to fp32 rounding.
  "w8a8"   DeepSeek-V3 / vLLM inference (and DeepSeek-V3's FP8 training forward): each token's
           activations are quantized per 128-wide K group to e4m3 (act_quant below), the GEMM
           runs on e4m3 x e4m3 and scales every partial sum by x_scale * w_scale. Adds the
           activation rounding error (~2^-4 relative per element, ~1-3% per output).
"""
from __future__ import annotations

import torch

from moet.formats.fp8 import E4M3_MAX
from moet.formats.fp8_block import BLOCK, dequantize

MODES = ("w8a16", "w8a8")


def act_quant_reference(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, ceil(K/block)]), per token per K group:
    scale = amax / 448 (1.0 for an all-zero group), q = e4m3(x / scale) (nearest even; |x/scale|
    <= 448 by construction, clamped against the last-ulp overshoot). x * scale recovers x."""
    m, k = x.shape
    kb = -(-k // block)
    xp = torch.zeros(m, kb * block, dtype=torch.float32, device=x.device)
    xp[:, :k] = x.float()
    amax = xp.reshape(m, kb, block).abs().amax(dim=2)
    # divide by a tensor, not a Python number: CUDA torch turns a scalar divisor into a multiply
    # by its rounded reciprocal (1 ulp off for about half the inputs); the kernel divides exactly
    scale = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    q = (xp.reshape(m, kb, block) / scale[:, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    return q.reshape(m, kb * block)[:, :k].to(torch.float8_e4m3fn), scale


def fp8_block_gemm_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, *,
                             mode: str = "w8a8", bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype; float32 upcast of both operands (see module doc)."""
    if mode not in MODES:
        raise ValueError(f"fp8 GEMM mode {mode!r}; expected one of {MODES}")
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    w = dequantize(weight, weight_scale_inv, dtype=torch.float32)
    if mode == "w8a8":
        q, s = act_quant_reference(x2)
        xf = q.float() * s.repeat_interleave(BLOCK, dim=1)[:, :k]
    else:
        xf = x2.float()
    y = xf @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*lead, w.shape[0])
