"""EngineStats: the numbers the server exports (Prometheus gauges / counters) and the bench prints."""
from __future__ import annotations

from dataclasses import dataclass, field

# How stale a busy engine's published snapshot may get. Building one (and, for the engine process,
# pickling it into every step message) costs tens of microseconds, a few percent of a short decode
# step; /metrics and /health need no per-step freshness. An engine that goes idle publishes at once.
SNAPSHOT_INTERVAL_S = 0.05


@dataclass
class EngineStats:
    num_running: int = 0                 # sequences holding KV blocks
    num_waiting: int = 0                 # sequences queued (new or preempted)
    kv_usage: float = 0.0                # fraction of KV blocks held by live sequences (0..1)
    prefix_cache_hit_rate: float = 0.0   # prompt tokens served from the prefix cache / prompt tokens admitted
    num_preemptions: int = 0             # total sequences preempted (recomputed later)
    prompt_tokens_total: int = 0         # prompt tokens computed (prefix-cache hits excluded)
    generation_tokens_total: int = 0     # tokens sampled
    last_step_time_s: float = 0.0        # wall time of the last engine step
    last_step_num_tokens: int = 0        # tokens the last step computed
    num_steps: int = 0
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0          # blocks no live sequence holds (prefix-cached ones included)
    block_size: int = 0
    extra: dict[str, float] = field(default_factory=dict)   # residency / quant counters, later
