"""EngineConfig.async_scheduling (engine/async_decode.py): decode steps launched before the
previous step's tokens are read give what the synchronous engine gives -- token ids, logprobs
(ranks and top-k), text, finish and stop reasons, seeded draws -- through stop strings, stop
ids with min_tokens, n > 1, penalties (not pipelined), requests arriving and aborted mid-run;
no placeholder ever reaches an output, and no block leaks."""
import random

import pytest

from moet.config import EngineConfig
from moet.engine.async_decode import PLACEHOLDER
from moet.engine.llm_engine import LLMEngine
from moet.sampling_params import SamplingParams
from moet.testing.tiny_checkpoint import cached_checkpoint

PROMPT = list(b"The quick brown fox jumps over")


@pytest.fixture(scope="module")
def path():
    return cached_checkpoint("glm4_moe")


def make(path, async_scheduling, **kw):
    cfg = dict(model=path, expert_format="bf16", dtype="float32", device="cpu", block_size=4,
               max_num_batched_tokens=32, max_num_seqs=8, async_scheduling=async_scheduling)
    cfg.update(kw)
    return LLMEngine.from_config(EngineConfig(**cfg))


def _view(out):
    """Everything a client sees of a RequestOutput."""
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason, round(c.cumulative_logprob, 3),
             [{t: (round(l.logprob, 5), l.rank) for t, l in p.items()} for p in c.logprobs] if c.logprobs else None)
            for c in out.outputs]


def drive(eng, script):
    """script: {step number: [("add", rid, prompt, params) | ("abort", rid)]}; steps until done.
    Returns every request's last output, and checks each output on the way."""
    last, step = {}, 0
    while True:
        for op in script.get(step, []):
            if op[0] == "add":
                eng.add_request(op[1], op[2], op[3])
            else:
                eng.abort_request(op[1])
        if not eng.has_unfinished_requests() and step >= max(script, default=0):
            break
        for out in eng.step():
            for c in out.outputs:
                assert PLACEHOLDER not in c.token_ids and all(t >= 0 for t in c.token_ids)
            last[out.request_id] = out
        step += 1
        assert step < 500
    return last


def test_async_equals_sync_through_every_feature(path):
    tok_eng = make(path, False)
    greedy = tok_eng.generate_all([("g", PROMPT, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))])
    g = greedy["g"].outputs[0]
    stop_str = tok_eng.tokenizer.decode(g.token_ids[5:7])
    reqs = [
        ("greedy-lp", PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)),
        ("seeded", PROMPT[:11], SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=7, ignore_eos=True,
                                               logprobs=0)),
        ("stop-str", PROMPT, SamplingParams(temperature=0.0, max_tokens=14, stop=[stop_str], ignore_eos=True)),
        ("stop-id-min", PROMPT, SamplingParams(temperature=0.0, max_tokens=14, stop_token_ids=[g.token_ids[1]],
                                               min_tokens=3, ignore_eos=True)),
        ("penalty", PROMPT[:9], SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.3,
                                               frequency_penalty=0.2, ignore_eos=True)),
        ("n3", list(b"abc def"), SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=5, ignore_eos=True)),
        ("short", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)),
    ]
    # the first four decode pipelined for a while; arrivals, an abort and the penalty request
    # (synchronous while it runs) break the pipeline and it resumes
    script = {0: [("add", *r) for r in reqs[:4]],
              5: [("add", "victim", PROMPT[:13], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))],
              9: [("abort", "victim")],
              11: [("add", *reqs[5])],
              16: [("add", *reqs[4])],
              27: [("add", *reqs[6])]}
    outs = {}
    for mode in (False, True):
        eng = make(path, mode)
        outs[mode] = drive(eng, script)
        st = eng.stats()
        assert st.num_running == st.num_waiting == 0 and st.kv_usage == 0.0
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
        if mode:
            assert st.extra["async_pipelined_steps"] > 5 and st.extra["async_sync_resolves"] >= 3
            assert eng._async.pending is None
    for rid in (r[0] for r in reqs):
        a, b = _view(outs[True][rid]), _view(outs[False][rid])
        assert [c[:5] for c in a] == [c[:5] for c in b], rid          # ids, text, finish, stop, cumulative
        for ca, cb in zip(a, b):                                      # logprobs: the same ids and ranks,
            if ca[5] is None:                                         # values within batch-variance noise
                assert cb[5] is None
                continue
            for pa, pb in zip(ca[5], cb[5]):
                assert pa.keys() == pb.keys() and all(pa[t][1] == pb[t][1] and abs(pa[t][0] - pb[t][0]) < 1e-4
                                                      for t in pa), rid
    assert outs[True]["stop-str"].outputs[0].finish_reason == "stop"
    assert len(outs[True]["short"].outputs[0].token_ids) == 2


def test_random_arrivals_and_aborts_leak_nothing(path):
    """A property run: random adds (greedy and sampled, random lengths) and aborts against
    the pipelined engine; every finished request's output is what the synchronous engine
    gives it alone (greedy) and the pool is whole at the end."""
    rng = random.Random(1234)
    eng = make(path, True, num_kv_blocks=48, max_model_len=64, max_num_seqs=4)
    ref = make(path, False)
    script, live, n = {}, [], 0
    for step in range(60):
        ops = []
        if rng.random() < 0.3:
            rid = f"r{n}"
            n += 1
            prompt = [rng.randrange(1, 250) for _ in range(rng.randrange(2, 12))]
            ops.append(("add", rid, prompt, SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 9),
                                                           ignore_eos=True)))
            live.append((rid, prompt, ops[-1][3]))
        if live and rng.random() < 0.08:
            ops.append(("abort", rng.choice(live)[0]))
        if ops:
            script[step] = ops
    aborted = {op[1] for ops in script.values() for op in ops if op[0] == "abort"}
    outs = drive(eng, script)
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    for rid, prompt, sp in live:
        if rid in aborted or rid not in outs:
            continue
        want = ref.generate_all([(rid, prompt, sp)])[rid]
        assert outs[rid].outputs[0].token_ids == want.outputs[0].token_ids, rid
    assert eng.stats().extra["async_pipelined_steps"] > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_is_freed_without_a_gc_pass(path, async_scheduling):
    """`del engine` must release the model at once (the server bench's next phase is another
    process that needs the device memory back): no reference cycle through the engine, its
    async pipeline included. With the collector off, only reference counting can free it."""
    import gc
    import weakref

    eng = make(path, async_scheduling)
    drive(eng, {0: [("add", "a", PROMPT, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)),
                    ("add", "b", PROMPT[:5], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))]})
    assert (eng._async is not None) == async_scheduling
    model, engine = weakref.ref(eng.runner.model), weakref.ref(eng)
    gc.collect()
    gc.disable()
    try:
        del eng
        assert engine() is None and model() is None
    finally:
        gc.enable()
