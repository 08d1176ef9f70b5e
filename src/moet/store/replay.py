"""Miss replay: the policy that makes a step over a partial expert cache equal the fully
resident step (SPEC 2.3).

    out, res = run_with_replay(lambda: model.forward_paged(ids, batch, kv), cache,
                               miss_tolerance=config.store.miss_tolerance, scan=batch_is_prefill)

A pass runs the step; missed (token, expert) pairs contribute zero and are counted per layer.
If none missed, the pass is the step. Otherwise the missing rows are fetched and:
  - strict (miss_tolerance = 0): the step runs again, until a pass has no miss. Each pass gets
    at least one more layer right (layers before the first miss had right inputs, and their
    rows are now resident and pinned), so it ends within layers + 1 passes; in practice 2;
  - tolerant: if at most miss_tolerance pairs missed, the pass is kept as the step (its output
    is not the fully resident one) and the fetched rows serve the next steps.
`step` must be safe to run again: it writes this step's K/V before attending (a replay
rewrites the same slots), and nothing may consume its output (sampling, RNG, prefix-cache
commits) before run_with_replay returns.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from moet.errors import MoetError
from moet.store.expert_cache import ExpertCache

T = TypeVar("T")


@dataclass
class StepResidency:
    passes: int                 # 1 = no miss
    first_pass_misses: int      # (token, expert) pairs that missed in the first pass
    tolerated_misses: int       # pairs missing in the kept pass (0 in strict mode)
    rows_fetched: int
    fetch_s: float


def run_with_replay(step: Callable[[], T], cache: ExpertCache, *, miss_tolerance: int = 0, scan: bool = False,
                    max_passes: int | None = None) -> tuple[T, StepResidency]:
    limit = max_passes or cache.num_layers + 2
    first = None
    fetched, fetch_s = 0, 0.0
    for p in range(1, limit + 1):
        cache.begin_pass()
        out = step()
        misses, routed = cache.read_pass()
        total = int(misses.sum())
        first = total if first is None else first
        if total:
            t0 = time.perf_counter()
            fetched += cache.fetch(cache.needed_after_miss(misses, routed), scan=scan)
            fetch_s += time.perf_counter() - t0
        if total == 0 or total <= miss_tolerance:
            cache.end_step(routed)
            cache.steps += 1
            cache.passes += p
            cache.pairs += int(routed.sum())
            cache.first_pass_missed_pairs += first
            cache.tolerated_pairs += total
            return out, StepResidency(p, first, total, fetched, fetch_s)
    raise MoetError(f"the step still missed experts after {limit} passes (replay should converge within "
                    f"layers + 1); this is a moet bug, please report it")
