"""The reference loop with a quantized KV format (ReferenceLoop's kv_format): its contiguous
cache holds what the paged cache of that format gives back, so the engine under fp8 / nvfp4 KV
equals it (greedy tokens, and first-token log-probs to float32 rounding), while the bf16-cache
reference is measurably elsewhere: the check `moet bench` makes of a quantized cache would
otherwise hold a lossy format to bf16's noise floor. GQA (Qwen3-MoE) and MLA (DeepSeek-V3)."""
import pytest

from moet.config import EngineConfig
from moet.engine.llm_engine import LLMEngine
from moet.errors import ConfigError
from moet.kernels.kv_cache import kv_format_for
from moet.sampling_params import SamplingParams
from moet.testing.reference_loop import ReferenceLoop
from moet.testing.tiny_checkpoint import V4_FAMILIES, cached_checkpoint

BASE = [(11 * i + 5) % 250 for i in range(40)]
PROMPTS = [BASE[:9], BASE[:33], list(range(60, 81))]


def first_logprobs(out) -> dict[int, float]:
    return {t: v.logprob for t, v in out.logprobs[0].items()}


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("kv", ["fp8", "nvfp4"])
def test_engine_equals_the_reference_holding_the_formats_values(family, kv):
    path = cached_checkpoint(family)
    eng = LLMEngine.from_config(EngineConfig(model=path, expert_format="bf16", dtype="float32", device="cpu",
                                             kv_cache_dtype=kv, block_size=4))
    fmt = eng.runner.kv_format
    assert fmt.is_fp8 or fmt.is_nvfp4
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)
    done = eng.generate_all([(str(i), p, sp) for i, p in enumerate(PROMPTS)])
    held = ReferenceLoop(eng.model, None, eng.eos_token_ids, eng.max_model_len, kv_format=fmt)
    plain = ReferenceLoop(eng.model, None, eng.eos_token_ids, eng.max_model_len)
    off_plain = 0.0
    for i, p in enumerate(PROMPTS):
        got = done[str(i)].outputs[0]
        want = held.generate(p, sp).outputs[0]
        assert got.token_ids == want.token_ids
        g, w = first_logprobs(got), first_logprobs(want)
        assert max(abs(g[t] - w[t]) for t in g.keys() & w.keys()) < 2e-4
        b = first_logprobs(plain.generate(p, sp).outputs[0])
        off_plain = max(off_plain, max(abs(g[t] - b[t]) for t in g.keys() & b.keys()))
    assert off_plain > 1e-3          # the format really is lossy: the bf16 reference is not the oracle


@pytest.mark.skipif(not V4_FAMILIES, reason="this transformers has no DeepseekV4Config (needs >= 5.23)")
def test_a_quantized_deepseek_v4_reference_is_refused():
    import torch

    from moet.checkpoint import open_checkpoint
    from moet.model import load_model
    model = load_model(open_checkpoint(cached_checkpoint("deepseek_v4")), expert_format="bf16", dtype=torch.float32)
    with pytest.raises(ConfigError, match="DeepSeek-V4"):
        ReferenceLoop(model, None, set(), 64, kv_format=kv_format_for("nvfp4", model.dtype))
