"""engine/decode_mode.py: how the expert store's decode steps run (graph + replay or eager + demand
fetch). Fixed modes never change; auto tries both per batch bucket, runs the faster, re-tries the
slower one periodically and follows a change in which is faster."""
import pytest

from moet.config import EngineConfig
from moet.engine.decode_mode import DecodeModeChooser
from moet.errors import ConfigError


def _run(ch, bucket, seconds_of, steps):
    picks = []
    for _ in range(steps):
        g = ch.use_graph(bucket)
        ch.record(bucket, g, seconds_of(g))
        picks.append(g)
    return picks


def test_fixed_modes():
    for mode, want in (("graph", True), ("eager", False)):
        ch = DecodeModeChooser(mode)
        assert _run(ch, 4, lambda g: 1.0, 20) == [want] * 20
    with pytest.raises(ValueError):
        DecodeModeChooser("fast")


def test_auto_picks_the_faster_explores_and_follows():
    ch = DecodeModeChooser("auto", warmup=3, explore_every=10)
    speed = {True: 0.030, False: 0.012}                     # eager faster (replays make graph steps slow)
    picks = _run(ch, 1, lambda g: speed[g], 6)
    assert picks == [True] * 3 + [False] * 3                  # warm-up: both ways
    picks = _run(ch, 1, lambda g: speed[g], 40)
    assert picks.count(False) >= 35 and True in picks          # mostly eager, graph re-tried now and then
    assert _run(ch, 2, lambda g: speed[g], 3) == [True] * 3    # another bucket has its own numbers
    speed = {True: 0.008, False: 0.012}                      # the cache warmed up: graph steps stop replaying
    picks = _run(ch, 1, lambda g: speed[g], 80)
    assert picks[-20:].count(True) >= 17                     # switched back to graphs
    st = ch.stats()
    assert st["expert_decode_graph_steps_total"] + st["expert_decode_eager_steps_total"] == 6 + 40 + 3 + 80


def test_eager_modes_need_demand_fetch():
    with pytest.raises(ConfigError, match="expert_demand_fetch"):
        EngineConfig(model="x", expert_decode_mode="eager", expert_demand_fetch=False)
    with pytest.raises(ConfigError):
        EngineConfig(model="x", expert_decode_mode="sometimes")
    assert EngineConfig(model="x").expert_decode_mode == "graph"
