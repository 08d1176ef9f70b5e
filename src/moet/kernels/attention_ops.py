"""Paged attention as the model calls it: one set of functions, the torch references on CPU and
the Triton kernels on CUDA, picked by the cache's device. Signatures are the references'
(kernels/attention_reference.py, kv_cache.py) plus keyword-only hints the Triton side uses
(`max_seqlen_q`: grid size without a host sync; `split_tokens`: decode split-K partition).

Why dispatch by device and not by a flag: the CPU has no Triton compiler (only the slow
interpreter, for tests), and on a GPU the references would copy every sequence's pages into
fresh tensors per layer. Tests that want the Triton path on CPU call the Triton modules directly.

`split_tokens` is fixed per model (CausalLM.split_tokens), never chosen per batch: the split
count changes the last bits of a decode row, and greedy output must not depend on what else
was scheduled in the same step (the Triton decode splits a sequence by its own length only;
its cap on splits per sequence -- attention_triton.GQA_DEFAULT_MAX_SPLITS / DEFAULT_MAX_SPLITS
for MLA -- and MLA's heads per program, mla_decode_triton.MLA_BLOCK_H, are fixed too).
"""
from __future__ import annotations

import torch

from moet.kernels import attention_reference as ref
from moet.kernels import kv_cache
from moet.kernels.kv_cache import GQALayerKV, MLALayerKV

# Decode split-K partition in tokens (whole pages). It only shapes contexts shorter than
# split_tokens x max splits (GQA 32): longer ones get max-splits longer splits anyway, which is
# what bench/attention_bench.py measures at 32K. At the short contexts of most decode steps a
# split is one 64-token loop step: an H200 profile of a captured Qwen3-30B-A3B decode step found
# 256-token splits slow at a 150-token context, one program walking four dependent load -> dot ->
# softmax steps that 64-token splits run side by side (docs/kernels.md, attention).
DEFAULT_SPLIT_TOKENS = 64

# GQA decode with the split merge in the split kernel (attention_triton fused_merge): set once per
# process by the CUDA model runner from EngineConfig.kernels.attention_fused_merge, so fixed for a model
# like the split partition (it may move the last bits)
_gqa_fused_merge = False


def set_gqa_fused_merge(on: bool) -> None:
    global _gqa_fused_merge
    _gqa_fused_merge = bool(on)


def _on_gpu(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


# ---------------------------------------------------------------------------- KV writes

def write_gqa_kv(cache: GQALayerKV, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if _on_gpu(cache.k):
        from moet.kernels import kv_write_triton
        return kv_write_triton.write_gqa_kv(cache, k, v, slot_mapping)
    return kv_cache.write_gqa_kv(cache, k, v, slot_mapping)


def write_mla_kv(cache: MLALayerKV, latent: torch.Tensor, k_rope: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if _on_gpu(cache.buffer):
        from moet.kernels import kv_write_triton
        return kv_write_triton.write_mla_kv(cache, latent, k_rope, slot_mapping)
    return kv_cache.write_mla_kv(cache, latent, k_rope, slot_mapping)


# ---------------------------------------------------------------------------- GQA

def paged_decode_gqa(q: torch.Tensor, cache: GQALayerKV, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, sliding_window: int | None = None, *,
                     split_tokens: int = DEFAULT_SPLIT_TOKENS, sinks: torch.Tensor | None = None) -> torch.Tensor:
    if _on_gpu(cache.k):
        from moet.kernels import attention_triton
        return attention_triton.paged_decode_gqa(q, cache, block_tables, seq_lens, scale, sliding_window,
                                                 split_tokens=split_tokens, fused_merge=_gqa_fused_merge, sinks=sinks)
    return ref.paged_decode_gqa(q, cache, block_tables, seq_lens, scale, sliding_window, sinks=sinks)


def paged_prefill_gqa(q: torch.Tensor, cache: GQALayerKV, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None, *,
                      max_seqlen_q: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    if _on_gpu(cache.k):
        from moet.kernels import prefill_triton
        return prefill_triton.paged_prefill_gqa(q, cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                                sliding_window, max_seqlen_q=max_seqlen_q, sinks=sinks)
    return ref.paged_prefill_gqa(q, cache, block_tables, cu_seqlens_q, seq_lens, scale, sliding_window, sinks=sinks)


# ---------------------------------------------------------------------------- MLA (absorbed)

def paged_decode_mla(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: MLALayerKV, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, *,
                     split_tokens: int = DEFAULT_SPLIT_TOKENS) -> torch.Tensor:
    if _on_gpu(cache.buffer):
        from moet.kernels import mla_decode_triton
        return mla_decode_triton.paged_decode_mla(q_latent, q_rope, cache, block_tables, seq_lens, scale,
                                                  split_tokens=split_tokens)
    return ref.paged_decode_mla(q_latent, q_rope, cache, block_tables, seq_lens, scale)


def paged_prefill_mla(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: MLALayerKV, block_tables: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                      max_seqlen_q: int | None = None) -> torch.Tensor:
    if _on_gpu(cache.buffer):
        from moet.kernels import mla_prefill_triton
        return mla_prefill_triton.paged_prefill_mla(q_latent, q_rope, cache, block_tables, cu_seqlens_q, seq_lens,
                                                    scale, max_seqlen_q=max_seqlen_q)
    return ref.paged_prefill_mla(q_latent, q_rope, cache, block_tables, cu_seqlens_q, seq_lens, scale)


def mla_absorb_q(q_nope: torch.Tensor, kv_b_weight: torch.Tensor, qk_nope_head_dim: int) -> torch.Tensor:
    """q_nope [T, H, nope] -> q_latent [T, H, R]. CPU: the float32 reference. GPU: one batched
    matmul in the weight's dtype (fp32 accumulation inside cuBLAS) instead of upcasting a
    [H * (nope + v), R] weight to fp32 at every layer of every step."""
    if not _on_gpu(q_nope) or kv_b_weight.dtype == torch.float32:
        return ref.mla_absorb_q(q_nope, kv_b_weight, qk_nope_head_dim).to(q_nope.dtype)
    h = q_nope.shape[1]
    w_uk = kv_b_weight.view(h, -1, kv_b_weight.shape[-1])[:, :qk_nope_head_dim]          # [H, nope, R]
    return torch.bmm(q_nope.transpose(0, 1).to(w_uk.dtype), w_uk).transpose(0, 1)         # [T, H, R]


def mla_output(out_latent: torch.Tensor, kv_b_weight: torch.Tensor, qk_nope_head_dim: int) -> torch.Tensor:
    """out_latent [T, H, R] -> [T, H, v] in out_latent.dtype (see mla_absorb_q for the GPU form)."""
    if not _on_gpu(out_latent) or kv_b_weight.dtype == torch.float32:
        return ref.mla_output(out_latent, kv_b_weight, qk_nope_head_dim).to(out_latent.dtype)
    h = out_latent.shape[1]
    w_uv = kv_b_weight.view(h, -1, kv_b_weight.shape[-1])[:, qk_nope_head_dim:]           # [H, v, R]
    return torch.bmm(out_latent.transpose(0, 1).to(w_uv.dtype), w_uv.transpose(1, 2)).transpose(0, 1)
