"""DecodeModeChooser: how a decode step runs when routed experts go through the expert store.

Two ways to give a decode step the fully resident result over a partial device cache:
  graph   the captured CUDA graph (fast per pass: no launch overhead); a pass that missed an
          expert contributed zero there, so the step is replayed after the fetch, and because a
          miss in layer L changes every later layer's routing, strict replay runs several graph
          passes per step even when nearly every expert hits (a GLM-4.5-Air-shaped model in a
          32 GB budget on the H200; docs/perf.md);
  eager   the model's eager forward (launch overhead, one host sync per MoE layer) with demand
          fetch (store/demand.py): each layer's experts are made resident before it runs, so a
          step is exactly one pass.
Which is faster depends on the model, the card and the hit rate, so `auto` measures: per batch
bucket it times the first steps each way (host wall time around the step, which ends on the
step's device-to-host read of the miss counters), keeps an exponential average per mode, runs
the faster one, and re-tries the other every `explore_every` steps (its sample then counts half,
its average being old) so it notices when the hit rate moves.
"""
from __future__ import annotations

from typing import Hashable

WARMUP_STEPS = 3          # steps per mode before auto compares them (the first may compile / warm)
EXPLORE_EVERY = 64        # then one step of the slower mode this often
ALPHA = 0.2               # weight of the newest step in the running average


class DecodeModeChooser:
    def __init__(self, mode: str, *, warmup: int = WARMUP_STEPS, explore_every: int = EXPLORE_EVERY,
                 alpha: float = ALPHA):
        if mode not in ("graph", "eager", "auto"):
            raise ValueError(f"decode mode {mode!r}: graph, eager or auto")
        self.mode = mode
        self.warmup, self.explore_every, self.alpha = warmup, explore_every, alpha
        self._avg: dict[Hashable, dict[bool, float]] = {}      # bucket -> {use_graph: seconds per step}
        self._count: dict[Hashable, dict[bool, int]] = {}
        self._steps: dict[Hashable, int] = {}
        self._last: dict[Hashable, dict[bool, int]] = {}       # bucket -> {use_graph: step of its last sample}
        self.graph_steps = self.eager_steps = 0

    def use_graph(self, bucket: Hashable) -> bool:
        """Run this step (graph key `bucket`: rows per sequence and batch bucket) as the captured graph?"""
        if self.mode != "auto":
            return self.mode == "graph"
        n = self._count.setdefault(bucket, {True: 0, False: 0})
        if n[True] < self.warmup:
            return True
        if n[False] < self.warmup:
            return False
        avg = self._avg[bucket]
        fast = avg[True] <= avg[False]
        if self._steps.get(bucket, 0) % self.explore_every == self.explore_every - 1:
            return not fast
        return fast

    def record(self, bucket: Hashable, graph: bool, seconds: float) -> None:
        """The wall time of a decode step that ran as `graph` (replays or demand fetches included)."""
        if graph:
            self.graph_steps += 1
        else:
            self.eager_steps += 1
        if self.mode != "auto":
            return
        n = self._count.setdefault(bucket, {True: 0, False: 0})
        avg = self._avg.setdefault(bucket, {})
        last = self._last.setdefault(bucket, {True: 0, False: 0})
        step = self._steps.get(bucket, 0)
        n[graph] += 1
        if n[graph] == 1:
            avg[graph] = seconds
        else:   # a mode only sampled by exploration has an old average: weigh its new sample more
            a = 0.5 if step - last[graph] > 1 else self.alpha
            avg[graph] = (1 - a) * avg[graph] + a * seconds
        last[graph] = step
        self._steps[bucket] = step + 1

    def stats(self) -> dict[str, float]:
        return {"expert_decode_graph_steps_total": float(self.graph_steps),
                "expert_decode_eager_steps_total": float(self.eager_steps)}
