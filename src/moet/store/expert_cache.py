"""The device expert cache: a pool of S slots per tag on the compute device, and the int32 slot
table [layers, experts] (-1 = absent) the MoE layers read through.

The pool is a kernels/pools.py object built from the pack's row layout, and every MoE block's
ExpertSlots (store/expert_slots.py) holds that very object (its `slot_table` is row l of the
table, a view): a cached expert's bytes are the pack row's bytes, so the computation cannot tell a
cached expert from a resident one. A miss (slot -1) contributes zero and counts in the layer's miss
counter; the MoE layer's route log (`route_counts`, int32 [experts], a row of this cache's
[layers, experts]) says which experts the pass chose, so the runner knows what to fetch
(store/replay.py drives it).

Eviction: by recency-decayed frequency (score = decay * score + [used this step], per step;
ties: least recent, then lowest key), or plain LRU; never a row the current pass needs.
Fetches copy rows from the host arena (which reads the pack on a miss) straight into the
pool's slots: one asynchronous host-to-device copy per row field on a side stream (rows are
pinned arena slots), then the updated table; the compute stream waits on an event, so no
host sync is needed before the replay.
"""
from __future__ import annotations

import time
from contextlib import nullcontext

import numpy as np
import torch

from moet.errors import ConfigError, MoetError
from moet.store.expert_slots import ExpertSlots
from moet.store.host_arena import HostArena
from moet.store.pack_file import PackFile, copy_row_into_slot

POLICIES = ("decayed", "lru")


def min_cache_slots(num_layers: int, top_k: int, max_num_seqs: int, num_drafts: int = 0) -> int:
    """Fewest slots a decode step can run with (SPEC 2.3): every MoE layer's top_k experts for
    each of up to 4 sequences and their drafts resident at once."""
    return num_layers * top_k * (1 + num_drafts) * min(max_num_seqs, 4)


class ExpertCache:
    def __init__(self, pack: PackFile, num_slots: int, device: torch.device | str, *,
                 arena: HostArena | None = None, policy: str = "decayed", decay: float = 0.9):
        if policy not in POLICIES:
            raise ConfigError(f"expert cache policy {policy!r} is not supported; choose one of {', '.join(POLICIES)}")
        self.pack = pack
        self.device = torch.device(device)
        self.layout = pack.layout
        self.num_layers, self.num_experts = pack.num_layers, pack.num_experts
        total = self.num_layers * self.num_experts
        if num_slots < 1:
            raise ConfigError(f"expert_cache_slots={num_slots} must be at least 1")
        self.num_slots = min(num_slots, total)
        self.policy, self.decay = policy, decay
        cuda = self.device.type == "cuda"
        self.pool = self.layout.new_pool(self.num_slots, self.device)
        self.slot_table = torch.full((self.num_layers, self.num_experts), -1, dtype=torch.int32, device=self.device)
        self.miss_counters = torch.zeros(self.num_layers, dtype=torch.int64, device=self.device)
        self.route_counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.int32, device=self.device)
        # prefetch (store/prefetch.py): tokens per expert predicted for layer l from layer l-1's
        # hidden state this pass (device ops only: graph-capturable); rows a prefetch may not evict
        self.predicted_counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.int32, device=self.device)
        self.predicted_layers = np.zeros(self.num_layers, dtype=bool)    # layers that have a predictor
        self._step_pinned = np.zeros(total, dtype=bool)     # rows fetched / prefetched for this step
        self._prefetched = np.zeros(total, dtype=bool)      # rows prefetched this step
        # demand fetch (eager passes, demand()): rows a prefill (scan) pass brought in, first to go
        # when a later layer of a prefill needs room, so a long prompt streams through a few
        # layers' worth of slots instead of flushing the rows decode keeps using
        self._scan_rows = np.zeros(total, dtype=bool)
        self.scan_pass = False                              # set by the runner for each pass
        self.demand_rows = 0
        self.demand_missed_pairs = 0                        # pairs whose expert demand() had to fetch
        self.demand_seconds = 0.0
        self.prefetched_rows = self.prefetch_used_rows = 0
        self.predicted_pairs = self.routed_pairs_predicted = self.true_pairs = 0
        # host mirror of the table (pinned: uploaded asynchronously) and per-row bookkeeping
        self._table_host = torch.full((self.num_layers, self.num_experts), -1, dtype=torch.int32, pin_memory=cuda)
        self._table = self._table_host.numpy().reshape(-1)
        self._key_of_slot = np.full(self.num_slots, -1, dtype=np.int64)
        self._score = np.zeros(total, dtype=np.float64)
        self._last_used = np.full(total, -1, dtype=np.int64)
        self.step = 0
        self.arena = arena if arena is not None else HostArena(pack, 0, pin=cuda)
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._done: torch.cuda.Event | None = None
        self._in_flight: list[torch.Tensor] = []     # host rows the last fetch copies from
        self.rows_fetched = self.bytes_fetched = 0
        self.fetch_seconds = 0.0
        # per accepted step (run_with_replay): for hit rates and replay counts in engine stats
        self.steps = self.passes = self.pairs = self.first_pass_missed_pairs = self.tolerated_pairs = 0

    # ---- wiring

    def attach(self, blocks: dict[str, object]) -> None:
        """Hand MoE blocks ({pack layer name: MoE}, CausalLM.moe_blocks()) an ExpertSlots over this
        cache: pool, table row, miss counter and route log (views: the tensors CUDA graphs capture
        are this cache's). Blocks the pack lacks are an error; pack layers without a block (MTP not
        loaded) are simply never used."""
        names = self.pack.meta.layers
        unknown = [n for n in blocks if n not in names]
        if unknown:
            raise ConfigError(f"MoE block {unknown[0]} is not in the pack {self.pack.paths.data}")
        for l, name in enumerate(names):
            moe = blocks.get(name)
            if moe is None:
                continue
            if moe.spec.router.num_experts != self.num_experts:
                raise ConfigError(f"{name}: {moe.spec.router.num_experts} experts, the pack has {self.num_experts}")
            # A new ExpertSlots: no CPU layout (CausalLM.prepare_cpu's copy of the pool this one
            # replaces is indexed by its slots, and the cache's slots change) and no demand fetch
            # (attach_demand adds it); the shared experts' stream is the engine's, kept.
            moe.experts = ExpertSlots(self.slot_table[l], self.miss_counters[l:l + 1],
                                      pools={self.layout.tag: self.pool}, primary=self.layout.tag,
                                      route_counts=self.route_counts[l],
                                      shared_stream=moe.experts.shared_stream)

    def key(self, layer: int, expert: int) -> int:
        return layer * self.num_experts + expert

    def resident(self) -> np.ndarray:
        """bool [layers, experts]."""
        return (self._table >= 0).reshape(self.num_layers, self.num_experts)

    # ---- one pass of a step

    def begin_pass(self) -> None:
        self.miss_counters.zero_()
        self.route_counts.zero_()
        self.predicted_counts.zero_()

    def read_pass(self) -> tuple[np.ndarray, np.ndarray]:
        """(missed pairs per layer int64 [L], tokens per expert int32 [L, E]) of the pass just
        run: the one device-to-host sync a step needs."""
        return self.miss_counters.cpu().numpy(), self.route_counts.cpu().numpy()

    def needed_after_miss(self, misses: np.ndarray, routed: np.ndarray) -> np.ndarray:
        """Rows to fetch after a pass with misses: everything the pass routed to when it fits
        (later layers' routes were computed from wrong inputs, but fetching them speculatively
        costs far less than another pass), else the routes of layers up to the first that
        missed (exact: their inputs were right)."""
        flat = np.flatnonzero(routed.reshape(-1) > 0)
        if len(flat) <= self.num_slots:
            return flat
        first_bad = int(np.flatnonzero(misses > 0)[0])
        return flat[flat < (first_bad + 1) * self.num_experts]

    # ---- fetching

    def _victims(self, n: int, keep: np.ndarray) -> np.ndarray:
        resident = self._key_of_slot[self._key_of_slot >= 0]
        cand = resident[~np.isin(resident, keep)]
        if len(cand) < n:
            raise ConfigError(f"one step needs {len(keep)} experts resident at once but the device cache has "
                              f"{self.num_slots} slots; raise --expert-cache-slots (or --expert-cache-gb) or "
                              "lower --max-num-seqs / --max-num-batched-tokens")
        if self.policy == "lru":
            order = np.lexsort((cand, self._last_used[cand]))
        else:
            order = np.lexsort((cand, self._last_used[cand], self._score[cand]))
        return cand[order[:n]]

    def fetch(self, keys, *, scan: bool = False) -> int:
        """Make rows `keys` (flat layer * E + expert) resident, none of them evicted for another;
        returns how many were copied. scan=True: a prefill batch (the arena only fills free
        slots for it)."""
        keys = np.unique(np.asarray(keys, dtype=np.int64))
        self._step_pinned[keys] = True                  # this step needs them: no prefetch evicts them
        if len(keys) > self.num_slots:
            raise ConfigError(f"one step needs {len(keys)} experts resident at once but the device cache has "
                              f"{self.num_slots} slots; raise --expert-cache-slots (or --expert-cache-gb) or "
                              "lower --max-num-seqs / --max-num-batched-tokens")
        missing = keys[self._table[keys] < 0]
        if not len(missing):
            return 0
        t0 = time.perf_counter()
        self._wait_previous()                           # host mirror / staging rows reusable
        free = np.flatnonzero(self._key_of_slot < 0)[:len(missing)]
        slots = list(free)
        if len(missing) > len(free):
            for v in self._victims(len(missing) - len(free), keys):
                slots.append(int(self._table[v]))
                self._table[v] = -1
                self._key_of_slot[slots[-1]] = -1
        self._copy_in(missing, slots, scan)
        self.fetch_seconds += time.perf_counter() - t0
        return len(missing)

    def prefetch(self, layer: int, experts: np.ndarray, *, running_layer: int = -1) -> int:
        """Best effort: make layer `layer`'s predicted `experts` (most wanted first) resident before
        that layer runs. Fills free slots, then evicts only rows this step cannot need as far as
        the host knows: not fetched or prefetched for this step, not used by the previous step,
        not routed so far in this pass, not of `running_layer` (the MoE about to run). Never
        raises for lack of room and never changes results (a wrong guess costs a copy; a miss
        stays a miss and is replayed). Returns the rows copied."""
        keys = layer * self.num_experts + np.asarray(experts, dtype=np.int64)
        missing = keys[self._table[keys] < 0]
        if not len(missing):
            return 0
        t0 = time.perf_counter()
        self._wait_previous()                           # the host table mirror is not in flight
        free = list(np.flatnonzero(self._key_of_slot < 0)[:len(missing)])
        if len(missing) > len(free):
            resident = self._key_of_slot[self._key_of_slot >= 0]
            routed_now = self.route_counts.cpu().numpy().reshape(-1) > 0
            ok = (~self._step_pinned[resident] & (self._last_used[resident] < self.step - 1)
                  & ~routed_now[resident] & (resident // self.num_experts != running_layer))
            cand = resident[ok]
            if self.policy == "lru":
                order = np.lexsort((cand, self._last_used[cand]))
            else:
                order = np.lexsort((cand, self._last_used[cand], self._score[cand]))
            for v in cand[order[:len(missing) - len(free)]]:
                s = int(self._table[v])
                self._table[v] = -1
                self._key_of_slot[s] = -1
                free.append(s)
        missing = missing[:len(free)]
        if not len(missing):
            return 0
        try:
            self._copy_in(missing, free, scan=False)
        except MoetError:
            # a damaged row the arena could not repair: a guess must not fail the step (the freed
            # slots stay free; if the step does route there, its own fetch raises the error)
            return 0
        self._step_pinned[missing] = True
        self._prefetched[missing] = True
        self.prefetched_rows += len(missing)
        self.fetch_seconds += time.perf_counter() - t0
        return len(missing)

    def demand(self, layer: int, experts: np.ndarray, counts: np.ndarray | None = None) -> int:
        """Make layer `layer`'s `experts` resident before that layer runs (eager passes: the MoE
        block calls it between its router and its experts, store/demand.py), so the pass cannot
        miss there and needs no replay. Room: free slots, then rows a prefill pass brought in for
        a layer that already ran in this pass, then by the eviction policy rows this step has not
        pinned, then any row but this layer's. On CUDA the copy runs on the side stream after
        everything already queued (so no slot is rewritten while a kernel reads it) and the
        compute stream waits for it. `counts`: tokens per expert (aligned with `experts`, unique),
        for the hit rate: pairs of fetched experts count as misses. Returns the rows copied."""
        keys = layer * self.num_experts + np.asarray(experts, dtype=np.int64)
        absent = self._table[keys] < 0
        missing = keys[absent]
        self._step_pinned[keys] = True
        if not len(missing):
            return 0
        self.demand_missed_pairs += int(counts[absent].sum()) if counts is not None else len(missing)
        if len(keys) > self.num_slots:
            raise ConfigError(f"one MoE layer needs {len(keys)} experts resident at once but the device cache has "
                              f"{self.num_slots} slots; raise --expert-cache-slots (or --expert-cache-gb) or lower "
                              "--max-num-batched-tokens")
        t0 = time.perf_counter()
        self._wait_previous()
        slots = list(np.flatnonzero(self._key_of_slot < 0)[:len(missing)])
        need = len(missing) - len(slots)
        if need > 0:
            resident = self._key_of_slot[self._key_of_slot >= 0]
            cand = resident[resident // self.num_experts != layer]
            done_scan = self._scan_rows[cand] & (cand // self.num_experts < layer)
            pinned = self._step_pinned[cand]
            if self.policy == "lru":
                order = np.lexsort((cand, self._last_used[cand], pinned, ~done_scan))
            else:
                order = np.lexsort((cand, self._last_used[cand], self._score[cand], pinned, ~done_scan))
            for v in cand[order[:need]]:
                s = int(self._table[v])
                self._table[v] = -1
                self._key_of_slot[s] = -1
                slots.append(s)
        self._copy_in(missing, slots, self.scan_pass)
        self._scan_rows[missing] = self.scan_pass
        self.demand_rows += len(missing)
        dt = time.perf_counter() - t0
        self.fetch_seconds += dt
        self.demand_seconds += dt
        return len(missing)

    def _copy_in(self, missing: np.ndarray, slots: list, scan: bool) -> None:
        """Copy rows `missing` into `slots` (already freed) and upload the table; the compute
        stream waits for the copy (CUDA) before its next kernel."""
        self._wait_previous()                           # host mirror / staging rows reusable
        rows = self.arena.rows(missing.tolist(), scan=scan)
        cuda = self._stream is not None
        if cuda:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the last pass is done reading
        with torch.cuda.stream(self._stream) if cuda else nullcontext():
            for k, s, row in zip(missing.tolist(), slots, rows):
                copy_row_into_slot(self.pool, self.layout, int(s), row, non_blocking=cuda)
                self._table[k] = s
                self._key_of_slot[s] = k
            self.slot_table.copy_(self._table_host, non_blocking=cuda)
        if cuda:
            self._done = torch.cuda.Event()
            self._done.record(self._stream)
            torch.cuda.current_stream(self.device).wait_event(self._done)
            self._in_flight = rows
        self.rows_fetched += len(missing)
        self.bytes_fetched += len(missing) * self.layout.row_bytes

    def _wait_previous(self) -> None:
        if self._done is not None:
            self._done.synchronize()
            self._done = None
            self._in_flight = []

    def warm(self, keys) -> int:
        """Fill free slots with `keys` in order (e.g. the arena's hot set); never evicts."""
        free = int((self._key_of_slot < 0).sum())
        keys = [k for k in dict.fromkeys(int(k) for k in keys) if self._table[k] < 0][:free]
        return self.fetch(keys) if keys else 0

    def stats(self) -> dict[str, float]:
        """Counters for EngineStats.extra (monotonic totals; rates where they need no window)."""
        arena = self.arena
        return {
            "expert_cache_slots": float(self.num_slots),
            "expert_cache_resident": float((self._key_of_slot >= 0).sum()),
            # a pair misses if its expert was absent when its layer ran: after a pass (replayed) or
            # fetched just before (demand fetch, store/demand.py)
            "expert_cache_hit_rate": (1.0 - (self.first_pass_missed_pairs + self.demand_missed_pairs) / self.pairs
                                      if self.pairs else 1.0),
            "expert_replay_passes_per_step": self.passes / self.steps if self.steps else 0.0,
            "expert_tolerated_misses_total": float(self.tolerated_pairs),
            "expert_rows_fetched_total": float(self.rows_fetched),
            "expert_bytes_fetched_total": float(self.bytes_fetched),
            "expert_fetch_seconds_total": self.fetch_seconds,
            "host_arena_hit_rate": arena.hits / (arena.hits + arena.misses) if arena.hits + arena.misses else 1.0,
            "pack_bytes_read_total": float(self.pack.bytes_read),
            # prefetch (store/prefetch.py): precision = predicted experts the layer then used,
            # recall = used experts that were predicted (per layer and step, as sets)
            "expert_prefetch_precision": self.true_pairs / self.predicted_pairs if self.predicted_pairs else 0.0,
            "expert_prefetch_recall": (self.true_pairs / self.routed_pairs_predicted
                                       if self.routed_pairs_predicted else 0.0),
            "expert_prefetch_predicted_total": float(self.predicted_pairs),
            "expert_prefetch_rows_total": float(self.prefetched_rows),
            "expert_prefetch_misses_saved_total": float(self.prefetch_used_rows),
            "expert_demand_rows_total": float(self.demand_rows),
        }

    def end_step(self, routed: np.ndarray) -> None:
        """Account the accepted pass's routes: frequencies decay, used rows score one."""
        used = np.flatnonzero(routed.reshape(-1) > 0)
        if not self.scan_pass:
            self._scan_rows[used] = False                   # decode uses them: ordinary rows now
        self._score *= self.decay
        self._score[used] += 1.0
        self._last_used[used] = self.step
        self.step += 1
        if self.predicted_layers.any():
            self._account_prefetch(routed)
        self._step_pinned[:] = False
        self._prefetched[:] = False

    def _account_prefetch(self, routed: np.ndarray) -> None:
        """Score the accepted pass's predictions (per layer, the set of experts predicted for the
        step's tokens vs the set they routed to) and count prefetched rows it used (misses saved)."""
        pred = self.predicted_counts.cpu().numpy()[self.predicted_layers] > 0
        real = routed[self.predicted_layers] > 0
        self.predicted_pairs += int(pred.sum())
        self.routed_pairs_predicted += int(real.sum())
        self.true_pairs += int((pred & real).sum())
        self.prefetch_used_rows += int((self._prefetched & (routed.reshape(-1) > 0)).sum())



def cache_slots(expert_cache_slots: int | None, expert_cache_gb: float | None, row_bytes: int, total_rows: int) -> int | None:
    """Slots for EngineConfig.store.expert_cache_slots / expert_cache_gb (None: neither is set; the
    engine decides from free device memory after weights and KV)."""
    if expert_cache_slots is not None:
        return min(expert_cache_slots, total_rows)
    if expert_cache_gb is not None:
        return min(total_rows, int(expert_cache_gb * 2**30) // row_bytes)
    return None
