"""Torch references of paged attention: decode and prefill/extend, GQA and weight-absorbed MLA.
The Triton kernels (attention_triton.py) implement these exact signatures; CPU runs these.

Metadata, per batch of B sequences (vLLM / FlashInfer's shapes):
  block_tables  int32 [B, max_blocks]  the pages of each sequence, in order; entries past a
                                       sequence's last page are never read (any value)
  seq_lens      int32 [B]              tokens in the cache for each sequence, INCLUDING the
                                       queries of this step (their K/V are written first)
  cu_seqlens_q  int32 [B + 1]          prefill/extend: sequence b's queries are rows
                                       cu[b]..cu[b+1] of q, its last q_len_b tokens, at
                                       positions seq_lens[b] - q_len_b ..
Every key, the step's own included, is read from the cache, so an output does not depend on
how a prompt was chunked or whether its prefix came from the prefix cache (same bytes read).

Numerics: float32 throughout (scores, fp32 softmax, probs @ V), output cast to q.dtype; the
model's contiguous path (model/layers/attention.attend) gives the same values within rounding.
Masking as `attend`: key j is visible to query i iff j <= i and, with a sliding window W,
j > i - W (transformers' sliding-window mask; Mixtral/Qwen3 configs may set it).
`split_tokens` is the kernels' split-K partition (tokens per split); it changes no math here.

MLA, weight-absorbed (DeepSeek-V2 paper, FlashMLA): with kv_b_proj.weight viewed as
[H, nope + v, R], W_UK = [:, :nope], W_UV = [:, nope:],
  q_nope . (W_UK latent) = (q_nope W_UK) . latent          -> mla_absorb_q
  sum_j p_j (W_UV latent_j) = W_UV (sum_j p_j latent_j)      -> mla_output
so attention runs as MQA over the cached rows [latent | rope] with values = latent:
  score = scale * (q_latent . latent + q_rope . k_rope)
`scale` is AttentionSpec.scale (qk_head_dim ** -0.5, times YaRN mscale(factor, mscale_all_dim)**2);
the rotary attention factor is already inside q_rope and the cached k_rope (Rotary.cos_sin).
"""
from __future__ import annotations

import torch

from moet.kernels.kv_cache import GQALayerKV, MLALayerKV, read_gqa_kv, read_mla_kv


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            sliding_window: int | None, keep: torch.Tensor | None = None,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [t, Hq, D] are the last t of n positions; k [n, Hkv, D], v [n, Hkv, Dv]; float32.
    keep [t, n] bool: the positions each query may see besides the causal rule (sparse
    attention's selection); None: all. sinks [Hq]: a logit per head that joins every softmax's
    denominator and adds nothing to the output (gpt-oss). -> [t, Hq, Dv] float32."""
    t, hq, _ = q.shape
    n, hkv, _ = k.shape
    g = hq // hkv
    qg = q.float().reshape(t, hkv, g, -1).permute(1, 0, 2, 3).reshape(hkv, t * g, -1)   # [Hkv, t*g, D]
    scores = torch.matmul(qg, k.permute(1, 2, 0)) * scale                              # [Hkv, t*g, n]
    qpos = torch.arange(n - t, n, device=k.device).repeat_interleave(g)[:, None]
    kpos = torch.arange(n, device=k.device)[None, :]
    allowed = kpos <= qpos
    if sliding_window is not None:
        allowed = allowed & (kpos > qpos - sliding_window)
    if keep is not None:
        allowed = allowed & keep.repeat_interleave(g, dim=0)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:        # query row r of KV head h is head h * g + r % g
        sink = sinks.float().reshape(hkv, 1, g).expand(hkv, t, g).reshape(hkv, t * g, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.permute(1, 0, 2))                                      # [Hkv, t*g, Dv]
    return out.reshape(hkv, t, g, -1).permute(1, 0, 2, 3).reshape(t, hq, -1)


def _decode_cu(q: torch.Tensor) -> torch.Tensor:
    return torch.arange(q.shape[0] + 1, dtype=torch.int32)


def paged_prefill_gqa(q: torch.Tensor, cache: GQALayerKV, block_tables: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                      sliding_window: int | None = None, *, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal varlen prefill/extend. q [Tq, Hq, D] (rotated) -> [Tq, Hq, Dv] in q.dtype."""
    out = torch.empty(q.shape[0], q.shape[1], cache.v_head_dim, dtype=torch.float32, device=q.device)
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for b, n in enumerate(lens):
        lo, hi = cu[b], cu[b + 1]
        if hi == lo:
            continue
        k, v = read_gqa_kv(cache, block_tables[b], n)
        out[lo:hi] = _attend(q[lo:hi], k, v, scale, sliding_window, sinks=sinks)
    return out.to(q.dtype)


def paged_decode_gqa(q: torch.Tensor, cache: GQALayerKV, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                     *, split_tokens: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence (its last token). q [B, Hq, D] -> [B, Hq, Dv] in q.dtype."""
    return paged_prefill_gqa(q, cache, block_tables, _decode_cu(q), seq_lens, scale, sliding_window, sinks=sinks)


def paged_prefill_mla(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: MLALayerKV,
                      block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Absorbed MLA, causal varlen. q_latent [Tq, H, R], q_rope [Tq, H, P] -> latent-space
    output [Tq, H, R] in q_latent.dtype (mla_output maps it to the heads' values)."""
    out = torch.empty(q_latent.shape, dtype=torch.float32, device=q_latent.device)
    q = torch.cat([q_latent.float(), q_rope.float()], dim=-1)
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for b, n in enumerate(lens):
        lo, hi = cu[b], cu[b + 1]
        if hi == lo:
            continue
        lat, rope = read_mla_kv(cache, block_tables[b], n)
        out[lo:hi] = attend_latent(q[lo:hi], lat, rope, scale)
    return out.to(q_latent.dtype)


def attend_latent(q: torch.Tensor, lat: torch.Tensor, rope: torch.Tensor, scale: float,
                  keep: torch.Tensor | None = None) -> torch.Tensor:
    """Latent-space MQA of one sequence: q [t, H, R + P] (the last t of n positions), its cached
    rows lat [n, R] and rope [n, P] (float32) -> [t, H, R] float32; keep as _attend's."""
    k = torch.cat([lat, rope], dim=-1)[:, None, :]             # MQA: one shared key head
    return _attend(q, k, lat[:, None, :], scale, None, keep)


def paged_decode_mla(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: MLALayerKV,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     *, split_tokens: int | None = None) -> torch.Tensor:
    """q_latent [B, H, R], q_rope [B, H, P] -> [B, H, R] in q_latent.dtype."""
    return paged_prefill_mla(q_latent, q_rope, cache, block_tables, _decode_cu(q_latent), seq_lens, scale)


def mla_absorb_q(q_nope: torch.Tensor, kv_b_weight: torch.Tensor, qk_nope_head_dim: int) -> torch.Tensor:
    """q_nope [T, H, nope], kv_b_proj.weight [H * (nope + v), R] -> q_latent [T, H, R] (float32)."""
    h = q_nope.shape[1]
    w_uk = kv_b_weight.float().view(h, -1, kv_b_weight.shape[-1])[:, :qk_nope_head_dim]   # [H, nope, R]
    return torch.einsum("thn,hnr->thr", q_nope.float(), w_uk)


def mla_output(out_latent: torch.Tensor, kv_b_weight: torch.Tensor, qk_nope_head_dim: int) -> torch.Tensor:
    """out_latent [T, H, R] -> per-head values [T, H, v] (float32); o_proj takes it flattened."""
    h = out_latent.shape[1]
    w_uv = kv_b_weight.float().view(h, -1, kv_b_weight.shape[-1])[:, qk_nope_head_dim:]   # [H, v, R]
    return torch.einsum("thr,hvr->thv", out_latent.float(), w_uv)
