"""RMSNorm exactly as transformers computes it: normalise in fp32, cast back, then scale.
On CUDA one Triton kernel does the same arithmetic (kernels/norm_rope_triton.py), optionally
fused with the residual add in front of it; on CPU the torch ops below."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from moet.kernels.norm_rope_triton import rms_norm
            return rms_norm(x, self.weight, self.eps)[0]
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add(self, x: torch.Tensor, residual: torch.Tensor | None,
            x2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The pre-norm residual step: s = residual + x, then (norm(s), s). residual None: (norm(x), x).
        x2 (a second delta, e.g. an MoE block's shared-expert output next to the routed one):
        s = residual + (x + x2), the same two adds in the model dtype; on CUDA in the one kernel."""
        if residual is None:
            if x2 is not None:
                x = x + x2
            return self(x), x
        if x.is_cuda:
            from moet.kernels.norm_rope_triton import rms_norm
            return rms_norm(x, self.weight, self.eps, residual, x2)
        if x2 is not None:
            x = x + x2
        s = residual + x
        return self(s), s
