"""Python's cyclic garbage collector while serving: every collection timed (gc.callbacks), and
what start-up built frozen out of later collections.

Why: a generation-2 collection walks every object the collector tracks -- after importing torch
and transformers and building a model that is several hundred thousand -- holding the GIL, so
the engine thread's step (and the event loop) wait for it. gc.freeze() after start-up moves those
objects to a permanent generation no collection walks (vLLM does the same); they are still freed
by reference counting, only reference cycles among them would never be collected. The servers
freeze (serve_cli.run, the engine process); the watch counts and logs the pauses a running
request sat through, next to the JIT watch (kernels/jit_watch.py).
"""
from __future__ import annotations

import gc
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger("moet.gc")

SLOW_S = 0.05                              # a pause worth a warning while serving


@dataclass
class GcCounts:
    collections: int = 0
    seconds: float = 0.0
    after_ready: int = 0
    seconds_after_ready: float = 0.0
    max_after_ready_s: float = 0.0


class GcPauses:
    def __init__(self):
        self.counts = GcCounts()
        self._ready = False
        self._t0: float | None = None
        self._cpu0 = 0.0

    def callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0, self._cpu0 = time.perf_counter(), time.thread_time()
        elif self._t0 is not None:
            self.record(time.perf_counter() - self._t0, int(info.get("generation", -1)),
                        int(info.get("collected", 0)), time.thread_time() - self._cpu0)
            self._t0 = None

    def record(self, seconds: float, generation: int, collected: int, cpu_s: float | None = None) -> None:
        """cpu_s: the collecting thread's CPU time in the pause. Near `seconds`: the walk itself
        (objects start-up did not freeze); far below: the thread waited inside the collection,
        i.e. a collected object's finalizer blocked (a device sync, a lock) or gave up the GIL."""
        c = self.counts
        c.collections += 1
        c.seconds += seconds
        if self._ready:
            c.after_ready += 1
            c.seconds_after_ready += seconds
            c.max_after_ready_s = max(c.max_after_ready_s, seconds)
            if seconds >= SLOW_S:
                cpu = "" if cpu_s is None else (f", {cpu_s:.3f} s on CPU" + (
                    ": waited in a finalizer" if cpu_s < 0.5 * seconds else ": the walk"))
                log.info("GC pause while serving: %.3f s (generation %d, %d objects collected%s)",
                         seconds, generation, collected, cpu)

    def mark_starting(self) -> None:
        self._ready = False

    def mark_ready(self) -> None:
        self._ready = True

    def snapshot(self) -> dict[str, float]:
        c = self.counts
        return {"gc_collections_after_ready": float(c.after_ready), "gc_pause_s_after_ready": c.seconds_after_ready,
                "gc_pause_max_s_after_ready": c.max_after_ready_s}


_watch: GcPauses | None = None
_server_starting = False


@contextmanager
def server_start_up():
    """Around a server's start-up (engine, app, imports): an engine built inside leaves its
    watches (JIT compiles, GC pauses) unmarked until freeze_start_up, so what happens meanwhile --
    collections of a large, not yet frozen heap (a fraction of a second each with a real model) --
    is not logged as a wait of a request."""
    global _server_starting
    _server_starting = True
    try:
        yield
    finally:
        _server_starting = False


def server_starting() -> bool:
    """Inside server_start_up(): the engine must not mark itself ready (LLMEngine.__init__)."""
    return _server_starting


def _watches() -> list:
    from moet.kernels.jit_watch import installed_jit_watch
    return [w for w in (installed_jit_watch(), _watch) if w is not None]


def install_gc_pauses() -> GcPauses:
    """The process's watch (installed on first call)."""
    global _watch
    if _watch is None:
        _watch = GcPauses()
        gc.callbacks.append(_watch.callback)
    return _watch


def freeze_start_up() -> int:
    """Collect once, then freeze every surviving object out of later collections; -> how many.
    The servers call it right before they accept requests, so it also marks the process's watches
    (JIT, GC) ready and starts the GC watch's "while serving" count afresh: that collection (a full
    walk of the start-up heap, which a count started earlier reported as a long "pause while
    serving") and any collection between
    the engine's ready mark and here (building the app) had no request waiting on them."""
    w = _watch
    if w is not None:
        w.mark_starting()
    gc.collect()
    gc.freeze()
    if w is not None:
        w.counts.after_ready = 0
        w.counts.seconds_after_ready = w.counts.max_after_ready_s = 0.0
    for watch in _watches():                    # from here on a compile or a pause is a request's wait
        watch.mark_ready()
    n = gc.get_freeze_count()
    log.info("froze %d start-up objects out of the garbage collector's walks", n)
    return n
