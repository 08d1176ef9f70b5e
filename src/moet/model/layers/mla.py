"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2), as transformers computes it.

The cache holds the compressed latent (kv_lora_rank, after kv_a_layernorm) and the shared
rotated key slice (qk_rope_head_dim) per token: 576 values per token for DeepSeek-V3 instead of
128 heads x 320. `forward` (contiguous, one sequence) re-expands keys/values through kv_b_proj at
every step, as transformers does; `forward_paged` (the serving path) uses the weight-absorbed
form over the paged latent cache (kernels/attention_reference.py explains the algebra).
With DeepSeek Sparse Attention (GLM-5) a layer attends only to the positions an indexer selects:
its own (a "full" layer) or the last full layer's (a "shared" one), model/layers/dsa.py.
"""
from __future__ import annotations

import torch
from torch import nn

from moet.checkpoint.spec import AttentionSpec, SparseAttentionSpec
from moet.kernels import attention_ops as ops
from moet.kernels import sparse_attention as dsa_ops
from moet.kernels.kv_cache import MLALayerKV
from moet.model.attention_batch import AttentionBatch
from moet.model.layers.attention import attend
from moet.model.layers.dsa import Indexer, TopKSelection
from moet.model.layers.linear import Linear
from moet.model.layers.norm import RMSNorm
from moet.model.layers.paged_attention import attend_mla
from moet.model.layers.rope import Rotary


class MLAttention(nn.Module):
    def __init__(self, spec: AttentionSpec, hidden: int, rotary: Rotary, eps: float, dtype: torch.dtype,
                 sparse: tuple[SparseAttentionSpec, bool, TopKSelection] | None = None):
        """sparse: (the DSA spec, whether this layer runs its own indexer, the selection it
        writes (own indexer) or reads (shared))."""
        super().__init__()
        self.spec, self.rotary = spec, rotary
        self.dsa, self.indexer, self.selection = None, None, None
        if sparse is not None:
            self.dsa, own, self.selection = sparse
            if own:
                self.indexer = Indexer(self.dsa, hidden, spec.q_lora_rank, rotary, dtype)
        nh, qk = spec.num_heads, spec.qk_nope_head_dim + spec.qk_rope_head_dim
        if spec.q_lora_rank is None:
            self.q_proj = Linear(hidden, nh * qk, False, dtype)
        else:
            self.q_a_proj = Linear(hidden, spec.q_lora_rank, spec.qkv_bias, dtype)
            # transformers builds these two norms with its default eps (1e-6), not rms_norm_eps
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, 1e-6, dtype)
            self.q_b_proj = Linear(spec.q_lora_rank, nh * qk, False, dtype)
        self.kv_a_proj_with_mqa = Linear(hidden, spec.kv_lora_rank + spec.qk_rope_head_dim, spec.qkv_bias, dtype)
        self.kv_a_layernorm = RMSNorm(spec.kv_lora_rank, 1e-6, dtype)
        self.kv_b_proj = Linear(spec.kv_lora_rank, nh * (spec.qk_nope_head_dim + spec.v_head_dim), False, dtype)
        self.o_proj = Linear(nh * spec.v_head_dim, hidden, spec.o_bias, dtype)
        # CPU: kv_b_proj.weight in float32, made once (keep_float32_kv_b): the absorbed forms'
        # torch references compute in float32 and would otherwise convert the weight twice per
        # layer per step. The same values, so the same results.
        self.kv_b_f32: torch.Tensor | None = None

    def keep_float32_kv_b(self) -> None:
        self.kv_b_f32 = self.kv_b_proj.weight.float()

    def cache_shapes(self, max_len: int) -> tuple[tuple[int, ...], ...]:
        shapes = (max_len, self.spec.kv_lora_rank), (max_len, self.spec.qk_rope_head_dim)
        return shapes + ((max_len, self.dsa.head_dim),) if self.indexer is not None else shapes

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """-> q_nope [T, H, nope], rotated q_rope [T, H, P], latent [T, R] (after kv_a_layernorm),
        rotated k_rope [T, P] (the last two are what both caches store), and the compressed
        query (q_a_layernorm's output; None without q_lora_rank), which the DSA indexer reads."""
        s, t = self.spec, x.shape[0]
        nope, rope_d, nh = s.qk_nope_head_dim, s.qk_rope_head_dim, s.num_heads
        q_resid = None if s.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_proj(x) if q_resid is None else self.q_b_proj(q_resid)
        q = q.view(t, nh, nope + rope_d)
        q_pass, q_rot = q[..., :nope], q[..., nope:]
        kv_nope, k_rot = self.kv_a_proj_with_mqa(x).split([s.kv_lora_rank, rope_d], dim=-1)
        kv_nope = self.kv_a_layernorm(kv_nope)
        q_rot = self.rotary.apply(q_rot, cos, sin)
        k_rot = self.rotary.apply(k_rot.view(t, 1, rope_d), cos, sin).view(t, rope_d)
        return q_pass, q_rot, kv_nope, k_rot, q_resid

    def _select(self, x, q_resid, cos, sin, index_keys: torch.Tensor, start: int) -> torch.Tensor | None:
        """Contiguous forward: the positions each of the T queries keeps ([T, start + T] bool), or
        None when every position is kept (no longer than top-k)."""
        n = start + x.shape[0]
        if self.indexer is not None:
            keep = None
            if n > self.dsa.top_k:
                q, w = self.indexer.queries(x, q_resid, cos, sin)
                keep = dsa_ops.select_top_k(q, w, index_keys[:n], self.dsa.top_k, self.dsa.scale)
            self.selection.keep = keep
        return self.selection.keep

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: tuple[torch.Tensor, ...], start: int) -> torch.Tensor:
        s, t = self.spec, x.shape[0]
        nope, rope_d, nh = s.qk_nope_head_dim, s.qk_rope_head_dim, s.num_heads
        q_pass, q_rot, kv_nope, k_rot, q_resid = self._project(x, cos, sin)
        lat_cache, rot_cache = cache[0], cache[1]
        lat_cache[start:start + t] = kv_nope
        rot_cache[start:start + t] = k_rot
        keep = None
        if self.dsa is not None:
            if self.indexer is not None:
                cache[2][start:start + t] = self.indexer.keys(x, cos, sin)
            keep = self._select(x, q_resid, cos, sin, cache[2] if self.indexer is not None else None, start)
        n = start + t
        kv = self.kv_b_proj(lat_cache[:n]).view(n, nh, nope + s.v_head_dim)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        k = torch.cat([k_nope, rot_cache[:n, None, :].expand(n, nh, rope_d)], dim=-1)
        q = torch.cat([q_pass, q_rot], dim=-1)
        return self.o_proj(attend(q, k, v, start, s.scale, keep=keep))

    def forward_paged(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttentionBatch,
                      kv: MLALayerKV, split_tokens: int) -> torch.Tensor:
        """x [N, H]: a flat varlen batch (AttentionBatch). Writes the new tokens' latent + rope
        rows, then attends in the weight-absorbed form for decode and prefill alike: queries are
        mapped into the latent space (W_UK), attention is MQA over the cached rows, and W_UV maps
        the latent-space output back to the heads' values."""
        s = self.spec
        q_pass, q_rot, latent, k_rot, q_resid = self._project(x, cos, sin)
        ops.write_mla_kv(kv, latent, k_rot, batch.slot_mapping)
        keep = None
        if self.dsa is not None:
            keep = self._select_paged(x, q_resid, cos, sin, batch, kv)
        w = self.kv_b_proj.weight if self.kv_b_f32 is None else self.kv_b_f32
        q_latent = ops.mla_absorb_q(q_pass, w, s.qk_nope_head_dim)
        if isinstance(keep, dsa_ops.DecodeSelection):
            out = dsa_ops.decode_sparse_mla(q_latent, q_rot, kv, batch.block_tables, keep, s.scale)
        elif keep is not None:
            out = dsa_ops.paged_sparse_mla(q_latent, q_rot, kv, batch.block_tables, batch.cu_seqlens_q_host,
                                           batch.seq_lens_host, s.scale, keep)
        else:
            out = attend_mla(q_latent, q_rot, kv, batch, s.scale, split_tokens)
        out = ops.mla_output(out, w, s.qk_nope_head_dim).to(x.dtype)
        return self.o_proj(out.reshape(x.shape[0], -1))

    def _select_paged(self, x, q_resid, cos, sin, batch: AttentionBatch, kv: MLALayerKV):
        """Paged forward: writes this layer's index keys (own indexer), then the positions the
        step's rows keep, or None when no sequence of the step is longer than top-k (a test on the
        host's lengths): every layer of the step then runs dense. An all-decode step selects on the
        device only (sparse_attention.DecodeSelection: static shapes, so a decode graph captured at
        the worst-case lengths holds this path and serves every length, ModelRunner.graph_context);
        a step with prompt rows per sequence (paged_select_top_k), eager."""
        if self.indexer is not None:
            dsa_ops.write_index_keys(kv.index_keys, self.indexer.keys(x, cos, sin), batch.slot_mapping)
        if max(batch.seq_lens_host, default=0) <= self.dsa.top_k:
            return None
        if self.indexer is not None and batch.is_pure_decode:
            q, w = self.indexer.queries(x, q_resid, cos, sin)
            self.selection.keep = dsa_ops.batched_top_k_positions(
                q, w, kv.index_keys, kv.block_size, batch.block_tables, batch.seq_lens, max(batch.seq_lens_host),
                self.dsa.top_k, self.dsa.scale)
        elif self.indexer is not None:
            q, w = self.indexer.queries(x, q_resid, cos, sin)
            self.selection.keep = dsa_ops.paged_select_top_k(
                q, w, kv.index_keys, kv.block_size, batch.block_tables, batch.cu_seqlens_q_host,
                batch.seq_lens_host, self.dsa.top_k, self.dsa.scale)
        return self.selection.keep
