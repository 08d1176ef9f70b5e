"""Named real model shapes (config.json fields) and moet's model of such a shape with random
weights, built on the device: a shape too big to download or to hold on the host can still be
timed, and every number is about the shape, not about one checkpoint's values."""
from __future__ import annotations

import math

import torch

from moet.errors import ConfigError

# config.json fields of each shape (model_type picks moet's family spec)
QWEN3_30B = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
                 num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                 intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
                 max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=False, torch_dtype="bfloat16",
                 eos_token_id=151645)
GLM45_AIR = dict(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", vocab_size=151552, hidden_size=4096,
                 num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                 intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=128, num_experts_per_tok=8,
                 n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                 norm_topk_prob=True, use_qk_norm=False, attention_bias=True, partial_rotary_factor=0.5,
                 rms_norm_eps=1e-5, max_position_embeddings=131072, rope_theta=1e6, tie_word_embeddings=False,
                 torch_dtype="bfloat16", eos_token_id=151329, num_nextn_predict_layers=0)
QWEN3_235B = dict(QWEN3_30B, hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, intermediate_size=12288,
                  moe_intermediate_size=1536)
DSV3 = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
            intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_nextn_predict_layers=0,
            num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
            num_experts_per_tok=8, routed_scaling_factor=2.5, n_group=8, topk_group=4, topk_method="noaux_tc",
            scoring_func="sigmoid", norm_topk_prob=True, first_k_dense_replace=3, moe_layer_freq=1,
            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            hidden_act="silu", max_position_embeddings=163840, rope_theta=10000.0, rope_scaling=None,
            rope_interleave=True, rms_norm_eps=1e-6, attention_bias=False, tie_word_embeddings=False,
            torch_dtype="bfloat16", eos_token_id=1)
# GLM-5 (transformers' GlmMoeDsaConfig defaults, which are GLM-5's): MLA with DSA, every layer its
# own indexer; W2 experts ~190 GiB, more than one H200 (issue 40: a cut to fewer layers times it)
GLM5 = dict(architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144,
            intermediate_size=12288, moe_intermediate_size=2048, num_hidden_layers=78, num_nextn_predict_layers=1,
            num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1, n_routed_experts=256,
            num_experts_per_tok=8, routed_scaling_factor=2.5, n_group=1, topk_group=1, norm_topk_prob=True,
            first_k_dense_replace=3, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
            v_head_dim=256, index_topk=2048, index_head_dim=128, index_n_heads=32, hidden_act="silu",
            max_position_embeddings=202752, rope_theta=10000.0, rms_norm_eps=1e-5, attention_bias=False,
            tie_word_embeddings=False, torch_dtype="bfloat16", eos_token_id=1)
# DeepSeek-V3.2: DeepSeek-V3 plus DSA (every layer its own indexer)
DSV32 = dict(DSV3, architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", index_topk=2048,
             index_head_dim=128, index_n_heads=64)
# DeepSeek-V4-Flash (the released config.json's legacy keys): 43 layers, sliding / CSA / HCA, the first 3
# hash-routed; W2 experts ~73 GiB, one H200
DSV4 = dict(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=129280, hidden_size=4096,
            num_hidden_layers=43, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024,
            o_groups=8, o_lora_rank=1024, n_routed_experts=256, num_experts_per_tok=6, moe_intermediate_size=2048,
            routed_scaling_factor=1.5, swiglu_limit=10.0, index_n_heads=64, index_head_dim=128, index_topk=512,
            sliding_window=128, compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0], num_hash_layers=3, hc_mult=4,
            hc_sinkhorn_iters=20, hc_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0,
            rope_scaling=dict(type="yarn", factor=16, original_max_position_embeddings=65536, beta_fast=32,
                              beta_slow=1),
            max_position_embeddings=1048576, rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="bfloat16",
            eos_token_id=1)
# MiniMax-M2: 62 layers of 256 experts top-8 (W2 ~59 GiB), GQA 48 / 8 heads with q / k normed across heads
MINIMAX_M2 = dict(architectures=["MiniMaxM2ForCausalLM"], model_type="minimax_m2", vocab_size=200064, hidden_size=3072,
                  intermediate_size=1536, num_hidden_layers=62, num_attention_heads=48, num_key_value_heads=8,
                  head_dim=128, rotary_dim=64, num_local_experts=256, num_experts_per_tok=8, use_qk_norm=True,
                  rope_theta=5000000.0, max_position_embeddings=196608, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, torch_dtype="bfloat16", eos_token_id=200020)
# gpt-oss-120b: 36 layers of 128 experts top-4 (MXFP4 as published; W2 ~30 GiB), GQA 64 / 8 heads of 64 with
# sinks, sliding (128) and full layers alternating, biases everywhere
GPT_OSS_120B = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=201088, hidden_size=2880,
                    intermediate_size=2880, num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8,
                    head_dim=64, num_local_experts=128, num_experts_per_tok=4, sliding_window=128,
                    layer_types=["sliding_attention", "full_attention"] * 18, attention_bias=True,
                    swiglu_limit=7.0, rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                                        truncate=False, original_max_position_embeddings=4096),
                    rope_theta=150000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
                    tie_word_embeddings=False, torch_dtype="bfloat16", eos_token_id=200002)
GPT_OSS_20B = dict(GPT_OSS_120B, num_hidden_layers=24, num_local_experts=32,
                   layer_types=["sliding_attention", "full_attention"] * 12)
# Qwen3.5-35B-A3B's text model: 40 layers, three gated DeltaNet layers to one gated-attention layer,
# 256 experts top-8 plus a gated shared expert (W2 experts ~10 GiB)
QWEN35_35B = dict(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", vocab_size=248320,
                  hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                  linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                  linear_value_head_dim=128, linear_conv_kernel_dim=4, moe_intermediate_size=512,
                  shared_expert_intermediate_size=512, num_experts=256, num_experts_per_tok=8,
                  layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 10,
                  rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                                       mrope_section=[11, 11, 10]),
                  max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  torch_dtype="bfloat16", eos_token_id=248044)
# a few-MB Qwen3-MoE-shaped model: the benchmark's own tests on a CPU (its numbers mean nothing)
MICRO = dict(QWEN3_30B, vocab_size=260, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
             num_experts_per_tok=2, max_position_embeddings=4096, eos_token_id=257)
# the same for a GLM-4.5-shaped model with an MTP layer (speculative decoding's bench tests)
MICRO_MTP = dict(GLM45_AIR, vocab_size=260, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                 n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=4096, eos_token_id=257,
                 num_nextn_predict_layers=1)
# and a DeepSeek-V4-shaped one (every attention kind, hash and learned routing)
MICRO_V4 = dict(DSV4, vocab_size=260, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
                qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32, index_n_heads=16, index_head_dim=16, index_topk=3,
                sliding_window=8, compress_ratios=[0, 4, 128, 4], num_hash_layers=2, max_position_embeddings=4096,
                eos_token_id=257)

SHAPES: dict[str, tuple[str, dict]] = {
    "glm45air": ("GLM-4.5-Air", GLM45_AIR), "qwen3_30b": ("Qwen3-30B-A3B", QWEN3_30B),
    "qwen3_235b": ("Qwen3-235B-A22B", QWEN3_235B), "dsv3": ("DeepSeek-V3", DSV3), "glm5": ("GLM-5", GLM5),
    "dsv32": ("DeepSeek-V3.2", DSV32), "dsv4": ("DeepSeek-V4-Flash", DSV4), "minimax_m2": ("MiniMax-M2", MINIMAX_M2),
    "gpt_oss_120b": ("gpt-oss-120b", GPT_OSS_120B), "gpt_oss_20b": ("gpt-oss-20b", GPT_OSS_20B),
    "qwen35_35b": ("Qwen3.5-35B-A3B", QWEN35_35B),
    "micro": ("micro (tests)", MICRO), "micro_v4": ("micro DeepSeek-V4 (tests)", MICRO_V4),
    "micro_mtp": ("micro with MTP (tests)", MICRO_MTP)}


def shape(name: str) -> tuple[str, dict]:
    """(display name, config fields) of --shape NAME, or one ConfigError line listing the names."""
    if name not in SHAPES:
        raise ConfigError(f"--shape {name}: unknown shape; choose from {', '.join(SHAPES)}")
    return SHAPES[name]


def cut_shape(name: str, layers: int | None) -> tuple[str, dict]:
    """shape(name), with only its first `layers` decoder layers when given (a shape too big for one
    card timed on part of its depth: per-layer costs are what a step is made of); the label says so."""
    label, cfg = shape(name)
    if layers is None:
        return label, cfg
    total = cfg["num_hidden_layers"]
    if not 1 <= layers <= total:
        raise ConfigError(f"--layers {layers}: --shape {name} has {total} layers; give 1..{total}")
    return f"{label} ({layers} of {total} layers)", first_layers(cfg, layers)


# config fields with one entry per decoder layer (gpt-oss's sliding / full schedule, DeepSeek-V4's
# MoE kinds, GLM-5's indexer sharing): cut with the layers
PER_LAYER_FIELDS = ("layer_types", "mlp_layer_types", "indexer_types")


def first_layers(cfg: dict, layers: int) -> dict:
    """A config of the first `layers` decoder layers of `cfg` (per-layer lists cut to match)."""
    out = dict(cfg, num_hidden_layers=layers)
    for key in PER_LAYER_FIELDS:
        if isinstance(out.get(key), list):
            out[key] = out[key][:layers]
    if "mlp_only_layers" in out:
        out["mlp_only_layers"] = [i for i in out["mlp_only_layers"] if i < layers]
    return out


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """n prompts of `length` random token ids (distinct prompts: no prefix-cache hits between them)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


@torch.no_grad()
def random_model(cfg: dict, device: torch.device, expert_format: str = "w2", seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16, repair_tier: bool = False, mtp: bool = False):
    """moet's CausalLM of `cfg`'s shape, every tensor made on `device` (no host copy of the
    weights ever exists), every expert resident in `expert_format`; repair_tier: an FP4 repair
    tier of every expert beside it (random FP4 rows, not a copy of the W2 ones: the bench times it);
    mtp: the config's MTP layers (at least one), for speculative decoding."""
    from moet.checkpoint.spec import spec_from_config
    from moet.model.layers.moe import MoE
    from moet.model.loader import allocate_pool
    from moet.model.model import CausalLM

    if mtp and not cfg.get("num_nextn_predict_layers"):
        cfg = dict(cfg, num_nextn_predict_layers=1)
    spec = spec_from_config(cfg, "bench shape")
    with torch.device(device):
        if spec.compressed_attention is not None:
            from moet.model.deepseek_v4 import DeepseekV4LM
            model = DeepseekV4LM(spec, dtype)
        else:
            model = CausalLM(spec, dtype, load_mtp=mtp)
    gen = torch.Generator(device=device).manual_seed(seed)
    # Scaled the way trained models are (GPT-2 / Megatron init): weights ~N(0, 0.02), the
    # projections that write into the residual stream (o_proj, down_proj, expert down) smaller
    # by sqrt(2 L). With every branch at full size the residual stream of a deep random model
    # grows so large that a 2^-9 relative perturbation of the embeddings decorrelates the final
    # hidden state: such a model could not tell a correct engine from a wrong one.
    depth = math.sqrt(2 * spec.num_layers)
    experts = spec.router.num_experts
    for name, p in model.named_parameters():
        if not p.dtype.is_floating_point:             # DeepSeek-V4's hash table: token -> k experts
            p.copy_(torch.randint(0, experts, p.shape, device=device, generator=gen))
        elif name.endswith("norm.weight") or "layernorm" in name:
            p.fill_(1.0)
        elif "bias" in name:
            p.normal_(0.0, 0.02, generator=gen) if p.dim() else p.zero_()
        elif "o_proj" in name or "down_proj" in name or "wo_b" in name:
            p.normal_(0.0, 0.02 / depth, generator=gen)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    # UE8M0 scale bytes: W2 levels (+-1, +-4) have rms ~2.9, so 2^-10 .. 2^-6 gives expert
    # weights of rms ~0.02 like the dense ones; the down projection 2^-log2(sqrt(2L)) lower.
    # Codes are random bytes and scales never zero: no kernel can skip work on them.
    shift = round(math.log2(depth))
    for mod in model.modules():
        if isinstance(mod, MoE):
            allocate_pool(mod, expert_format, dtype, device, repair=repair_tier)
            for pool in (mod.experts.pool, mod.experts.repair_pool):
                if pool is not None:
                    _fill_random(pool, gen, shift, depth, device)
            if mod.gate.e_score_correction_bias is not None:
                mod.gate.e_score_correction_bias.zero_()
    return model.eval()


def _fill_random(pool, gen, shift: int, depth: float, device) -> None:
    """Random bytes / values for every field of a W2, FP4 or dense pool (see random_model)."""
    u8 = dict(dtype=torch.uint8, device=device, generator=gen)
    for f in pool.__slots__:
        t = getattr(pool, f, None)
        if not isinstance(t, torch.Tensor):
            continue
        if t.dtype == torch.uint8 and "scale" not in f:
            t.copy_(torch.randint(0, 256, t.shape, **u8))              # codes
        elif t.dtype == torch.uint8:
            lo = 117 - (shift if f.startswith("down") else 0)
            t.copy_(torch.randint(lo, lo + 5, t.shape, **u8))
        elif t.dtype == torch.float8_e4m3fn:                            # NVFP4 block scales
            t.copy_(torch.empty(t.shape, device=device).uniform_(0.5, 2.0, generator=gen).to(t.dtype))
        elif "scale_2" in f:        # NVFP4 global scales: e2m1 values have rms ~3, so rms ~0.02
            t.fill_(0.007 / (depth if f.startswith("down") else 1.0))
        else:
            t.normal_(0.0, 0.02 / (depth if f.startswith("down") else 1.0), generator=gen)
