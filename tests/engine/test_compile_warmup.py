"""LLMEngine.compile_warmup (EngineConfig.compile_warmup; runs by itself on CUDA only): one
prefill per warm-up size and serving-shaped groups of concurrent requests (a shared prefix, so
later groups hit the prefix cache, then decode steps), then no trace -- no request, no cached prefix, zeroed counters -- and
what the engine generates afterwards is bit-identical to a fresh engine's, greedy and seeded."""
from moet.config import EngineConfig
from moet.engine.llm_engine import LLMEngine
from moet.sampling_params import SamplingParams
from moet.testing.tiny_checkpoint import cached_checkpoint


def make(**kw):
    cfg = dict(model=cached_checkpoint("glm4_moe"), expert_format="bf16", dtype="float32", device="cpu",
               block_size=4, max_num_batched_tokens=32, max_num_seqs=4)
    cfg.update(kw)
    return LLMEngine.from_config(EngineConfig(**cfg))


def run(eng):
    prompts = [list(b"The quick brown fox"), list(b"jumps over the lazy dog, twice")]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=6, ignore_eos=True, logprobs=3)]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                c = o.outputs[0]
                done[o.request_id] = (list(c.token_ids), [{t: v.logprob for t, v in d.items()} for d in c.logprobs])
    return done


def test_warmup_sizes_leave_no_trace_and_change_no_output():
    fresh = make()
    assert fresh.config.compile_warmup and fresh.stats().num_steps == 0     # CPU: never on its own
    want = run(fresh)
    eng = make()
    steps = []
    real_step = eng.step
    eng.step = lambda: steps.append((len(eng.scheduler.running), eng.block_manager.prefix_hits)) or real_step()
    n = eng.compile_warmup()
    del eng.step
    # prefills up to max_num_batched_tokens, then groups of 2, 3 and 4 requests (max_num_seqs 4)
    assert n == len([1, 2, 3, 4, 5, 8, 9, 16, 17, 32]) + 2 + 3 + 4
    assert max(r for r, _ in steps) == 4                                     # 4 sequences in one step
    assert steps[-1][1] > 0                                                  # the later groups hit the prefix
    st = eng.stats()
    assert not eng.requests and not eng.has_unfinished_requests()
    assert st.num_steps == 0 and st.prompt_tokens_total == 0 and st.generation_tokens_total == 0
    assert st.prefix_cache_hit_rate == 0.0 and st.num_free_kv_blocks == st.num_kv_blocks
    assert not eng.block_manager.hash_to_block
    assert run(eng) == want
    small = make(max_model_len=10)
    assert small.compile_warmup() == len([1, 2, 3, 4, 5, 8, 9]) + 2 + 3 + 4  # capped by max_model_len - 1
    assert not small.requests and small.stats().num_free_kv_blocks == small.stats().num_kv_blocks
