"""moet.probe.distributions: the top-K KL estimate against the exact KL of full distributions, the
comparison fields, and the engine's prompt-logprob dicts turned into score arrays; plus the CLI's
format list. No model: synthetic distributions."""
from __future__ import annotations

import numpy as np
import pytest

from moet.errors import ConfigError
from moet.outputs import Logprob
from moet.probe.distributions import KL_TOP, TOP_K, CodeScores, compare, topk_kl


def _dists(seed: int, n: int = 64, v: int = 50, noise: float = 0.5):
    rng = np.random.default_rng(seed)
    a = rng.normal(0, 2.0, (n, v))
    b = a + rng.normal(0, noise, (n, v))
    lp = a - np.logaddexp.reduce(a, axis=1, keepdims=True)
    lq = b - np.logaddexp.reduce(b, axis=1, keepdims=True)
    return lp, lq


def _top(l: np.ndarray, k: int):
    ids = np.argsort(-l, axis=1, kind="stable")[:, :k]
    return ids, np.take_along_axis(l, ids, 1)


def _exact(lp, lq):
    return (np.exp(lp) * (lp - lq)).sum(1)


def _binned(lp, lq, ids):
    """KL of P and Q merged into bins: each token of ids (per row), and the rest."""
    p, q = np.take_along_axis(np.exp(lp), ids, 1), np.take_along_axis(np.exp(lq), ids, 1)
    pr, qr = 1 - p.sum(1), 1 - q.sum(1)
    return (p * np.log(p / q)).sum(1) + pr * np.log(pr / qr)


def test_full_lists_give_the_exact_kl():
    lp, lq = _dists(0)
    kl, bounded = topk_kl(*_top(lp, 50), *_top(lq, 50))
    np.testing.assert_allclose(kl, _exact(lp, lq), rtol=1e-9, atol=1e-12)
    assert (bounded == 0).all()


def test_top_k_estimate_is_the_binned_kl_and_below_the_exact_one():
    lp, lq = _dists(1)
    p_ids, p_lp = _top(lp, 10)
    q_ids, q_lp = _top(lq, 20)
    kl, bounded = topk_kl(p_ids, p_lp, q_ids, q_lp)
    covered = bounded == 0
    assert covered.mean() > 0.5
    np.testing.assert_allclose(kl[covered], _binned(lp, lq, p_ids)[covered], rtol=1e-9)
    assert (kl[covered] <= _exact(lp, lq)[covered] + 1e-12).all()
    assert kl.mean() > 0.3 * _exact(lp, lq).mean()


def test_a_token_missing_from_the_candidate_list_gets_its_last_probability():
    lp, lq = _dists(2, n=1, v=8)
    p_ids, p_lp = _top(lp, 3)
    q_ids, q_lp = _top(lq, 3)
    q_ids[0] = [i for i in range(8) if i not in p_ids[0]][:3]     # none of P's tokens in Q's list
    kl, bounded = topk_kl(p_ids, p_lp, q_ids, q_lp)
    assert bounded[0] == 3
    p = np.exp(p_lp[0])
    pr, qr = 1 - p.sum(), 1 - 3 * np.exp(q_lp[0, -1])
    assert kl[0] == pytest.approx((p * (p_lp[0] - q_lp[0, -1])).sum() + pr * np.log(pr / qr), rel=1e-12)


def _scores(l, k=TOP_K):
    ids, lps = _top(l, k)
    return CodeScores(lps[:, 0], np.ones(len(l), bool), ids, lps)


def test_compare_fields():
    lp, lq = _dists(3)
    same = compare(_scores(lp), _scores(lp), "bf16")
    assert same["top1_vs_bf16"] == 1.0 and same["kl_vs_bf16"] == 0.0 and same["kl_bounded"] == 0.0
    assert same["kl_top"] == KL_TOP
    far = compare(_scores(lp), _scores(lq), "bf16")
    assert far["top1_vs_bf16"] == round(float((lp.argmax(1) == lq.argmax(1)).mean()), 4) < 1
    kl, _ = topk_kl(*_top(lp, KL_TOP), *_top(lq, TOP_K))
    assert far["kl_vs_bf16"] == round(float(kl.mean()), 5) > 0
    assert compare(_scores(lp), _scores(lq[:10]), "bf16") == {}       # different positions: nothing


def test_prompt_logprobs_to_arrays():
    from moet.probe.engine import _from_prompt_logprobs
    ids = [5, 3, 9]
    plps = [None,
            {3: Logprob(-0.1, 1), 4: Logprob(-2.5, 2)},                     # actual among the top-2
            {9: Logprob(-4.0, 7), 1: Logprob(-0.3, 1), 2: Logprob(-1.9, 2)}]  # actual listed first, outside
    sc = _from_prompt_logprobs(ids, plps, 2)
    assert sc.lp.tolist() == [-0.1, -4.0] and sc.top1.tolist() == [True, False]
    assert sc.top_ids.tolist() == [[3, 4], [1, 2]] and sc.top_lp.tolist() == [[-0.1, -2.5], [-0.3, -1.9]]


def test_cli_formats():
    from moet.probe.cli import formats
    assert formats(None) == ["nvfp4"]
    assert formats(["w2", "fp4", "nvfp4"]) == ["w2", "nvfp4"]
    assert formats(["w2", "bf16"]) == ["bf16", "w2"]                  # bf16 first: the others compare with it
    assert formats(["all"]) == ["bf16", "nvfp4", "w2", "w2+gate@0.95", "w2+gate@0.96", "w2+gate@0.97",
                                "w2+gate@0.99"]
    assert formats(["w2+gate", "w2"], [0.5, 0.99]) == ["w2+gate@0.5", "w2+gate@0.99", "w2"]
    with pytest.raises(ConfigError, match="--gate-tau 1.5"):
        formats(["w2+gate"], [1.5])
