"""MTP speculative decoding (engine/speculative.py, --speculative-config).

  * greedy: on moet-tiny (float32, CPU) the tokens equal non-speculative decoding for k = 1..3 and
    for FP4, W2 and W2 + gate experts, with chunked prefill and drafts cut to a small step budget
    too, and the drafts are accepted often (the MTP layer is trained); a run repeats exactly;
  * sampling: with the same per-request seeds the tokens equal non-speculative sampling (every
    emitted token is the target's own sample, drawn in the same order); with independent seeds the
    two distributions of the first tokens agree (a chi-square test);
  * rollback: a KV cache so small that sequences are preempted, and a request aborted mid-stream,
    leave the other outputs equal to the reference and every block free at the end;
  * the expert store: drafting and verifying over a capped W2 cache (misses replayed, or fetched
    on demand) give the resident tokens and logprobs bit for bit;
  * bad settings: one ConfigError naming the flag, before any weight is read.
"""
import collections
import math

import pytest
import torch

from moet.assets import MOET_TINY
from moet.config import EngineConfig
from moet.engine.llm_engine import LLMEngine
from moet.errors import ConfigError
from moet.sampling_params import SamplingParams
from moet.testing.tiny_checkpoint import cached_checkpoint

PROMPTS = ["What is 345 + 278?", "The capital of France is", "Write a short poem about the sea.",
           "List three prime numbers:"]


def engine(k=0, model=str(MOET_TINY), **kw):
    kw = {"expert_format": "fp4", "dtype": "float32", "device": "cpu", **kw}
    if k:
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
    return LLMEngine.from_config(EngineConfig(model=model, **kw))


def generate(eng, prompts, sp, logprobs=False):
    done = eng.generate_all([(str(i), p, sp) for i, p in enumerate(prompts)])
    outs = [done[str(i)].outputs[0] for i in range(len(prompts))]
    if logprobs:
        return [(o.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.logprobs]) for o in outs]
    return [o.token_ids for o in outs]


GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


@pytest.mark.parametrize("fmt,kw", [("fp4", {}), ("w2", {"fp4_gate": False}), ("w2", {})],
                         ids=["fp4", "w2", "w2+gate"])
def test_greedy_equals_non_speculative(fmt, kw):
    want = generate(engine(0, expert_format=fmt, **kw), PROMPTS, GREEDY)
    for k, budget in ((1, 8192), (3, 5)):          # 5: chunked prefill, drafts cut to the step's budget
        eng = engine(k, expert_format=fmt, max_num_batched_tokens=budget, max_num_seqs=4, **kw)
        assert generate(eng, PROMPTS, GREEDY) == want, k
        st = eng.stats().extra
        assert st["spec_draft_tokens_total"] > 0 and st["spec_acceptance_rate_position_1"] > 0.1
        assert st["spec_mean_tokens_per_step"] > 1.1
        assert st["spec_accepted_tokens_total"] <= st["spec_draft_tokens_total"]
        assert f"spec_acceptance_rate_position_{k}" in st
        if "fp4_gate" not in kw and fmt == "w2":
            assert st["fp4_gate_repaired"] > 0           # the gate judged verified positions
    eng = engine(2, expert_format=fmt, **kw)
    runs = [generate(eng, PROMPTS, GREEDY) for _ in range(2)]
    assert runs[0] == runs[1] == want


def test_fixed_width_drafting_passes_equal_varlen_ones():
    """The MTP layer's first pass at a captured width (every sequence's verify rows as they are,
    the rejected ones padding that writes no KV: what a drafting graph takes, run eagerly here
    over placeholder graph sets) proposes the drafts of the varlen pass, step for step."""
    from moet.engine.cuda_graphs import GraphSet

    def drafts_of(eng):
        seen = []
        propose = eng.drafter.propose

        def spy(rows, hidden):
            propose(rows, hidden)
            seen.append(sorted((seq.request_id, seq.num_tokens, tuple(seq.spec_token_ids)) for seq, *_ in rows))
        eng.drafter.propose = spy
        return generate(eng, PROMPTS, GREEDY), seen

    want, want_drafts = drafts_of(engine(2, max_num_seqs=4))
    eng = engine(2, max_num_seqs=4)
    for key in ((True, 3), (True, 1), (False, 1)):      # no graphs in them: the passes run eagerly
        eng.runner.draft_graphs[key] = GraphSet(key[1], 4, 2, 64, "cpu", "placeholder", hidden=(8, torch.float32))
    widths = []
    uniform = eng.drafter._uniform_width
    eng.drafter._uniform_width = lambda rows, hidden: widths.append(uniform(rows, hidden)) or widths[-1]
    got, got_drafts = drafts_of(eng)
    assert got == want and got_drafts == want_drafts
    assert widths.count(3) > 5                               # every verify step with two drafts everywhere
    st = eng.stats().extra
    assert st["spec_acceptance_rate_position_1"] > 0.1


def test_sampling_follows_the_target_distribution():
    sp = lambda seed: SamplingParams(temperature=1.0, top_p=0.95, max_tokens=6, seed=seed)  # noqa: E731
    prompt = "Once upon a time"
    base, spec = engine(0), engine(2)
    n = 160

    def draws(eng, seeds):
        done = eng.generate_all([(str(s), prompt, sp(s)) for s in seeds])
        return [tuple(done[str(s)].outputs[0].token_ids) for s in seeds]

    same = list(range(24))
    assert draws(spec, same) == draws(base, same)            # same seeds: the same samples
    assert spec.stats().extra["spec_accepted_tokens_total"] > 0
    # independent seeds: the third token's distribution (after two tokens where drafts were
    # checked) by a two-sample chi-square test over the tokens both runs drew at least 5 times
    a = collections.Counter(t[2] for t in draws(spec, range(1000, 1000 + n)))
    b = collections.Counter(t[2] for t in draws(base, range(5000, 5000 + n)))
    common = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
    rest_a, rest_b = n - sum(a[t] for t in common), n - sum(b[t] for t in common)
    cells = [(a[t], b[t]) for t in common] + [(rest_a, rest_b)]
    chi2 = sum((x - y) ** 2 / (x + y) for x, y in cells if x + y)
    dof = len(cells) - 1
    # p < 0.001 would reject: the 0.999 quantile of chi-square(dof), Wilson-Hilferty
    z = 3.09
    crit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert dof >= 3 and chi2 < crit, (chi2, crit, cells)


def test_preemption_and_abort_roll_back():
    prompts = PROMPTS * 2
    want = generate(engine(0), prompts, GREEDY)
    # 8 blocks of 16 tokens for 8 sequences of ~40 tokens each: most of them wait or are preempted
    eng = engine(2, num_kv_blocks=12, block_size=16, max_model_len=64)
    assert generate(eng, prompts, GREEDY) == want
    assert eng.scheduler.num_preemptions > 0 and eng.stats().extra["spec_accepted_tokens_total"] > 0
    assert eng.block_manager.num_free_blocks == 12
    # an abort mid-stream: the others are unaffected, its blocks come back
    eng = engine(2)
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, GREEDY)
    for _ in range(6):
        eng.step()
    assert eng.abort_request("1")
    out = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
    assert sorted(out) == ["0", "2", "3"] and all(out[str(i)] == want[i] for i in (0, 2, 3))
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


@pytest.mark.parametrize("demand", [False, True])
def test_drafting_over_a_capped_expert_cache_is_resident(tmp_path, demand):
    """moet-tiny's W2 experts through the store, the device cache well below them (the MTP layer's
    experts included: drafting misses too): tokens and logprobs equal the resident engine's."""
    sp = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2)
    # a schedule the capped cache does not change: 48 slots hold 5 MoE layers x top_k 4 x 2 tokens
    kw = dict(expert_format="w2", fp4_gate=False, max_num_seqs=2, max_num_batched_tokens=2)
    want = generate(engine(2, **kw), PROMPTS[:2], sp, logprobs=True)
    eng = engine(2, pack_dir=str(tmp_path), expert_cache_slots=48, expert_demand_fetch=demand, **kw)
    got = generate(eng, PROMPTS[:2], sp, logprobs=True)
    assert got == want
    st = eng.stats().extra
    assert st["spec_accepted_tokens_total"] > 0 and st["expert_cache_slots"] == 48
    assert (st["expert_first_pass_misses_total"] > 0) != demand
    eng.close()


def test_bad_settings_name_the_flag(monkeypatch):
    import moet.model
    with pytest.raises(ConfigError, match="num_speculative_tokens=5"):
        EngineConfig(model="x", speculative_config='{"method": "mtp", "num_speculative_tokens": 5}')
    with pytest.raises(ConfigError, match="method 'ngram' is not supported"):
        EngineConfig(model="x", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="is not JSON"):
        EngineConfig(model="x", speculative_config="{mtp")
    monkeypatch.setattr(moet.model, "load_model", lambda *a, **k: pytest.fail("weights were read"))
    no_mtp = cached_checkpoint("qwen3_moe")
    with pytest.raises(ConfigError, match="has no MTP layer"):
        engine(2, model=no_mtp)
    with pytest.raises(ConfigError, match="--no-load-mtp"):
        engine(2, load_mtp=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (graph capture)")
@pytest.mark.parametrize("fmt", ["w2", "fp4"])
def test_verify_steps_replay_captured_graphs(fmt):
    """On CUDA the verify steps (every sequence with its k drafts) replay graphs captured per
    bucket; their greedy tokens equal eager verification's and their logprobs agree to rounding
    (an eager MoE may size its launch from host counts, a captured one from the worst case)."""
    kw = dict(device="cuda", expert_format=fmt, fp4_gate=False, max_num_seqs=4, max_model_len=256,
              kv_cache_memory_gb=0.05)
    graphs, eager = engine(2, **kw), engine(2, enforce_eager=True, **kw)
    assert sorted(graphs.runner.verify_graphs) == [(3, 1), (3, 2), (3, 4)], graphs.runner.spec_graphs
    assert eager.runner.verify_graphs == {}
    sp = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2)
    got, want = generate(graphs, PROMPTS, sp, logprobs=True), generate(eager, PROMPTS, sp, logprobs=True)
    assert [t for t, _ in got] == [t for t, _ in want]
    # W2's MoE kernels run the same tiles eager and captured; FP4's eager launch may pick another
    # kernel form from the host's token counts (another summation order of its bf16 products)
    tol = 1e-3 if fmt == "w2" else 1e-2
    diff = max(abs(pa[k] - pb[k]) for (_, a), (_, b) in zip(got, want) for pa, pb in zip(a, b) for k in pa)
    assert all(pa.keys() == pb.keys() for (_, a), (_, b) in zip(got, want) for pa, pb in zip(a, b))
    assert diff < tol, diff
    assert graphs.runner.spec_graphs[3].replays > 0
    assert sorted(graphs.runner.draft_graphs) == [(False, 1), (True, 1), (True, 3)] and not eager.runner.draft_graphs
    assert graphs.runner.draft_graphs[(True, 3)].replays > 0 and graphs.runner.draft_graphs[(False, 1)].replays > 0
