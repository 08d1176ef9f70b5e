"""--kv-cache-dtype nvfp4 end to end on CPU, through moet.LLM (float32 activations, the torch
references): the shipped moet-tiny (MLA: latent nvfp4, rope e4m3) and a tiny random-weight
Qwen3-MoE (GQA: K and V nvfp4). Each nvfp4 engine is compared with a bf16-KV engine over the same
loaded model, so only the KV cache differs.

Why these assertions. nvfp4 moves every cached value by up to a quarter of its 16-block's scale
(~10% RMS), so logits move by O(0.1) nats: a position whose bf16 top-2 are closer than that may
legitimately flip, and once a greedy run flips it diverges. So greedy equality is asserted only
where the model is confident (moet-tiny is trained: its first tokens on plain prompts), and the
general claim is teacher-forced: over a fixed text, the top-1 token of each position's
distribution agrees with the bf16 cache's at a high rate, and the text's own tokens' log-probs
move by a small mean amount that is not zero (really quantized). A broken cache (nibbles swapped,
a dropped scale) agrees at a few to ~20% and moves log-probs by whole nats, far outside these
bounds; the random-weight GQA model's flat distributions have many near-ties, hence its lower
agreement bound."""
from __future__ import annotations

import copy

import torch

from moet.assets import default_model
from moet.config import EngineConfig
from moet.engine.llm_engine import LLMEngine
from moet.llm import LLM
from moet.sampling_params import SamplingParams
from moet.testing.tiny_checkpoint import cached_checkpoint

TEXT = ("The history of the Roman Empire begins with the founding of the city of Rome. Over centuries, the "
        "republic grew into an empire that spanned the Mediterranean, and its laws, roads and language shaped "
        "Europe for a thousand years.")
PROMPTS = ["The capital of France is", "def add(a, b):", "Question: what is 2 + 3? Answer:"]
KV_GB = 0.01


def _pair(path: str, expert_format: str) -> tuple[LLM, LLM]:
    """(nvfp4-KV LLM, bf16-KV LLM over the same loaded model)."""
    kw = dict(expert_format=expert_format, dtype="float32", kv_cache_memory_gb=KV_GB, block_size=16)
    nv = LLM(path, kv_cache_dtype="nvfp4", **kw)
    bf = copy.copy(nv)
    bf.engine = LLMEngine(EngineConfig(model=path, kv_cache_dtype="bf16", **kw), nv.model, nv.tokenizer,
                          nv.engine.eos_token_ids, nv.device, nv.max_model_len)
    return nv, bf


def _teacher_forced(nv: LLM, bf: LLM) -> tuple[float, float]:
    """(top-1 agreement over TEXT's positions, mean |log-prob change| of TEXT's own tokens)."""
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    a, b = nv.generate(TEXT, sp, use_tqdm=False)[0], bf.generate(TEXT, sp, use_tqdm=False)[0]
    top = lambda d: max(d.items(), key=lambda kv: kv[1].logprob)[0]           # noqa: E731
    pairs = list(zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], a.prompt_token_ids[1:]))
    agree = sum(top(x) == top(y) for x, y, _ in pairs) / len(pairs)
    moved = sum(abs(x[t].logprob - y[t].logprob) for x, y, t in pairs) / len(pairs)
    return agree, moved


def _capacity(nv: LLM, bf: LLM, per_layer_nv: int, per_layer_bf: int) -> None:
    """Bytes per token from the format's layout (every attention layer, MTP included), and the
    blocks that fit the same KV budget grow by the byte ratio (what start-up reports)."""
    layers = len(nv.engine.runner.kv)
    assert nv.engine.runner.bytes_per_token == layers * per_layer_nv
    assert bf.engine.runner.bytes_per_token == layers * per_layer_bf
    budget = int(KV_GB * 2**30)
    assert nv.engine.runner.num_blocks == budget // (layers * per_layer_nv * 16)
    assert nv.engine.stats().num_kv_blocks == nv.engine.runner.num_blocks
    assert nv.engine.runner.num_blocks > 3 * bf.engine.runner.num_blocks


def test_moet_tiny_mla_generates_with_nvfp4_kv():
    nv, bf = _pair(str(default_model()), "fp4")
    a = nv.spec.attention
    _capacity(nv, bf, a.kv_lora_rank // 2 + a.kv_lora_rank // 16 + a.qk_rope_head_dim,
              (a.kv_lora_rank + a.qk_rope_head_dim) * 2)
    assert nv.engine.runner.kv[0].fmt.is_nvfp4 and nv.engine.runner.kv[0].buffer.dtype == torch.uint8
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in nv.generate(PROMPTS, sp, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in bf.generate(PROMPTS, sp, use_tqdm=False)]
    assert [g[:4] for g in got] == [w[:4] for w in want]          # confident first tokens: equal
    assert all(len(g) == 8 for g in got)
    agree, moved = _teacher_forced(nv, bf)
    assert agree >= 0.85 and 0 < moved < 0.3, (agree, moved)


def test_tiny_qwen3_gqa_generates_with_nvfp4_kv():
    nv, bf = _pair(cached_checkpoint("qwen3_moe", "bf16"), "bf16")
    a = nv.spec.attention
    _capacity(nv, bf, a.num_kv_heads * (a.head_dim + a.v_head_dim) * 9 // 16,
              a.num_kv_heads * (a.head_dim + a.v_head_dim) * 2)
    out = nv.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 and o.outputs[0].finish_reason == "length" for o in out)
    agree, moved = _teacher_forced(nv, bf)
    assert agree >= 0.7 and 0 < moved < 0.3, (agree, moved)
