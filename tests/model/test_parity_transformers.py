"""Every family, float32, expert_format="bf16": moet's prompt logprobs equal transformers'
log_softmax(logits) within 1e-4 and greedy continuations are identical, on tiny random
checkpoints with the family's non-default options on (group routing, YaRN, partial rotary,
qk-norm, attention bias, shared experts, dense first layers, sliding window)."""
import pytest
import torch

from moet.llm import LLM
from moet.sampling_params import SamplingParams
from moet.testing.tiny_checkpoint import FAMILIES, cached_checkpoint, reference_model

PROMPT = list(range(40, 40 + 37))  # longer than Mixtral's sliding window (12)
# An explicit KV cache size: left to gpu_memory_utilization, an engine on a GPU claims 90% of the
# card, and a test here holds two at once (pytest-xdist workers on the same GPU besides).
KV_GB = 0.05
CASES = [
    ("deepseek_v3", {}),
    ("deepseek_v3", {"q_lora_rank": None, "rope_interleave": False, "n_group": 1, "topk_group": 1,
                     "norm_topk_prob": False, "mtp": False}),
    ("glm4_moe", {}),
    ("glm4_moe", {"use_qk_norm": False, "attention_bias": False, "n_group": 1, "topk_group": 1, "mtp": False}),
    ("qwen3_moe", {}),
    ("qwen3_moe", {"norm_topk_prob": False, "decoder_sparse_step": 2, "mlp_only_layers": []}),
    ("mixtral", {}),
] + ([
    # GLM-5: DSA with top-k 4 (the prompt attends sparsely from its 5th token), layer 1 sharing
    # layer 0's selection; then transformers' default schedule (every layer its own indexer)
    ("glm_moe_dsa", {}),
    ("glm_moe_dsa", {"indexer_types": None, "index_topk": 16, "mtp": False}),
    # DeepSeek-V3.2: YaRN, group routing, every layer its own indexer with a half-split rope
    ("deepseek_v32", {}),
] if "glm_moe_dsa" in FAMILIES else []) + ([
    # MiniMax-M2: q / k normed across all heads, half of each head rotated, sigmoid + bias routing
    ("minimax_m2", {}),
] if "minimax_m2" in FAMILIES else []) + ([
    # gpt-oss: sinks, sliding (window 8) / full layers alternating, router and expert biases, the
    # clamped alpha activation; then every layer full (no window) and a looser clamp
    ("gpt_oss", {}),
    ("gpt_oss", {"layer_types": ["full_attention"] * 3, "swiglu_limit": 2.0}),
] if "gpt_oss" in FAMILIES else [])


def _ids(case):
    fam, kw = case
    return fam + ("-" + "-".join(kw) if kw else "")


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_prompt_logprobs_and_greedy_match_transformers(case):
    family, kw = case
    path = cached_checkpoint(family, "bf16", **kw)
    ref = reference_model(path)
    llm = LLM(path, expert_format="bf16", dtype="float32", kv_cache_memory_gb=KV_GB)
    out = llm.generate({"prompt_token_ids": PROMPT},
                       SamplingParams(temperature=0.0, max_tokens=10, prompt_logprobs=0, ignore_eos=True))[0]
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        ref_lp = ref(ids).logits[0].float().log_softmax(-1)
        ref_gen = ref.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.prompt_logprobs[0] is None
    got = torch.tensor([out.prompt_logprobs[i][PROMPT[i]].logprob for i in range(1, len(PROMPT))])
    want = ref_lp[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
    assert out.outputs[0].token_ids == ref_gen[0, len(PROMPT):].tolist()


def test_full_logit_rows_match(tmp_path):
    """All vocabulary entries, not only the prompt tokens, for one MLA and one GQA family."""
    from moet.checkpoint import open_checkpoint
    from moet.model import load_model

    for family in ("deepseek_v3", "glm4_moe") + (("glm_moe_dsa", "deepseek_v32") if "glm_moe_dsa" in FAMILIES else ()):
        path = cached_checkpoint(family, "bf16")
        ref = reference_model(path)
        model = load_model(open_checkpoint(path), expert_format="bf16", dtype=torch.float32)
        with torch.no_grad():
            ids = torch.tensor(PROMPT)
            got = model(ids, 0, model.new_cache(64, "cpu")).log_softmax(-1)
            want = ref(ids[None]).logits[0].log_softmax(-1)
            # and the same rows when the prompt is fed in two chunks through the KV cache
            cache = model.new_cache(64, "cpu")
            a = model(ids[:20], 0, cache)
            b = model(ids[20:], 20, cache)
            chunked = torch.cat([a, b]).log_softmax(-1)
        assert (got - want).abs().max() < 1e-4, family
        assert (chunked - want).abs().max() < 1e-4, family


def test_fused_experts_on_disk_match_per_expert():
    """transformers-style fused expert tensors on disk load to the same model."""
    per_expert = cached_checkpoint("qwen3_moe", "bf16")
    fused = cached_checkpoint("qwen3_moe", "bf16", fused_experts=True)
    from moet.checkpoint import open_checkpoint
    assert any(n.endswith("experts.gate_up_proj") for n in open_checkpoint(fused).reader.tensors)
    a = LLM(per_expert, expert_format="bf16", dtype="float32", kv_cache_memory_gb=KV_GB)
    b = LLM(fused, expert_format="bf16", dtype="float32", kv_cache_memory_gb=KV_GB)
    sp = SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=0, ignore_eos=True)
    oa, ob = a.generate({"prompt_token_ids": PROMPT}, sp)[0], b.generate({"prompt_token_ids": PROMPT}, sp)[0]
    assert oa.outputs[0].token_ids == ob.outputs[0].token_ids
    for pa, pb in zip(oa.prompt_logprobs[1:], ob.prompt_logprobs[1:]):
        assert list(pa) == list(pb) and all(pa[t].logprob == pb[t].logprob for t in pa)


def test_released_config_style_loads_the_same_model(tmp_path):
    """Kimi-K2 / DeepSeek-V3 as released: model_type kimi_k2 with remote-code auto_map, rope as
    top-level rope_theta + rope_scaling {type: yarn}, no rope_parameters. Same weights, same model."""
    import json
    import os
    import shutil

    from moet.checkpoint import open_checkpoint
    from moet.model import load_model

    src = cached_checkpoint("deepseek_v3", "bf16")
    dst = str(tmp_path / "kimi")
    shutil.copytree(src, dst)
    cfg = json.load(open(os.path.join(dst, "config.json")))
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    cfg.update(rope_scaling=rope, model_type="kimi_k2",
               auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                         "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    a = load_model(open_checkpoint(src), expert_format="bf16", dtype=torch.float32)
    b = load_model(open_checkpoint(dst), expert_format="bf16", dtype=torch.float32)
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        assert torch.equal(a(ids, 0, a.new_cache(64, "cpu")), b(ids, 0, b.new_cache(64, "cpu")))


def test_bfloat16_checkpoint_runs_in_bfloat16_close_to_transformers():
    """dtype=auto keeps a BF16 checkpoint in bf16; bf16 rounding differs from transformers' op
    order only in the last bits, so logprobs agree loosely and the top-1 mostly."""
    path = cached_checkpoint("qwen3_moe", "bf16", dtype=torch.bfloat16)
    llm = LLM(path, expert_format="bf16", kv_cache_memory_gb=KV_GB)
    assert llm.dtype == torch.bfloat16 and llm.model.lm_head.weight.dtype == torch.bfloat16
    ref = reference_model(path, dtype=torch.bfloat16)
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
    with torch.no_grad():
        lp = ref(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)
    got = torch.tensor([out.prompt_logprobs[i][PROMPT[i]].logprob for i in range(1, len(PROMPT))])
    want = lp[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    assert (got - want).abs().max() < 0.1
