"""The after-the-run tools: tools.train_tiny.ingest (unpack the returned parts, check the size
limits, merge CPU probe rows into the summary) and tools.train_tiny.compare (re-run within noise)."""
from __future__ import annotations

import json
import os

import pytest

from tools.train_tiny import compare, ingest
from tools.train_tiny.pipeline import _pack


def _fake_ckpt(d, shard_bytes=(3000, 2000)):
    d.mkdir(parents=True)
    shards = [f"model-{i + 1:05d}-of-{len(shard_bytes):05d}.safetensors" for i in range(len(shard_bytes))]
    for name, n in zip(shards, shard_bytes):
        (d / name).write_bytes(os.urandom(n))
    index = {"weight_map": {f"w{i}": s for i, s in enumerate(shards)}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    for f in ingest.REQUIRED:
        if not (d / f).exists():
            (d / f).write_text("{}")
    return d


def test_unpack_returns_the_packed_files(tmp_path):
    src = _fake_ckpt(tmp_path / "run" / "moet-tiny", (9_000_000, 8_000_000))
    names = _pack(src, tmp_path / "returned", part_bytes=4_000_000)
    assert len(names) == 5
    stage = tmp_path / "stage"
    for _ in range(2):  # a second unpack replaces the first
        got = ingest.unpack(tmp_path / "returned", stage)
        assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in src.iterdir())
        for p in src.iterdir():
            assert (got / p.name).read_bytes() == p.read_bytes()
    (stage / "stray.txt").write_text("x")
    with pytest.raises(SystemExit):
        ingest.unpack(tmp_path / "returned", stage)


def test_size_limits_are_enforced(tmp_path):
    ingest.check_limits(_fake_ckpt(tmp_path / "ok"))
    with pytest.raises(SystemExit, match="15 MiB"):
        ingest.check_limits(_fake_ckpt(tmp_path / "big", (ingest.SHARD_LIMIT + 1,)))
    bad = _fake_ckpt(tmp_path / "missing")
    (bad / "tokenizer.json").unlink()
    with pytest.raises(SystemExit, match="tokenizer.json"):
        ingest.check_limits(bad)


def _summary(name="full-v3", facts=0.9, tools_fn=0.5, device="cuda:0"):
    return {"recipe": {"name": name, "seed": 1}, "env": {"device_name": "NVIDIA H200"},
            "history": [{"step": 20, "loss": 3.0, "mtp_loss": 3.1}, {"step": 40, "loss": 2.0, "mtp_loss": 2.2}],
            "probes": {"bf16": {"experts": "bf16", "device": device, "code": {"loss": 2.5},
                                "facts": {"n": 744, "accuracy": facts},
                                "tools": {"n": 150, "call_right_function": tools_fn, "call_valid": 0.9},
                                "needle": {"skipped": "time budget"}},
                       "nvfp4": {"experts": "nvfp4", "code": {"skipped": "time budget"}}}}


def test_merge_keeps_run_rows_adds_cpu_rows_and_compares():
    base = _summary("full-v2", tools_fn=0.0)
    base["probes"]["nvfp4"] = {"experts": "nvfp4", "device": "cpu", "facts": {"n": 744, "accuracy": 0.93},
                               "tools": {"n": 150, "call_right_function": 0.0}}
    cpu = {"nvfp4": {"experts": "nvfp4", "device": "cpu", "facts": {"n": 744, "accuracy": 0.95},
                     "tools": {"n": 150, "call_right_function": 0.4}, "date_utc": "2026-11-29T12:00:00+00:00"}}
    m = ingest.merge(_summary(), cpu, "full", base, ["A note."])
    assert list(m["probes"]) == ["bf16", "nvfp4"] and m["probes"]["nvfp4"]["facts"]["accuracy"] == 0.95
    assert "facts, tools" in m["probe_sources"]["bf16"] and "--device cpu" in m["probe_sources"]["nvfp4"]
    table = m["addenda"][1]
    assert "| full-v2 |" in table and "| full-v3 |" in table and "40.0%" in table and m["addenda"][-1] == "A note."


def test_compare_flags_gaps_outside_noise():
    a = _summary()
    same = compare.compare(a, _summary(facts=0.91))
    assert same and all(r["within"] for r in same)
    far = {r["metric"]: r for r in compare.compare(a, _summary(facts=0.80, tools_fn=0.2))}
    assert not far["facts.accuracy"]["within"] and not far["tools.call_right_function"]["within"]
    assert far["tools.call_right_function"]["n"] == 90
    # a CPU row is never compared with a GPU row
    assert not compare.compare(a, _summary(device="cpu"))
    assert compare.curve_gap(a, _summary())["max_loss_gap"] == 0.0
    # two binomial s.e. of a difference: p = 0.5, n = 100 -> 2 * sqrt(0.005) = 0.1414
    assert abs(compare.rate_noise(0.5, 0.5, 100) - 0.1414) < 1e-4


def test_shipped_recipe_is_unchanged():
    """full-v5 (the shipped model, 2026-12-01) must stay reproducible: its pinned fields equal the
    shipped run's; full-v2 (shipped before it) likewise against its own run's summary."""
    from pathlib import Path

    from tools.train_tiny.recipe import RECIPES
    runs = Path(ingest.__file__).parent / "runs"
    shipped = json.loads((runs / "full-v5" / "summary.json").read_text())["recipe"]
    assert json.loads(json.dumps(RECIPES["full-v5"].as_dict())) == shipped
    v2 = json.loads((runs / "summary.json").read_text())["recipe"]
    now = json.loads(json.dumps(RECIPES["full-v2"].as_dict()))
    assert now.pop("probe_order") == ["code", "facts", "arithmetic", "needle", "tools"]  # added later; same order
    assert now == v2

def test_cpu_probes_run_moet_engine_and_reuse_the_cache(ckpt, tmp_path, monkeypatch):
    """ingest's CPU rows are what `moet probe` measures: moet's engine, float32 on CPU; a finished
    format is read back from the cache instead of probed again."""
    import moet.probe.engine
    from moet.probe.run import BUDGETS, Budget
    monkeypatch.setitem(BUDGETS, "micro", Budget(2, 1, 1, (160,), (0.5,), 1, 300, 128, 4))  # every probe, few items
    cache = tmp_path / "cpu_probes.json"
    got = ingest.cpu_probes(ckpt, ["w2"], "micro", cache)["w2"]
    assert (got["backend"], got["experts"], got["device"], got["dtype"], got["budget"]) == \
        ("moet", "w2", "cpu", "float32", "micro")
    assert got["facts"]["n"] == 2 and got["tools"]["n"] == 1 and got["code"]["tokens"] == 2 * 127
    assert "date_utc" in got

    def no_engine(*a, **k):
        raise AssertionError("a cached format was probed again")
    monkeypatch.setattr(moet.probe.engine, "open_engine", no_engine)
    assert ingest.cpu_probes(ckpt, ["w2"], "micro", cache) == {"w2": json.loads(cache.read_text())["w2"]}
