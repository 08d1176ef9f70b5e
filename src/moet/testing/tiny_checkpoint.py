"""Tiny random checkpoints of every supported family in every checkpoint format, for tests.

The model comes from transformers' own classes (config -> random model -> save_pretrained), so
the file and transformers' reading of it agree by construction; the tensors are then rewritten
in the requested format, the way real exporters store them:
  "bf16"   float tensors as saved (in `dtype`; float32 by default so tests compare at 1e-4)
  "fp8"    DeepSeek FP8 block-128: routed experts and every dense linear (attention, dense
           MLP, shared experts) as e4m3 + weight_scale_inv; quantization_config quant_method fp8
  "nvfp4"  modelopt NVFP4: routed experts and the dense MLP / shared-expert linears as
           weight + weight_scale + weight_scale_2 (+ input_scale); hf_quant_config.json
  "mxfp4"  gpt-oss style: routed experts fused per layer as experts.gate_up_proj_blocks
           [E, 2I, H/32, 16] / _scales and experts.down_proj_blocks / _scales
MTP layers (DeepSeek-V3 and GLM) are appended as model.layers.{num_hidden_layers + j}.*
(transformers does not build them), including copies of the embedding and LM head as the
released checkpoints store them. A byte-level tokenizer (ids 0..255 = bytes, 256 <s>,
257 </s>, 258 <pad>) is written alongside.

`reference_model(path)` gives the transformers model of a checkpoint, with quantized tensors
decoded exactly (float64 -> model dtype): the oracle the tests compare moet against.
"""
from __future__ import annotations

import json
import math
import os
import re
import tempfile

import torch
from safetensors.torch import save_file

from moet.formats import fp8_block, mxfp4, nvfp4

def _transformers_has(cls: str) -> bool:
    import transformers
    return hasattr(transformers, cls)


# glm_moe_dsa (GLM-5) and deepseek_v32 need transformers >= 5.23 as their reference; an older one (the GPU image's)
# leaves the family out of the parametrized tests rather than failing them
FAMILIES = ("deepseek_v3", "glm4_moe", "qwen3_moe", "mixtral") + (
    ("glm_moe_dsa", "deepseek_v32") if _transformers_has("GlmMoeDsaConfig") and _transformers_has("DeepseekV32Config")
    else ()) + (("minimax_m2",) if _transformers_has("MiniMaxM2Config") else ()) + (
    ("gpt_oss",) if _transformers_has("GptOssConfig") else ())
# DeepSeek-V4 (transformers >= 5.23): contiguous forward only so far (moet/model/deepseek_v4.py), so
# not among FAMILIES, whose tests run every family through the engine
V4_FAMILIES = ("deepseek_v4",) if _transformers_has("DeepseekV4Config") else ()
# Qwen3.5-MoE: gated DeltaNet layers with a per-sequence state (no prefix caching, no FP4 gate, no
# MTP drafts), so not among FAMILIES either
LINEAR_FAMILIES = ("qwen3_5_moe",) if _transformers_has("Qwen3_5MoeTextConfig") else ()
FORMATS = ("bf16", "fp8", "nvfp4", "mxfp4")
VOCAB = 260
BOS, EOS, PAD = 256, 257, 258

_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")


def tiny_config(family: str, **overrides):
    """A transformers config with tiny dimensions and the family's non-default options on."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                  rms_norm_eps=1e-6, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False)
    if family == "deepseek_v3":
        kw = dict(common, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                  num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                  first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                  kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                  rope_interleave=True, num_nextn_predict_layers=1,
                  rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                       original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0,
                                       mscale=0.707, mscale_all_dim=1.0))
        cls = tf.DeepseekV3Config
    elif family == "glm4_moe":
        kw = dict(common, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                  num_key_value_heads=2, head_dim=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                  topk_group=1, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=1.5,
                  norm_topk_prob=True, use_qk_norm=True, attention_bias=True, num_nextn_predict_layers=1,
                  rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))
        cls = tf.Glm4MoeConfig
    elif family == "qwen3_moe":
        kw = dict(common, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                  num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                  decoder_sparse_step=1, mlp_only_layers=[0],
                  rope_parameters=dict(rope_type="default", rope_theta=1000000.0))
        cls = tf.Qwen3MoeConfig
    elif family == "glm_moe_dsa":
        # index_topk 4: prompts of a few tokens already attend sparsely; 16 indexer heads make an
        # exact tie of two positions' scores (all heads' ReLUs at zero) negligible; layer 1 shares
        # layer 0's selection, layer 2 runs its own
        kw = dict(common, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                  num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                  first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                  kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                  index_topk=4, index_head_dim=32, index_n_heads=16, indexer_types=["full", "shared", "full"],
                  num_nextn_predict_layers=1, rope_parameters=dict(rope_type="default", rope_theta=10000.0))
        cls = tf.GlmMoeDsaConfig
    elif family == "deepseek_v32":
        # DeepSeek-V3's options (YaRN, group routing) plus DSA with a half-split indexer rope
        kw = dict(common, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                  num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                  first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                  kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                  index_topk=6, index_head_dim=32, index_n_heads=16, num_nextn_predict_layers=1,
                  rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                       original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0,
                                       mscale=0.707, mscale_all_dim=1.0))
        cls = tf.DeepseekV32Config
    elif family == "deepseek_v4":
        # every path: sliding / CSA / HCA layers, hash and learned routing, YaRN on the compress rope
        # (its ramp spans pair indices 0..2), 16 indexer heads (no exact score ties), a window of 8
        # and compression 4 / 8 so a 40-token prompt evicts, keeps open windows and selects
        kw = dict(common, num_hidden_layers=4, head_dim=32, partial_rotary_factor=0.5, q_lora_rank=32, o_groups=2,
                  o_lora_rank=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  index_n_heads=16, index_head_dim=16, index_topk=3, sliding_window=8,
                  compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                  layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                               "compressed_sparse_attention"],
                  mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], hc_mult=4, hc_sinkhorn_iters=20,
                  rope_theta=10000.0, compress_rope_theta=160000.0, num_nextn_predict_layers=0,
                  rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                                "beta_fast": 32, "beta_slow": 1})
        cls = tf.DeepseekV4Config
    elif family == "minimax_m2":
        # q / k normed across all heads, half of each head rotated, sigmoid routing with a bias
        kw = dict(common, intermediate_size=32, num_hidden_layers=2, num_key_value_heads=2, head_dim=16,
                  num_local_experts=8, num_experts_per_tok=2,
                  rope_parameters=dict(rope_type="default", rope_theta=5000000.0, partial_rotary_factor=0.5))
        cls = tf.MiniMaxM2Config
    elif family == "gpt_oss":
        # sliding (window 8) and full layers alternating, sinks, biases everywhere, YaRN in halves
        # without truncation; 12-token prompts already slide
        kw = dict(common, intermediate_size=32, num_hidden_layers=3, num_key_value_heads=2, head_dim=16,
                  num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                  rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0,
                                       original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0,
                                       truncate=False))
        cls = tf.GptOssConfig
    elif family == "qwen3_5_moe":
        # three gated DeltaNet layers and a gated-attention one; 4 value heads over 2 key heads;
        # a quarter of each 32-dim head rotated
        kw = dict(common, num_hidden_layers=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_conv_kernel_dim=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                  num_experts=8, num_experts_per_tok=2,
                  layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                  rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                       mrope_section=[2, 1, 1]))
        cls = tf.Qwen3_5MoeTextConfig
    elif family == "mixtral":
        kw = dict(common, intermediate_size=32, num_hidden_layers=2, num_key_value_heads=2, num_local_experts=4,
                  num_experts_per_tok=2, sliding_window=12,
                  rope_parameters=dict(rope_type="default", rope_theta=10000.0))
        cls = tf.MixtralConfig
    else:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES + V4_FAMILIES + LINEAR_FAMILIES}")
    kw.update(overrides)
    return cls(**kw)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits are peaked (greedy is decided, not a coin flip)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name or "layernorm" in name):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".sinks"):                # gpt-oss: big enough to move the softmax
                p.copy_(1.5 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / math.sqrt(p.shape[-1])))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
            elif name.endswith("tid2eid"):               # DeepSeek-V4's hash routing: k distinct experts a token
                experts = int(model.config.n_routed_experts)
                b.copy_(torch.stack([torch.randperm(experts, generator=g)[:b.shape[1]] for _ in range(b.shape[0])]))


def _is_expert(name: str) -> bool:
    return bool(_EXPERT.search(name))


def _is_dense_linear(name: str) -> bool:
    if not name.endswith(".weight") or _is_expert(name):
        return False
    return bool(re.search(r"\.(q_proj|k_proj|v_proj|o_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|"
                          r"gate_proj|up_proj|down_proj|eh_proj|indexer\.wq_b|indexer\.wk)\.weight$", name))


def _is_mlp_linear(name: str) -> bool:
    return _is_dense_linear(name) and bool(re.search(r"\.(gate_proj|up_proj|down_proj)\.weight$", name))


def _add_mtp(tensors: dict[str, torch.Tensor], num_layers: int, n_mtp: int, seed: int) -> None:
    """DeepSeek-V3 MTP layout: a copy of the last decoder layer (perturbed) plus enorm, hnorm,
    eh_proj, shared_head.{norm,head} and embed_tokens (the last two copies of the main ones)."""
    g = torch.Generator().manual_seed(seed + 1)
    last = f"model.layers.{num_layers - 1}."
    hidden = tensors["model.norm.weight"].shape[0]
    for j in range(n_mtp):
        pre = f"model.layers.{num_layers + j}."
        for name in [n for n in tensors if n.startswith(last)]:
            t = tensors[name]
            tensors[pre + name[len(last):]] = t + 0.01 * torch.randn(t.shape, generator=g).to(t.dtype)
        dt = tensors["model.norm.weight"].dtype
        tensors[pre + "enorm.weight"] = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dt)
        tensors[pre + "hnorm.weight"] = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dt)
        tensors[pre + "eh_proj.weight"] = (torch.randn(hidden, 2 * hidden, generator=g) / math.sqrt(2 * hidden)).to(dt)
        tensors[pre + "shared_head.norm.weight"] = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dt)
        tensors[pre + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
        tensors[pre + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()


def _fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, list]:
    """Per-expert tensors -> {layer prefix: {proj: {expert: tensor}}}, removing them."""
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name in [n for n in tensors if _is_expert(n)]:
        m = _EXPERT.search(name)
        prefix = name[: m.start()] + ".experts."
        proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(m.group(2), m.group(2))
        groups.setdefault(prefix, {}).setdefault(proj, {})[int(m.group(1))] = tensors.pop(name)
    return groups


def _stack(by_expert: dict[int, torch.Tensor]) -> torch.Tensor:
    return torch.stack([by_expert[e] for e in sorted(by_expert)])


def _convert(tensors: dict[str, torch.Tensor], fmt: str, fused_experts: bool) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if fmt == "mxfp4" or fused_experts:
        for prefix, projs in _fuse_experts(tensors).items():
            gate_up = torch.cat([_stack(projs["gate_proj"]), _stack(projs["up_proj"])], dim=1)
            down = _stack(projs["down_proj"])
            for pname, w in (("gate_up_proj", gate_up), ("down_proj", down)):
                if fmt == "mxfp4":
                    blocks, scales = mxfp4.quantize(w.float())
                    out[prefix + pname + "_blocks"], out[prefix + pname + "_scales"] = blocks, scales
                else:
                    out[prefix + pname] = w
    for name, t in tensors.items():
        if fmt == "mxfp4" and re.search(r"\.experts\.(gate_up_proj|down_proj)$", name):
            # gpt-oss: fused [E, in, out] float -> MXFP4 blocks of [E, out, in], as published
            out[name + "_blocks"], out[name + "_scales"] = mxfp4.quantize(t.transpose(1, 2).float())
            continue
        stem = name[: -len(".weight")]
        if fmt == "fp8" and (_is_expert(name) or _is_dense_linear(name)):
            q, s = fp8_block.quantize(t.float())
            out[name], out[stem + ".weight_scale_inv"] = q, s
        elif fmt == "nvfp4" and (_is_expert(name) or _is_mlp_linear(name)):
            q = nvfp4.quantize(t.float())
            out[name], out[stem + ".weight_scale"], out[stem + ".weight_scale_2"] = q.weight, q.weight_scale, q.weight_scale_2
            out[stem + ".input_scale"] = torch.tensor(1.0, dtype=torch.float32)  # calibration scalar, unused
        else:
            out[name] = t
    return out


def write_shards(path: str, tensors: dict[str, torch.Tensor], max_shard_bytes: int | None) -> None:
    """Write tensors as model.safetensors, or as shards + model.safetensors.index.json."""
    for f in os.listdir(path):
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            os.remove(os.path.join(path, f))
    names = sorted(tensors)
    shards: list[list[str]] = [[]]
    size = 0
    for n in names:
        nb = tensors[n].numel() * tensors[n].element_size()
        if max_shard_bytes and shards[-1] and size + nb > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nb
    if len(shards) == 1 and not max_shard_bytes:
        save_file({n: tensors[n].contiguous() for n in names}, os.path.join(path, "model.safetensors"))
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in shard}, os.path.join(path, fname))
        weight_map.update({n: fname for n in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def write_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    vocab = {b2u[i]: i for i in range(256)}
    vocab.update({"<s>": BOS, "</s>": EOS, "<pad>": PAD})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(path)


def make_checkpoint(path: str, family: str, fmt: str = "bf16", *, dtype: torch.dtype = torch.float32,
                    seed: int = 0, fused_experts: bool = False, mtp: bool = True,
                    max_shard_bytes: int | None = None, tokenizer: bool = True, **config_overrides) -> str:
    """Write a tiny random `family` checkpoint in format `fmt` to `path`; returns path."""
    import transformers as tf

    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose from {FORMATS}")
    os.makedirs(path, exist_ok=True)
    cfg = tiny_config(family, **config_overrides)
    if not mtp and hasattr(cfg, "num_nextn_predict_layers"):
        cfg.num_nextn_predict_layers = 0
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize(model, seed)
    model = model.to(dtype)
    model.save_pretrained(path)
    tensors = _read_all(path)
    n_mtp = getattr(cfg, "num_nextn_predict_layers", 0) or 0
    if n_mtp:
        _add_mtp(tensors, cfg.num_hidden_layers, n_mtp, seed)
    tensors = _convert(tensors, fmt, fused_experts)
    write_shards(path, tensors, max_shard_bytes)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    if fmt == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]}
    elif fmt == "nvfp4":
        quant = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                 "exclude_modules": ["lm_head", "*self_attn*", "*mlp.gate"]}
        with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
            json.dump({"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization": quant}, f, indent=2)
        config["quantization_config"] = {"quant_method": "modelopt", **quant}
    elif fmt == "mxfp4":
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["self_attn", "lm_head"]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}, f)
    if tokenizer:
        write_tokenizer(path)
    return path


def _read_all(path: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), framework="pt") as h:
                for k in h.keys():
                    out[k] = h.get_tensor(k).clone()
    return out


def dequantized_tensors(path: str, dtype: torch.dtype = torch.float32, expert_fn=None) -> dict[str, torch.Tensor]:
    """Every parameter of a checkpoint decoded exactly (through float64) to `dtype`, with the
    per-expert on-disk names transformers expects; MTP layers dropped. `expert_fn` (float64
    [N, K] -> float64 [N, K]) is applied to every routed-expert projection, e.g. a W2 round trip."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    n_layers = config["num_hidden_layers"]
    raw = _read_all(path)
    out: dict[str, torch.Tensor] = {}
    mixtral = config["architectures"][0] in ("MixtralForCausalLM", "MiniMaxM2ForCausalLM")     # w1 / w3 / w2
    gpt_oss = config["architectures"][0] == "GptOssForCausalLM"
    mx_names = {n[: -len("_blocks")] for n in raw if n.endswith("_blocks")}
    for name, t in raw.items():
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m and int(m.group(1)) >= n_layers:
            continue
        if name.endswith((".weight_scale_inv", ".weight_scale", ".weight_scale_2", ".input_scale", "_scales")):
            continue
        stem = name[: -len(".weight")]
        if stem + ".weight_scale_inv" in raw:
            w = fp8_block.dequantize(t, raw[stem + ".weight_scale_inv"], dtype=torch.float64)
        elif stem + ".weight_scale" in raw:
            w = nvfp4.dequantize(t, raw[stem + ".weight_scale"], raw[stem + ".weight_scale_2"], dtype=torch.float64)
        elif name.endswith("_blocks"):
            w = mxfp4.dequantize(t, raw[name[: -len("_blocks")] + "_scales"], dtype=torch.float64)
            name = name[: -len("_blocks")]
        elif not t.dtype.is_floating_point:              # an integer table (DeepSeek-V4's tid2eid)
            out[name] = t
            continue
        else:
            w = t.double()
        w = w.to(dtype if expert_fn is None else torch.float64)
        fm = re.search(r"\.experts\.(gate_up_proj|down_proj)$", name)
        if fm and gpt_oss:           # transformers reads gpt-oss's fused [E, in, out] tensors
            w = w.transpose(1, 2) if name in mx_names else w
            if expert_fn is not None:    # per projection in the [N, K] layout: gate rows, up rows, down
                per = w.transpose(1, 2).clone()                                # [E, out, in]
                for e in range(per.shape[0]):
                    rows = (slice(0, None, 2), slice(1, None, 2)) if fm.group(1) == "gate_up_proj" else (slice(None),)
                    for r in rows:
                        per[e, r] = expert_fn(per[e, r].double())
                w = per.transpose(1, 2)
            out[name] = w.contiguous()
            continue
        if fm:  # unfuse: transformers reads per-expert names from disk
            prefix = name[: fm.start()] + ".experts."
            names = ({"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)} if mixtral else
                     {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)})[fm.group(1)]
            for e in range(w.shape[0]):
                for k, part in enumerate(w[e].chunk(len(names), dim=0)):
                    out[f"{prefix}{e}.{names[k]}.weight"] = part.contiguous()
            continue
        out[name] = w
    if expert_fn is not None:
        for name in [n for n in out if _is_expert(n)]:
            out[name] = expert_fn(out[name].double()).to(dtype)
        out = {n: t.to(dtype) if t.dtype.is_floating_point else t for n, t in out.items()}
    return out


def reference_model(path: str, dtype: torch.dtype = torch.float32, expert_fn=None):
    """transformers' model of the checkpoint at `path` (quantized tensors decoded exactly;
    routed experts passed through `expert_fn` when given, see dequantized_tensors)."""
    import transformers as tf

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    config["dtype"] = str(dtype).replace("torch.", "")
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f)
        save_file(dequantized_tensors(path, dtype, expert_fn), os.path.join(tmp, "model.safetensors"))
        # eager experts: the grouped-GEMM path has no float64 kernel
        model = tf.AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, experts_implementation="eager")
    return model.eval()


_CACHE_DIR: str | None = None
_CACHE: dict[tuple, str] = {}


def cached_checkpoint(family: str, fmt: str = "bf16", **kwargs) -> str:
    """make_checkpoint into a per-process temporary directory, once per argument set (tests
    share checkpoints instead of re-creating them). Removed at interpreter exit."""
    global _CACHE_DIR
    import atexit
    import shutil

    key = (family, fmt, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
    if key not in _CACHE:
        if _CACHE_DIR is None:
            _CACHE_DIR = tempfile.mkdtemp(prefix="moet-tiny-")
            atexit.register(shutil.rmtree, _CACHE_DIR, True)
        path = os.path.join(_CACHE_DIR, f"{family}-{fmt}-{len(_CACHE)}")
        _CACHE[key] = make_checkpoint(path, family, fmt, **kwargs)
    return _CACHE[key]
