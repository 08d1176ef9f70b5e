"""StoreConfig: the expert store (moet/store and engine/expert_residency.py), the ladder that keeps
routed experts beyond the GPU: the pack file on disk -> the host arena -> the GPU expert cache, and
how a step runs when it routes to an expert that is not on the GPU. `EngineConfig.store`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moet.config.knobs import Section, knob
from moet.errors import ConfigError

EXPERT_CACHE_POLICIES = ("decayed", "lru")
PACK_VERIFY_MODES = ("lazy", "full")
EXPERT_DECODE_MODES = ("graph", "eager", "auto")


@dataclass(frozen=True)
class StoreConfig(Section):
    title: ClassVar[str] = "expert store (experts beyond the GPU: pack on disk -> host arena -> GPU cache)"
    about: ClassVar[str] = ("Off unless a knob here turns it on or the experts do not fit on the GPU. From Python: "
                            "`EngineConfig.store` (`StoreConfig`).")

    pack_dir: str | None = knob(
        None, "where converted experts (pack files) are kept", common=True, metavar="DIR",
        doc="A pack file holds the routed experts converted to expert_format once, keyed by the checkpoint's "
            "identity and the quantizer options: the persistent quantization cache. Setting it turns the "
            "expert store on (pack on disk -> host arena -> GPU expert cache). Unset: ~/.cache/moet/packs, used "
            "only when the store is on (--expert-cache-slots / --expert-cache-gb set, or the experts do not fit "
            "on the GPU). Put it on a fast local disk.")
    expert_cache_slots: int | None = knob(
        None, "GPU slots for routed experts (one slot holds one expert)",
        doc="Turns the expert store on with this many GPU slots. Unset, with --expert-cache-gb unset too: every "
            "expert stays on the GPU when they fit, else the slots are all the memory left after the weights "
            "and the KV cache. `moet plan` shows what a budget gives.")
    expert_cache_gb: float | None = knob(
        None, "GPU expert cache size in GiB", common=True, metavar="GIB",
        doc="The same as --expert-cache-slots, as a size in GiB (not both).")
    expert_cache_policy: str = knob(
        "decayed", "which expert the GPU cache evicts", EXPERT_CACHE_POLICIES,
        doc="decayed: the one with the lowest recency-decayed use count (keeps experts that are hot over time); "
            "lru: the least recently used.")
    host_arena_gb: float | None = knob(
        None, "host memory for experts between disk and GPU, in GiB", common=True, metavar="GIB",
        doc="Pack rows cached in host memory (pinned when CUDA is available). 0: every GPU cache miss reads the "
            "pack file. Unset: the whole pack when it fits in half the available memory, else that half. Lower "
            "it when other processes need the memory.")
    miss_tolerance: int = knob(
        0, "misses a step may skip instead of replaying",
        doc="A decode step that routed to experts not on the GPU is replayed once they are fetched. With N > 0, "
            "up to N (token, expert) misses are dropped instead: faster when the cache is small, outputs no "
            "longer exact. 0 is strict: outputs bit-identical to every expert resident.")
    expert_demand_fetch: bool = knob(
        True, "fetch missing experts layer by layer",
        doc="With the expert store, eager passes (prefill and mixed steps) fetch each MoE layer's experts just "
            "before the layer runs instead of replaying the step after a miss, so a prefill step can route "
            "through a cache that holds one layer's experts. Captured decode steps keep miss replay.")
    expert_decode_mode: str = knob(
        "graph", "how decode steps run with the expert store", EXPERT_DECODE_MODES,
        doc="graph: the captured CUDA graph; a pass that missed is replayed. eager: not captured, every layer "
            "demand-fetches, one pass and no replay (needs --expert-demand-fetch). auto: per batch size, "
            "whichever was faster lately. Try eager or auto when the hit rate is low.")
    expert_prefetch: bool = knob(
        True, "fetch the next layer's likely experts early",
        doc="With the expert store: after each layer's attention, apply the next layer's router to guess its "
            "experts and fetch the missing ones early (eager steps; CUDA-graph decode steps only score the "
            "guesses). Never changes outputs; its accuracy is in the engine stats.")
    pack_verify: str = knob(
        "lazy", "when pack file checksums are checked", PACK_VERIFY_MODES,
        doc="lazy: each row when it is read from disk. full: also every row at start-up, rebuilding damaged "
            "layers; use it after a crash or a copy of the pack directory.")
    rebuild_pack: bool = knob(
        False, "convert the experts again into a new pack",
        doc="Discards the existing pack and converts again, for a pack that fails its checks.")
    o_direct: bool = knob(
        False, "read pack rows with O_DIRECT",
        doc="Bypasses the page cache, so the pack does not take the host's file cache as well as the arena. "
            "The pack's file system must allow it (a local disk, not tmpfs or some network file systems).")
    expert_stats_interval_s: float = knob(
        10.0, "seconds between store stats logs (0: off)", metavar="SECONDS",
        doc="With the expert store: one INFO line of residency statistics (cache and arena hit rates, bytes "
            "moved per token, replay passes per step, fetch latency, prefetch accuracy) every this many seconds "
            "of engine steps.")

    def validate(self) -> None:
        super().validate()
        if self.expert_cache_slots is not None and self.expert_cache_gb is not None:
            raise ConfigError("set expert_cache_slots or expert_cache_gb, not both")
        if self.expert_cache_slots is not None and (not isinstance(self.expert_cache_slots, int)
                                                    or self.expert_cache_slots < 1):
            raise ConfigError(f"expert_cache_slots={self.expert_cache_slots!r} must be a positive integer (or unset)")
        for name in ("expert_cache_gb", "host_arena_gb"):
            v = getattr(self, name)
            if v is not None and not v >= 0:
                raise ConfigError(f"{name}={v!r} must be >= 0 (or unset)")
        if not self.expert_stats_interval_s >= 0:
            raise ConfigError(f"expert_stats_interval_s={self.expert_stats_interval_s!r} must be >= 0 (0 = off)")
        if not isinstance(self.miss_tolerance, int) or self.miss_tolerance < 0:
            raise ConfigError(f"miss_tolerance={self.miss_tolerance!r} must be an integer >= 0")
        if self.expert_decode_mode != "graph" and not self.expert_demand_fetch:
            raise ConfigError(f"expert_decode_mode={self.expert_decode_mode!r} runs decode steps eagerly with demand "
                              "fetch; it needs expert_demand_fetch on (or expert_decode_mode=graph)")
