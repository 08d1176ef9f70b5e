"""Checkpoint identity: stable for the same weights wherever they live, different as soon as a
value that matters changes."""
import json
import os
import shutil

from safetensors.torch import load_file, save_file

from moet.checkpoint.identity import identity
from moet.testing.tiny_checkpoint import cached_checkpoint


def _copy(tmp_path, name="a", **kw):
    dst = str(tmp_path / name)
    shutil.copytree(cached_checkpoint("mixtral", "bf16", **kw), dst)
    return dst


def test_stable_across_calls_and_locations(tmp_path):
    a, b = _copy(tmp_path, "a"), _copy(tmp_path, "b")
    ida = identity(a)
    assert ida.startswith("ckpt-v1-fp-") and ida == identity(a) == identity(b)
    # reformatting config.json, editing generation_config or the tokenizer changes nothing
    cfg = json.load(open(os.path.join(b, "config.json")))
    json.dump(cfg, open(os.path.join(b, "config.json"), "w"), indent=7, sort_keys=True)
    json.dump({"eos_token_id": 3}, open(os.path.join(b, "generation_config.json"), "w"))
    os.remove(os.path.join(b, "tokenizer.json"))
    assert identity(b) == ida


def test_changes_with_config_values(tmp_path):
    a = _copy(tmp_path)
    before = identity(a)
    cfg = json.load(open(os.path.join(a, "config.json")))
    cfg["rms_norm_eps"] = 1e-5
    json.dump(cfg, open(os.path.join(a, "config.json"), "w"))
    assert identity(a) != before


def test_changes_with_one_weight_value_of_the_same_size(tmp_path):
    a = _copy(tmp_path)
    before, before_full = identity(a), identity(a, full=True)
    f = os.path.join(a, "model.safetensors")
    t = load_file(f)
    t["model.layers.1.block_sparse_moe.experts.2.w2.weight"][3, 5] += 1.0
    save_file(t, f)
    assert identity(a) != before and identity(a, full=True) != before_full
    assert before != before_full  # the two modes never share a key


def test_changes_with_sharding(tmp_path):
    a = _copy(tmp_path, "a")
    b = _copy(tmp_path, "b", max_shard_bytes=60_000)
    assert identity(a) != identity(b)
