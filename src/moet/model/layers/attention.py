"""Grouped-query attention (Qwen3-MoE, GLM-4.5, Mixtral) over a contiguous per-sequence KV
cache, plus the masked-softmax core shared with MLA.

Shapes are token-major without a batch dimension (one sequence per call): x [T, H]. `start` is
the number of tokens already in the cache; the T new tokens sit at positions start..start+T-1.
`forward_paged` is the batched form over the paged cache (several sequences, AttentionBatch).
"""
from __future__ import annotations

import torch
from torch import nn

from moet.checkpoint.spec import AttentionSpec
from moet.kernels import attention_ops as ops
from moet.kernels.kv_cache import GQALayerKV
from moet.model.attention_batch import AttentionBatch
from moet.model.layers.linear import Linear, fuse_linears
from moet.model.layers.norm import RMSNorm
from moet.model.layers.paged_attention import attend_gqa
from moet.model.layers.rope import Rotary


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
           sliding_window: int | None = None, keep: torch.Tensor | None = None,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention. q [T, Hq, d], k [S, Hkv, d], v [S, Hkv, dv] with S = start + T.
    keep [T, S] bool: the positions each query may see besides the causal rule (sparse
    attention's selection). sinks [Hq]: a logit per head in every softmax's denominator that
    adds nothing to the output (gpt-oss). Softmax in fp32, as transformers' eager path.
    -> [T, Hq * dv]."""
    t, hq, _ = q.shape
    s, hkv, _ = k.shape
    if hkv != hq:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)   # [H, T|S, d]
    scores = torch.matmul(qh, kh.transpose(1, 2)) * scale                 # [H, T, S]
    qpos = torch.arange(start, start + t, device=q.device)[:, None]
    kpos = torch.arange(s, device=q.device)[None, :]
    allowed = kpos <= qpos
    if sliding_window is not None:
        allowed = allowed & (kpos > qpos - sliding_window)
    if keep is not None:
        allowed = allowed & keep
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(hq, 1, 1).expand(hq, t, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :-1].to(q.dtype)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, vh)                                          # [H, T, dv]
    return out.transpose(0, 1).reshape(t, -1)


class GQAttention(nn.Module):
    def __init__(self, spec: AttentionSpec, hidden: int, rotary: Rotary, eps: float, dtype: torch.dtype):
        super().__init__()
        self.spec, self.rotary = spec, rotary
        d = spec.head_dim
        # Qwen3.5: each head's q followed by its output gate (out * sigmoid(gate) before o_proj)
        self.q_proj = Linear(hidden, spec.num_heads * d * (2 if spec.output_gate else 1), spec.qkv_bias, dtype)
        self.k_proj = Linear(hidden, spec.num_kv_heads * d, spec.qkv_bias, dtype)
        self.v_proj = Linear(hidden, spec.num_kv_heads * d, spec.qkv_bias, dtype)
        self.o_proj = Linear(spec.num_heads * d, hidden, spec.o_bias, dtype)
        # gpt-oss: one learned logit per head joins every softmax's denominator
        self.sinks = (nn.Parameter(torch.empty(spec.num_heads, dtype=dtype), requires_grad=False)
                      if spec.sinks else None)
        if spec.qk_norm:                 # per head (Qwen3, GLM) or across all heads (MiniMax-M2)
            self.q_norm = RMSNorm(d if spec.qk_norm_per_head else spec.num_heads * d, eps, dtype)
            self.k_norm = RMSNorm(d if spec.qk_norm_per_head else spec.num_kv_heads * d, eps, dtype)
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None     # fuse_qkv()

    def fuse_qkv(self) -> bool:
        """q, k, v as one GEMV (linear.fuse_linears: the projections' parameters become views
        of the stacked weight). -> fused?"""
        if self.qkv is None:
            self.qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        return self.qkv is not None

    def cache_shapes(self, max_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        s = self.spec
        return (max_len, s.num_kv_heads, s.head_dim), (max_len, s.num_kv_heads, s.head_dim)

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """-> rotated q [T, Hq, d], rotated k [T, Hkv, d], v [T, Hkv, d] (what both caches store),
        and Qwen3.5's output gate [T, Hq * d] (None without one)."""
        s, t = self.spec, x.shape[0]
        if self.qkv is not None:
            nq, nk = s.num_heads * s.head_dim * (2 if s.output_gate else 1), s.num_kv_heads * s.head_dim
            q, k, v = torch.nn.functional.linear(x, *self.qkv).split([nq, nk, nk], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        gate = None
        if s.output_gate:
            qg = q.view(t, s.num_heads, 2 * s.head_dim)
            q, gate = qg[..., :s.head_dim].reshape(t, -1), qg[..., s.head_dim:].reshape(t, -1)
        across = s.qk_norm and not s.qk_norm_per_head
        if across:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(t, s.num_heads, s.head_dim)
        k = k.view(t, s.num_kv_heads, s.head_dim)
        v = v.view(t, s.num_kv_heads, s.head_dim)
        if x.is_cuda:   # q/k norm and both rotations in one launch (same arithmetic as below)
            from moet.kernels.norm_rope_triton import qk_norm_rope
            if s.qk_norm and not across:
                q, k = qk_norm_rope(q, k, cos, sin, self.rotary.spec.interleave, self.q_norm.weight,
                                    self.k_norm.weight, self.q_norm.eps)
            else:
                q, k = qk_norm_rope(q, k, cos, sin, self.rotary.spec.interleave)
            return q, k, v, gate
        if s.qk_norm and not across:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin), v, gate

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: tuple[torch.Tensor, torch.Tensor], start: int) -> torch.Tensor:
        s, t = self.spec, x.shape[0]
        q, k, v, gate = self._project(x, cos, sin)
        k_cache, v_cache = cache
        k_cache[start:start + t] = k
        v_cache[start:start + t] = v
        out = attend(q, k_cache[:start + t], v_cache[:start + t], start, s.scale, s.sliding_window, sinks=self.sinks)
        return self.o_proj(self._gated(out, gate))

    @staticmethod
    def _gated(out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """Qwen3.5's output gate, out [T, Hq * d] * sigmoid(gate); else out as it is."""
        return out if gate is None else out * torch.sigmoid(gate)

    def forward_paged(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttentionBatch,
                      kv: GQALayerKV, split_tokens: int) -> torch.Tensor:
        """x [N, H]: a flat varlen batch of several sequences' new tokens (AttentionBatch).
        Writes their K/V into the paged cache, then attends reading every key from it."""
        q, k, v, gate = self._project(x, cos, sin)
        ops.write_gqa_kv(kv, k, v, batch.slot_mapping)
        out = attend_gqa(q, kv, batch, self.spec.scale, self.spec.sliding_window, split_tokens, self.sinks)
        return self.o_proj(self._gated(out.reshape(x.shape[0], -1), gate))
