"""kernels/jit_watch.py: Triton's JIT hooks timed and counted, split at the engine's ready mark,
the hooks it replaced still called (and a compile never skipped by it)."""
import logging

import pytest

from moet.kernels.jit_watch import JitWatch, install_jit_watch


class Fn:
    name = "moet.kernels.norm_rope_triton._rmsnorm_kernel"


def test_counts_split_at_ready_and_slowest_kept(caplog):
    w = JitWatch()
    seen = []
    w._prev_cache_hook = lambda **kw: seen.append(("miss", kw["key"]))
    w._prev_post_hook = lambda **kw: seen.append(("done", kw["key"]))
    assert not w._on_cache_miss(key=1, repr="k1", fn=Fn())      # falsy: Triton goes on to compile
    w._on_compiled(key=1, repr="k1", fn=Fn())
    assert seen == [("miss", 1), ("done", 1)]
    assert w.counts.compiles == 1 and w.counts.compiles_after_ready == 0
    w.mark_ready()
    with caplog.at_level(logging.INFO, logger="moet.jit"):
        for i, s in enumerate([0.5, 2.0, 0.1] + [0.01] * 10):
            w.record(s, f"kernel{i}")
    assert w.counts.compiles == 14 and w.counts.compiles_after_ready == 13
    assert w.counts.seconds_after_ready == pytest.approx(2.7)
    assert [k for _, k in w.counts.slowest_after_ready[:3]] == ["kernel1", "kernel0", "kernel2"]
    assert len(w.counts.slowest_after_ready) == JitWatch.KEEP
    assert sum("Triton JIT while serving" in r.message for r in caplog.records) == 13
    snap = w.snapshot()
    assert snap["jit_compiles_after_ready"] == 13.0 and snap["jit_compiles"] == 14.0
    w.mark_starting()                                            # a second engine starting: not counted
    w.record(1.0, "k")
    assert w.counts.compiles_after_ready == 13 and w.counts.compiles == 15


def test_installed_once_on_tritons_hooks():
    pytest.importorskip("triton")
    from triton import knobs
    w = install_jit_watch()
    if w is None:
        pytest.skip("this Triton has no JIT hooks")
    assert install_jit_watch() is w
    assert knobs.runtime.jit_cache_hook == w._on_cache_miss and knobs.runtime.jit_post_compile_hook == w._on_compiled
