"""moet.bench.residency_bench end to end on CPU (--cpu-smoke): correctness stages pass, the
boot stage builds then reuses a pack, a 50% card runs both store configurations at miss
tolerance 0 and 8 with the cached greedy outputs equal to resident, a 100% card is all resident;
the accelerate baseline ran or says how to install accelerate."""
import json

from moet.bench import residency_bench


def test_residency_bench_cpu_smoke(tmp_path):
    assert residency_bench.main(["--cpu-smoke", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "residency_bench.json").read_text())
    assert r["correctness_tiny"]["ok"] and r["correctness_tiny"]["10pct"]["bit_identical"]
    b = r["boot"]
    assert b["first_boot"]["built_layers"] == 1 and b["boot_from_pack"]["built_layers"] == 0
    assert b["first_boot"]["peak_rss_gb"] > 0 and b["boot_from_pack"]["seconds"] < b["first_boot"]["seconds"]
    m = r["model"]
    assert m["resident"]["runs"]["1"]["decode_tok_s"] > 0 and m["pack_write_GBps"] > 0
    assert m["resident"]["runs"]["2"]["decode_tok_s"] > 0
    half, full = m["cards"]["50%"], m["cards"]["100%"]
    assert full["all_resident"] and half["slots"] == m["rows"] // 2
    for label in ("cache+arena", "cache+pack+small arena"):
        run = half[label]
        assert run["correctness"]["bit_identical"]
        t0, t8 = run["tol0"], run["tol8"]
        assert t0["runs"]["1"]["decode_tok_s"] > 0 and t0["counters"]["tolerated_pairs"] == 0
        assert t0["runs"]["2"]["decode_tok_s"] > 0      # some steps had both sequences decoding
        assert 0 <= t0["hit_rate"] < 1 and (t0["passes_per_step"] > 1 or t0["counters"]["demand_rows"] > 0) and t0["bytes_fetched_per_generated_token"] > 0
        assert t8["generated"] == t0["generated"] and t0["pcie_bound_tok_s_55GBps"] > 0
        eager = run["eager"]          # decode steps eager with demand fetch: one pass each
        assert eager["decode_mode"] == "eager" and eager["passes_per_step"] == 1 and eager["counters"]["demand_rows"] > 0
        plan = t0["plan"]["1"]        # moet plan's prediction for this configuration, and the ratio
        assert plan["predicted_tok_s"] > 0 and plan["measured_over_predicted"] > 0
        assert plan["predicted_hit_rate"] == 0.5 and plan["measured_hit_rate"] == t0["hit_rate"]
    assert m["resident"]["plan"]["1"]["predicted_hit_rate"] == 1.0
    assert half["cache+pack+small arena"]["host_arena_gb"] == 0.0    # every miss read from the pack
    assert r["host_peak_rss_gb"] > 0
    acc = r["accelerate"]             # the transformers + accelerate baseline, or why it is missing
    assert ("pip install" in acc["skipped"]) if "skipped" in acc else acc["cards"]["50%"]["decode_tok_s_cut_model"] > 0


def test_prefill_done_steps_follows_the_scheduler():
    """Hand-worked schedule, 4 prompts of 3 tokens, 4 tokens a step: step 1 prefills p0 (3) and
    starts p1 (1); step 2: p0 decodes, p1 ends (2), p2 starts (1); step 3: 2 decodes + p2's last 2;
    step 4: 3 decodes + p3's first token; step 5: 3 decodes + 1; step 6: p3's last token."""
    assert residency_bench.prefill_done_steps(3, 4, 4) == [1, 2, 3, 6]
    assert residency_bench.prefill_done_steps(64, 4, 4) == [16, 38, 69, 133]   # 64/4, then 3, 2, 1 a step
    assert residency_bench.prefill_done_steps(64, 4, 256) == [1, 1, 1, 1]
