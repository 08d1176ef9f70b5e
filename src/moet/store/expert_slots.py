"""ExpertSlots: the one object through which a MoE layer reaches its routed experts.

A MoE block (model/layers/moe.py) owns its router and shared experts; everything about its routed
experts that is decided outside the block (where their weights are, which of them are resident,
what to count, whom to call before they run, which stream the shared experts may use) arrives in
one ExpertSlots, `MoE.experts`, instead of loose attributes. The block reads it in every forward
and writes into it only through the tensors it holds (the miss counter, the route log).

Who builds it, and when:
  * MoE.__init__: `ExpertSlots.absent(num_experts)`, no pool and every expert absent, until one
    of the two below replaces it;
  * model/loader.py (every expert resident, no expert store): `ExpertSlots.resident(...)`, one
    pool of the expert format, slot = expert id; once, before the weights are read into the pool;
  * store/expert_cache.py, ExpertCache.attach (the expert store): the device cache's pool, the
    layer's row of the cache's slot table, miss counters and route log; once, at engine start.
Fields set on the block's ExpertSlots after that, each by one writer:
  * `cpu_pool` by CausalLM.prepare_cpu (model/model.py), once, before a CPU run's first step;
  * `demand_fetch` by store/demand.py (attach_demand / detach_demand), at engine start;
  * `shared_stream` by CausalLM.overlap_shared_experts (model/model.py), at engine start on CUDA.

CUDA graphs capture the tensors, not this object: `slot_table`, `miss_counter` and `route_counts`
keep their storage for the engine's life (the cache rewrites the table in place, the runner zeroes
the counters in place), so nothing here may be reallocated once graphs are captured, and wrapping
a tensor in an ExpertSlots never copies it.

The FP4 repair tier (EngineConfig.gate, engine/confidence_gate.py) is one more entry of `pools`
with its own slot table, `repair_slot_table`: a forward computes with the primary tier (`primary`,
the pool `slot_table` indexes) unless `repairing` is set, which only the confidence gate's repair
pass does (CausalLM.repair_tier), always eagerly: captured decode graphs read the primary tier.
The repair pool may hold part of the experts (store/repair_pool.py promotes the hot ones into its
slots): a pair whose expert has no FP4 row computes with its primary row instead, so a repair pass
is the FP4 pass plus a primary pass over the rest (MoE._repaired). The primary rows may come from
the device expert cache (the expert store): a primary row absent there counts in `miss_counter`
like any miss, so the store's replay or demand fetch covers repair passes too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

# The repair tier's format tag (the pack's and the pools' name for NVFP4 rows).
REPAIR_FORMAT = "fp4"


@dataclass(eq=False)
class ExpertSlots:
    # int32 [num_experts]: the slot of each expert in the pool, -1 = not resident. The loader's
    # arange (slot = expert), or a row of the device cache's [layers, experts] table (a view), which
    # ExpertCache rewrites in place as it fetches and evicts. The MoE kernels read it.
    slot_table: torch.Tensor
    # int64 [1]: (token, expert) pairs of this layer whose expert was absent, added by the MoE
    # kernels (a missed pair contributes zero). The store zeroes it before each pass
    # (ExpertCache.begin_pass) and reads it after (store/replay.py); with every expert resident it
    # only ever counts zero.
    miss_counter: torch.Tensor
    # The routed experts' pools (moet.kernels.pools: W2Pool / FP4Pool / DensePool), keyed by format
    # tag ("w2", "fp4", "bf16": the pack tags), leading dimension the slot. Today one per layer: the
    # loader's (every expert) or the device cache's (shared by every layer, the cache's slots).
    # Empty until the loader or the store sets one (a model whose experts come from the store only).
    pools: dict[str, object] = field(default_factory=dict)
    # A copy of `pool` laid out for CPU GEMVs (kernels/moe_cpu.py: CpuPool or DecodedPool, the same
    # slots), which the layer computes with instead of `pool`; only for CPU runs whose slots never
    # change (no expert store). Set by CausalLM.prepare_cpu; None elsewhere.
    cpu_pool: object | None = None
    # int32 [num_experts] or None: tokens that chose each expert this pass, added by the layer
    # (integer adds: exact in any order, graph-capturable). A row of the device cache's route log,
    # so the runner knows which experts a missed pass needs; None without the store.
    route_counts: torch.Tensor | None = None
    # Called with the routed ids [T, k] before the experts run, in eager passes: makes those experts
    # resident so the pass cannot miss (store/demand.py's LayerDemand). None: no demand fetch.
    demand_fetch: Callable[[torch.Tensor], None] | None = None
    # A second CUDA stream for the shared experts (EngineConfig.kernels.overlap_shared_experts), or None: at
    # decode the routed and the shared experts are each a few small GEMVs that leave the GPU half
    # idle while they ramp up and drain; on two streams they overlap (SGLang's dual-stream MoE).
    # One stream for every layer (the layers run one after another).
    shared_stream: torch.cuda.Stream | None = None
    # The format tag of the pool `slot_table` indexes ("w2", ...): set by `resident`; "" for a
    # single-pool ExpertSlots built elsewhere (the store's), whose one pool is the primary.
    primary: str = ""
    # The FP4 repair tier: int32 [num_experts], each expert's slot in pools[REPAIR_FORMAT]; None
    # without the tier. Set by `add_repair_tier` (model/loader.py), once, before the weights load.
    repair_slot_table: torch.Tensor | None = None
    # The repair pool laid out for CPU GEMVs, as `cpu_pool` is for the primary (CausalLM.prepare_cpu).
    repair_cpu_pool: object | None = None
    # True only inside CausalLM.repair_tier: the layer computes with the repair tier.
    repairing: bool = False
    # Set only inside CausalLM.repair_tier(rows=mask): int64 row indices of the pass that compute
    # with the repair tier (a step's prompt positions, EngineConfig.gate.fp4_prefill) and those
    # that compute with the primary; None outside.
    repair_rows: torch.Tensor | None = None
    primary_rows: torch.Tensor | None = None
    # With a repair pool of part of the experts (else None): int64 [1], the repair passes' (token,
    # expert) pairs that had no FP4 row; int32 [num_experts], pairs routed to each expert in repair
    # passes (the pool's heat). store/repair_pool.py re-points both at rows of its own [layers, ...]
    # tensors, reads and zeroes them.
    repair_miss_counter: torch.Tensor | None = None
    repair_route_counts: torch.Tensor | None = None
    # The CUDA event of the partial pool's last promotion copies (made on their own stream by
    # store/repair_pool.py): a pass waits for it before it reads the repair tier. None: nothing to wait for.
    repair_ready: object | None = None
    # A partial pool's source without the expert store: every expert's FP4 rows in host memory
    # (slot = expert id; pinned on CUDA), filled by the loader; store/repair_pool.py copies from it
    # into the device slots. With the store the rows come from the FP4 pack instead (None here).
    repair_host_pool: object | None = None

    @classmethod
    def absent(cls, num_experts: int) -> "ExpertSlots":
        """No pool, every expert absent: a block's state before the loader or the store fills it."""
        return cls(torch.full((num_experts,), -1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64))

    @classmethod
    def resident(cls, fmt: str, pool, device: torch.device | str) -> "ExpertSlots":
        """Every expert resident in `pool` (format tag `fmt`), slot = expert id."""
        return cls(torch.arange(pool.num_slots, dtype=torch.int32, device=device),
                   torch.zeros(1, dtype=torch.int64, device=device), pools={fmt: pool}, primary=fmt)

    def add_repair_tier(self, pool, slot_table: torch.Tensor) -> None:
        """The FP4 repair tier: `pool` (an FP4Pool) and each expert's slot in it (-1: no FP4 row;
        such experts compute with their primary rows in a repair pass)."""
        if self.repair_slot_table is not None:
            raise RuntimeError("this MoE layer already has a repair tier")
        if REPAIR_FORMAT in self.pools:
            raise RuntimeError(f"the repair tier's format {REPAIR_FORMAT} is already this layer's primary format")
        self.pools[REPAIR_FORMAT] = pool
        self.repair_slot_table = slot_table
        if pool.num_slots < slot_table.numel() or bool((slot_table < 0).any()):
            dev = slot_table.device
            self.repair_miss_counter = torch.zeros(1, dtype=torch.int64, device=dev)
            self.repair_route_counts = torch.zeros(slot_table.numel(), dtype=torch.int32, device=dev)

    @property
    def repair_complete(self) -> bool:
        """Every expert has an FP4 row (no fallback to the primary in a repair pass)."""
        return self.repair_miss_counter is None

    def repair_fallback_table(self) -> torch.Tensor:
        """int32 [num_experts]: the primary slot of each expert without an FP4 row, -1 for those
        with one. Computed per pass: the primary slots move when the expert store fetches and
        evicts."""
        return torch.where(self.repair_slot_table < 0, self.slot_table, -1).to(torch.int32)

    def assign_repair_slot(self, expert: int, slot: int) -> None:
        """Expert `expert`'s FP4 row is now in repair slot `slot` (-1: it has none). In place: a
        partial pool's table keeps its storage."""
        self.repair_slot_table[expert] = slot

    @property
    def pool(self):
        """The pool the slot table indexes (None while there is none)."""
        if self.primary:
            return self.pools[self.primary]
        if len(self.pools) > 1:
            raise RuntimeError(f"a MoE layer has pools {sorted(self.pools)} and no primary tier")
        return next(iter(self.pools.values()), None)

    @property
    def repair_pool(self):
        """The FP4 repair tier's pool, or None without the tier."""
        return self.pools.get(REPAIR_FORMAT) if self.repair_slot_table is not None else None

    def tier(self):
        """(slot table, pool) the layer computes with now: the repair tier's inside a repair pass,
        else the primary's; the pool in its CPU layout when there is one."""
        return self.repair_tier() if self.repairing else (self.slot_table, self.compute_pool())

    def repair_tier(self):
        """(slot table, pool) of the repair tier, the pool in its CPU layout when there is one."""
        if self.repair_slot_table is None:
            raise RuntimeError("a repair pass reached a MoE layer without a repair tier")
        pool = self.repair_cpu_pool if self.repair_cpu_pool is not None else self.repair_pool
        return self.repair_slot_table, pool

    def compute_pool(self):
        """The primary tier's pool as the layer hands it to the MoE kernels: the CPU layout when
        there is one, else `pool`."""
        return self.cpu_pool if self.cpu_pool is not None else self.pool
