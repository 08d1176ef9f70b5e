"""RepairPool: an FP4 repair tier of part of the experts (EngineConfig.gate.fp4_pool_gb smaller than
every expert's FP4 rows): which experts hold its device slots, and their promotion.

Every MoE layer has the same number of FP4 slots on the device (`ExpertSlots.pools["fp4"]`). The rows
to fill them from come from a row source: every expert's FP4 rows in host memory
(`HostPoolRows`, the loader's `ExpertSlots.repair_host_pool`, slot = expert id, pinned on CUDA), or,
with the expert store, the FP4 pack through its own host arena (`PackRows`: disk -> host arena ->
device, like the W2 rows). A repair pass counts the pairs routed to each expert
(`repair_route_counts`) and the pairs that found no FP4 row (`repair_miss_counter`: those computed
with their W2 rows); both are views of this pool's [layers, ...] tensors, so one copy reads, saves or
restores them all (a store step replayed after a W2 miss restores them first: `snapshot`,
`restore`). After each pass `after_repair` folds the counts into a decayed heat per (layer, expert)
and moves the hottest absent experts in, evicting the coldest present ones, at most
`max_rows_per_repair` rows a pass: the traffic a repair can add stays bounded. The copies go on the
stream of their own on CUDA (they overlap the W2 steps that follow; the next pass that reads the
repair tier waits for them: `ExpertSlots.repair_ready`); the tables change in place
(`ExpertSlots.assign_repair_slot`). The heat outlives the engine: saved at close beside the packs
(~/.cache/moet/packs unless --pack-dir), keyed by the checkpoint's identity, and the next engine
fills its slots hottest first.
"""
from __future__ import annotations

import json
import os

import torch

from moet.kernels.pools import pool_nbytes


# With the expert store, --fp4-pool-gb auto gives the FP4 device pool this share of the room the
# dense weights leave: the W2 cache must keep most of it, or every W2 step would miss.
STORE_POOL_SHARE = 4


class HostPoolRows:
    """Rows from every expert's FP4 rows in host memory (`ExpertSlots.repair_host_pool`)."""

    def copy(self, slots, moves: list[tuple[int, int, int]]) -> None:
        """moves: (layer index, device slot, expert) -> the expert's rows into the slot."""
        for li, slot, expert in moves:
            e = slots[li]
            host, dev = e.repair_host_pool, e.repair_pool
            for f in dev.__slots__:
                t = getattr(dev, f)
                if isinstance(t, torch.Tensor):
                    t[slot].copy_(getattr(host, f)[expert], non_blocking=True)

    def close(self) -> None:
        """Nothing to release: the host pools belong to the model's ExpertSlots."""


class PackRows:
    """Rows from the FP4 pack through a host arena (store/host_arena.py): the rows of one call are
    read together (disk misses in parallel), then copied into the slots asynchronously. A row
    stays valid in the arena until its next call, which first waits for the last copies."""

    def __init__(self, arena, layer_of: list[int]):
        self.arena = arena
        self.layout = arena.pack.layout
        self.layer_of = layer_of          # pool layer index -> pack layer
        self._done = None

    def copy(self, slots, moves: list[tuple[int, int, int]]) -> None:
        from moet.store.pack_file import copy_row_into_slot

        if not moves:
            return
        if self._done is not None:
            self._done.synchronize()
        rows = self.arena.rows([self.arena.key(self.layer_of[li], x) for li, _, x in moves])
        for (li, slot, _), row in zip(moves, rows):
            copy_row_into_slot(slots[li].repair_pool, self.layout, slot, row, non_blocking=True)
        dev = slots[0].repair_slot_table.device
        if dev.type == "cuda":
            self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(dev))

    def close(self) -> None:
        if self._done is not None:
            self._done.synchronize()
            self._done = None


class RepairPool:
    DECAY = 0.9          # heat kept per repair pass: the last ~10 passes dominate

    def __init__(self, blocks: dict, max_rows_per_repair: int, source=None):
        """blocks: {layer name: MoE block} whose ExpertSlots hold a partial repair tier; source:
        where promoted rows come from (HostPoolRows when None)."""
        self.names = list(blocks)
        self.slots = [blocks[n].experts for n in self.names]
        first = self.slots[0]
        self.num_experts = first.repair_slot_table.numel()
        self.num_slots = first.repair_pool.num_slots
        self.max_rows_per_repair = max(1, int(max_rows_per_repair))
        self.row_bytes = pool_nbytes(first.repair_pool) // self.num_slots
        self.source = source if source is not None else HostPoolRows()
        # every layer's counters in one tensor each; the layers count into views of them
        dev = first.repair_slot_table.device
        self.route_counts = torch.zeros(len(self.slots), self.num_experts, dtype=torch.int32, device=dev)
        self.miss_counts = torch.zeros(len(self.slots), dtype=torch.int64, device=dev)
        for li, e in enumerate(self.slots):
            e.repair_route_counts = self.route_counts[li]
            e.repair_miss_counter = self.miss_counts[li:li + 1]
        # promotions copy on a stream of their own: they overlap the W2 steps that follow, and the
        # next pass that reads the repair tier waits for them (ExpertSlots.repair_ready)
        self._stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        self.heat = torch.zeros(len(self.slots), self.num_experts, dtype=torch.float64)
        # holder[l][slot] = the expert in that slot, -1 = empty
        self.holder = [[-1] * self.num_slots for _ in self.slots]
        self.promotions = 0
        self.bytes_moved = 0
        self.routed_pairs = 0
        self.missed_pairs = 0

    def fill(self, order: list[list[int]] | None = None) -> None:
        """The first occupants of every layer's slots: `order[l]` (hottest first; e.g. the heat
        of an earlier run), else experts 0, 1, ...; counted as promotions."""
        for li in range(len(self.slots)):
            want = (order[li] if order is not None else list(range(self.num_experts)))[:self.num_slots]
            keep = set(want) & set(self.holder[li])          # already in a slot: stays there
            free = [slot for slot, x in enumerate(self.holder[li]) if x not in keep]
            self._move_in([(li, free.pop(0), x) for x in want if x not in keep])

    def _move_in(self, moves: list[tuple[int, int, int]]) -> None:
        """(layer index, slot, expert): the tables first (the old occupant leaves), then the rows."""
        for li, slot, expert in moves:
            e = self.slots[li]
            old = self.holder[li][slot]
            if old >= 0:
                e.assign_repair_slot(old, -1)
            e.assign_repair_slot(expert, slot)
            self.holder[li][slot] = expert
        if self._stream is None:
            self.source.copy(self.slots, moves)
        elif moves:
            dev = self.route_counts.device
            self._stream.wait_stream(torch.cuda.current_stream(dev))    # passes still reading the slots
            with torch.cuda.stream(self._stream):
                self.source.copy(self.slots, moves)
            ready = torch.cuda.Event()
            ready.record(self._stream)
            for e in self.slots:
                e.repair_ready = ready
        self.promotions += len(moves)
        self.bytes_moved += len(moves) * self.row_bytes

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The counters now (a step that may run again after a miss restores them before each pass)."""
        return self.route_counts.clone(), self.miss_counts.clone()

    def restore(self, snap: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.route_counts.copy_(snap[0])
        self.miss_counts.copy_(snap[1])

    def after_repair(self) -> int:
        """Fold one repair pass's routing into the heat and promote; -> rows moved."""
        counts = self.route_counts.to("cpu", torch.float64)
        missed = int(self.miss_counts.sum().item())
        self.route_counts.zero_()
        self.miss_counts.zero_()
        self.routed_pairs += int(counts.sum().item())
        self.missed_pairs += missed
        self.heat.mul_(self.DECAY).add_(counts)
        moves = []                    # (heat gain, layer, slot, expert)
        for li, order in enumerate(self.hot_order()):
            heat = self.heat[li].tolist()
            slot_of = {x: slot for slot, x in enumerate(self.holder[li]) if x >= 0}
            # the hottest experts (ties: lower id), and those of them not yet in a slot
            ranked = order[:self.num_slots]
            absent = [x for x in ranked if x not in slot_of]
            if not absent:
                continue
            hot = set(ranked)
            victims = sorted((x for x in slot_of if x not in hot), key=lambda x: (heat[x], x))
            free = [slot for slot, x in enumerate(self.holder[li]) if x < 0]
            for x in absent:
                if free:
                    moves.append((heat[x], li, free.pop(0), x))
                elif victims:
                    v = victims.pop(0)
                    if heat[x] - heat[v] > 0:
                        moves.append((heat[x] - heat[v], li, slot_of[v], x))
        moves.sort(key=lambda m: -m[0])
        self._move_in([(li, slot, x) for _, li, slot, x in moves[:self.max_rows_per_repair]])
        return min(len(moves), self.max_rows_per_repair)

    def hot_order(self) -> list[list[int]]:
        """Each layer's experts, hottest first (what `fill` takes back)."""
        return [sorted(range(self.num_experts), key=lambda x: (-h[x], x)) for h in self.heat.tolist()]

    def save_heat(self, path: str, checkpoint_identity: str) -> None:
        """The heat, for the next engine on this checkpoint (`load_heat`); written atomically."""
        doc = {"checkpoint_identity": checkpoint_identity, "layers": self.names, "num_experts": self.num_experts,
               "heat": self.heat.tolist()}
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)

    def load_heat(self, path: str, checkpoint_identity: str) -> bool:
        """Take a saved heat back and refill the slots hottest first. A file of another checkpoint
        or layout, or an unreadable one, is ignored (it is only a hint). -> whether it was used."""
        try:
            with open(path) as f:
                doc = json.load(f)
            if (doc["checkpoint_identity"], doc["layers"], doc["num_experts"]) != (
                    checkpoint_identity, self.names, self.num_experts):
                return False
            heat = torch.tensor(doc["heat"], dtype=torch.float64)
        except (OSError, ValueError, KeyError, TypeError):
            return False
        if tuple(heat.shape) != tuple(self.heat.shape) or not bool(torch.isfinite(heat).all()):
            return False
        self.heat = heat
        self.fill(self.hot_order())
        return True

    def stats(self) -> dict[str, float]:
        return {
            "fp4_pool_slots_per_layer": float(self.num_slots),
            "fp4_pool_experts_per_layer": float(self.num_experts),
            "fp4_pool_hit_rate": 1.0 - self.missed_pairs / self.routed_pairs if self.routed_pairs else 0.0,
            "fp4_pool_promotions": float(self.promotions),
            "fp4_pool_bytes_moved": float(self.bytes_moved),
        }
