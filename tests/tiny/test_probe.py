"""Probes run on a tiny subset of the shipped model and give sane numbers. Floors sit well
below the values measured on the full probe sets (MODEL_CARD.md) so that CPU / library
differences do not flake, while a broken loader, tokenizer or expert decode still fails."""
from __future__ import annotations

import math


from moet.probe.run import BUDGETS, code_probe, facts_probe, run_all, tools_probe


def test_code_loss_and_mtp(tiny_nvfp4):
    r = code_probe(tiny_nvfp4, BUDGETS["tiny"])
    assert r["tokens"] > 1000 and math.isfinite(r["loss"])
    assert r["ppl"] < 40          # measured ~14.5 on the full held-out set
    assert r["top1"] > 0.35 and r["mtp_top1"] > 0.35


def test_facts_at_nvfp4_above_floor(tiny_nvfp4):
    r = facts_probe(tiny_nvfp4, BUDGETS["tiny"])
    assert r["n"] == 12 and r["accuracy"] >= 0.5   # measured ~0.85 on all 724 held-out prompts


def test_tool_markup_is_valid(tiny_nvfp4):
    r = tools_probe(tiny_nvfp4, BUDGETS["tiny"])
    assert r["call_valid"] >= 0.5


def test_run_all_reports_every_probe_and_w2_code_loss(ckpt, tensors, tiny_nvfp4):
    from moet.probe.loader import load
    w2 = load(ckpt, "w2", "cpu", tensors=tensors)
    r = run_all(w2, BUDGETS["tiny"], only=("code",))
    base = code_probe(tiny_nvfp4, BUDGETS["tiny"])
    # 2-bit experts cost something but do not break the model
    assert base["loss"] <= r["code"]["loss"] < base["loss"] + 1.0
    skipped = run_all(w2, "tiny", should_stop=lambda: True)
    assert all(skipped[k] == {"skipped": "time budget"} for k in ("code", "facts", "arithmetic", "needle", "tools"))
