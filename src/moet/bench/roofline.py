"""What a decode step must read, and the bandwidth it is held to (measured in the same run).

A decode step is memory-bound: its floor is the bytes it must read over the device's bandwidth.
The bytes: every dense weight (the embedding table one row per token), for each MoE layer the
distinct experts the batch's tokens route to, and the KV cache of every sequence. The bandwidth:
a bf16 GEMV on a GPU (what a well-made decode kernel reaches, not the datasheet), a large tensor
copy on a CPU. % of roofline = achieved GB/s / that bandwidth."""
from __future__ import annotations

import time

import torch


def expert_bytes(pool) -> int:
    """Bytes one expert occupies in `pool` (codes + scales; the weights of a bf16 pool)."""
    return sum(v[0].nbytes for v in (getattr(pool, f) for f in pool.__slots__) if isinstance(v, torch.Tensor))


def distinct_experts(experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts `batch` tokens touch when each picks top_k of `experts` uniformly.
    Uniform routing touches the most experts (a trained router's skew touches fewer), so for a
    real checkpoint the bytes, and the GB/s from them, are an upper bound."""
    return experts * (1.0 - (1.0 - top_k / experts) ** batch)


def decode_step_bytes(model, kv_bytes_per_token: int, context: int, batch: int = 1) -> int | None:
    """Bytes one decode step of `batch` sequences of `context` tokens must read (see the module
    doc); None when the experts are not resident (the expert store: no pool to count)."""
    from moet.model.layers.moe import MoE

    total = 0
    for name, p in model.named_parameters():
        if name.startswith("mtp."):
            continue                              # MTP layers: not read by a plain decode step
        if "embed_tokens" in name:
            total += batch * p.shape[-1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    for i, layer in enumerate(model.model.layers):
        mod = getattr(layer, "mlp", None)
        if isinstance(mod, MoE):
            pool = mod.experts.pool
            if pool is None:
                return None
            r = mod.spec.router
            total += int(distinct_experts(r.num_experts, r.top_k, batch) * expert_bytes(pool))
    per_sequence = getattr(model, "decode_cache_bytes", None)     # a cache not read whole (DeepSeek-V4)
    if per_sequence is not None:
        return total + per_sequence(context) * batch
    # sliding-window layers (gpt-oss alternates them with full ones) read only their window: the
    # tokens a step reads, averaged over layers whose cache rows are all the same size
    windows = [getattr(getattr(layer.self_attn, "spec", None), "sliding_window", None) for layer in model.model.layers]
    read = sum(min(w, context) if w else context for w in windows) / max(len(windows), 1)
    return total + int(kv_bytes_per_token * read) * batch


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 28) -> dict:
    """A tensor copy far larger than the caches: GB/s counted on bytes read + written (best of 5)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return {"what": f"copy of {nbytes >> 20} MiB (read + write)", "GBps": 2 * nbytes / best / 1e9}


def reference_bandwidth(device: torch.device) -> dict:
    """The bandwidth this run's decode is held to: a bf16 GEMV on CUDA, a copy on a CPU."""
    if device.type == "cuda":
        from moet.bench.timing import bf16_gemv_bandwidth
        return bf16_gemv_bandwidth(device)
    return copy_bandwidth(device)
