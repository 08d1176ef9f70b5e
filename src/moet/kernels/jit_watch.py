"""Which Triton kernels compile, when, and for how long: a process-wide watch on Triton's JIT
hooks (triton.knobs.runtime.jit_cache_hook / jit_post_compile_hook, Triton >= 3.4).

Triton compiles a kernel on its first launch with each new specialization (constexprs, and for
integer arguments whether they equal 1 or are multiples of 16). A compile mid-serving stops the
step that needs it, and every running stream with it, for ~0.1-2 s (server benchmarks on the H200
showed such stalls in the p99 of their first phase, and not in later phases, which found the
kernels in Triton's on-disk cache).
The watch counts every in-process cache miss (a compile or an on-disk cache load) and its time;
the engine marks when it is ready, so the misses after that are the ones a request paid for, and
logs each of those with the kernel and its specialization.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger("moet.jit")


@dataclass
class JitCounts:
    compiles: int = 0                    # in-process JIT cache misses (compiled, or loaded from disk)
    seconds: float = 0.0
    compiles_after_ready: int = 0        # those after mark_ready(): paid by a running step
    seconds_after_ready: float = 0.0
    slowest_after_ready: list[tuple[float, str]] = field(default_factory=list)   # (s, kernel), longest first


class JitWatch:
    """Install once per process (install_jit_watch()); thread-safe (the server steps the engine in
    a thread). Hooks it replaces are still called, in order."""

    KEEP = 8                              # slowest after-ready compiles remembered

    def __init__(self):
        self.counts = JitCounts()
        self._ready = False
        self._lock = threading.Lock()
        self._started: dict[tuple, float] = {}
        self._prev_cache_hook = None
        self._prev_post_hook = None
        # kernel -> the specializations compiled (parsed, and the raw cache key)
        self._variants: dict[str, list[tuple[dict[str, str], str]]] = {}

    # the two hooks: called by triton with keyword arguments (key, repr, fn, compile, is_manual_warmup, ...)
    def _on_cache_miss(self, **kw):
        with self._lock:
            self._started[self._id(kw)] = time.perf_counter()
        if self._prev_cache_hook is not None:
            return self._prev_cache_hook(**kw)
        return None                      # falsy: let Triton compile (a truthy return would skip it)

    def _on_compiled(self, **kw):
        now = time.perf_counter()
        with self._lock:
            t0 = self._started.pop(self._id(kw), now)
            self.record(now - t0, self._describe(kw))
        if self._prev_post_hook is not None:
            return self._prev_post_hook(**kw)
        return None

    def _describe(self, kw) -> str:
        """The kernel and what makes this variant new: the parameters (and launch options) whose
        specialization differs from the nearest variant compiled before, e.g. `_prep_small_kernel:
        PP 64 -> 128, num_warps 4 -> 8`, which names the warm-up size that was missing. (Triton's
        own `repr` lists the specialization wrongly in 3.6: it zips the parameters with the
        options string.) Falls back to Triton's repr where the hook's arguments differ."""
        try:
            fn = kw["fn"]
            name = str(getattr(fn, "name", "?")).rsplit(".", 1)[-1]
            params = [p.name for p in fn.jit_function.params]
            spec = kw["key"][0]
            var = {n: self._spec_str(sp) for n, sp in zip(params, spec)}
            # the launch options (num_warps, num_stages, launch_pdl, ...): key[1] is str(options)
            var.update(re.findall(r"(\w+)=([^,()]+)", str(kw["key"][1])))
        except Exception:                                  # another Triton's hook shape
            return str(kw.get("repr", "?"))
        raw = str(kw["key"])
        seen = self._variants.setdefault(name, [])
        diff, nearest = None, None
        for old, old_raw in seen:
            d = [f"{k} {old.get(k)} -> {v}" for k, v in var.items() if old.get(k) != v]
            if diff is None or len(d) < len(diff):
                diff, nearest = d, old_raw
        seen.append((var, raw))
        if diff is None:
            return f"{name} (first variant)"
        if not diff:                    # the parsed fields agree: show where the raw keys part
            i = next((j for j, (a, b) in enumerate(zip(nearest, raw)) if a != b), min(len(nearest), len(raw)))
            return (f"{name}: same specialization and parsed options; the cache keys differ at "
                    f"...{nearest[max(0, i - 40):i + 40]!r} -> ...{raw[max(0, i - 40):i + 40]!r}")
        return f"{name}: " + ", ".join(diff)

    @staticmethod
    def _spec_str(sp) -> str:
        """One parameter's specialization: a constexpr's value, an integer's or pointer's type and
        Triton's attribute ('D': divisible by 16, '' none)."""
        if isinstance(sp, tuple) and len(sp) == 2:
            ty, val = sp
            if ty == "constexpr":
                return repr(val)
            return f"{ty}:{val}" if val else str(ty)
        return str(sp)

    @staticmethod
    def _id(kw) -> tuple:
        fn = kw.get("fn")
        return (getattr(fn, "name", None), str(kw.get("key")))

    def record(self, seconds: float, what: str) -> None:
        c = self.counts
        c.compiles += 1
        c.seconds += seconds
        if self._ready:
            c.compiles_after_ready += 1
            c.seconds_after_ready += seconds
            c.slowest_after_ready = sorted(c.slowest_after_ready + [(seconds, what[:500])], reverse=True)[:self.KEEP]
            log.info("Triton JIT while serving: %.2f s for %s (a kernel variant the start-up warm-up did not "
                        "reach; the step waited)", seconds, what[:500])

    def mark_starting(self) -> None:
        """An engine is starting (its graph capture and warm-up compile): not counted as waited for."""
        self._ready = False

    def mark_ready(self) -> None:
        """From now on a compile is one a request waited for."""
        self._ready = True

    def snapshot(self) -> dict[str, float]:
        c = self.counts
        return {"jit_compiles": float(c.compiles), "jit_compile_s": c.seconds,
                "jit_compiles_after_ready": float(c.compiles_after_ready),
                "jit_compile_s_after_ready": c.seconds_after_ready}


_watch: JitWatch | None = None


def installed_jit_watch() -> JitWatch | None:
    """The process's watch if one was installed (no install)."""
    return _watch


def install_jit_watch() -> JitWatch | None:
    """The process's watch (installed on first call); None where Triton lacks the hooks."""
    global _watch
    if _watch is not None:
        return _watch
    try:
        from triton import knobs
        rt = knobs.runtime
        rt.jit_cache_hook, rt.jit_post_compile_hook          # noqa: B018 (present in Triton >= 3.4)
    except (ImportError, AttributeError):
        return None
    w = JitWatch()
    w._prev_cache_hook, w._prev_post_hook = rt.jit_cache_hook, rt.jit_post_compile_hook
    rt.jit_cache_hook, rt.jit_post_compile_hook = w._on_cache_miss, w._on_compiled
    _watch = w
    return w
