"""A user-caused checkpoint problem raises CheckpointError (or ConfigError) with one line that
says what is wrong and where (file, tensor), never a traceback from deep inside torch."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moet.checkpoint import open_checkpoint
from moet.errors import CheckpointError, ConfigError
from moet.model import load_model
from moet.testing.tiny_checkpoint import cached_checkpoint


def _copy(tmp_path, family="qwen3_moe", fmt="bf16", **kw):
    dst = str(tmp_path / "ckpt")
    shutil.copytree(cached_checkpoint(family, fmt, **kw), dst)
    return dst


def _one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg
    return msg


def _edit_config(path, **changes):
    p = os.path.join(path, "config.json")
    cfg = json.load(open(p))
    cfg.update(changes)
    json.dump(cfg, open(p, "w"))


def _rewrite(path, fn):
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(str(tmp_path / "nope"))
    assert "nope" in _one_line(e) and "not found" in str(e.value)


def test_missing_config(tmp_path):
    path = _copy(tmp_path)
    os.remove(os.path.join(path, "config.json"))
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path)
    assert "config.json is missing" in _one_line(e) and path in str(e.value)


def test_missing_weights(tmp_path):
    path = _copy(tmp_path)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path)
    assert "no weights" in _one_line(e)


def test_missing_shard(tmp_path):
    path = _copy(tmp_path, max_shard_bytes=50_000)
    shard = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[1]
    os.remove(os.path.join(path, shard))
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path)
    assert shard in _one_line(e) and "missing" in str(e.value)


def test_truncated_shard(tmp_path):
    path = _copy(tmp_path)
    f = os.path.join(path, "model.safetensors")
    size = os.path.getsize(f)
    with open(f, "r+b") as h:
        h.truncate(size - 1000)
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path)
    assert "truncated" in _one_line(e) and "model.safetensors" in str(e.value)


def test_unknown_architecture_names_the_supported_ones(tmp_path):
    path = _copy(tmp_path)
    _edit_config(path, architectures=["LlamaForCausalLM"], model_type="llama")
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path)
    msg = _one_line(e)
    assert "LlamaForCausalLM is not supported" in msg
    for arch in ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM"):
        assert arch in msg


@pytest.mark.parametrize("qc,needle", [
    ({"quant_method": "gptq", "bits": 4}, "gptq is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "per-tensor FP8"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "[64, 64]"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "quant_algo FP8"),
])
def test_unsupported_quantization(tmp_path, qc, needle):
    path = _copy(tmp_path)
    _edit_config(path, quantization_config=qc)
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path)
    assert needle in _one_line(e) and "config.json" in str(e.value)


def test_mismatched_shape_names_tensor_and_file(tmp_path):
    path = _copy(tmp_path)
    _rewrite(path, lambda t: t.__setitem__("model.layers.1.self_attn.o_proj.weight", torch.zeros(64, 32)))
    with pytest.raises(CheckpointError) as e:
        load_model(open_checkpoint(path), expert_format="bf16", dtype=torch.float32)
    msg = _one_line(e)
    assert "model.layers.1.self_attn.o_proj.weight" in msg and "model.safetensors" in msg
    assert "[64, 32]" in msg and "[64, 64]" in msg


def test_mismatched_expert_shape(tmp_path):
    path = _copy(tmp_path)
    _rewrite(path, lambda t: t.__setitem__("model.layers.2.mlp.experts.1.down_proj.weight", torch.zeros(64, 16)))
    with pytest.raises(CheckpointError) as e:
        load_model(open_checkpoint(path), expert_format="w2", dtype=torch.float32)
    assert "experts.1.down_proj.weight" in _one_line(e) and "[64, 16]" in str(e.value)


def test_config_disagreeing_with_weights(tmp_path):
    path = _copy(tmp_path)
    _edit_config(path, num_hidden_layers=2)  # layer 2's tensors look like an MTP layer now
    with pytest.raises(CheckpointError) as e:
        load_model(open_checkpoint(path), expert_format="bf16", dtype=torch.float32)
    assert "model.layers.2" in _one_line(e)


def test_missing_tensor(tmp_path):
    path = _copy(tmp_path)
    _rewrite(path, lambda t: t.pop("model.layers.0.post_attention_layernorm.weight"))
    with pytest.raises(CheckpointError) as e:
        load_model(open_checkpoint(path), expert_format="bf16", dtype=torch.float32)
    assert "model.layers.0.post_attention_layernorm.weight is missing" in _one_line(e)


def test_missing_expert(tmp_path):
    path = _copy(tmp_path)
    _rewrite(path, lambda t: t.pop("model.layers.1.mlp.experts.6.up_proj.weight"))
    with pytest.raises(CheckpointError) as e:
        load_model(open_checkpoint(path), expert_format="w2", dtype=torch.float32)
    msg = _one_line(e)
    assert "model.layers.1.mlp" in msg and "expert 6 up_proj" in msg


def test_quantized_weight_without_its_scale(tmp_path):
    path = _copy(tmp_path, "mixtral", "fp8")
    _rewrite(path, lambda t: t.pop("model.layers.0.self_attn.q_proj.weight_scale_inv"))
    with pytest.raises(CheckpointError) as e:  # an e4m3 weight alone is not a float weight
        load_model(open_checkpoint(path), expert_format="bf16", dtype=torch.float32)
    assert "model.layers.0.self_attn.q_proj.weight" in _one_line(e)


def test_bad_engine_options():
    from moet.llm import LLM

    path = cached_checkpoint("qwen3_moe")
    with pytest.raises(ConfigError) as e:
        LLM(path, expert_format="int3")
    assert "expert_format='int3'" in _one_line(e) and "w2" in str(e.value)
    with pytest.raises(ConfigError) as e:
        LLM(path, gpu_memory_utilisation=0.9)
    assert "gpu_memory_utilisation" in _one_line(e)


@pytest.mark.parametrize("change,needle", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"num_experts": None, "num_local_experts": None}, "'num_experts' is missing"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "rope type 'dynamic'"),
])
def test_invalid_config_values(tmp_path, change, needle):
    path = _copy(tmp_path)
    _edit_config(path, **change)
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path)
    assert needle in _one_line(e) and os.path.join(path, "config.json") in str(e.value)


def test_missing_mtp_tensor_is_named_as_on_disk(tmp_path):
    path = _copy(tmp_path, "glm4_moe")
    _rewrite(path, lambda t: t.pop("model.layers.3.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError) as e:
        load_model(open_checkpoint(path), expert_format="bf16", dtype=torch.float32)
    assert "model.layers.3.self_attn.k_norm.weight is missing" in _one_line(e)
    # without MTP the same checkpoint loads
    assert len(load_model(open_checkpoint(path), expert_format="bf16", dtype=torch.float32, load_mtp=False).mtp) == 0


def test_expert_index_beyond_config(tmp_path):
    path = _copy(tmp_path)
    _rewrite(path, lambda t: t.__setitem__("model.layers.1.mlp.experts.8.up_proj.weight",
                                           t["model.layers.1.mlp.experts.7.up_proj.weight"].clone()))
    with pytest.raises(CheckpointError) as e:
        load_model(open_checkpoint(path), expert_format="w2", dtype=torch.float32)
    assert "experts.8.up_proj.weight" in _one_line(e) and "expert 8 is out of range" in str(e.value)
