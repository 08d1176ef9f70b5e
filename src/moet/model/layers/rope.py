"""Rotary position embedding: default, linear and YaRN frequencies; neox-style (rotate_half,
optionally partial) or DeepSeek's interleaved pairs. Mirrors transformers' modeling_rope_utils
so logits match it (same fp32 op order)."""
from __future__ import annotations

import math

import torch

from moet.checkpoint.spec import RopeSpec


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq_and_scaling(rope: RopeSpec, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    dim, base = rope.dim, rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim)
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    if rope.rope_type == "linear":
        return 1.0 / pos_freqs / rope.factor, 1.0
    # YaRN (https://arxiv.org/abs/2309.00071), as transformers' _compute_yarn_parameters
    orig = rope.original_max_position_embeddings or max_position_embeddings
    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(_yarn_get_mscale(factor, rope.mscale) / _yarn_get_mscale(factor, rope.mscale_all_dim))
        else:
            attention_factor = _yarn_get_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # prevent a singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, attention_factor


class Rotary:
    """cos/sin for given positions; apply() rotates q/k of shape [T, heads, d]."""

    def __init__(self, rope: RopeSpec, max_position_embeddings: int):
        self.spec = rope
        self.inv_freq, self.scaling = inv_freq_and_scaling(rope, max_position_embeddings)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, d] with the rotated part in the first `rope.dim` dims (all of x for MLA's
        rope slice). cos/sin [T, rope.dim]."""
        if x.is_cuda:                    # one kernel instead of neg/cat/mul/add (same arithmetic)
            from moet.kernels.norm_rope_triton import rope
            return rope(x, cos, sin, self.spec.interleave)
        cos, sin = cos[:, None, :], sin[:, None, :]
        if self.spec.interleave:
            half = cos.shape[-1] // 2
            c, s = cos[..., :half], sin[..., :half]
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        rd = cos.shape[-1]
        x_rot, x_pass = x[..., :rd], x[..., rd:]
        h = rd // 2
        rotated = torch.cat((-x_rot[..., h:], x_rot[..., :h]), dim=-1)
        out = x_rot * cos + rotated * sin
        return torch.cat([out, x_pass], dim=-1) if x_pass.shape[-1] else out
