"""The MoE block: router -> routed experts through a slot table and a pool -> + shared experts.

The block owns its router and shared experts (dense weights). Routed experts are reached only
through `experts`, one ExpertSlots (store/expert_slots.py: the pools, the slot table, the miss
counter, the route log, the demand-fetch hook, the shared experts' stream): the loader's with every
expert resident (slot = expert id), or the expert store's device cache, handed in without
touching this file.
"""
from __future__ import annotations

import torch
from torch import nn

from moet.checkpoint.spec import ModelSpec
from moet.kernels.moe_dispatch import moe_experts
from moet.model.layers.linear import MLP
from moet.model.layers.router import route
from moet.store.expert_slots import ExpertSlots


class Router(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype):
        super().__init__()
        r = spec.router
        wdtype = torch.float32 if r.fp32_weight else dtype
        self.weight = nn.Parameter(torch.empty(r.num_experts, spec.hidden_size, dtype=wdtype), requires_grad=False)
        if r.correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(r.num_experts, dtype=torch.float32),
                                                        requires_grad=False)
        else:
            self.e_score_correction_bias = None


class MoE(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype):
        super().__init__()
        self.spec = spec
        self.gate = Router(spec, dtype)
        self.shared_experts = (MLP(spec.hidden_size, spec.shared_intermediate_size, dtype)
                               if spec.shared_intermediate_size else None)
        # set by the loader or the expert store; until then no pool and every expert absent
        self.experts = ExpertSlots.absent(spec.router.num_experts)

    def forward_parts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(routed experts' output, shared experts' output or None), not yet summed: the decoder
        layer hands both to the next RMSNorm.add, which does the add inside its kernel on CUDA."""
        side = self.experts.shared_stream if self.shared_experts is not None and x.is_cuda else None
        if side is None:
            return self._routed(x), (self.shared_experts(x) if self.shared_experts is not None else None)
        main = torch.cuda.current_stream(x.device)
        side.wait_stream(main)                         # x is ready
        with torch.cuda.stream(side):
            shared = self.shared_experts(x)
        out = self._routed(x)
        # Join before anyone reads `shared`. No record_stream is needed: x's memory can only be
        # reused by main-stream work queued after this join, and side-stream blocks (shared and
        # its temporaries) only by the next side-stream work, which first waits for the main stream.
        main.wait_stream(side)
        return out, shared

    def select_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This block's routing rule: x [T, H] -> (expert ids int64 [T, k], their weights [T, k])."""
        return route(x, self.gate.weight, self.spec.router, self.gate.e_score_correction_bias)

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.select_experts(x)
        e = self.experts
        if e.demand_fetch is not None:     # expert store, eager pass: make these experts resident now
            e.demand_fetch(ids)
        if e.route_counts is not None:     # integer adds: exact in any order (graph-capturable)
            flat = ids.reshape(-1)
            e.route_counts.index_add_(0, flat, torch.ones_like(flat, dtype=e.route_counts.dtype))
        # the primary tier, or the FP4 repair tier inside a repair pass (ExpertSlots.tier); Triton
        # grouped kernels for W2/FP4 pools on CUDA, the torch reference otherwise
        if e.repairing:
            return self._repaired(x, ids, weights)
        if e.repair_rows is None:
            return moe_experts(x, ids, weights, e.slot_table, e.compute_pool(), e.miss_counter,
                               swiglu_limit=self.spec.swiglu_limit)
        # a step whose prompt positions compute with the repair tier: the two row sets apart, each
        # as it would run alone, put back in row order
        out = torch.empty_like(x)
        rep, pri = e.repair_rows, e.primary_rows
        if pri.numel():
            out[pri] = moe_experts(x[pri], ids[pri], weights[pri], e.slot_table, e.compute_pool(), e.miss_counter,
                                   swiglu_limit=self.spec.swiglu_limit).to(x.dtype)
        if rep.numel():
            out[rep] = self._repaired(x[rep], ids[rep], weights[rep]).to(x.dtype)
        return out

    def _repaired(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts with the FP4 repair tier: every pair from its FP4 row; with a pool of
        part of the experts, the pairs without one from their primary rows (a second pass over the
        same routing whose table holds only those experts), added to the FP4 pass."""
        e = self.experts
        table, pool = e.repair_tier()
        if e.repair_ready is not None and x.is_cuda:     # promotion copies still on their stream
            torch.cuda.current_stream(x.device).wait_event(e.repair_ready)
        if e.repair_complete:
            return moe_experts(x, ids, weights, table, pool, e.miss_counter, swiglu_limit=self.spec.swiglu_limit)
        flat = ids.reshape(-1)
        e.repair_route_counts.index_add_(0, flat, torch.ones_like(flat, dtype=e.repair_route_counts.dtype))
        out = moe_experts(x, ids, weights, table, pool, e.repair_miss_counter, swiglu_limit=self.spec.swiglu_limit)
        # the primary pass misses the FP4 pairs on purpose; what it misses beyond them is a primary
        # row absent from the expert store's cache, a real miss (replayed like any other)
        missed = torch.zeros(1, dtype=torch.int64, device=x.device)
        out = out + moe_experts(x, ids, weights, e.repair_fallback_table(), e.compute_pool(), missed,
                                swiglu_limit=self.spec.swiglu_limit)
        e.miss_counter.add_(missed - (table[flat] >= 0).sum())
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, shared = self.forward_parts(x)
        return out if shared is None else out + shared
