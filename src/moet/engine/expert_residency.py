"""ExpertResidency: the engine's side of the residency store (moet/store).

When routed experts go through the store (`store_reason`, the one rule; docs/architecture.md):
  1. pack_dir is set, or expert_cache_slots / expert_cache_gb caps the device cache: always;
  2. neither, on CUDA: when the estimated weights (dense in the model dtype + every expert row)
     exceed 80% of what gpu_memory_utilization allows (the rest is left to KV and activations);
  3. otherwise (CPU, or everything fits): all experts resident, the loader's path, no pack.
The bf16 expert format has no pack: it is always resident (asking for the store with it is an
error that says so).

With the store on, the model is loaded without routed experts; the pack is opened (built,
resumed or repaired first), a host arena fronts it, and a device ExpertCache that every MoE
block reads through. Each engine step runs under run_with_replay, so strict mode
(miss_tolerance=0) gives exactly the fully resident outputs. One step's experts must fit in
the cache at once: `step_token_cap` bounds the scheduler's token budget so that even the worst
step (every token routed to distinct experts in every layer) fits, unless `expert_demand_fetch`
(store/demand.py) lets eager steps fetch layer by layer: then only captured decode steps are
bounded, in sequences (`decode_seq_cap`). With `expert_prefetch` (and a
cache smaller than the pack) each layer guesses the next layer's experts and fetches them early
(store/prefetch.py); results are unchanged, accuracy goes to the stats. Every
`expert_stats_interval_s` seconds (0 = off) one INFO line sums up the store since the last one
(log_stats: hit rates per tier, bytes moved per token, passes per step, fetch stall, prefetch).
A pack row that fails its checksum when read is re-converted from the checkpoint and rewritten
(store/pack_builder.RowRepairer) and the step goes on; until every such row is whole on disk
again the engine is degraded (`health()`, `pack_*_rows` in the stats).

With the FP4 repair tier (`repair_slots`, engine/confidence_gate.repair_tier_plan) the FP4 rows
have a pack of their own (tag fp4, beside the W2 pack) and a host arena of their own; every MoE
block gets a device FP4 pool of `repair_slots` slots. A pool of every expert is filled from the
pack at start; a smaller one is a RepairPool (store/repair_pool.py) whose promotions read the FP4
pack through its arena. Repair passes run under `run` like any step (their W2 fallback rows can
miss), with the pool's counters restored before each replayed pass.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable, TypeVar

import torch

from moet.config import EngineConfig
from moet.errors import ConfigError, PackError
from moet.store import ExpertCache, HostArena, expert_row_bytes, min_cache_slots, open_pack, run_with_replay
from moet.engine.decode_mode import DecodeModeChooser
from moet.store.demand import attach_demand
from moet.store.expert_cache import cache_slots
from moet.store.host_arena import arena_slots
from moet.store.pack_builder import PACK_TAGS, RowRepairer, pack_layers
from moet.store.pack_file import READ_ONLY_ERRNOS, not_writable
from moet.store.prefetch import attach_prefetch
from moet.store.expert_slots import REPAIR_FORMAT
from moet.store.pack_file import copy_row_into_slot
from moet.store.repair_pool import PackRows, RepairPool

log = logging.getLogger("moet.engine")
T = TypeVar("T")

DEFAULT_PACK_DIR = "~/.cache/moet/packs"
REPAIR_RETRY_S = 60.0         # pack rows still damaged on disk are re-converted again this often
FIT_FRACTION = 0.8            # weights may take this much of the GPU budget before the store turns on
_ACTIVATION_RESERVE = 0.05    # auto-sized cache on CUDA: share of the budget kept for activations


def estimated_weight_bytes(ckpt, tag: str, dtype: torch.dtype) -> tuple[int, int]:
    """(dense bytes in `dtype`, all routed-expert rows in `tag`): what a fully resident load needs."""
    from moet.checkpoint.spec import expert_ref

    spec = ckpt.spec
    elem = torch.empty((), dtype=dtype).element_size()
    dense = 0
    for name, info in ckpt.reader.tensors.items():
        if expert_ref(spec.canonical_name(name)) is None and not name.endswith(("_scale", "_scale_inv", "_scale_2")):
            n = 1
            for d in info.shape:
                n *= d
            dense += n * elem
    rows = len(pack_layers(spec)) * spec.router.num_experts
    return dense, rows * expert_row_bytes(spec, tag)


def store_reason(config: EngineConfig, ckpt, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why routed experts go through the store; None: all resident (the loader's path)."""
    store = config.store
    explicit = [n for n in ("pack_dir", "expert_cache_slots", "expert_cache_gb") if getattr(store, n) is not None]
    if not pack_layers(ckpt.spec):
        return None                                   # no routed experts: nothing to page
    fmt = config.load.expert_format
    if fmt not in PACK_TAGS:
        if explicit:
            raise ConfigError(f"{explicit[0]} is set but expert_format={fmt} has no pack (packs hold "
                              f"{', '.join(PACK_TAGS)}); use --expert-format w2 or fp4, or unset {explicit[0]}")
        return None
    if explicit:
        return f"{explicit[0]} is set"
    if device.type != "cuda":
        return None
    dense, expert = estimated_weight_bytes(ckpt, fmt, dtype)
    free, total = torch.cuda.mem_get_info(device)
    budget = total * config.cache.gpu_memory_utilization - (total - free)
    if budget < dense:
        # Nothing can help here but memory: say whose it is (another process, or an engine of this
        # one not yet freed), rather than the store's later "0 expert slots".
        raise ConfigError(
            f"the GPU budget is {budget / 2**30:.1f} GiB ({config.cache.gpu_memory_utilization:.0%} of {device}'s "
            f"{total / 2**30:.1f} GiB, less {(total - free) / 2**30:.1f} GiB already in use there, by another "
            f"process or an engine not yet freed), and the dense weights alone need {dense / 2**30:.1f} GiB: "
            f"free that memory or raise --gpu-memory-utilization")
    if dense + expert <= FIT_FRACTION * budget:
        return None
    return (f"dense {dense / 2**30:.1f} GiB + experts {expert / 2**30:.1f} GiB exceed {FIT_FRACTION:.0%} of the "
            f"{budget / 2**30:.1f} GiB GPU budget")


def health_from_extra(extra: dict) -> tuple[str, str]:
    """ExpertResidency.health() from EngineStats.extra alone (a process that has only the stats,
    e.g. EngineProcess's parent): ("ok", "") or ("degraded", reason)."""
    n = int(extra.get("pack_unrepaired_rows", 0))
    if not n:
        return ("ok", "")
    return ("degraded", f"{n} expert row{'s' if n > 1 else ''} of the pack failed "
                        f"{'their checksums' if n > 1 else 'its checksum'} and {'are' if n > 1 else 'is'} not "
                        "repaired on disk (the engine log names them); restart with --pack-verify full, or "
                        "--rebuild-pack")


class ExpertResidency:
    """Pack + host arena + device expert cache of one engine; `run` wraps each step.
    `ExpertResidency.open` opens the checkpoint's pack; the constructor takes an open one (the
    residency then owns it and closes it)."""

    @classmethod
    def open(cls, config: EngineConfig, ckpt, model, device: torch.device, *,
             progress: bool = True, repair_slots: int | None = None) -> "ExpertResidency":
        store, load = config.store, config.load
        pack_dir = os.path.expanduser(store.pack_dir or DEFAULT_PACK_DIR)
        try:
            os.makedirs(pack_dir, exist_ok=True)
        except OSError as exc:
            if exc.errno not in READ_ONLY_ERRNOS:
                raise
            raise not_writable(pack_dir, exc, "creating the pack directory") from None
        t0 = time.perf_counter()
        pack = open_pack(ckpt, pack_dir, tag=load.expert_format, zero_mode=load.w2_zero_mode,
                         scale_rule=load.w2_scale_rule, verify=store.pack_verify, rebuild=store.rebuild_pack,
                         o_direct=store.o_direct, device=device, progress=progress)
        repair_pack = None
        if repair_slots is not None:
            try:
                repair_pack = open_pack(ckpt, pack_dir, tag=REPAIR_FORMAT, verify=store.pack_verify,
                                        rebuild=store.rebuild_pack, o_direct=store.o_direct, device=device,
                                        progress=progress)
            except ConfigError as exc:
                # e.g. a read-only pack directory holding the W2 pack only: serve bare W2 rather than
                # nothing, unless the FP4 pool was asked for by size
                if config.gate.fp4_pool_bytes is not None:
                    pack.close()
                    raise
                log.warning("FP4 repair tier and confidence gate off: the FP4 pack cannot be opened (%s)", exc)
                repair_slots = None
            except BaseException:
                pack.close()
                raise
        return cls(config, pack, ckpt.spec, model, device, pack_open_s=time.perf_counter() - t0,
                   repairer=RowRepairer(ckpt, pack, device), repair_pack=repair_pack, repair_slots=repair_slots,
                   repair_repairer=RowRepairer(ckpt, repair_pack, device) if repair_pack is not None else None)

    def __init__(self, config: EngineConfig, pack, spec, model, device: torch.device, *, pack_open_s: float = 0.0,
                 repairer: RowRepairer | None = None, repair_pack=None, repair_slots: int | None = None,
                 repair_repairer: RowRepairer | None = None):
        self.config = config
        self.device = device
        self.spec = spec
        self.pack = pack
        self.model = model
        self.pack_open_s = pack_open_s
        self.miss_tolerance = config.store.miss_tolerance      # a bench may change it between runs
        self.total_rows = self.pack.num_layers * self.pack.num_experts
        self.arena: HostArena | None = None
        self.cache: ExpertCache | None = None
        self.demand = False           # demand fetch attached (start)
        self.decode_mode = DecodeModeChooser("graph")
        self.tokens = 0
        self.warm_bytes = 0           # fetched at start (not by steps): kept out of the per-token rate
        self.warm_pack_bytes = 0      # read from the pack at start (hot set preload, warm-up)
        # fetches after a pass with misses (the stall a step waits for; prefetches excluded)
        self.step_fetches = 0
        self.step_fetch_s = 0.0
        self._log_every = float(config.store.expert_stats_interval_s)
        self._log_t = time.monotonic()
        self._log_last: dict[str, float] | None = None
        self._closed = False
        # damaged pack rows found while serving (PackFile.read_row_into): re-converted from the
        # checkpoint and rewritten by `repairer`; rows not whole on disk again keep the engine
        # degraded (health()) until a later read repairs them
        self.repairer = repairer
        self.pack_corrupt_rows = 0        # reads that found a row damaged
        self.pack_repaired_rows = 0       # of those, rows re-converted and rewritten (whole on disk again)
        self.pack_reconverted_rows = 0    # rows served re-converted from the checkpoint (rewritten or not)
        self._damaged: dict[int, str] = {}   # row key -> why it is not whole on disk yet
        self._health: tuple[str, str] = ("ok", "")
        self.repair_retry_s = REPAIR_RETRY_S  # rows still damaged are tried again this often (at a step)
        self._retry_t = time.monotonic()
        # the FP4 repair tier's pack, host arena, device pools (one per MoE block, attached at start)
        # and, for a pool of part of the experts, its RepairPool
        self.repair_pack = repair_pack
        self.repair_repairer = repair_repairer
        self.repair_arena: HostArena | None = None
        self.repair_pools: dict[str, object] = {}
        self.repair_pool: RepairPool | None = None
        try:
            slots = arena_slots(config.store.host_arena_gb, self.pack.stride, self.total_rows)
            self.arena = HostArena(self.pack, slots,
                                   pin=device.type == "cuda", repair=self._repair_row if repairer else None)
            self.preloaded = self.arena.preload_hot_set()
            if repair_pack is not None:
                # sized by the W2 arena's rule, after it: unset takes half of what the W2 arena left
                slots = arena_slots(config.store.host_arena_gb, repair_pack.stride, self.total_rows)
                self.repair_arena = HostArena(repair_pack, slots, pin=device.type == "cuda",
                                              repair=self._repair_fp4_row if repair_repairer else None)
                # before the W2 cache is sized (auto_slots): the pools' bytes are already in use then
                n = min(int(repair_slots), repair_pack.num_experts)
                self.repair_pools = {name: repair_pack.layout.new_pool(n, device)
                                     for name in model.moe_blocks() if name in repair_pack.meta.layers}
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ sizing (the runner calls start)

    @property
    def layers_per_token(self) -> int:
        """MoE layers one token passes through in a step (the decoder's; MTP runs apart)."""
        return len(self.spec.moe_layers)

    def requested_slots(self) -> int | None:
        c = self.config.store
        return cache_slots(c.expert_cache_slots, c.expert_cache_gb, self.pack.layout.row_bytes, self.total_rows)

    def auto_slots(self, kv_floor_bytes: int) -> int:
        """No cap given: every row on CPU; on CUDA what the budget leaves after the weights in use,
        a KV floor and an activation reserve (the KV cache then takes what is left)."""
        if self.device.type != "cuda":
            return self.total_rows
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total * self.config.cache.gpu_memory_utilization - (total - free)
        room = budget * (1 - _ACTIVATION_RESERVE) - kv_floor_bytes
        return max(0, min(self.total_rows, int(room // self.pack.layout.row_bytes)))

    def start(self, num_slots: int) -> None:
        """Allocate the device cache, point the MoE blocks at it, warm it (everything when it all
        fits, else the saved hot set)."""
        c, r = self.config.store, self.spec.router
        need = min_cache_slots(self.layers_per_token, r.top_k, self.config.scheduler.max_num_seqs)
        if num_slots < need:
            raise ConfigError(
                f"the device expert cache would hold {num_slots} experts, fewer than the {need} a decode step needs "
                f"({self.layers_per_token} MoE layers x top_k {r.top_k} x min(max_num_seqs, 4)); raise "
                "--expert-cache-slots (or --expert-cache-gb, or --gpu-memory-utilization) or lower --max-num-seqs")
        self.cache = ExpertCache(self.pack, num_slots, self.device, arena=self.arena, policy=c.expert_cache_policy)
        self.cache.attach(self.model.moe_blocks())
        if c.expert_prefetch and self.cache.num_slots < self.total_rows:     # a full cache never misses
            attach_prefetch(self.model, self.cache)
        self.demand = bool(c.expert_demand_fetch) and self.cache.num_slots < self.total_rows
        if self.demand:
            attach_demand(self.model.moe_blocks(), self.cache)
        # graph + replay or eager + demand fetch for decode steps (a full cache never misses: graphs)
        self.decode_mode = DecodeModeChooser(c.expert_decode_mode if self.demand else "graph")
        if self.cache.num_slots >= self.total_rows:
            self.cache.warm(range(self.total_rows))
        elif self.arena is not None and self.arena.hot_keys():
            self.cache.warm(list(reversed(self.arena.hot_keys())))      # most recent first
        self.warm_bytes = self.cache.bytes_fetched
        self.warm_pack_bytes = self.pack.bytes_read
        if self.repair_pools:
            self._attach_repair_tier()
        self._log_t, self._log_last = time.monotonic(), self._counters()
        log.info("expert store: pack %s (%s), %d/%d rows in the device cache, %d host arena slots",
                 self.pack.paths.data, "built" if self.pack.built_layers else "reused", self.cache.num_slots,
                 self.total_rows, self.arena.num_slots if self.arena else 0)

    def _attach_repair_tier(self) -> None:
        """Every MoE block's FP4 pool into its (new, the cache's) ExpertSlots: every expert's rows
        read from the FP4 pack now, or a RepairPool that promotes them as repairs need them."""
        blocks = self.model.moe_blocks()
        pack, arena = self.repair_pack, self.repair_arena
        layer_of = {name: pack.meta.layers.index(name) for name in self.repair_pools}
        full = next(iter(self.repair_pools.values())).num_slots >= pack.num_experts
        for name, pool in self.repair_pools.items():
            e = blocks[name].experts
            n = pack.num_experts
            if full:
                for x, row in enumerate(arena.rows([arena.key(layer_of[name], x) for x in range(n)])):
                    copy_row_into_slot(pool, pack.layout, x, row)
                table = torch.arange(n, dtype=torch.int32, device=self.device)
            else:
                table = torch.full((n,), -1, dtype=torch.int32, device=self.device)
            e.add_repair_tier(pool, table)
        if not full:
            partial = {name: blocks[name] for name in self.repair_pools}
            self.repair_pool = RepairPool(partial, max_rows_per_repair=len(partial) * self.spec.router.top_k,
                                          source=PackRows(arena, [layer_of[n] for n in partial]))
            self.repair_pool.fill()
        log.info("FP4 repair tier from the pack %s: %d of %d experts per MoE layer on the device, %d host arena "
                 "slots", pack.paths.data, next(iter(self.repair_pools.values())).num_slots, pack.num_experts,
                 arena.num_slots)

    def step_token_cap(self) -> int | None:
        """Most tokens one step may compute so that its experts always fit the cache (None: no cap).
        With miss replay alone a step's experts of every layer must be resident at once; with
        demand fetch an eager step needs one layer's at a time (a cache of at least one layer's
        experts: no cap), but a captured decode step still needs them all (decode_seq_cap)."""
        if self.cache is None or self.cache.num_slots >= self.total_rows:
            return None
        k = self.spec.router.top_k
        if self.demand:
            return None if self.cache.num_slots >= self.pack.num_experts else max(1, self.cache.num_slots // k)
        return max(1, self.cache.num_slots // (self.layers_per_token * k))

    def decode_seq_cap(self) -> int | None:
        """Most sequences one (captured, replayed) decode step may hold so that its experts of every
        layer fit the cache at once (None: no cap)."""
        if self.cache is None or self.cache.num_slots >= self.total_rows:
            return None
        return max(1, self.cache.num_slots // (self.layers_per_token * self.spec.router.top_k))

    # ------------------------------------------------------------------ one step

    def run(self, step: Callable[[], T], *, scan: bool, num_tokens: int, repairing: bool = False) -> T:
        """The step, replayed until no expert missed (or at most miss_tolerance pairs did).
        repairing: the step computes rows with a partial FP4 pool, whose counters each replayed
        pass must start from where the step found them."""
        if self._damaged and time.monotonic() - self._retry_t >= self.repair_retry_s:
            self._retry_damaged()
        if repairing and self.repair_pool is not None:
            pool, snap, inner = self.repair_pool, self.repair_pool.snapshot(), step

            def step():
                pool.restore(snap)
                return inner()
        c = self.cache
        c.scan_pass = scan
        rows0, s0 = c.demand_rows, c.demand_seconds
        out, r = run_with_replay(step, c, miss_tolerance=self.miss_tolerance, scan=scan)
        self.tokens += num_tokens
        if r.rows_fetched or c.demand_rows > rows0:      # the step waited for copies: after a pass or per layer
            self.step_fetches += 1
            self.step_fetch_s += r.fetch_s + (c.demand_seconds - s0)
        if self._log_every > 0 and time.monotonic() - self._log_t >= self._log_every:
            self.log_stats()
        return out

    # ------------------------------------------------------------------ damaged rows, health

    def _repair_row(self, layer: int, expert: int, out: memoryview) -> None:
        """HostArena's repair hook: called in the step's thread for a row that failed its checksum
        (or was cut short) on read. The step goes on with the re-converted bytes; if they cannot
        be made, the PackError fails this step and the engine stays degraded."""
        key = layer * self.pack.num_experts + expert
        where = self.pack.where(layer, expert)
        self.pack_corrupt_rows += 1
        log.error("%s is damaged on disk (failed its checksum or was cut short): re-converting it from the "
                  "checkpoint", where)
        try:
            why = self.repairer.repair(layer, expert, out)
        except Exception as exc:             # the checkpoint moved, a shard unreadable, other bytes
            self._damaged[key] = f"could not re-convert it: {type(exc).__name__}: {exc}"
            self._retry_t = time.monotonic()
            self._update_health()
            raise PackError(f"{where} is damaged on disk and could not be re-converted from the checkpoint "
                            f"({type(exc).__name__}: {exc}); it is tried again every {self.repair_retry_s:g}s, or "
                            "restart with --pack-verify full (or --rebuild-pack) once the checkpoint is "
                            "readable") from None
        self.pack_reconverted_rows += 1
        if why is None:
            self.pack_repaired_rows += 1
            self._damaged.pop(key, None)
            log.warning("%s re-converted from the checkpoint and rewritten: the pack is whole again there", where)
        else:
            self._damaged[key] = why
            log.error("%s: %s", where, why)
        self._update_health()

    def _repair_fp4_row(self, layer: int, expert: int, out: memoryview) -> None:
        """The FP4 arena's repair hook: as `_repair_row`, for the FP4 pack (not retried later)."""
        where = self.repair_pack.where(layer, expert)
        self.pack_corrupt_rows += 1
        log.error("%s is damaged on disk (failed its checksum or was cut short): re-converting it from the "
                  "checkpoint", where)
        try:
            why = self.repair_repairer.repair(layer, expert, out)
        except Exception as exc:
            raise PackError(f"{where} is damaged on disk and could not be re-converted from the checkpoint "
                            f"({type(exc).__name__}: {exc}); restart with --pack-verify full (or --rebuild-pack) "
                            "once the checkpoint is readable") from None
        self.pack_reconverted_rows += 1
        if why is None:
            self.pack_repaired_rows += 1
            log.warning("%s re-converted from the checkpoint and rewritten: the pack is whole again there", where)
        else:
            log.error("%s: %s", where, why)

    def _retry_damaged(self) -> None:
        """Try the rows still damaged on disk again (a repair that failed because the checkpoint
        was unreadable, or a rewrite the disk refused): degraded lasts until they are whole, not
        until some request happens to need them."""
        self._retry_t = time.monotonic()
        buf = bytearray(self.pack.stride)
        for key in list(self._damaged):
            layer, expert = divmod(key, self.pack.num_experts)
            try:
                why = self.repairer.repair(layer, expert, memoryview(buf))
            except Exception as exc:
                self._damaged[key] = f"could not re-convert it: {type(exc).__name__}: {exc}"
                continue
            if why is None:
                self.pack_repaired_rows += 1
                del self._damaged[key]
                log.warning("%s re-converted from the checkpoint and rewritten: the pack is whole again there",
                            self.pack.where(layer, expert))
            else:
                self._damaged[key] = why
        self._update_health()

    def _update_health(self) -> None:
        n = len(self._damaged)
        if not n:
            self._health = ("ok", "")
            return
        first = next(iter(self._damaged.values()))
        self._health = ("degraded", f"{n} expert row{'s' if n > 1 else ''} of the pack {self.pack.paths.data} "
                                    f"failed {'their checksums' if n > 1 else 'its checksum'} and "
                                    f"{'are' if n > 1 else 'is'} not repaired on disk (e.g. {first}); restart with "
                                    "--pack-verify full, or --rebuild-pack")

    def health(self) -> tuple[str, str]:
        """("ok", "") or ("degraded", why): degraded while a pack row found damaged is not whole
        on disk again (a read that repairs it turns the engine ok again). One tuple, replaced
        whole, so other threads may read it while a step runs."""
        return self._health

    # ------------------------------------------------------------------ statistics

    def _counters(self) -> dict[str, float]:
        """Monotonic totals the periodic log line takes differences of."""
        c, a = self.cache, self.arena
        return {"t": time.monotonic(), "tokens": self.tokens, "steps": c.steps, "passes": c.passes, "pairs": c.pairs,
                "missed": c.first_pass_missed_pairs + c.demand_missed_pairs, "bytes": c.bytes_fetched, "pack_bytes": self.pack.bytes_read,
                "arena_hits": a.hits if a else 0, "arena_misses": a.misses if a else 0,
                "fetches": self.step_fetches, "fetch_s": self.step_fetch_s, "predicted": c.predicted_pairs,
                "true": c.true_pairs, "routed_predicted": c.routed_pairs_predicted}

    def log_stats(self) -> str | None:
        """Log (INFO, logger moet.engine) the store's numbers since the last line: GPU cache and host
        arena hit rates, bytes moved host -> device and read from the pack per computed token,
        replay passes per step, mean fetch stall per step that fetched, prefetch precision / recall.
        Returns the line (None before start or when no step ran)."""
        if self.cache is None:
            return None
        now = self._counters()
        last = self._log_last or {k: 0.0 for k in now}
        d = {k: now[k] - last[k] for k in now}
        self._log_t, self._log_last = time.monotonic(), now
        if not d["steps"]:
            return None
        tok = max(1.0, d["tokens"])
        arena = d["arena_hits"] + d["arena_misses"]
        pct = lambda x, n: f"{100 * x / n:.1f}%" if n else "-"     # noqa: E731
        line = (f"expert store, last {d['t']:.1f}s: {int(d['tokens'])} tokens in {int(d['steps'])} steps; "
                f"hit rate GPU cache {pct(d['pairs'] - d['missed'], d['pairs'])}, host arena "
                f"{pct(d['arena_hits'], arena)}; moved {d['bytes'] / tok / 2**20:.2f} MiB/token host->GPU, "
                f"{d['pack_bytes'] / tok / 2**20:.2f} MiB/token from the pack; "
                f"{d['passes'] / d['steps']:.2f} passes/step; fetch "
                + (f"{1e3 * d['fetch_s'] / d['fetches']:.2f} ms x {int(d['fetches'])} steps" if d["fetches"] else "none")
                + f"; prefetch precision {pct(d['true'], d['predicted'])} recall {pct(d['true'], d['routed_predicted'])}")
        log.info(line)
        return line

    def stats(self) -> dict[str, float]:
        if self.cache is None:
            return {}
        c = self.cache
        out = c.stats()
        out.update(self.decode_mode.stats())
        out.update({
            "expert_first_pass_misses_total": float(c.first_pass_missed_pairs),
            "expert_replays_total": float(c.passes - c.steps),
            # the PCIe bound of a step: these bytes over the measured host-to-device bandwidth
            "expert_bytes_fetched_per_token": (c.bytes_fetched - self.warm_bytes) / self.tokens if self.tokens else 0.0,
            "pack_bytes_read_per_token": ((self.pack.bytes_read - self.warm_pack_bytes) / self.tokens
                                          if self.tokens else 0.0),
            # the stall of a step with misses: its fetch after the pass (prefetches not counted)
            "expert_step_fetches_total": float(self.step_fetches),
            "expert_step_fetch_seconds_total": self.step_fetch_s,
            "expert_step_fetch_latency_ms": 1e3 * self.step_fetch_s / self.step_fetches if self.step_fetches else 0.0,
            "pack_built_layers": float(getattr(self.pack, "built_layers", 0)),
            # damaged rows found while serving (health() is degraded while pack_unrepaired_rows > 0)
            "pack_corrupt_rows": float(self.pack_corrupt_rows),
            "pack_repaired_rows": float(self.pack_repaired_rows),
            "pack_reconverted_rows": float(self.pack_reconverted_rows),
            "pack_unrepaired_rows": float(len(self._damaged)),
            "pack_degraded": float(bool(self._damaged)),
            "pack_open_seconds": self.pack_open_s,
            "host_arena_slots": float(self.arena.num_slots if self.arena else 0),
        })
        if self.repair_arena is not None:
            a = self.repair_arena
            out.update({"fp4_host_arena_slots": float(a.num_slots),
                        "fp4_host_arena_hit_rate": a.hits / (a.hits + a.misses) if a.hits + a.misses else 0.0,
                        "fp4_pack_bytes_read": float(self.repair_pack.bytes_read)})
        return out

    def close(self) -> None:
        """Save the arena's hot set beside the pack, release the arena's threads and the pack."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.repair_pool is not None:
                self.repair_pool.source.close()
            if self.repair_arena is not None:
                self.repair_arena.close()
            if self.arena is not None:
                if self.arena.hot_keys():
                    try:
                        self.arena.save_hot_set()
                    except OSError as exc:       # a hint only: never fail a shutdown over it
                        log.warning("could not save the hot set: %s", exc)
                self.arena.close()
        finally:
            self.pack.close()
            if self.repair_pack is not None:
                self.repair_pack.close()
