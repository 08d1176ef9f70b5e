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
from moet.errors import CheckpointError
from moet.kernels.moe_dispatch import moe_experts
from moet.kernels.reference import ExpertActivation
from moet.model.layers.linear import MLP, Linear
from moet.model.layers.router import route
from moet.store.expert_slots import ExpertSlots


def _deinterleaved_loader(param: nn.Parameter, fmt: str, parts: dict[str, torch.Tensor], where: str) -> None:
    """gpt-oss's gate_up bias [E, 2I] as stored (gate, up, gate, up, ...) -> gate biases, then up."""
    value = parts.get("weight")
    if fmt != "float" or value is None or tuple(value.shape) != tuple(param.shape):
        got = f"{fmt} {list(value.shape)}" if value is not None else fmt
        raise CheckpointError(f"{where}: expert bias stored as {got}; config.json implies float {list(param.shape)}")
    param.data.copy_(torch.cat([value[:, 0::2], value[:, 1::2]], dim=1))


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
        self.bias = (nn.Parameter(torch.empty(r.num_experts, dtype=wdtype), requires_grad=False)
                     if r.logit_bias else None)


class MoE(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype):
        super().__init__()
        self.spec = spec
        self.gate = Router(spec, dtype)
        self.shared_experts = (MLP(spec.hidden_size, spec.shared_intermediate_size, dtype)
                               if spec.shared_intermediate_size else None)
        # Qwen3.5: the shared expert's output times sigmoid(shared_expert_gate(x))
        self.register_module("shared_expert_gate",
                             Linear(spec.hidden_size, 1, False, dtype) if spec.shared_expert_gate else None)
        # gpt-oss's expert biases, by expert id (not slot): a few KiB a layer, resident beside the
        # router while expert weights move through slots. gate_up_bias holds the gate biases,
        # then the up biases (the pools' row order); down_bias is added after the weighted sum.
        e, i = spec.router.num_experts, spec.moe_intermediate_size
        bias = spec.expert_bias
        self.register_parameter("gate_up_bias", nn.Parameter(torch.empty(e, 2 * i, dtype=dtype), requires_grad=False)
                                if bias else None)
        self.register_parameter("down_bias", nn.Parameter(torch.empty(e, spec.hidden_size, dtype=dtype),
                                                          requires_grad=False) if bias else None)
        if bias and spec.fused_expert_layout == "gpt_oss":       # stored interleaved: gate, up, gate, up, ...
            self.gate_up_bias.weight_loader = _deinterleaved_loader
        # set by the loader or the expert store; until then no pool and every expert absent
        self.experts = ExpertSlots.absent(spec.router.num_experts)

    def forward_parts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(routed experts' output, shared experts' output or None), not yet summed: the decoder
        layer hands both to the next RMSNorm.add, which does the add inside its kernel on CUDA."""
        side = self.experts.shared_stream if self.shared_experts is not None and x.is_cuda else None
        if side is None:
            return self._routed(x), (self._shared(x) if self.shared_experts is not None else None)
        main = torch.cuda.current_stream(x.device)
        side.wait_stream(main)                         # x is ready
        with torch.cuda.stream(side):
            shared = self._shared(x)
        out = self._routed(x)
        # Join before anyone reads `shared`. No record_stream is needed: x's memory can only be
        # reused by main-stream work queued after this join, and side-stream blocks (shared and
        # its temporaries) only by the next side-stream work, which first waits for the main stream.
        main.wait_stream(side)
        return out, shared

    def activation(self) -> ExpertActivation:
        """What the expert kernels run between their two GEMMs (with this block's gate/up biases)."""
        return ExpertActivation(self.spec.swiglu_limit, self.spec.swiglu_alpha, self.gate_up_bias)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        out = self.shared_experts(x)
        return out if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(x)) * out

    def select_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This block's routing rule: x [T, H] -> (expert ids int64 [T, k], their weights [T, k])."""
        return route(x, self.gate.weight, self.spec.router, self.gate.e_score_correction_bias, self.gate.bias)

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.select_experts(x)
        out = self._routed_experts(x, ids, weights)
        if self.down_bias is None:
            return out
        # each pair's down bias times its weight: linear, so added once after the experts' sum
        # (the FP4 repair pass and its primary fallback then need not split it)
        return out + (weights[..., None].to(x.dtype) * self.down_bias[ids]).sum(dim=1).to(out.dtype)

    def _routed_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
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
                               act=self.activation())
        # a step whose prompt positions compute with the repair tier: the two row sets apart, each
        # as it would run alone, put back in row order
        out = torch.empty_like(x)
        rep, pri = e.repair_rows, e.primary_rows
        if pri.numel():
            out[pri] = moe_experts(x[pri], ids[pri], weights[pri], e.slot_table, e.compute_pool(), e.miss_counter,
                                   act=self.activation()).to(x.dtype)
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
            return moe_experts(x, ids, weights, table, pool, e.miss_counter, act=self.activation())
        flat = ids.reshape(-1)
        e.repair_route_counts.index_add_(0, flat, torch.ones_like(flat, dtype=e.repair_route_counts.dtype))
        out = moe_experts(x, ids, weights, table, pool, e.repair_miss_counter, act=self.activation())
        # the primary pass misses the FP4 pairs on purpose; what it misses beyond them is a primary
        # row absent from the expert store's cache, a real miss (replayed like any other)
        missed = torch.zeros(1, dtype=torch.int64, device=x.device)
        out = out + moe_experts(x, ids, weights, e.repair_fallback_table(), e.compute_pool(), missed,
                                act=self.activation())
        e.miss_counter.add_(missed - (table[flat] >= 0).sum())
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, shared = self.forward_parts(x)
        return out if shared is None else out + shared
