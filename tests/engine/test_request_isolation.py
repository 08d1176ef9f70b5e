"""One request never takes another down (issue 34): what the model cannot honour is refused at
add with the field named (RequestError.param) before the scheduler sees it; a fault in one
request's own part of a step (its sampling row, prompt logprobs, the detokenizer / stop checks,
its RequestOutput, its step message) fails that request alone while the others keep their
tokens; a failed step fails only the requests it ran, never one that was waiting, and the engine
serves on. Through the Sampler, LLMEngine, AsyncEngine, EngineProcess and LLM, on the tiny
glm4_moe checkpoint (vocabulary 260, byte-level tokenizer) on CPU."""
import asyncio
import pickle

import pytest
import torch

from moet.config import EngineConfig
from moet.engine.async_engine import AsyncEngine
from moet.engine.detokenizer import IncrementalDetokenizer
from moet.engine.engine_process import EngineProcess, build_llm_engine
from moet.engine.llm_engine import LLMEngine
from moet.engine.sampler import Sampler
from moet.engine.sequence import Sequence
from moet.errors import ConfigError, MoetError, RequestError, RequestFailed
from moet.sampling_params import SamplingParams
from moet.testing.tiny_checkpoint import EOS, VOCAB, cached_checkpoint

PROMPT = list(b"The quick brown fox jumps over")
OTHER = list(b"hello there, engine")
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=7, ignore_eos=True, logprobs=2)


def _config(path, **kw) -> EngineConfig:
    # no prefix cache: a warm one changes the rounding of reused K/V (docs/architecture.md)
    args = dict(model=path, expert_format="bf16", dtype="float32", device="cpu", block_size=4,
                max_num_batched_tokens=32, max_num_seqs=8, enable_prefix_caching=False)
    args.update(kw)
    return EngineConfig(**args)


@pytest.fixture(scope="module")
def path():
    return cached_checkpoint("glm4_moe")


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def eng(path, request):
    return LLMEngine.from_config(_config(path, async_scheduling=request.param))


def _final(out) -> list:
    return [(c.token_ids, c.text, c.finish_reason) for c in out.outputs]


def _solo(eng, prompt, sp):
    return eng.generate_all([("solo", prompt, sp)])["solo"]


def _assert_clean(eng):
    assert not eng.has_unfinished_requests() and not eng.scheduler.running and not eng.scheduler.waiting
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


# ---------------------------------------------------------------------------- refused at add

def test_sampling_params_name_the_field():
    for kw, param in ((dict(seed=2**63), "seed"), (dict(seed=-(2**63) - 1), "seed"), (dict(seed=True), "seed"),
                      (dict(seed=1.5), "seed"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
                      (dict(stop_token_ids=[3.0]), "stop_token_ids"), (dict(stop_token_ids=7), "stop_token_ids"),
                      (dict(logprobs=-1), "logprobs"), (dict(prompt_logprobs=2.5), "prompt_logprobs"),
                      (dict(n=0), "n"), (dict(top_p=0.0), "top_p"), (dict(stop=[1]), "stop"),
                      (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(max_tokens=4.0), "max_tokens")):
        with pytest.raises(RequestError) as e:
            SamplingParams(**kw)
        assert e.value.param == param and isinstance(e.value, ConfigError), kw
    ok = SamplingParams(seed=2**63 - 1, stop_token_ids=(3, 4))
    assert ok.stop_token_ids == [3, 4] and SamplingParams(seed=-(2**63)).seed == -(2**63)
    # EngineProcess pickles refusals: the field survives
    e = pickle.loads(pickle.dumps(RequestError("bad seed", param="seed")))
    assert type(e) is RequestError and str(e) == "bad seed" and e.param == "seed"


def test_engine_refuses_what_the_model_cannot_honour_before_the_scheduler(eng):
    vocab = eng.model.spec.vocab_size
    seeded = SamplingParams(temperature=1.0, max_tokens=4, seed=1)
    seeded.seed = 2**64                          # past SamplingParams' own check: the engine checks again
    two = SamplingParams(temperature=1.0, max_tokens=4, n=2, seed=1)
    two.seed = 2**64 - 1                         # seed + 1 is past what torch.Generator takes
    cases = [
        (SamplingParams(stop_token_ids=[vocab + 5], min_tokens=3, max_tokens=8), "stop_token_ids"),
        (SamplingParams(stop_token_ids=[3, vocab], max_tokens=8), "stop_token_ids"),
        (SamplingParams(logprobs=vocab + 1), "logprobs"),
        (SamplingParams(prompt_logprobs=vocab + 1), "prompt_logprobs"),
        (seeded, "seed"),
        (two, "seed"),
    ]
    for sp, param in cases:
        with pytest.raises(RequestError) as e:
            eng.add_request("bad", PROMPT, sp)
        assert e.value.param == param, (sp, str(e.value))
        assert "bad" not in eng.requests and not eng.scheduler.waiting and not eng.scheduler.running
    tok = eng.tokenizer
    try:
        eng.tokenizer = None
        with pytest.raises(RequestError) as e:
            eng.add_request("bad", PROMPT, SamplingParams(stop=["x"]))
        assert e.value.param == "stop"
    finally:
        eng.tokenizer = tok
    # the edges that do fit: every completion's seed within torch's range, logprobs = the vocabulary
    edge = SamplingParams(temperature=1.0, max_tokens=3, n=2, seed=2**63 - 1, logprobs=vocab, ignore_eos=True)
    out = eng.generate_all([("edge", PROMPT, edge)])["edge"]
    assert out.error is None and [len(c.token_ids) for c in out.outputs] == [3, 3]
    assert len(out.outputs[0].logprobs[0]) == vocab
    _assert_clean(eng)


def test_out_of_vocab_stop_ids_refused_while_another_request_streams(path):
    """The HIGH case end to end: before, the request was admitted and its first step failed
    (stop id out of range in the min_tokens block), which failed every running request."""
    aeng = AsyncEngine(LLMEngine.from_config(_config(path)))
    vocab = aeng.engine.model.spec.vocab_size
    bad = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[vocab + 5], min_tokens=3)

    async def collect(rid, prompt, sp):
        return [o async for o in aeng.generate(rid, prompt, sp)]

    async def main():
        alone = await collect("alone", PROMPT, GREEDY)
        good = aeng.generate("good", PROMPT, GREEDY)
        first = await good.__anext__()                         # good is running
        seen = []
        with pytest.raises(RequestError) as e:
            async for o in aeng.generate("bad", OTHER, bad):
                seen.append(o)
        assert seen == [] and e.value.param == "stop_token_ids" and str(vocab + 5) in str(e.value)
        rest = [first] + [o async for o in good]
        return alone, rest

    try:
        alone, rest = asyncio.run(main())
    finally:
        asyncio.run(aeng.shutdown())
    assert rest[-1].finished and rest[-1].error is None
    assert _final(rest[-1]) == _final(alone[-1]) and len(rest[-1].outputs[0].token_ids) == 10
    _assert_clean(aeng.engine)


# ---------------------------------------------------------------------------- the sampler's rows

def _seq(sp, sid, prompt=(1, 2, 3)):
    s = Sequence(sid, f"r{sid}", 0, list(prompt), sp, 100)
    if sp.temperature > 0:
        s.generator = torch.Generator().manual_seed(sp.seed)
    return s


def test_a_failing_sampler_row_leaves_the_other_rows_bit_identical(monkeypatch):
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    sps = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.8, top_k=5, seed=3, logprobs=2),
           SamplingParams(temperature=1.0, min_p=0.1, seed=4, min_tokens=2, stop_token_ids=[7, 55]),
           SamplingParams(temperature=0.7, repetition_penalty=1.3, seed=5, logprobs=0)]
    # a stop id outside the vocabulary is nothing to block (it can never be sampled), not an index
    want = Sampler({EOS})(logits, [_seq(sp, i) for i, sp in enumerate(sps)])
    assert not want.failed
    orig = Sampler._blocked

    def blocked(self, seq, *a):
        if seq.request_id == "r2":
            raise RuntimeError("injected row fault")
        return orig(self, seq, *a)

    monkeypatch.setattr(Sampler, "_blocked", blocked)
    seqs = [_seq(sp, i) for i, sp in enumerate(sps)]
    got = Sampler({EOS})(logits, seqs)
    assert list(got.failed) == [2] and "injected row fault" in str(seqs[2].error)
    assert all(s.error is None for i, s in enumerate(seqs) if i != 2)
    for b in (0, 1, 3):
        assert got.token_ids[b] == want.token_ids[b] and got.token_logprobs[b] == want.token_logprobs[b]
        assert repr(got.logprobs[b]) == repr(want.logprobs[b])
    # the seeded draw fails for one row: the others are untouched too
    monkeypatch.setattr(Sampler, "_blocked", orig)
    real_exp = torch.Tensor.exponential_

    def exponential_(self, *a, generator=None, **kw):
        if generator is seqs[1].generator:
            raise RuntimeError("injected draw fault")
        return real_exp(self, *a, generator=generator, **kw)

    seqs = [_seq(sp, i) for i, sp in enumerate(sps)]
    monkeypatch.setattr(torch.Tensor, "exponential_", exponential_)
    got = Sampler({EOS})(logits, seqs)
    monkeypatch.setattr(torch.Tensor, "exponential_", real_exp)
    assert list(got.failed) == [1] and "injected draw fault" in str(seqs[1].error)
    for b in (0, 2, 3):
        assert got.token_ids[b] == want.token_ids[b] and got.token_logprobs[b] == want.token_logprobs[b]


# ---------------------------------------------------------------------------- faults inside a step

def _inject(monkeypatch, where: str, rid: str = "bad") -> None:
    """Make the engine's per-sequence work raise for request `rid` (after a token or two)."""
    if where == "sampler_row":
        orig = Sampler._blocked

        def blocked(self, seq, *a):
            if seq.request_id == rid and seq.num_output_tokens >= 2:
                raise RuntimeError("injected sampler fault")
            return orig(self, seq, *a)
        monkeypatch.setattr(Sampler, "_blocked", blocked)
    elif where == "detokenizer":
        orig_update = IncrementalDetokenizer.update

        def update(self):
            if self.seq.request_id == rid and self.seq.num_output_tokens >= 3:
                raise RuntimeError("injected detokenizer fault")
            return orig_update(self)
        monkeypatch.setattr(IncrementalDetokenizer, "update", update)
    elif where == "output":
        orig_text = IncrementalDetokenizer.visible_text

        def visible_text(self, finished):
            if self.seq.request_id == rid and self.seq.num_output_tokens >= 2:
                raise RuntimeError("injected output fault")
            return orig_text(self, finished)
        monkeypatch.setattr(IncrementalDetokenizer, "visible_text", visible_text)
    elif where == "prompt_logprobs":
        orig_plp = LLMEngine._prompt_logprobs

        def plp(self, seq, *a):
            if seq.request_id == rid:
                raise RuntimeError("injected prompt-logprobs fault")
            return orig_plp(self, seq, *a)
        monkeypatch.setattr(LLMEngine, "_prompt_logprobs", plp)
    else:
        raise AssertionError(where)


@pytest.mark.parametrize("where", ["sampler_row", "detokenizer", "output", "prompt_logprobs"])
def test_a_fault_in_one_request_fails_it_alone(eng, monkeypatch, where):
    bad_sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, n=2,
                            prompt_logprobs=1 if where == "prompt_logprobs" else None)
    solo_greedy, solo_seeded = _solo(eng, PROMPT, GREEDY), _solo(eng, OTHER, SEEDED)
    _inject(monkeypatch, where)
    done = eng.generate_all([("g", PROMPT, GREEDY), ("bad", list(b"xyz xyz xyz"), bad_sp), ("s", OTHER, SEEDED)])
    bad = done["bad"]
    assert bad.finished and isinstance(bad.error, RequestFailed) and "injected" in str(bad.error)
    assert "'bad' failed inside the engine" in str(bad.error)
    assert [c.finish_reason for c in bad.outputs] == ["error", "error"]
    assert all(len(c.token_ids) < 10 for c in bad.outputs)
    for out, solo in ((done["g"], solo_greedy), (done["s"], solo_seeded)):
        assert out.error is None and _final(out) == _final(solo)
    assert done["s"].outputs[0].cumulative_logprob == pytest.approx(solo_seeded.outputs[0].cumulative_logprob,
                                                                     abs=1e-5)
    _assert_clean(eng)
    monkeypatch.undo()                           # the engine serves the same request again
    again = eng.generate_all([("bad", list(b"xyz xyz xyz"), bad_sp)])["bad"]
    assert again.error is None and [len(c.token_ids) for c in again.outputs] == [10, 10]
    _assert_clean(eng)


def test_async_engine_fails_the_faulty_request_alone(eng, monkeypatch):
    solo = _solo(eng, PROMPT, GREEDY)
    aeng = AsyncEngine(eng)

    async def collect(rid, prompt, sp):
        return [o async for o in aeng.generate(rid, prompt, sp)]

    async def main():
        good = asyncio.create_task(collect("good", PROMPT, GREEDY))
        with pytest.raises(RequestFailed, match="'bad' failed inside the engine .*injected detokenizer fault"):
            await collect("bad", OTHER, GREEDY)
        return await good

    _inject(monkeypatch, "detokenizer")
    try:
        outs = asyncio.run(main())
        monkeypatch.undo()
        after = asyncio.run(collect("after", OTHER, GREEDY))
    finally:
        asyncio.run(aeng.shutdown())
    assert outs[-1].finished and _final(outs[-1]) == _final(solo)
    assert after[-1].finished and len(after[-1].outputs[0].token_ids) == 10
    _assert_clean(eng)


# ---------------------------------------------------------------------------- a failed step

@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async-scheduling"])
def test_failed_step_fails_only_its_requests_and_the_engine_serves_on(path, async_scheduling):
    """max_num_seqs=1: 'waiter' waits while 'boom' runs; the forward fails once 'waiter' is
    queued. Before, every request of the engine failed with the step (the waiting one too)."""
    eng = LLMEngine.from_config(_config(path, max_num_seqs=1, async_scheduling=async_scheduling))
    solo = _solo(eng, OTHER, GREEDY)
    forward = eng.runner.forward
    last: set = set()
    schedule = eng.scheduler.schedule

    def recording_schedule():
        out = schedule()
        last.clear()
        last.update(s.seq.request_id for s in out.scheduled)
        return out

    def failing_forward(*a, **kw):
        if "boom" in last and "waiter" in eng.requests:
            raise RuntimeError("injected forward failure")
        return forward(*a, **kw)

    eng.scheduler.schedule = recording_schedule
    eng.runner.forward = failing_forward
    aeng = AsyncEngine(eng)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def collect(rid, prompt, sp):
        return [o async for o in aeng.generate(rid, prompt, sp)]

    async def main():
        boom = aeng.generate("boom", PROMPT, long)
        await boom.__anext__()                                  # boom runs; the seat is taken
        waiter = asyncio.create_task(collect("waiter", OTHER, GREEDY))
        with pytest.raises(MoetError, match="engine step failed: RuntimeError: injected forward failure") as e:
            async for _ in boom:
                pass
        assert not isinstance(e.value, RequestFailed)
        w = await waiter
        after = await collect("after", OTHER, GREEDY)
        return w, after

    try:
        w, after = asyncio.run(main())
    finally:
        asyncio.run(aeng.shutdown())
    assert w[-1].finished and w[-1].error is None and _final(w[-1]) == _final(solo)
    assert _final(after[-1]) == _final(solo)
    _assert_clean(eng)


# ---------------------------------------------------------------------------- the offline API

def test_llm_generate_returns_the_failed_request_with_its_error(path, monkeypatch):
    from moet.llm import LLM

    llm = LLM(path, expert_format="bf16", dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=32,
              max_num_seqs=8, enable_prefix_caching=False)
    solo = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    _inject(monkeypatch, "detokenizer", rid=str(llm._next_id + 1))   # the second prompt's request id
    outs = llm.generate([PROMPT, OTHER], GREEDY, use_tqdm=False)
    assert outs[0].error is None and _final(outs[0]) == _final(solo)
    assert isinstance(outs[1].error, RequestFailed) and outs[1].finished
    assert outs[1].outputs[0].finish_reason == "error"
    with pytest.raises(RequestError) as e:                      # refused: raises before anything runs
        llm.generate([PROMPT], SamplingParams(stop_token_ids=[10**6]), use_tqdm=False)
    assert e.value.param == "stop_token_ids" and not llm.engine.has_unfinished_requests()


# ---------------------------------------------------------------------------- the engine in a child

def build_faulty(config):
    """The child's engine, with the detokenizer failing for request 'bad' (patched in the child only)."""
    orig = IncrementalDetokenizer.update

    def update(self):
        if self.seq.request_id == "bad" and self.seq.num_output_tokens >= 3:
            raise RuntimeError("injected detokenizer fault")
        return orig(self)
    IncrementalDetokenizer.update = update
    return build_llm_engine(config)


def test_engine_process_fails_the_faulty_request_alone(path):
    ep = EngineProcess(build_faulty, (_config(path),))
    vocab = VOCAB

    async def collect(rid, prompt, sp):
        return [o async for o in ep.generate(rid, prompt, sp)]

    async def main():
        solo = await collect("solo", PROMPT, GREEDY)
        good = asyncio.create_task(collect("good", PROMPT, GREEDY))
        with pytest.raises(RequestFailed, match="'bad' failed inside the engine .*injected detokenizer fault"):
            await collect("bad", OTHER, GREEDY)
        with pytest.raises(RequestError) as e:
            await collect("refused", OTHER, SamplingParams(stop_token_ids=[vocab + 5], min_tokens=3))
        assert e.value.param == "stop_token_ids"
        g = await good
        after = await collect("after", OTHER, GREEDY)
        return solo, g, after

    try:
        solo, g, after = asyncio.run(main())
        st = ep.stats()
    finally:
        asyncio.run(ep.shutdown())
    assert g[-1].finished and _final(g[-1]) == _final(solo[-1])
    assert after[-1].finished and len(after[-1].outputs[0].token_ids) == 10
    assert st.num_running == 0 and st.num_free_kv_blocks == st.num_kv_blocks


def test_engine_process_an_unsendable_output_fails_its_request_alone():
    """The child's step message: an event that does not pickle fails its own request only."""
    import multiprocessing as mp

    from moet.engine import engine_process as epm

    class _Engine:
        def __init__(self):
            self.aborted = []

        def stats(self):
            return {"steps": 1}

        def abort_request(self, rid):
            self.aborted.append(rid)

    r, w = mp.Pipe(duplex=False)
    loop = epm._EngineLoop(_Engine(), None, w)
    loop.sent = {"ok": epm._Sent(1), "bad": epm._Sent(2)}
    good_ev = (epm._OUT, 1, None, None, [], False)
    loop.send([good_ev, (epm._OUT, 2, None, None, [(0, 0, [], 0, lambda: 0, None, None, None, None)], False)])
    kind, events, stats = r.recv()
    assert kind == "step" and stats == {"steps": 1} and events[0] == good_ev
    assert events[1][:2] == (epm._FAILED, 2) and isinstance(events[1][2], RequestFailed)
    assert "'bad' failed inside the engine" in str(events[1][2])
    assert loop.engine.aborted == ["bad"] and list(loop.sent) == ["ok"]
