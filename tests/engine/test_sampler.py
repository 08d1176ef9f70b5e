"""The batched sampler against independent definitions: greedy = argmax, the exponential race
draws from softmax(logits / T) restricted to the top_k / top_p / min_p set, penalties follow
vLLM's formulas, seeds make draws reproducible and independent of the rest of the batch."""
import math

import pytest
import torch

from moet.engine.sampler import Sampler, new_generator
from moet.engine.sequence import Sequence
from moet.errors import ConfigError
from moet.sampling_params import SamplingParams

CPU = torch.device("cpu")
EOS = 7


def seq(sp, prompt=(1, 2, 3), out=(), seed=0, sid=0):
    s = Sequence(sid, str(sid), 0, list(prompt), sp, 100)
    s.token_ids += list(out)
    s.generator = new_generator(seed, CPU)
    return s


def test_greedy_is_exact_argmax_with_lowest_id_on_ties():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1
    sp = SamplingParams(temperature=0.0)
    res = Sampler({EOS})(logits, [seq(sp, sid=i) for i in range(5)])
    assert res.token_ids[:3] + res.token_ids[4:] == [int(logits[i].argmax()) for i in (0, 1, 2, 4)]
    assert res.token_ids[3] == 10
    lp = torch.log_softmax(logits, -1)
    assert res.token_logprobs == pytest.approx([lp[i, t].item() for i, t in enumerate(res.token_ids)], abs=0)


def _reference_keep(logits, t, top_k, top_p, min_p):
    """Independent definition of the kept set and its probabilities (python floats)."""
    z = [x / t for x in logits.tolist()]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    if top_k > 0:
        order = order[:top_k]
    m = max(z[i] for i in order)
    e = {i: math.exp(z[i] - m) for i in order}
    tot = sum(e.values())
    p = {i: e[i] / tot for i in order}
    kept, cum = [], 0.0
    for i in order:
        if top_p < 1.0 and cum >= top_p:
            break
        kept.append(i)
        cum += p[i]
    pmax = p[order[0]]
    kept = [i for i in kept if p[i] >= min_p * pmax]
    tot = sum(p[i] for i in kept)
    return {i: p[i] / tot for i in kept}


@pytest.mark.parametrize("t,top_k,top_p,min_p", [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0),
                                                 (1.0, 0, 1.0, 0.1), (0.9, 6, 0.9, 0.05)])
def test_draws_follow_the_filtered_distribution(t, top_k, top_p, min_p):
    torch.manual_seed(1)
    logits = torch.randn(12) * 1.5
    sp = SamplingParams(temperature=t, top_k=top_k, top_p=top_p, min_p=min_p)
    n = 3000
    seqs = [seq(sp, seed=1000 + i, sid=i) for i in range(n)]     # one draw from each of n generators
    res = Sampler({EOS})(logits.expand(n, -1), seqs)
    want = _reference_keep(logits, t, top_k, top_p, min_p)
    counts = torch.bincount(torch.tensor(res.token_ids), minlength=12).tolist()
    assert {i for i, c in enumerate(counts) if c} <= set(want)      # nothing outside the kept set
    for i, p in want.items():
        sd = math.sqrt(p * (1 - p) / n)
        assert abs(counts[i] / n - p) < 5 * sd + 1e-3, (i, counts[i] / n, p)


def test_seed_reproducible_and_independent_of_the_batch():
    torch.manual_seed(2)
    logits = torch.randn(4, 40)
    sp = SamplingParams(temperature=1.0, top_p=0.95)
    alone = [Sampler(set())(logits[2:3], [seq(sp, seed=42)]).token_ids[0] for _ in range(2)]
    batch = Sampler(set())(logits, [seq(sp, seed=s, sid=i) for i, s in enumerate([5, 6, 42, 7])]).token_ids[2]
    assert alone[0] == alone[1] == batch
    # a generator advances: successive draws of one sequence are not all equal
    s = seq(sp, seed=3)
    draws = {Sampler(set())(logits[:1], [s]).token_ids[0] for _ in range(30)}
    assert len(draws) > 1


def test_penalties_follow_vllm_formulas():
    torch.manual_seed(3)
    logits = torch.randn(30) * 2
    prompt, out = [1, 4, 9], [4, 4, 12, 20]
    sp = SamplingParams(temperature=0.0, repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=0.9)
    want = logits.tolist()
    for i in set(prompt + out):
        want[i] = want[i] / 1.7 if want[i] > 0 else want[i] * 1.7
    for i in set(out):
        want[i] -= 0.6 * out.count(i) + 0.9
    res = Sampler(set())(logits[None], [seq(sp, prompt, out)])
    assert res.token_ids[0] == max(range(30), key=lambda i: want[i])
    # construct a case where the penalty changes the winner
    lg = torch.zeros(30)
    lg[5], lg[6] = 3.0, 2.0
    assert Sampler(set())(lg[None], [seq(SamplingParams(temperature=0.0), [5], [])]).token_ids[0] == 5
    pen = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert Sampler(set())(lg[None], [seq(pen, [5], [])]).token_ids[0] == 6
    pres = SamplingParams(temperature=0.0, presence_penalty=1.5)
    assert Sampler(set())(lg[None], [seq(pres, [1], [5])]).token_ids[0] == 6
    assert Sampler(set())(lg[None], [seq(pres, [5], [])]).token_ids[0] == 5     # presence: output only


def test_min_tokens_blocks_eos_and_logprobs_report_rank():
    lg = torch.zeros(20)
    lg[EOS], lg[3] = 5.0, 4.0
    sp = SamplingParams(temperature=0.0, min_tokens=2, logprobs=1)
    s = seq(sp)
    res = Sampler({EOS})(lg[None], [s], token_str=lambda t: f"<{t}>")
    assert res.token_ids == [3]
    d = res.logprobs[0]
    assert list(d) == [3, EOS] and d[3].rank == 2 and d[EOS].rank == 1 and d[3].decoded_token == "<3>"
    lp = torch.log_softmax(lg, -1)
    assert d[3].logprob == pytest.approx(lp[3].item(), abs=1e-7) and d[EOS].logprob == pytest.approx(lp[EOS].item())
    s.token_ids += [3, 3]                      # min_tokens reached: EOS allowed again
    assert Sampler({EOS})(lg[None], [s]).token_ids == [EOS]


@pytest.mark.parametrize("kw", [dict(n=0), dict(top_k=-2), dict(min_p=1.5), dict(repetition_penalty=0.0),
                                dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(min_tokens=5, max_tokens=2),
                                dict(stop=[""]), dict(top_p=0.0), dict(temperature=-1)])
def test_invalid_params_raise_config_error(kw):
    with pytest.raises(ConfigError):
        SamplingParams(**kw)
