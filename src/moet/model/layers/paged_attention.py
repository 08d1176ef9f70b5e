"""How an attention layer attends over the paged KV cache for one AttentionBatch: which kernel
runs which rows. The K/V (latent) of the step's tokens are already written (callers write first).

A pure-decode batch is one paged-decode call. Otherwise the leading `num_decode_seqs` one-token
sequences still go through paged decode and only the rest through prefill/extend: the two kernels
round differently (split-K vs one pass), and a decode row must give the same bits whether or not
a prefill chunk shares its step, or greedy output would depend on the scheduler's batching.
"""
from __future__ import annotations

import torch

from moet.kernels import attention_ops as ops
from moet.kernels.kv_cache import GQALayerKV, MLALayerKV
from moet.model.attention_batch import AttentionBatch


def _split(batch: AttentionBatch):
    """-> (decode seqs, cu_seqlens_q / block_tables / seq_lens of the prefill sequences)."""
    nd = batch.num_decode_seqs
    return nd, batch.cu_seqlens_q[nd:] - nd, batch.block_tables[nd:], batch.seq_lens[nd:]


def attend_gqa(q: torch.Tensor, cache: GQALayerKV, batch: AttentionBatch, scale: float,
               sliding_window: int | None, split_tokens: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, Hq, D] (rotated) -> [N, Hq, Dv]. sinks [Hq]: gpt-oss's per-head softmax sink."""
    if batch.is_pure_decode:
        return ops.paged_decode_gqa(q, cache, batch.block_tables, batch.seq_lens, scale, sliding_window,
                                    split_tokens=split_tokens, sinks=sinks)
    nd, cu, tables, lens = _split(batch)
    pre = ops.paged_prefill_gqa(q[nd:], cache, tables, cu, lens, scale, sliding_window,
                                max_seqlen_q=batch.max_seqlen_q, sinks=sinks)
    if nd == 0:
        return pre
    dec = ops.paged_decode_gqa(q[:nd], cache, batch.block_tables[:nd], batch.seq_lens[:nd], scale, sliding_window,
                               split_tokens=split_tokens, sinks=sinks)
    return torch.cat([dec, pre])


def attend_mla(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: MLALayerKV, batch: AttentionBatch,
               scale: float, split_tokens: int) -> torch.Tensor:
    """Absorbed MLA: q_latent [N, H, R], q_rope [N, H, P] -> latent-space output [N, H, R]."""
    if batch.is_pure_decode:
        return ops.paged_decode_mla(q_latent, q_rope, cache, batch.block_tables, batch.seq_lens, scale,
                                    split_tokens=split_tokens)
    nd, cu, tables, lens = _split(batch)
    pre = ops.paged_prefill_mla(q_latent[nd:], q_rope[nd:], cache, tables, cu, lens, scale,
                                max_seqlen_q=batch.max_seqlen_q)
    if nd == 0:
        return pre
    dec = ops.paged_decode_mla(q_latent[:nd], q_rope[:nd], cache, batch.block_tables[:nd], batch.seq_lens[:nd],
                               scale, split_tokens=split_tokens)
    return torch.cat([dec, pre])
