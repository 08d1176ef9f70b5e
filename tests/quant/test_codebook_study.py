import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from moet.errors import CheckpointError
from moet.quant import codebook_study as cs
from moet.quant.expert_tensors import ExpertTensorReader
from tests.quant.conftest import write_expert_checkpoint


def test_candidate_sets():
    assert len(cs.SUBSETS) == 1365 and len(cs.MIRROR) == 21
    assert cs.W2_SET in [cs.SUBSETS[i] for i in cs.MIRROR]


def test_study_numbers_by_hand():
    # histogram: 3 x (+0.5), 1 x (+6); codebook {-4,-1,1,4}: 0.5 -> 1 (err +.5), 6 -> 4 (err -2)
    h = np.zeros(16)
    h[1], h[7] = 3, 1
    bias = cs.ERR[cs.SUBSETS.index(cs.W2_SET)] @ h / 4
    assert bias == pytest.approx((3 * 0.5 - 2) / 4)
    r = cs.study_histogram(h)
    # with only two distinct values, the best sets reproduce both exactly: zero error
    assert 0.5 in r.best_set and 6.0 in r.best_set and r.best_rel_rms == 0 and r.best_bias == 0
    # best mirror set contains 0.5 and 6 as well ({-6,-.5,.5,6})
    assert r.sym_set == (-6.0, -0.5, 0.5, 6.0) and r.sym_rel_rms == 0


def test_zero_maps_to_its_own_sign_in_the_w2_set():
    s = cs.SUBSETS.index(cs.W2_SET)
    assert cs.ERR[s][0] == 1.0 and cs.ERR[s][8] == -1.0      # +0 -> +1, -0 -> -1


def test_a_skewed_distribution_prefers_an_asymmetric_set():
    h = np.zeros(16)
    for c, cnt in {1: 50, 2: 30, 9: 5, 11: 40, 13: 60, 14: 30, 6: 2}.items():  # mostly negative mass
        h[c] = cnt
    r = cs.study_histogram(h)
    assert not r.best_is_mirror and r.best_rel_rms < r.sym_rel_rms


@pytest.mark.parametrize("fmt", ["bf16", "fused", "nvfp4", "fp8", "mxfp4"])
def test_reader_finds_every_routed_expert_and_skips_shared_and_dense(tmp_path, fmt):
    truth = write_expert_checkpoint(tmp_path / fmt, fmt)
    reader = ExpertTensorReader(tmp_path / fmt)
    mats = list(reader)
    assert sorted(m.name for m in mats) == sorted(truth)
    assert all("shared" not in m.name for m in mats)
    assert reader.total_native_bytes() == sum(m.native_bytes for m in mats)
    want_fmt = {"bf16": "float", "fused": "float", "nvfp4": "nvfp4", "fp8": "fp8_block", "mxfp4": "mxfp4"}[fmt]
    assert {m.fmt for m in mats} == {want_fmt}
    # the histogram is a full count of the matrix's elements
    for m in mats[:3]:
        assert cs.unit_space_histogram(m).sum() == truth[m.name].numel()


def test_gaussian_experts_choose_the_w2_set(tmp_path):
    write_expert_checkpoint(tmp_path / "c", "nvfp4", layers=1, experts=4, n=128, k=256)
    rows = [cs.study_histogram(cs.unit_space_histogram(m), m.name) for m in ExpertTensorReader(tmp_path / "c")]
    s = cs.summarize(rows)
    assert s.tensors == 12 and s.share_sym_choosing_w2_set == 1.0
    assert s.rel_rms_penalty_pct >= 0 and s.mean_abs_bias_sym < 0.05


def test_cli_json_and_table(tmp_path):
    write_expert_checkpoint(tmp_path / "c", "fp8", layers=2, experts=2)
    out = subprocess.run([sys.executable, "-m", "moet.cli", "quant-study", str(tmp_path / "c"), "--json", "--no-progress"],
                         capture_output=True, text=True, check=True)
    data = json.loads(out.stdout)
    assert data["summary"]["tensors"] == 12 and len(data["tensors"]) == 12
    assert all(math.isfinite(r["sym_rel_rms"]) for r in data["tensors"])
    table = subprocess.run([sys.executable, "-m", "moet.cli", "quant-study", str(tmp_path / "c")],
                           capture_output=True, text=True, check=True)
    assert "12 expert tensors" in table.stdout and "quant-study" in table.stderr  # progress bar on stderr


def test_errors_are_one_clear_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "moet.cli", "quant-study", str(tmp_path / "nope")], capture_output=True, text=True)
    assert r.returncode == 2 and "checkpoint directory not found" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json"):
        ExpertTensorReader(tmp_path / "empty")
    write_expert_checkpoint(tmp_path / "c", "bf16", shards=2)
    (tmp_path / "c" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard file missing"):
        list(ExpertTensorReader(tmp_path / "c"))
    # NaN in an expert: the study names the tensor
    from moet.errors import FormatError
    write_expert_checkpoint(tmp_path / "n", "bf16", layers=1, experts=1,
                            weight_fn=lambda shape: torch.full(shape, float("nan")))
    with pytest.raises(FormatError, match="experts.0.*NaN"):
        for m in ExpertTensorReader(tmp_path / "n"):
            cs.unit_space_histogram(m)


def test_truncated_or_corrupt_shard_is_a_clear_error(tmp_path):
    write_expert_checkpoint(tmp_path / "c", "nvfp4", shards=1)
    f = tmp_path / "c" / "model-00001-of-00001.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])          # truncated
    with pytest.raises(CheckpointError, match="model-00001-of-00001.safetensors"):
        list(ExpertTensorReader(tmp_path / "c"))
    f.write_bytes(b"\xff" * 64)                     # garbage header
    with pytest.raises(CheckpointError, match="unreadable safetensors"):
        list(ExpertTensorReader(tmp_path / "c"))
