"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5), as transformers'
GlmMoeDsaIndexer / DeepseekV32Indexer compute it: small heads of its own score every earlier position for each
query, and the MLA attention of its layer (and of the "shared" layers after it) reads only the
top-k positions (kernels/sparse_attention.py has the arithmetic).

Where the selection cannot matter -- a sequence no longer than top-k keeps every position --
nothing is selected and the dense attention runs unchanged; the index keys are still written,
for the steps after the sequence outgrows top-k.
"""
from __future__ import annotations

import copy
from dataclasses import replace

import torch
from torch import nn

from moet.checkpoint.spec import SparseAttentionSpec
from moet.model.layers.linear import Linear
from moet.model.layers.rope import Rotary


class TopKSelection:
    """The positions the last full indexer layer selected in the current forward, for the shared
    layers after it (GLM-5's cross-layer sharing): contiguous forward [T, S] bool; paged forward
    one (index, valid) [q_b, K] pair per sequence (sparse_attention.top_k_positions; None: every
    position). None: nothing selected (dense)."""

    def __init__(self) -> None:
        self.keep = None


class Indexer(nn.Module):
    def __init__(self, spec: SparseAttentionSpec, hidden: int, q_lora_rank: int, rotary: Rotary,
                 dtype: torch.dtype):
        super().__init__()
        self.spec, self.rotary = spec, rotary
        if rotary.spec.interleave != spec.rope_interleave:
            # the same frequencies and cos / sin, the other pairing (DeepSeek-V3.2's half-split)
            self.rotary = copy.copy(rotary)
            self.rotary.spec = replace(rotary.spec, interleave=spec.rope_interleave)
        self.wq_b = Linear(q_lora_rank, spec.num_heads * spec.head_dim, False, dtype)
        self.wk = Linear(hidden, spec.head_dim, False, dtype)
        # transformers builds this one with nn.LayerNorm's eps 1e-6 (weight and bias)
        self.k_norm = nn.LayerNorm(spec.head_dim, eps=1e-6, dtype=dtype)
        self.k_norm.requires_grad_(False)
        self.weights_proj = Linear(hidden, spec.num_heads, False, dtype)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, Di]: the first rope_dim dims rotated (interleaved pairs), the rest kept."""
        p = self.spec.rope_dim
        return torch.cat([self.rotary.apply(x[..., :p].contiguous(), cos, sin), x[..., p:]], dim=-1)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (the attention's input) -> index keys [T, Di], what the cache stores."""
        k = self.k_norm(self.wk(x))
        return self._rotate(k[:, None, :], cos, sin)[:, 0]

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (queries [T, Hi, Di] from the compressed query q_resid, per-head weights [T, Hi] in
        float32 times Hi ** -0.5)."""
        s, t = self.spec, x.shape[0]
        q = self._rotate(self.wq_b(q_resid).view(t, s.num_heads, s.head_dim), cos, sin)
        w = self.weights_proj(x).float() * (s.num_heads ** -0.5)
        return q, w
