"""Next-token distributions of the code probe, and two expert formats compared from their top-K.

The engine returns, per prompt position, the actual token's logprob and rank plus the top-K
(SamplingParams(prompt_logprobs=K)), never the whole distribution: asking for all V entries would
build V Python objects per position. So the comparison of a format Q against the reference P
(bf16 experts) works from each side's top-K (TOP_K entries per position):

  top-1 agreement  P's and Q's most likely tokens are the same (exact from the top-K).
  KL(P || Q)       estimated on P's KL_TOP most likely tokens plus one bin for the rest of the
                   vocabulary:
                     sum_{i in top(P)} p_i log(p_i / q_i) + p_rest log(p_rest / q_rest)
                   with p_rest = 1 - sum p_i, q_rest = 1 - sum q_i. q_i comes from Q's top-K, which
                   is twice as long as P's list so that it almost always holds P's tokens; a token
                   it misses gets Q's K-th probability, an upper bound of its true q_i (`kl_bounded`
                   reports the share of such entries). With exact q_i this is the KL of the two
                   distributions merged into KL_TOP + 1 bins, which by the data-processing
                   inequality is at most the true KL: the estimate misses what differs inside the
                   tail, so it ranks formats but understates the KL of a flat distribution.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# The top-K every format keeps per position, and the reference's share of it that the KL sums
# over. Each position costs the engine K + 1 Python entries, so K stays small next to the
# forward pass; looking P's top KL_TOP up in Q's longer top-K leaves few q_i to bound (a
# token's rank moves a little between formats, rarely past twice its list).
TOP_K = 40
KL_TOP = TOP_K // 2

# q_rest's floor: a tail bin the candidate gives no mass (its top-K sums to 1 in float) would
# make the term infinite; this caps it.
_Q_REST_FLOOR = 1e-12


@dataclass
class CodeScores:
    """The code probe's per-position results for one model, positions of every sequence
    concatenated (position t of a sequence predicts its token t + 1)."""
    lp: np.ndarray              # float64 [N]: logprob of the actual next token
    top1: np.ndarray            # bool [N]: the actual next token ranked first
    top_ids: np.ndarray         # int64 [N, K]: the K most likely tokens, most likely first
    top_lp: np.ndarray          # float64 [N, K]: their logprobs
    mtp_hits: int | None = None  # MTP drafts (position t predicts t + 2) that were right; None: no MTP layer
    mtp_count: int = 0


def concat(parts: list[CodeScores]) -> CodeScores:
    k = parts[0].top_ids.shape[1] if parts else TOP_K
    mtp = [p.mtp_hits for p in parts]
    return CodeScores(
        np.concatenate([p.lp for p in parts]) if parts else np.zeros(0),
        np.concatenate([p.top1 for p in parts]) if parts else np.zeros(0, bool),
        np.concatenate([p.top_ids for p in parts]) if parts else np.zeros((0, k), np.int64),
        np.concatenate([p.top_lp for p in parts]) if parts else np.zeros((0, k)),
        None if not parts or any(h is None for h in mtp) else sum(mtp),
        sum(p.mtp_count for p in parts))


def topk_kl(p_ids: np.ndarray, p_lp: np.ndarray, q_ids: np.ndarray, q_lp: np.ndarray,
            chunk: int = 8192) -> tuple[np.ndarray, np.ndarray]:
    """Per position: the binned KL(P || Q) estimate of the module docstring over P's listed
    tokens, and how many of them were missing from Q's list (their q_i bounded). Inputs [N, Kp]
    and [N, Kq], logprobs sorted descending per row."""
    n = p_ids.shape[0]
    kl = np.zeros(n)
    bounded = np.zeros(n, np.int64)
    for a in range(0, n, chunk):
        pi, pl, qi, ql = p_ids[a:a + chunk], p_lp[a:a + chunk], q_ids[a:a + chunk], q_lp[a:a + chunk]
        match = pi[:, :, None] == qi[:, None, :]                        # [n, K(P), K(Q)]
        found = match.any(-1)
        q_found = np.where(match, ql[:, None, :], -np.inf).max(-1)      # Q's logprob of P's token, if in its top-K
        lq = np.where(found, q_found, ql[:, -1:])                       # else Q's K-th: an upper bound
        p = np.exp(pl)
        p_rest = np.clip(1.0 - p.sum(-1), 0.0, 1.0)
        q_rest = np.clip(1.0 - np.exp(lq).sum(-1), _Q_REST_FLOOR, 1.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            rest = np.where(p_rest > 0, p_rest * (np.log(p_rest) - np.log(q_rest)), 0.0)
        kl[a:a + chunk] = (p * (pl - lq)).sum(-1) + rest
        bounded[a:a + chunk] = (~found).sum(-1)
    return kl, bounded


def compare(ref: CodeScores, cand: CodeScores, ref_name: str) -> dict:
    """The candidate's top-1 agreement with the reference and the KL estimate, as code-probe
    fields named after the reference format (empty when the two scored different positions)."""
    if ref.top_ids.shape != cand.top_ids.shape or not len(ref.lp):
        return {}
    k = min(KL_TOP, ref.top_ids.shape[1])
    kl, bounded = topk_kl(ref.top_ids[:, :k], ref.top_lp[:, :k], cand.top_ids, cand.top_lp)
    return {f"top1_vs_{ref_name}": round(float((ref.top_ids[:, 0] == cand.top_ids[:, 0]).mean()), 4),
            f"kl_vs_{ref_name}": round(float(kl.mean()), 5),
            "kl_top": k,
            "kl_bounded": round(float(bounded.sum() / (k * len(kl))), 5)}


class FormatComparison:
    """Carries the reference format's code scores across formats in one probe run: the
    reference's code probe stores them, every later format's code probe compares with them."""

    def __init__(self, reference: str = "bf16"):
        self.reference = reference
        self.scores: CodeScores | None = None
