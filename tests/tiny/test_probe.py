"""The probes through moet's engine (moet.probe.engine, what `moet probe` runs) on a tiny subset of
the shipped model give sane numbers, and agree with transformers' forward (moet.probe.loader, the
independent reference) where they must. Floors sit well below the values measured on the full
probe sets (MODEL_CARD.md) so that CPU / library differences do not flake, while a broken engine
path, tokenizer or expert decode still fails."""
from __future__ import annotations

import math

import numpy as np
import pytest

from moet.probe.run import BUDGETS, Budget, code_probe, code_scores, facts_probe, greedy, run_all, tools_probe

# a few short code sequences: enough positions for a loss, seconds on CPU
SMALL = Budget(4, 2, 2, (160,), (0.5,), 1, 600, 128, 8)


@pytest.fixture(scope="module")
def engine_fp4(ckpt):
    from moet.probe.engine import open_engine
    m = open_engine(ckpt, "nvfp4", "cpu")
    yield m
    m.close()


@pytest.fixture(scope="module")
def engine_bf16(ckpt):
    from moet.probe.engine import open_engine
    m = open_engine(ckpt, "bf16", "cpu")
    yield m
    m.close()


def test_engine_probe_model(engine_fp4):
    import torch
    assert engine_fp4.backend == "moet" and engine_fp4.experts == "nvfp4"
    assert engine_fp4.llm.config.expert_format == "fp4" and engine_fp4.dtype == torch.float32


def test_code_loss_and_mtp(engine_fp4):
    r = code_probe(engine_fp4, BUDGETS["tiny"])
    assert r["tokens"] > 1000 and math.isfinite(r["loss"])
    assert r["ppl"] < 40          # measured ~14.5 on the full held-out set
    assert r["top1"] > 0.35 and r["mtp_top1"] > 0.35


def test_facts_at_nvfp4_above_floor(engine_fp4):
    r = facts_probe(engine_fp4, BUDGETS["tiny"])
    assert r["n"] == 12 and r["accuracy"] >= 0.5   # measured ~0.85 on all 724 held-out prompts


def test_tool_markup_is_valid(engine_fp4):
    r = tools_probe(engine_fp4, BUDGETS["tiny"])
    assert r["call_valid"] >= 0.5


def test_progress_ticks_once_per_task(engine_fp4):
    from moet.probe import facts
    from moet.probe.run import count_tasks
    ticks = []
    greedy(engine_fp4, facts.eval_cases(5), 4, 2, ticks.append)
    assert ticks == [2, 2, 1]
    assert count_tasks(engine_fp4.tokenizer, SMALL, ("code", "facts")) == 4 + 4


def test_run_all_w2_code_loss_and_comparison_with_bf16(ckpt, engine_bf16, engine_fp4):
    from moet.probe.distributions import FormatComparison
    from moet.probe.engine import open_engine
    cmp = FormatComparison("bf16")
    base = run_all(engine_bf16, SMALL, only=("code",), comparison=cmp)["code"]
    assert cmp.scores is not None and "kl_vs_bf16" not in base
    fp4 = run_all(engine_fp4, SMALL, only=("code",), comparison=cmp)
    w2 = open_engine(ckpt, "w2", "cpu")
    try:
        r = run_all(w2, SMALL, only=("code",), comparison=cmp)
        skipped = run_all(w2, "tiny", should_stop=lambda: True)
    finally:
        w2.close()
    assert r["backend"] == "moet" and r["experts"] == "w2" and r["dtype"] == "float32"
    # 2-bit experts cost something but do not break the model
    assert base["loss"] <= r["code"]["loss"] < base["loss"] + 1.0
    # the shipped experts are NVFP4: bf16 decodes them exactly, so the engine's fp4 kernels give
    # bf16's distributions up to rounding, while W2 moves them
    assert fp4["code"]["top1_vs_bf16"] > 0.99 and fp4["code"]["kl_vs_bf16"] < 1e-3
    assert r["code"]["top1_vs_bf16"] < 0.95 and r["code"]["kl_vs_bf16"] > 10 * max(fp4["code"]["kl_vs_bf16"], 1e-4)
    assert r["code"]["kl_top"] == 20 and 0 <= r["code"]["kl_bounded"] < 0.2
    assert all(skipped[k] == {"skipped": "time budget"} for k in ("code", "facts", "arithmetic", "needle", "tools"))


def test_engine_agrees_with_transformers_on_bf16_experts(ckpt, tensors, engine_bf16):
    """The old path (transformers' generate / forward with the experts decoded) and the engine, both
    float32 on CPU with the same bf16 experts: the same greedy completions token for token, the same
    next-token scores up to float rounding."""
    from moet.probe import arithmetic, facts, tools
    from moet.probe.loader import load
    ref = load(ckpt, "bf16", "cpu", tensors=tensors)
    convs = facts.eval_cases(4) + tools.eval_cases(2) + arithmetic.eval_cases(1)
    got, want = greedy(engine_bf16, convs, 48, 8), greedy(ref, convs, 48, 8)
    assert got == want
    assert all("<|end|>" in g or len(engine_bf16.tokenizer.encode(g, add_special_tokens=False)) >= 48 for g in got)
    r_eng, s_eng = code_scores(engine_bf16, SMALL)
    r_ref, s_ref = code_scores(ref, SMALL)
    assert r_eng["tokens"] == r_ref["tokens"] > 300
    np.testing.assert_allclose(s_eng.lp, s_ref.lp, atol=2e-3)
    assert (s_eng.top_ids[:, 0] == s_ref.top_ids[:, 0]).mean() > 0.99
    assert abs(r_eng["mtp_top1"] - r_ref["mtp_top1"]) <= 0.01


def test_cli_runs_bf16_first_and_reports_against_it(monkeypatch, tmp_path, capsys):
    """`moet probe`: one JSON line per probe on stdout, the engine's backend, bf16 first whatever the
    order asked, the other format's code line with its comparison, the same results in --json."""
    import json

    from moet.cli import main
    from moet.probe.run import BUDGETS
    monkeypatch.setitem(BUDGETS, "tiny", Budget(2, 1, 1, (160,), (0.5,), 1, 300, 128, 4))
    out = tmp_path / "probe.json"
    rc = main(["probe", "--device", "cpu", "--budget", "tiny", "--experts", "w2", "--experts", "bf16",
               "--only", "code", "--only", "facts", "--no-progress", "--json", str(out)])
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [(r["experts"], r["probe"]) for r in lines] == [("bf16", "code"), ("bf16", "facts"),
                                                           ("w2", "code"), ("w2", "facts")]
    assert all(r["backend"] == "moet" for r in lines)
    assert "top1_vs_bf16" not in lines[0] and 0 < lines[2]["top1_vs_bf16"] < 1 and lines[2]["kl_vs_bf16"] > 0
    saved = json.loads(out.read_text())
    assert list(saved["formats"]) == ["bf16", "w2"] and saved["formats"]["w2"]["code"]["kl_vs_bf16"] == lines[2]["kl_vs_bf16"]
    assert main(["probe", "--device", "cuda:7", "--budget", "tiny"]) == 2                 # one line, no traceback
    assert "--device cuda:7" in capsys.readouterr().err


def test_cli_kv_cache_dtype_reaches_the_engine(ckpt, capsys):
    """--kv-cache-dtype: the probes' engine caches K/V in that format; with transformers' forward
    (--expert-activations e4m3) it means nothing and is refused in one line."""
    from moet.cli import main
    from moet.probe.cli import _engine_opener

    m = _engine_opener(ckpt, "cpu", None, None, "nvfp4")("nvfp4")
    try:
        assert m.llm.engine.runner.kv_format.name == "nvfp4"
        outs = m.generate([m.tokenizer.encode("The capital of France is")], 6, 1)
        assert len(outs) == 1 and outs[0]
    finally:
        m.close()
    assert main(["probe", "--device", "cpu", "--kv-cache-dtype", "fp8", "--expert-activations", "e4m3"]) == 2
    assert "--kv-cache-dtype sets moet's engine" in capsys.readouterr().err


def test_cli_needle_grid_table_and_heat_map(tmp_path, capsys):
    """--needle-lengths / --needle-depths / --needle-trials set the needle grid; --markdown adds its
    depth x length table, --needle-map draws it; a length past the model's context, a depth outside
    [0, 1] or a bad list is one line naming the flag."""
    pytest.importorskip("matplotlib")
    import json

    from moet.cli import main

    out, md, png = tmp_path / "p.json", tmp_path / "p.md", tmp_path / "needle.png"
    rc = main(["probe", "--device", "cpu", "--experts", "nvfp4", "--only", "needle", "--no-progress",
               "--needle-lengths", "320,160", "--needle-depths", "0.1,0.9", "--needle-trials", "1",
               "--json", str(out), "--markdown", str(md), "--needle-map", str(png)])
    assert rc == 0
    r = json.loads(out.read_text())["formats"]["nvfp4"]["needle"]
    assert r["n"] == 4 and set(r["by_length_depth"]) == {"160", "320"}
    assert all(set(v) == {"0.1", "0.9"} for v in r["by_length_depth"].values())
    text = md.read_text()
    assert "needle pass rate, NVFP4 (FP4)" in text and "| depth | 160 | 320 |" in text and "| 0.9 |" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert main(["probe", "--device", "cpu", "--only", "needle", "--needle-lengths", "8192", "--no-progress"]) == 2
    assert "longer than this model's context (4,096 tokens)" in capsys.readouterr().err
    for flag, value, msg in (("--needle-depths", "0.5,1.5", "a depth is in [0, 1]"),
                             ("--needle-lengths", "1k", "comma-separated list of numbers"),
                             ("--needle-lengths", "32", "at least 64 tokens")):
        assert main(["probe", "--device", "cpu", "--only", "needle", flag, value]) == 2
        assert msg in capsys.readouterr().err
