"""The MoE tuner (benchmarks/kernels/tune_moe.py) off the GPU: its candidate configs are valid and
include the forms a run is meant to time, its pools take the model's layout (or its row-major twin
for A/B runs), its correctness check passes the new decode forms under the interpreter, and its
table merge keeps what it did not tune."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from benchmarks.kernels import tune_moe as tune
from moet.kernels.moe_configs import MoEConfig
from moet.kernels.pools import row_tiled
from tests.kernels.triton_support import requires_triton


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def test_candidates_are_valid_and_hold_the_new_forms():
    for regime in ("decode", "prefill"):
        for fmt in ("w2", "fp4"):
            base, gus, dns = tune.candidates(regime, fmt)
            for g in gus + dns:
                assert _pow2(g.BN) and _pow2(g.BKH) and g.SPLIT_K >= 1 and g.num_warps in (1, 2, 4, 8)
            assert any(g.chains == 2 for g in gus) and (regime == "prefill" or any(d.chains == 2 for d in dns))
    wholes = tune.decode_whole_configs()
    assert wholes and all(MoEConfig.from_json(c.to_json()) == c for c in wholes)
    assert all(c.BM <= 8 for c in wholes)   # row-tiled pools take them
    assert any(c.BM == 4 and c.gate_up.BKH == 64 and c.gate_up.SPLIT_K == 1 for c in wholes)
    assert tune.decode_tile_sizes(8, 256) == [1, 2, 4, 8]


@pytest.mark.parametrize("fmt,tiled,plain", [("w2", "nb8t", "nb8"), ("fp4", "nvfp4t", "nvfp4")])
def test_pools_take_the_model_layout_or_its_row_major_twin(fmt, tiled, plain):
    make = lambda **kw: tune.make_pool(fmt, 3, 512, 256, "cpu", torch.Generator().manual_seed(2), **kw)  # noqa: E731
    a, b = make(), make(row_major=True)
    assert a.layout == tiled and b.layout == plain
    re = row_tiled(b)
    for f in a.__slots__:
        if f != "layout":
            x, y = getattr(a, f), getattr(re, f)
            assert torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                               y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y), f
    small = tune.make_pool(fmt, 2, 384, 256, "cpu", torch.Generator().manual_seed(3))   # H % 256 != 0
    assert small.layout == plain


@requires_triton
def test_check_passes_the_new_decode_forms():
    """Under the interpreter without a GPU, compiled on one (the tensors where the kernels can read them)."""
    from moet.kernels import moe_triton as mt
    from moet.kernels.reference import moe_experts_reference
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=dev).manual_seed(4)
    pool = tune.make_pool("w2", 8, 512, 256, dev, g)
    whole = tune.decode_whole_configs()
    for cfg in (whole[0], whole[-1]):                      # BM 4 + BKH-64 gate/up; the same, two chains
        rec = tune.check("w2", pool, 512, 8, 2, 1, 7.0, dev, g, mt, moe_experts_reference, config=cfg)
        assert rec["ok"] and rec["slot_invariant"] and rec["rerun_identical"], (cfg, rec)
    assert whole[-1].gate_up.chains == 2 and whole[-1].down.chains == 2


def test_merge_table_keeps_what_it_did_not_tune(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"version": 1, "devices": {"G": {"w2 H1 I1": {"8": {"a": 1}, "64": {"b": 2}},
                                                                "fp4 H1 I1": {"8": {"c": 3}}}}}))
    tune.merge_table({"devices": {"G": {"w2 H1 I1": {"16": {"d": 4}, "8": {"e": 5}}}, "H": {"x": {"1": {}}}}},
                     str(path))
    got = json.loads(path.read_text())["devices"]
    assert got["G"]["w2 H1 I1"] == {"8": {"e": 5}, "16": {"d": 4}, "64": {"b": 2}}
    assert list(got["G"]["w2 H1 I1"]) == ["8", "16", "64"] and got["G"]["fp4 H1 I1"] == {"8": {"c": 3}}
    assert got["H"] == {"x": {"1": {}}}


@pytest.mark.parametrize("ab_flag", ["--row-major", "--masked-tiles"])
def test_ab_runs_refuse_to_write_the_table(monkeypatch, capsys, ab_flag):
    monkeypatch.setattr(sys, "argv", ["moe_kernel_tune", ab_flag, "--write-table"])
    with pytest.raises(SystemExit):
        tune.main()
    assert "--write-table" in capsys.readouterr().err
