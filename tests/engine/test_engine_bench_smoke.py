"""moet.bench.engine_bench end to end on CPU (--cpu-smoke: a tiny Qwen3-shaped random W2 model):
the correctness stage passes and every stage writes its numbers."""
import json

from moet.bench import engine_bench


def test_engine_bench_cpu_smoke(tmp_path):
    assert engine_bench.main(["--cpu-smoke", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "engine_bench.json").read_text())
    r = res["models"]["smoke"]
    c = r["correctness"]
    assert c["ok"] and c["six_runs_bit_identical"] and c["reference_agreement_within_noise"]
    assert c["first_token_top20_min_overlap"] >= 15 and c["first_token_max_abs_dlogprob_on_overlap"] < 0.1
    assert r["single_stream"]["decode_tok_s"] > 0 and r["single_stream"]["bytes_per_step"] > 0
    assert set(r["aggregate"]) == {"1", "4"} and all(a["generated"] > 0 for a in r["aggregate"].values())
    assert r["aggregate"]["4"]["generated"] == 4 * 8
    assert r["prefill"]["tokens"] == 256 and r["prefill"]["tok_s"] > 0
    assert r["stats"]["num_running"] == 0 and r["stats"]["kv_usage"] == 0.0
    assert "| 4 |" in (tmp_path / "engine_bench.md").read_text()
