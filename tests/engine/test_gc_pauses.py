"""engine/gc_pauses.py: collections timed through gc.callbacks, split at the ready mark, slow
ones logged; freeze_start_up moves the survivors out of later walks (undone here)."""
import gc
import logging

from moet.engine.gc_pauses import SLOW_S, GcPauses, freeze_start_up, install_gc_pauses, server_start_up


def test_pauses_counted_and_split_at_ready(caplog):
    w = GcPauses()
    w.callback("start", {"generation": 0})
    w.callback("stop", {"generation": 0, "collected": 3})
    assert w.counts.collections == 1 and w.counts.after_ready == 0
    w.callback("stop", {"generation": 2})                        # a stop without its start: ignored
    assert w.counts.collections == 1
    w.mark_ready()
    with caplog.at_level(logging.INFO, logger="moet.gc"):
        w.record(SLOW_S * 4, 2, 100)
        w.record(SLOW_S / 10, 0, 1)
    assert w.counts.after_ready == 2 and w.counts.max_after_ready_s == SLOW_S * 4
    assert sum("GC pause while serving" in r.message for r in caplog.records) == 1
    snap = w.snapshot()
    assert snap["gc_collections_after_ready"] == 2.0
    assert abs(snap["gc_pause_s_after_ready"] - SLOW_S * 4.1) < 1e-12
    with caplog.at_level(logging.INFO, logger="moet.gc"):
        w.record(SLOW_S * 4, 0, 5, cpu_s=SLOW_S / 100)            # blocked, not walking
        w.record(SLOW_S * 4, 2, 5, cpu_s=SLOW_S * 3.9)
    assert "waited in a finalizer" in caplog.records[-2].message and "the walk" in caplog.records[-1].message


def test_installed_once_and_sees_real_collections():
    w = install_gc_pauses()
    assert install_gc_pauses() is w and gc.callbacks.count(w.callback) == 1
    before = w.counts.collections
    gc.collect()
    assert w.counts.collections == before + 1 and w.counts.seconds > 0


def test_freeze_start_up_then_unfreeze():
    w = install_gc_pauses()
    w.mark_ready()
    w.record(SLOW_S * 2, 2, 1)                  # between the engine's ready mark and the server's start
    try:
        assert freeze_start_up() == gc.get_freeze_count() > 0
        # its own full collection and the pause before it are not waits of a request
        assert w.counts.after_ready == 0 and w.counts.seconds_after_ready == 0.0 and w._ready
        gc.collect()                             # one while serving: counted
        assert w.counts.after_ready == 1
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_an_engine_built_in_a_server_start_up_waits_for_the_freeze_to_be_ready():
    """Inside server_start_up() the engine leaves its watches unmarked (what the app build does
    meanwhile is no request's wait); freeze_start_up marks them ready."""
    from moet.config import EngineConfig
    from moet.engine.llm_engine import LLMEngine
    from moet.testing.tiny_checkpoint import cached_checkpoint

    cfg = EngineConfig(model=cached_checkpoint("qwen3_moe"), expert_format="bf16", dtype="float32", device="cpu")
    w = install_gc_pauses()
    with server_start_up():
        LLMEngine.from_config(cfg)
        assert not w._ready
    try:
        freeze_start_up()
        assert w._ready
    finally:
        gc.unfreeze()
    LLMEngine.from_config(cfg)                   # outside a server start-up: ready at the end of init
    assert w._ready


def test_engine_stats_carry_the_gc_counters():
    from moet.config import EngineConfig
    from moet.engine.llm_engine import LLMEngine
    from moet.testing.tiny_checkpoint import cached_checkpoint

    eng = LLMEngine.from_config(EngineConfig(model=cached_checkpoint("qwen3_moe"), expert_format="bf16",
                                             dtype="float32", device="cpu"))
    extra = eng.stats().extra
    assert {"gc_collections_after_ready", "gc_pause_s_after_ready", "gc_pause_max_s_after_ready"} <= set(extra)
    assert "jit_compiles" not in extra                           # CPU: no Triton compiles to watch
