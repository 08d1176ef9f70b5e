"""Expert prefetch: guess layer L+1's experts from layer L's hidden state and fetch them early.

After layer L's attention, the residual stream h is what layer L+1 will (almost) see: layer L's
MoE adds one more term. `NextLayerPrefetch` applies layer L+1's post-attention norm and router
to h, which predicts L+1's top-k experts per token:
  * device side (always, graph-capturable): the predicted experts' token counts go to the
    cache's `predicted_counts[l]`; after the accepted pass the cache scores them against the
    route log (precision / recall per layer and step, as expert sets; ExpertCache.stats);
  * host side (eager passes only): the predicted ids are read back (one sync per MoE layer)
    and the non-resident ones are fetched now (ExpertCache.prefetch: free slots first, then
    rows this step cannot need as far as the host knows; never raises). On CUDA the copy runs
    on the cache's side stream and the compute stream waits for it before layer L's MoE (so a
    slot is never rewritten while a kernel may read it): the copy overlaps the host's work,
    not L's MoE. On CPU it is a plain synchronous copy (for counting and tests).
  * a captured CUDA graph cannot call Python: inside capture only the device side runs, so
    graph (decode) steps record prediction accuracy but fetch nothing early; their misses are
    fetched after the pass and replayed as without prefetch.
It never changes results: a cached row holds the pack row's bytes, a wrong guess only costs a
copy, and miss replay stays the source of truth (strict mode equals fully resident).
"""
from __future__ import annotations

import numpy as np
import torch

from moet.store.expert_cache import ExpertCache


class NextLayerPrefetch:
    """The hook of one decoder layer L (`DecoderLayer.expert_prefetch`): called with the residual
    after L's attention, predicts the MoE of layer L+1 (pack layer `next_index`)."""

    def __init__(self, cache: ExpertCache, next_layer, next_index: int, running_index: int):
        self.cache = cache
        self.norm = next_layer.post_attention_layernorm
        self.select_experts = next_layer.mlp.select_experts
        self.next_index = next_index
        self.running_index = running_index      # pack index of layer L's own MoE (-1: dense layer)
        self.fetch = True                       # False: predict and score only

    def __call__(self, h: torch.Tensor) -> None:
        ids, _ = self.select_experts(self.norm(h))
        flat = ids.reshape(-1)
        counts = self.cache.predicted_counts[self.next_index]
        counts.index_add_(0, flat, torch.ones_like(flat, dtype=counts.dtype))
        if not self.fetch or (flat.is_cuda and torch.cuda.is_current_stream_capturing()):
            return
        want = counts.cpu().numpy()
        experts = np.flatnonzero(want)
        experts = experts[np.argsort(-want[experts], kind="stable")]    # most tokens first
        self.cache.prefetch(self.next_index, experts, running_layer=self.running_index)


def attach_prefetch(model, cache: ExpertCache, *, fetch: bool = True) -> int:
    """Give every decoder layer whose successor is a MoE block in the cache's pack a
    NextLayerPrefetch; returns how many layers got one. `detach_prefetch` removes them."""
    index = {name: l for l, name in enumerate(cache.pack.meta.layers)}
    layers = model.model.layers
    n = 0
    for i in range(len(layers) - 1):
        nxt = index.get(f"model.layers.{i + 1}")
        if nxt is None:
            continue
        hook = NextLayerPrefetch(cache, layers[i + 1], nxt, index.get(f"model.layers.{i}", -1))
        hook.fetch = fetch
        layers[i].expert_prefetch = hook
        cache.predicted_layers[nxt] = True
        n += 1
    return n


def detach_prefetch(model, cache: ExpertCache) -> None:
    for layer in model.model.layers:
        layer.expert_prefetch = None
    cache.predicted_layers[:] = False
