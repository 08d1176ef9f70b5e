"""Reading checkpoints: lazy per-tensor access, shards, weight-format detection, ModelSpec."""
import json
import os

import pytest
import torch
from safetensors import safe_open

from moet.checkpoint import CheckpointReader, open_checkpoint, spec_from_config
from moet.testing.tiny_checkpoint import cached_checkpoint, make_checkpoint, tiny_config


def test_sharded_and_single_file_read_the_same_tensors(tmp_path):
    single = make_checkpoint(str(tmp_path / "single"), "mixtral", tokenizer=False)
    sharded = make_checkpoint(str(tmp_path / "sharded"), "mixtral", tokenizer=False, max_shard_bytes=40_000)
    a, b = CheckpointReader.open(single), CheckpointReader.open(sharded)
    assert a.shards == ["model.safetensors"]
    assert len(b.shards) > 3 and os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    assert set(a.tensors) == set(b.tensors)
    for name in sorted(a.tensors):
        ta, tb = a.get(name), b.get(name)
        assert torch.equal(ta, tb)
        assert tuple(ta.shape) == b.info(name).shape
    # get() returns a copy that does not alias the file mapping
    with safe_open(os.path.join(single, "model.safetensors"), "pt") as f:
        mapped = f.get_tensor("model.norm.weight")
    t = a.get("model.norm.weight")
    assert t.data_ptr() != mapped.data_ptr()


@pytest.mark.parametrize("fmt,expected", [("bf16", "float"), ("fp8", "fp8_block"), ("nvfp4", "nvfp4"),
                                          ("mxfp4", "mxfp4")])
def test_weight_format_detected(fmt, expected):
    ckpt = open_checkpoint(cached_checkpoint("deepseek_v3", fmt))
    assert ckpt.weight_format == expected


def test_nvfp4_detected_from_hf_quant_config_alone(tmp_path):
    path = make_checkpoint(str(tmp_path / "c"), "qwen3_moe", "nvfp4", tokenizer=False)
    cfg = json.load(open(os.path.join(path, "config.json")))
    del cfg["quantization_config"]  # older modelopt exports: only hf_quant_config.json
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    assert open_checkpoint(path).weight_format == "nvfp4"


def _cfg(family, **kw):
    return tiny_config(family, **kw).to_dict()


def test_spec_deepseek_v3():
    s = spec_from_config(_cfg("deepseek_v3"))
    assert s.family == "deepseek_v3" and s.attention.kind == "mla"
    assert s.layer_kinds == ("dense", "moe", "moe")
    r = s.router
    assert (r.scoring, r.n_group, r.topk_group, r.top_k, r.num_experts) == ("sigmoid", 4, 2, 2, 8)
    assert r.correction_bias and r.norm_topk_prob and r.routed_scaling_factor == 2.5
    assert s.rope.rope_type == "yarn" and s.rope.dim == 16 and s.rope.interleave
    assert s.shared_intermediate_size == 32 and s.num_mtp_layers == 1
    # YaRN mscale_all_dim folds into the softmax scale: (nope + rope)^-0.5 * mscale(4, 1)^2
    import math
    m = 0.1 * math.log(4.0) + 1.0
    assert s.attention.scale == pytest.approx(32 ** -0.5 * m * m)


def test_spec_old_style_rope_scaling_equals_rope_parameters():
    """Released checkpoints (DeepSeek-V3, Kimi-K2) carry rope_theta + rope_scaling {type: yarn}."""
    new = _cfg("deepseek_v3")
    old = dict(new)
    rp = old.pop("rope_parameters")
    old["rope_theta"] = rp.pop("rope_theta")
    rp["type"] = rp.pop("rope_type")
    old["rope_scaling"] = rp
    assert spec_from_config(old).rope == spec_from_config(new).rope


def test_spec_glm_partial_rotary_and_qk_norm():
    s = spec_from_config(_cfg("glm4_moe"))
    assert s.attention.kind == "gqa" and s.attention.qk_norm and s.attention.qkv_bias
    assert s.attention.head_dim == 32 and s.rope.dim == 16  # partial_rotary_factor 0.5
    cfg = _cfg("glm4_moe")
    cfg.pop("rope_parameters")
    cfg.update(rope_theta=10000.0, partial_rotary_factor=0.25)  # GLM-4.5's own config.json style
    assert spec_from_config(cfg).rope.dim == 8


def test_spec_qwen3_and_mixtral_layer_kinds_and_names():
    q = spec_from_config(_cfg("qwen3_moe"))
    assert q.layer_kinds == ("dense", "moe", "moe") and q.router.scoring == "softmax" and q.router.norm_topk_prob
    q2 = spec_from_config(_cfg("qwen3_moe", decoder_sparse_step=2, mlp_only_layers=[]))
    assert q2.layer_kinds == ("dense", "moe", "dense")
    m = spec_from_config(_cfg("mixtral"))
    assert m.attention.sliding_window == 12 and m.layer_kinds == ("moe", "moe")
    assert m.canonical_name("model.layers.1.block_sparse_moe.experts.3.w3.weight") == \
        "model.layers.1.mlp.experts.3.up_proj.weight"
    assert m.canonical_name("model.layers.1.block_sparse_moe.gate.weight") == "model.layers.1.mlp.gate.weight"


def test_mtp_names_map_to_mtp_blocks():
    s = spec_from_config(_cfg("deepseek_v3"))
    assert s.canonical_name("model.layers.3.eh_proj.weight") == "mtp.0.eh_proj.weight"
    assert s.canonical_name("model.layers.3.shared_head.head.weight") == "mtp.0.shared_head.head.weight"
    assert s.canonical_name("model.layers.3.mlp.experts.5.down_proj.weight") == \
        "mtp.0.layer.mlp.experts.5.down_proj.weight"
    assert s.canonical_name("model.layers.2.mlp.gate.weight") == "model.layers.2.mlp.gate.weight"


def test_mtp_layers_are_loaded_and_kept():
    from moet.model import load_model

    path = cached_checkpoint("glm4_moe")
    ckpt = open_checkpoint(path)
    model = load_model(ckpt, expert_format="bf16", dtype=torch.float32)
    assert len(model.mtp) == 1
    m = model.mtp[0]
    assert torch.equal(m.eh_proj.weight, ckpt.reader.get("model.layers.3.eh_proj.weight"))
    assert torch.equal(m.layer.self_attn.q_proj.bias, ckpt.reader.get("model.layers.3.self_attn.q_proj.bias"))
    gate_up = m.layer.mlp.experts.pool.gate_up[5]
    assert torch.equal(gate_up[:32], ckpt.reader.get("model.layers.3.mlp.experts.5.gate_proj.weight"))
    # the stored embedding / head copies equal the main ones, so they are shared, not duplicated
    assert not m.has_own_embed and not m.has_own_head and m.embed_tokens is None
    ids = torch.arange(10, 20)
    with torch.no_grad():
        cache = model.new_cache(16, "cpu")
        hidden = model.hidden_states(ids, 0, cache)
        h, logits = model.mtp_forward(0, ids + 1, hidden, 0, cache)
    assert logits.shape == (10, 260) and torch.isfinite(logits).all()
    assert len(load_model(ckpt, expert_format="bf16", dtype=torch.float32, load_mtp=False).mtp) == 0
