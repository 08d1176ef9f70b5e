"""LLMEngine / AsyncEngine behaviour beyond greedy parity: seeded sampling, n > 1, stop
conditions equal to the reference loop, request validation, streaming, abort and cancel."""
import asyncio

import pytest

from moet.config import EngineConfig
from moet.engine.async_engine import AsyncEngine
from moet.engine.llm_engine import LLMEngine
from moet.errors import ConfigError
from moet.sampling_params import SamplingParams
from moet.testing.reference_loop import ReferenceLoop
from moet.testing.tiny_checkpoint import EOS, cached_checkpoint

PROMPT = list(b"The quick brown fox jumps over")


@pytest.fixture(scope="module")
def path():
    return cached_checkpoint("glm4_moe")


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def eng(path, request):
    """Every test here runs on the synchronous engine and on async_scheduling (engine/async_decode.py)."""
    return LLMEngine.from_config(EngineConfig(model=path, expert_format="bf16", dtype="float32", device="cpu",
                                              block_size=4, max_num_batched_tokens=32, max_num_seqs=8,
                                              async_scheduling=request.param))


def run(eng, reqs):
    done = eng.generate_all([(str(i), p, sp) for i, (p, sp) in enumerate(reqs)])
    return [done[str(i)] for i in range(len(reqs))]


def test_seeded_sampling_reproducible_alone_or_in_a_batch(eng):
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=11, ignore_eos=True)
    alone = run(eng, [(PROMPT, sp)])[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True)
    batch = run(eng, [(PROMPT[:9], noise), (PROMPT, sp), (list(b"xyz"), noise)])[1].outputs[0].token_ids
    assert alone == batch
    others = {tuple(run(eng, [(PROMPT, SamplingParams(temperature=1.0, max_tokens=10, seed=s, ignore_eos=True))])[0]
                    .outputs[0].token_ids) for s in range(4)}
    assert len(others) > 1
    top1 = run(eng, [(PROMPT, SamplingParams(temperature=0.8, top_k=1, max_tokens=6, seed=3, ignore_eos=True))])[0]
    greedy = run(eng, [(PROMPT, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))])[0]
    assert top1.outputs[0].token_ids == greedy.outputs[0].token_ids


def test_n_completions_share_the_prompt_blocks(eng):
    eng.reset_prefix_cache()
    hits0 = eng.block_manager.prefix_hits
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=5, ignore_eos=True, logprobs=0)
    out = run(eng, [(PROMPT, sp)])[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert all(len(c.token_ids) == 6 and len(c.logprobs) == 6 for c in out.outputs)
    # siblings took the first completion's full prompt blocks from the cache
    assert eng.block_manager.prefix_hits - hits0 == 2 * ((len(PROMPT) - 1) // 4) * 4
    again = run(eng, [(PROMPT, sp)])[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_stop_conditions_equal_the_reference_loop(eng):
    ref = ReferenceLoop(eng.model, eng.tokenizer, eng.eos_token_ids, eng.max_model_len)
    greedy = ref.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)).outputs[0]
    text = eng.tokenizer.decode(greedy.token_ids)
    # a character first seen after a few tokens (random bytes decode to U+FFFD often)
    stop_str = next(ch for i, ch in enumerate(text) if i >= 2 and ch != "\ufffd" and ch not in text[:i])
    cases = [
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[greedy.token_ids[4]], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, stop=[stop_str], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, stop=[stop_str], include_stop_str_in_output=True, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[greedy.token_ids[1]], min_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=5, logprobs=2, ignore_eos=True),
    ]
    outs = run(eng, [(PROMPT, sp) for sp in cases])
    for sp, o in zip(cases, outs):
        r = ref.generate(PROMPT, sp).outputs[0]
        c = o.outputs[0]
        assert (c.token_ids, c.text, c.finish_reason, c.stop_reason) == \
               (r.token_ids, r.text, r.finish_reason, r.stop_reason)
        assert c.cumulative_logprob == pytest.approx(r.cumulative_logprob, abs=1e-4)
    assert outs[1].outputs[0].finish_reason == "stop" and outs[1].outputs[0].stop_reason == stop_str
    # EOS: make the greedy second token the EOS id
    saved = set(eng.eos_token_ids)
    try:
        eng.set_eos_token_ids({greedy.token_ids[1]})
        c = run(eng, [(PROMPT, SamplingParams(temperature=0.0, max_tokens=10))])[0].outputs[0]
        assert c.token_ids == greedy.token_ids[:2] and c.finish_reason == "stop" and c.stop_reason is None
    finally:
        eng.set_eos_token_ids(saved)
    assert eng.eos_token_ids == {EOS}


def test_requests_that_can_never_run_are_refused(eng, path):
    with pytest.raises(ConfigError, match="max_model_len"):
        eng.add_request("long", [5] * eng.max_model_len, SamplingParams())
    with pytest.raises(ConfigError, match="token ids"):
        eng.add_request("vocab", [10**6], SamplingParams())
    with pytest.raises(ConfigError, match="empty"):
        eng.add_request("empty", [], SamplingParams())
    with pytest.raises(ConfigError, match="less than one max_model_len"):
        LLMEngine.from_config(EngineConfig(model=path, expert_format="bf16", dtype="float32", device="cpu",
                                           block_size=4, num_kv_blocks=5, max_model_len=40))
    assert not eng.has_unfinished_requests()


# ---------------------------------------------------------------------------- async engine

@pytest.fixture(scope="module")
def aeng(eng):
    a = AsyncEngine(eng)
    yield a
    asyncio.run(a.shutdown())


def test_async_streams_cumulative_outputs_and_matches_sync(aeng, eng):
    # (the engine belongs to aeng's thread now: the expected output comes from the reference loop)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = ReferenceLoop(eng.model, eng.tokenizer, eng.eos_token_ids, eng.max_model_len).generate(PROMPT, sp).outputs[0]

    async def main():
        async def one(rid, prompt):
            return [o async for o in aeng.generate(rid, prompt, sp)]
        return await asyncio.gather(one("a", PROMPT), one("b", list(b"hello")))

    a, b = asyncio.run(main())
    assert a[-1].finished and a[-1].outputs[0].finish_reason == "length" and not any(o.finished for o in a[:-1])
    assert a[-1].outputs[0].token_ids == want.token_ids and a[-1].outputs[0].text == want.text
    lens = [len(o.outputs[0].token_ids) for o in a]
    assert lens == sorted(lens) and lens[-1] == 8 and len(lens) >= 2
    for x, y in zip(a, a[1:]):
        assert y.outputs[0].token_ids[:len(x.outputs[0].token_ids)] == x.outputs[0].token_ids
    assert b[-1].finished and aeng.model_name.startswith("glm4_moe")
    st = aeng.stats()
    assert st.num_running == 0 and st.kv_usage == 0.0 and st.generation_tokens_total > 0


def test_async_abort_and_cancel_free_blocks(aeng, eng):
    sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        got = []
        async for o in aeng.generate("x", PROMPT, sp):
            got.append(o)
            if len(got) == 2:
                await aeng.abort("x")
        assert len(got) <= 3 and not got[-1].finished

        async def consume():
            async for _ in aeng.generate("y", PROMPT, sp):
                pass
        task = asyncio.create_task(consume())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await aeng.abort("never-existed")                       # harmless
        for _ in range(100):
            if aeng.stats().num_running == 0:
                break
            await asyncio.sleep(0.05)

        with pytest.raises(ConfigError):
            async for _ in aeng.generate("z", [1] * 10_000, sp):
                pass

    asyncio.run(main())
    assert not eng.has_unfinished_requests()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


@pytest.mark.parametrize("kv_dtype,ratio", [("bf16", 0.5), ("fp8", None)])
def test_kv_cache_dtypes_size_and_run(path, kv_dtype, ratio):
    mk = lambda d: LLMEngine.from_config(EngineConfig(model=path, expert_format="bf16", dtype="float32", device="cpu",
                                                      block_size=4, kv_cache_dtype=d, max_model_len=64))
    auto, other = mk("auto"), mk(kv_dtype)
    r = other.runner.bytes_per_token / auto.runner.bytes_per_token
    assert r == ratio if ratio else r < 0.5           # fp8: 1 byte per element + per-token-group scales
    sp = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0, ignore_eos=True)
    a, b = run(auto, [(PROMPT, sp)])[0], run(other, [(PROMPT, sp)])[0]
    diffs = [abs(x[t].logprob - y[t].logprob) for x, y, t in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], PROMPT[1:])]
    assert 0 < max(diffs) < 0.5                       # really quantized, still close
    assert len(b.outputs[0].token_ids) == 4 and b.outputs[0].finish_reason == "length"


def test_kv_budget_and_graph_buckets(path):
    from moet.engine.cuda_graphs import graph_buckets

    assert graph_buckets(64) == [1, 2, 4, 8, 16, 32, 64] and graph_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert graph_buckets(1) == [1]
    e = LLMEngine.from_config(EngineConfig(model=path, expert_format="bf16", dtype="float32", device="cpu",
                                           block_size=8, kv_cache_memory_gb=0.001, max_model_len=64))
    per_block = e.runner.bytes_per_token * 8
    assert e.runner.num_blocks == int(0.001 * 2**30) // per_block
    assert e.runner.kv_cache_bytes <= 0.001 * 2**30 < e.runner.kv_cache_bytes + per_block
    # the cache holds every attention layer, MTP included: 4 layers x 2 heads x (32 + 32) x 4 B
    assert e.runner.bytes_per_token == 4 * 2 * 64 * 4
    st = e.stats()
    assert st.num_kv_blocks == e.runner.num_blocks and st.block_size == 8 and st.extra["cuda_graphs"] == 0
