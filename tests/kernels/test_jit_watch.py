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


def test_a_new_variant_is_named_by_what_differs_from_the_nearest_earlier_one(caplog):
    from types import SimpleNamespace
    # what Triton 3.6 passes as fn: JitFunctionInfo(module, name, jit_function); the tests run
    # under the interpreter, whose kernels have no .params, so a stand-in JITFunction
    kern = SimpleNamespace(params=[SimpleNamespace(name=n) for n in ("x_ptr", "n", "PP")])
    info = SimpleNamespace(module=__name__, name="kern", jit_function=kern)

    def hook_args(n_spec, pp, warps):       # the shape of Triton 3.6's hook call: key = (specialization, options)
        opts = f"CUDAOptions(num_warps={warps}, num_ctas=1, num_stages=3, launch_pdl={warps == 8}, extern_libs=(('a', 'b'),))"
        return dict(key=((("*i32", "D"), n_spec, ("constexpr", pp)), opts), repr="kern[...]", fn=info,
                    compile={"num_warps": warps, "num_stages": 3})

    w = JitWatch()
    w._on_compiled(**hook_args(("i32", "D"), 64, 4))          # the warm-up's variants
    w._on_compiled(**hook_args(("i32", ""), 64, 4))
    w.mark_ready()
    with caplog.at_level(logging.INFO, logger="moet.jit"):
        w._on_compiled(**hook_args(("i32", ""), 128, 8))
    (_, what), = w.counts.slowest_after_ready
    assert what == "kern: PP 64 -> 128, num_warps 4 -> 8, launch_pdl False -> True"   # nearest: the second
    assert "PP 64 -> 128" in caplog.records[-1].message
    # equal in every parsed field but not in the raw key (an option value with parentheses): the
    # place where the keys part is shown
    a, b = hook_args(("i32", ""), 128, 8), hook_args(("i32", ""), 128, 8)
    b["key"] = (b["key"][0], b["key"][1].replace("(('a', 'b'),)", "(('a', 'c'),)"))
    w._on_compiled(**b)
    what = [x for _, x in w.counts.slowest_after_ready if "cache keys differ" in x]
    assert len(what) == 1 and "extern_libs" in what[0], w.counts.slowest_after_ready
    before, after = what[0].split(" -> ")
    assert "c" in after.split("extern_libs")[-1] and "c" not in before.split("extern_libs")[-1]
    w._on_compiled(key="odd", repr="kern[odd]", fn=object())    # another hook shape: Triton's repr
    assert "kern[odd]" in [what for _, what in w.counts.slowest_after_ready]
