"""benchmarks/kernels/benchmark_attention.py end to end on CPU (--smoke: the Triton kernels under the interpreter at
toy shapes, --quick: no checks) -- the bandwidth references, the launch each GQA row ran with, the
per-setting table -- and the --quick settings the next GPU run measures."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks.kernels import benchmark_attention as ab
from tests.kernels.triton_support import requires_triton


@requires_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke runs the kernels under the CPU interpreter")
def test_attention_bench_smoke(tmp_path):
    assert ab.main(["--smoke", "--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "attention_bench.json").read_text())
    kinds = {r["kind"] for r in result["records"]}
    assert {"copy", "copy_graph_node", "gemv", "decode", "prefill"} <= kinds
    assert not result["failures"]
    copy = next(r for r in result["records"] if r["kind"] == "copy")
    assert copy["gbps"] > 0 and "eager" in copy["how"]
    gqa = [r for r in result["records"] if r["kind"] == "decode" and r["arch"] == "gqa"]
    assert gqa and all(r["num_warps"] and r["num_stages"] and r["frac_of_gemv"] > 0 for r in gqa)
    # the explicit 5-stage launch is compared with the default launch's output (same partition)
    assert any(r["same_output_as_first_of_partition"] is True for r in gqa)
    md = (tmp_path / "attention_bench.md").read_text()
    assert "bf16 GEMV:" in md and "of GEMV" in md and "16/32: launch | w4 s3" in md
    # every row's best setting again as one graph of 4 calls over 4 caches (the engine-shaped figure)
    graphs = [r for r in result["records"] if r["kind"] == "decode_graph"]
    rows = {(r["arch"], r["ctx"], r["batch"], r["fmt"]) for r in result["records"] if r["kind"] == "decode"}
    assert {(r["arch"], r["ctx"], r["batch"], r["fmt"]) for r in graphs} == rows
    assert all(r["calls"] == ab.Bench.GRAPH_CALLS and r["gbps"] > 0 and r["ms"] > 0 for r in graphs)
    assert f"graph of {ab.Bench.GRAPH_CALLS}: ms, GB/s, of copy" in md


def test_quick_settings():
    labels = [ab.setting_label(s) for s in ab.QUICK_SPLITS["gqa"]]
    assert labels[0] == "256/32"                          # the defaults: the launch table's
    assert {"256/32 w4 s3", "256/32 w4 s5", "256/32 w4 s7"} <= set(labels)
    # no fused merge (runs 18 / 21) and no chains 2 (run 22, removed): the launches only
    assert not any("fused merge" in lab or "chains" in lab for lab in labels)
    assert ab.gqa_kw((256, 32, None, 4, 7)) == dict(split_tokens=256, max_splits=32, tile_tokens=None,
                                                   num_warps=4, num_stages=7, fused_merge=False)
    assert ab.gqa_kw((256, 32, None, None, None, True))["fused_merge"] is True
