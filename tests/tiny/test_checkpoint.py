"""The shipped moet-tiny checkpoint: layout, sizes, NVFP4 tensors, loading in transformers."""
from __future__ import annotations

import json

import pytest
import torch

MIB = 2**20
EXPERT_LINEARS = ("gate_proj", "up_proj", "down_proj")


def test_shard_and_total_sizes(ckpt):
    shards = sorted(ckpt.glob("model-*.safetensors"))
    assert len(shards) >= 2
    assert all(p.stat().st_size <= 15 * MIB for p in shards), {p.name: p.stat().st_size for p in shards}
    total = sum(p.stat().st_size for p in ckpt.iterdir() if p.is_file())
    assert total <= 48 * MIB, total / MIB


def test_index_covers_every_tensor(ckpt, tensors):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert set(index["weight_map"].values()) == {p.name for p in ckpt.glob("model-*.safetensors")}


def test_config_is_deepseek_v3_with_modelopt_nvfp4(ckpt, config):
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["model_type"] == "deepseek_v3"
    assert config["num_nextn_predict_layers"] == 1 and config["first_k_dense_replace"] == 1
    assert 16 <= config["n_routed_experts"] <= 32 and config["num_experts_per_tok"] == 4
    assert config["max_position_embeddings"] == 4096 and config["q_lora_rank"] and config["kv_lora_rank"]
    qc = config["quantization_config"]
    assert (qc["quant_method"], qc["quant_algo"], qc["group_size"]) == ("modelopt", "NVFP4", 16)
    assert "lm_head" in qc["exclude_modules"] and qc["ignore"] == qc["exclude_modules"]
    assert not [m for m in qc["exclude_modules"] if ".mlp.experts." in m]
    hq = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]
    assert (hq["quant_algo"], hq["group_size"], hq["exclude_modules"]) == ("NVFP4", 16, qc["exclude_modules"])
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert config["eos_token_id"] in gen["eos_token_id"]


def test_every_non_expert_weight_is_excluded(config, tensors):
    excluded = set(config["quantization_config"]["exclude_modules"])
    for name in tensors:
        if name.endswith(".weight") and ".mlp.experts." not in name:
            assert name.rsplit(".", 1)[0] in excluded, name


def test_nvfp4_expert_tensors_have_documented_dtypes_and_shapes(config, tensors):
    h, inter = config["hidden_size"], config["moe_intermediate_size"]
    moe_layers = range(config["first_k_dense_replace"], config["num_hidden_layers"] + 1)  # + the MTP layer
    for layer in moe_layers:
        for e in range(config["n_routed_experts"]):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            for lin in EXPERT_LINEARS:
                n, k = (h, inter) if lin == "down_proj" else (inter, h)
                w, s, s2, si = (tensors[f"{p}.{lin}.{x}"] for x in ("weight", "weight_scale", "weight_scale_2", "input_scale"))
                assert w.dtype == torch.uint8 and w.shape == (n, k // 2)
                assert s.dtype == torch.float8_e4m3fn and s.shape == (n, k // 16)
                assert s2.dtype == torch.float32 and s2.shape == ()
                assert si.dtype == torch.float32 and si.shape == () and float(si) > 0
            # modelopt gives gate and up one global scale (one fused GEMM)
            assert float(tensors[f"{p}.gate_proj.weight_scale_2"]) == float(tensors[f"{p}.up_proj.weight_scale_2"])
    assert not [k for k in tensors if ".mlp.experts." in k and ".experts.gate_up_proj" in k]  # per-expert names only


def test_everything_else_is_bf16(tensors):
    for name, t in tensors.items():
        if ".mlp.experts." in name:
            continue
        want = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
        assert t.dtype == want, (name, t.dtype)


def test_mtp_layer_in_deepseek_v3_layout(config, tensors):
    L = config["num_hidden_layers"]
    for suffix in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                   "shared_head.head.weight", "self_attn.kv_a_proj_with_mqa.weight", "mlp.gate.weight",
                   "mlp.gate.e_score_correction_bias", "mlp.shared_experts.down_proj.weight",
                   "mlp.experts.0.gate_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"):
        assert f"model.layers.{L}.{suffix}" in tensors, suffix
    h = config["hidden_size"]
    assert tensors[f"model.layers.{L}.eh_proj.weight"].shape == (h, 2 * h)
    assert torch.equal(tensors[f"model.layers.{L}.shared_head.head.weight"], tensors["lm_head.weight"])


def test_loads_in_transformers_with_decoded_experts_and_gives_finite_logits(tiny_nvfp4):
    m = tiny_nvfp4
    ids = torch.tensor([m.tokenizer.encode("def add(a, b):\n    return a + b\n")])
    with torch.no_grad():
        out = m.model.model(ids)
        logits = m.model.lm_head(out.last_hidden_state)
        mtp = m.mtp(m.model, ids, out.last_hidden_state)
    assert torch.isfinite(logits).all() and torch.isfinite(mtp).all()
    assert mtp.shape[1] == ids.shape[1] - 1
    # a trained model puts most of its mass on few tokens after "return a"
    assert logits.float().softmax(-1).max(-1).values.mean() > 0.2


@pytest.mark.slow
def test_per_expert_bf16_names_load_with_from_pretrained(ckpt, tensors, config, tmp_path, tiny_nvfp4):
    """transformers 5 fuses DeepSeek-V3's per-expert names on load: an unquantized-expert copy of the
    checkpoint loads with from_pretrained and matches the probe loader's model."""
    from safetensors.torch import save_file
    from transformers import DeepseekV3ForCausalLM

    from moet.probe.loader import expert_weight
    sd = {}
    for k, v in tensors.items():
        if ".mlp.experts." not in k:
            sd[k] = v
        elif k.endswith(".weight"):
            sd[k] = expert_weight(tensors, k[: -len(".weight")], "nvfp4")  # exact decode, fp32
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg = {k: v for k, v in config.items() if k != "quantization_config"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf = DeepseekV3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.tensor([[1, 4, 217, 1943, 239, 500, 77]])
    with torch.no_grad():
        a = hf(ids).logits
        b = tiny_nvfp4.model(ids).logits
    assert (a - b).abs().max() < 1e-3
