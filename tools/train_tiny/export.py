"""Write the trained model as a Hugging Face checkpoint in DeepSeek-V3's official layout:
per-expert names model.layers.L.mlp.experts.E.{gate,up,down}_proj.*, the MTP layer at
model.layers.{num_hidden_layers} with shared_head.head (a copy of lm_head, which it shares
in training), gate.weight in bf16, e_score_correction_bias in fp32.

Routed experts are NVFP4 in modelopt's layout (weight uint8 [N, K/2], weight_scale e4m3
[N, K/16], weight_scale_2 fp32 [], input_scale fp32 []); gate and up of one expert share one
weight_scale_2 (modelopt does this so that the fused gate|up GEMM has one global scale).
Everything else stays BF16 and is listed in quantization_config's exclude list.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from moet.formats import nvfp4
from tools.train_tiny.model import Shape, TinyDeepseekV3

EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")


def hf_config(s: Shape, bos: int, eos: int, pad: int) -> dict:
    """config.json as DeepSeek-V3 ships it (rope_theta / rope_scaling keys, scoring_func,
    topk_method), which transformers 5 and the serving engines all read."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "moe_intermediate_size": s.moe_intermediate_size,
        "num_hidden_layers": s.num_hidden_layers,
        "num_nextn_predict_layers": s.num_nextn_predict_layers,
        "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_attention_heads,
        "n_shared_experts": s.n_shared_experts,
        "n_routed_experts": s.n_routed_experts,
        "num_experts_per_tok": s.num_experts_per_tok,
        "routed_scaling_factor": s.routed_scaling_factor,
        "n_group": s.n_group,
        "topk_group": s.topk_group,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": s.norm_topk_prob,
        "first_k_dense_replace": s.first_k_dense_replace,
        "moe_layer_freq": 1,
        "q_lora_rank": s.q_lora_rank,
        "kv_lora_rank": s.kv_lora_rank,
        "qk_nope_head_dim": s.qk_nope_head_dim,
        "qk_rope_head_dim": s.qk_rope_head_dim,
        "v_head_dim": s.v_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": s.max_position_embeddings,
        "rope_theta": s.rope_theta,
        "rope_scaling": None,
        "rope_interleave": True,
        "rms_norm_eps": s.rms_norm_eps,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "bfloat16",
    }


def expert_prefix(layer: int, e: int) -> str:
    return f"model.layers.{layer}.mlp.experts.{e}"


def bf16_state_dict(model: TinyDeepseekV3, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Every tensor in its checkpoint name and dtype; routed experts per expert in bf16.
    (dtype=float32 gives an exact copy, used to check the export against transformers.)"""
    s, out = model.s, {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        if name.endswith("mlp.experts.gate_up_proj"):
            layer = int(name.split(".")[2])
            for e in range(s.n_routed_experts):
                gate, up = t[e].chunk(2, dim=0)
                out[f"{expert_prefix(layer, e)}.gate_proj.weight"] = gate.to(dtype).contiguous()
                out[f"{expert_prefix(layer, e)}.up_proj.weight"] = up.to(dtype).contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            layer = int(name.split(".")[2])
            for e in range(s.n_routed_experts):
                out[f"{expert_prefix(layer, e)}.down_proj.weight"] = t[e].to(dtype).contiguous()
        elif name.endswith("e_score_correction_bias"):
            out[name] = t.float().contiguous()
        else:
            out[name] = t.to(dtype).contiguous()
    mtp = s.num_hidden_layers
    out[f"model.layers.{mtp}.shared_head.head.weight"] = out["lm_head.weight"].clone()
    return out


def is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name


def nvfp4_state_dict(bf16: dict[str, torch.Tensor], input_amax: dict[str, float] | None = None
                     ) -> dict[str, torch.Tensor]:
    """Replace routed-expert weights by NVFP4 tensors. `input_amax` maps an expert linear's
    prefix to the calibrated max |input|; input_scale = amax / (6 * 448) as modelopt computes
    it, or 1.0 where no calibration is given."""
    out = {k: v for k, v in bf16.items() if not is_routed_expert(k)}
    prefixes = sorted({k.rsplit(".", 2)[0] for k in bf16 if is_routed_expert(k)})
    for p in prefixes:
        gate, up, down = (bf16[f"{p}.{n}.weight"].float() for n in EXPERT_PROJ)
        shared_s2 = float(torch.cat([gate, up]).abs().max()) / (6.0 * 448.0)
        for n, w, s2 in (("gate_proj", gate, shared_s2), ("up_proj", up, shared_s2), ("down_proj", down, None)):
            q = nvfp4.quantize(w, weight_scale_2=s2 or None)
            amax = (input_amax or {}).get(f"{p}.{n}")
            out[f"{p}.{n}.weight"] = q.weight.contiguous()
            out[f"{p}.{n}.weight_scale"] = q.weight_scale.contiguous()
            out[f"{p}.{n}.weight_scale_2"] = q.weight_scale_2.reshape(()).float().contiguous()
            out[f"{p}.{n}.input_scale"] = torch.tensor(amax / (6.0 * 448.0) if amax else 1.0, dtype=torch.float32)
    return dict(sorted(out.items()))


def excluded_modules(sd: dict[str, torch.Tensor]) -> list[str]:
    """Every module that holds a weight and is not a routed expert (modelopt's exclude list)."""
    mods = {k.rsplit(".", 1)[0] for k in sd if k.endswith(".weight") and not is_routed_expert(k)}
    return sorted(mods)


def quant_configs(sd: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """(config.json quantization_config, hf_quant_config.json). vLLM reads `ignore` from the
    first and `exclude_modules` from the second; both are written in both places."""
    excl = excluded_modules(sd)
    producer = {"name": "modelopt", "version": "0.0.0",
                "note": "modelopt-format checkpoint written by moet tools/train_tiny, not by nvidia-modelopt"}
    qc = {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": 16,
        "kv_cache_quant_algo": None,
        "kv_cache_scheme": None,
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False, "symmetric": True},
            "input_activations": {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False,
                                  "symmetric": True}}},
        "exclude_modules": excl,
        "ignore": excl,
        "producer": producer,
    }
    hf = {"producer": producer,
          "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                           "exclude_modules": excl}}
    return qc, hf


def _shards(sd: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards, cur, size = [], {}, 0
    # 1 KiB of slack per tensor for the safetensors header.
    for k, v in sd.items():
        n = v.numel() * v.element_size() + 1024
        if cur and size + n > max_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = v
        size += n
    if cur:
        shards.append(cur)
    return shards


def write(out_dir: Path, sd: dict[str, torch.Tensor], config: dict, *, shard_bytes: int,
          generation_config: dict, hf_quant_config: dict | None = None) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("model*.safetensors*"):
        old.unlink()
    shards = _shards(sd, shard_bytes)
    files, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
        files.append(out_dir / fname)
        for k, v in shard.items():
            weight_map[k] = fname
            total += v.numel() * v.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    if hf_quant_config is not None:
        (out_dir / "hf_quant_config.json").write_text(json.dumps(hf_quant_config, indent=2) + "\n")
    return files
