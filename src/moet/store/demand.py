"""Demand fetch: in eager passes, each MoE layer makes its experts resident just before it runs.

Miss replay (store/replay.py) is what a captured decode graph needs: the graph cannot stop in the
middle, so a missed expert contributes zero, the runner fetches it after the pass and runs the
step again. An eager pass (prefill, a step mixing a prompt chunk with decodes, any step outside
the graph buckets) can stop: `LayerDemand` sits between a MoE block's router and its experts,
reads the routed expert ids back (one host sync per layer), and has the cache copy the missing
rows in (ExpertCache.demand) before the experts run. The pass then cannot miss, runs once, and
its outputs are the fully resident ones (a cached row holds the pack row's bytes).

What it buys: a step only needs ONE layer's experts resident at a time instead of every layer's,
so a prefill step is no longer capped at slots / (layers x top_k) tokens (8 tokens for
GLM-4.5-Air on a 32 GB card) and a long prompt streams through the cache layer by layer: each
layer's experts are copied at most once per step, the prefill's rows being the first to make
room for its later layers (ExpertCache.demand), so decode's hot rows are mostly kept.
"""
from __future__ import annotations

import numpy as np
import torch

from moet.store.expert_cache import ExpertCache


class LayerDemand:
    """ExpertSlots.demand_fetch of the block at pack layer `index`: called with the block's routed ids."""

    def __init__(self, cache: ExpertCache, index: int):
        self.cache = cache
        self.index = index

    def __call__(self, ids: torch.Tensor) -> None:
        if ids.is_cuda and torch.cuda.is_current_stream_capturing():
            return                                  # a graph cannot call back: replay covers it
        experts, counts = np.unique(ids.reshape(-1).cpu().numpy(), return_counts=True)
        self.cache.demand(self.index, experts, counts)


def attach_demand(blocks: dict[str, object], cache: ExpertCache) -> int:
    """Give every MoE block ({pack layer name: MoE}) in the cache's pack a LayerDemand; returns
    how many got one."""
    index = {name: l for l, name in enumerate(cache.pack.meta.layers)}
    n = 0
    for name, moe in blocks.items():
        if name in index:
            moe.experts.demand_fetch = LayerDemand(cache, index[name])
            n += 1
    return n


def detach_demand(blocks: dict[str, object]) -> None:
    for moe in blocks.values():
        moe.experts.demand_fetch = None
