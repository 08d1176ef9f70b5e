"""The kernel benchmarks (benchmarks/kernels/benchmark_fp8_gemm.py, benchmark_moe.py) end to end on
CPU with tiny shapes (--cpu-smoke: the torch references stand in for the kernels), and the FP8
bench's correctness stage with the real Triton kernel under the interpreter."""
from __future__ import annotations

import json

import torch

from benchmarks.kernels import benchmark_fp8_gemm as fp8_gemm_bench
from benchmarks.kernels import benchmark_moe as moe_bench
from tests.kernels.triton_support import requires_triton


def test_moe_bench_cpu_smoke(tmp_path):
    assert moe_bench.main(["--cpu-smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "moe_bench.json").read_text())
    rec = result["models"]["smoke"]
    assert rec["checks"] and all(c["ok"] and c["rel_err"] < 2e-2 for c in rec["checks"])
    assert {c["path"] for c in rec["checks"]} >= {"w2 (reference)", "fp4 (reference)", "bf16 transformers loop"}
    # every path that passed its checks is timed at every T, with positive numbers
    timed = {(r["path"], r["T"]) for r in rec["timing"]}
    assert {(p, t) for p in {c["path"] for c in rec["checks"]} for t in (1, 4, 16)} == timed
    assert all(r["us"] > 0 and r["GBps"] > 0 and r["distinct_experts"] >= 1 for r in rec["timing"])
    assert rec["expert_bytes"]["w2"] * 7 < rec["expert_bytes"]["bf16"]      # 2.25 vs 16 bits per weight
    assert "| 16 |" in (tmp_path / "moe_bench.md").read_text()


def test_moe_baselines_match_the_reference_with_misses():
    g = torch.Generator().manual_seed(5)
    pools = moe_bench.make_pools(64, 32, 8, "cpu", g)
    for fn in (moe_bench.moe_bf16_transformers_loop, moe_bench.moe_bf16_grouped_mm):
        rec = moe_bench.check(fn.__name__, fn, pools["bf16"], 64, 8, 2, 5, torch.device("cpu"), g)
        if "error" in rec:          # a torch without a CPU _grouped_mm
            assert fn is moe_bench.moe_bf16_grouped_mm
            continue
        assert rec["ok"] and rec["misses"][0] == rec["misses"][1]


def test_fp8_bench_cpu_smoke(tmp_path):
    assert fp8_gemm_bench.main(["--cpu-smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "fp8_gemm_bench.json").read_text())
    assert result["check"] and all(r["ok"] for r in result["check"])
    assert len(result["timing"]) == 2 * 2 and all(r["w8a8_ms"] > 0 and r["bf16_ms"] > 0 for r in result["timing"])
    # small T: the eager time is kept next to the (graph-replay) time, and not counted as a rate
    assert all(r["w8a16_eager_ms"] > 0 and "w8a16_eager_GBps" not in r for r in result["timing"])
    md = (tmp_path / "fp8_gemm_bench.md").read_text()
    assert "w8a8 eager us" in md and md.count("| tiny a |") == 2


@requires_triton
def test_fp8_bench_check_runs_the_triton_kernel():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gemm = fp8_gemm_bench._gemm(device, smoke=False)
    rows = fp8_gemm_bench.check({"tiny": (72, 200)}, ["w8a8", "w8a16"], device, gemm, smoke=True)
    assert len(rows) == 4 and all(r["ok"] for r in rows)
    assert all(r["rel_err_vs_reference"] < 1e-2 for r in rows)
    w8a8 = [r for r in rows if r["mode"] == "w8a8"]
    assert all(r["rel_err_vs_exact"] > r["rel_err_vs_reference"] for r in w8a8)   # act rounding shows


@requires_triton
def test_moe_bench_pools_fit_the_triton_kernels():
    """The harness's random pools (nb8 W2 codes, NVFP4 bytes) through the expert kernels it
    times: equal to moe_experts_reference (interpreter on CPU, tiny shapes)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=device).manual_seed(0)
    pools = moe_bench.make_pools(64, 32, 8, device, g)
    run, skipped = moe_bench.paths(False, device)
    triton_paths = {label: v for label, v in run.items() if "triton" in label}
    assert triton_paths or all("not found" in why for why in skipped.values())
    for label, (fn, fmt, _) in triton_paths.items():
        rec = moe_bench.check(label, fn, pools[fmt], 64, 8, 2, 3, device, g)
        assert rec["ok"] and rec["rel_err"] < 2e-2, rec


def test_graphed_falls_back_to_the_eager_call_where_capture_fails():
    """timing.graphed: without CUDA (this machine) the capture fails; the caller gets fn itself back,
    already called once, and the reason, so it can time eagerly and say so."""
    from moet.bench.timing import graphed
    calls = []
    fn = lambda: calls.append(1)                      # noqa: E731
    run, err = graphed(fn)
    if torch.cuda.is_available():
        assert err is None and run is not fn
    else:
        assert run is fn and err is not None and len(calls) == 1
