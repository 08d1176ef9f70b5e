"""A three-layer GLM-4.5-shaped random model (layer 0 dense, two MoE layers with a shared expert)
and one greedy run of it through LLMEngine: for tests that compare engine options bit for bit."""
from __future__ import annotations

import torch

from moet.bench import shapes as eb

GLM_TINY = dict(eb.GLM45_AIR, vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                n_routed_experts=8, num_experts_per_tok=2, eos_token_id=257)


def greedy_outputs(device: torch.device, seed: int, check=None, **config) -> list[tuple[list[int], list[dict]]]:
    """Three mixed prompts, 12 greedy tokens each with top-5 logprobs, from the model of `seed`
    under EngineConfig(**config); check(engine, model) runs before the requests."""
    from moet.config import EngineConfig
    from moet.engine.llm_engine import LLMEngine
    from moet.sampling_params import SamplingParams

    model = eb.random_model(GLM_TINY, device, seed=seed)
    ec = EngineConfig(model="random:glm4_moe", device=device.type, max_model_len=128, max_num_seqs=4,
                      kv_cache_memory_gb=0.05, **config)
    eng = LLMEngine(ec, model, None, {GLM_TINY["eos_token_id"]}, device, 128)
    if check is not None:
        check(eng, model)
    prompts = eb.prompts(3, 40, GLM_TINY["vocab_size"] - 50, seed % 1000)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    done = eng.generate_all([(f"r{i}", p, sp) for i, p in enumerate(prompts)])
    return [(list(done[f"r{i}"].outputs[0].token_ids),
             [{t: v.logprob for t, v in d.items()} for d in done[f"r{i}"].outputs[0].logprobs])
            for i in range(len(prompts))]
