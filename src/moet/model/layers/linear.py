"""Dense linear layers in the model dtype.

Checkpoint precision is kept where the dtype allows: BF16 weights load as is; FP8 block-128 and
NVFP4 weights are decoded once at load (moet.model.weights.decode).
SEAM for the FP8 GPU path: a `Fp8BlockLinear` keeps `weight` (e4m3) + `weight_scale_inv` and
runs a block-scaled GEMM; it needs only its own weight_loader (receiving the raw parts) and
forward. The loader already hands every parameter its on-disk parts and format.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MLP(nn.Module):
    """SwiGLU MLP (dense layers and shared experts): down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, False, dtype)
        self.up_proj = Linear(hidden, intermediate, False, dtype)
        self.down_proj = Linear(intermediate, hidden, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
