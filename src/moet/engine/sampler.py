"""Sampler: next tokens for a batch of sequences, each with its own SamplingParams.

Deterministic by construction:
  * greedy (temperature 0) is the exact argmax of the (penalized) float32 logits; ties go to
    the lowest id (torch.argmax);
  * a random draw is an exponential race, argmax(p / E) with E ~ Exp(1) drawn from the
    SEQUENCE's own generator (seeded from SamplingParams.seed + index, or from the engine's
    seeded stream when the request has none). It is an exact categorical draw (the Gumbel-max
    trick in disguise) whose noise depends on nothing else in the batch, so the same seed gives
    the same tokens alone or among 63 other requests.
Order (vLLM's): min_tokens blocks EOS / stop ids -> penalties (repetition over prompt + output,
frequency and presence over the output) -> argmax | temperature -> top_k -> top_p -> min_p ->
draw. Logprobs are of the raw model distribution (log_softmax of the unprocessed logits),
vLLM's default; rank = 1 + number of tokens strictly more likely.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moet.engine.sequence import Sequence
from moet.outputs import Logprob, PositionLogprobs


@dataclass
class SampleResult:
    token_ids: list[int]
    token_logprobs: list[float]          # raw logprob of each sampled token
    logprobs: list[PositionLogprobs | None]  # per sequence: sampled token + top-k (None if not asked)


def new_generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def position_logprobs(lp_row: torch.Tensor, actual: int, k: int, token_str=None,
                      top: tuple[list[float], list[int]] | None = None) -> PositionLogprobs:
    """vLLM semantics: the actual token (with its rank) plus the top-k, actual first when it
    is not among them. `top` = precomputed (values, ids) of at least k entries."""
    out: PositionLogprobs = {}
    s = token_str or (lambda t: None)
    if k:
        if top is None:
            vals, ids = torch.topk(lp_row, k)
            vals, ids = vals.tolist(), ids.tolist()
        else:
            vals, ids = top[0][:k], top[1][:k]
        for r, (v, i) in enumerate(zip(vals, ids)):
            out[i] = Logprob(v, r + 1, s(i))
    if actual not in out:
        lp = lp_row[actual]
        rank = int((lp_row > lp).sum()) + 1
        out = {actual: Logprob(float(lp), rank, s(actual)), **out}
    return out


class Sampler:
    def __init__(self, eos_token_ids: set[int]):
        self.eos_token_ids = set(eos_token_ids)

    def _blocked(self, seq: Sequence) -> list[int]:
        """Tokens that may not be sampled yet (EOS and stop ids before min_tokens)."""
        sp = seq.params
        if seq.num_output_tokens >= sp.min_tokens:
            return []
        ids = set(sp.stop_token_ids or []) | (set() if sp.ignore_eos else self.eos_token_ids)
        return sorted(ids)

    @staticmethod
    def _penalize(logits: torch.Tensor, seq: Sequence) -> None:
        """In place on one row (float32 [V]); vLLM's rules."""
        sp = seq.params
        v = logits.shape[-1]
        dev = logits.device
        out_ids = torch.tensor([t for t in seq.output_token_ids if t < v], dtype=torch.long, device=dev)
        if sp.repetition_penalty != 1.0:
            seen = torch.zeros(v, dtype=torch.bool, device=dev)
            seen[torch.tensor([t for t in seq.token_ids if t < v], dtype=torch.long, device=dev)] = True
            pen = torch.where(logits > 0, logits / sp.repetition_penalty, logits * sp.repetition_penalty)
            logits.copy_(torch.where(seen, pen, logits))
        if sp.frequency_penalty or sp.presence_penalty:
            counts = torch.zeros(v, dtype=torch.float32, device=dev)
            counts.index_add_(0, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
            logits -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).float()

    @staticmethod
    def _filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
        """Temperature-scaled row [V] -> probabilities with top_k / top_p / min_p applied."""
        if top_k <= 0 and top_p >= 1.0 and min_p <= 0.0:
            return torch.softmax(logits, dim=-1)
        sorted_l, order = torch.sort(logits, descending=True)
        if 0 < top_k < sorted_l.numel():
            sorted_l[top_k:] = -math.inf
        p = torch.softmax(sorted_l, dim=-1)
        drop = torch.zeros_like(p, dtype=torch.bool)
        if top_p < 1.0:
            drop |= (torch.cumsum(p, 0) - p) >= top_p       # keep the smallest prefix reaching top_p
        if min_p > 0.0:
            drop |= p < min_p * p[0]
        drop[0] = False                                    # the top token always survives
        sorted_l = sorted_l.masked_fill(drop, -math.inf)
        probs = torch.empty_like(p)
        probs[order] = torch.softmax(sorted_l, dim=-1)
        return probs

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], token_str=None) -> SampleResult:
        """logits [B, V] (any float dtype), one row per sequence, in order. One host sync."""
        logits = logits.float()
        raw_lp = torch.log_softmax(logits, dim=-1)
        proc = logits
        edited = False
        for b, seq in enumerate(seqs):                      # rare per-row edits first
            blocked = self._blocked(seq)
            if not blocked and not seq.params.has_penalties:
                continue
            if not edited:
                proc, edited = logits.clone(), True
            if blocked:
                proc[b, torch.tensor(blocked, dtype=torch.long, device=proc.device)] = -math.inf
            if seq.params.has_penalties:
                self._penalize(proc[b], seq)
        tok = torch.argmax(proc, dim=-1)                    # greedy rows keep this
        for b, seq in enumerate(seqs):
            sp = seq.params
            if sp.temperature == 0:
                continue
            probs = self._filter(proc[b] / sp.temperature, sp.top_k, sp.top_p, sp.min_p)
            noise = torch.empty_like(probs).exponential_(generator=seq.generator)
            tok[b] = torch.argmax(probs / noise)
        tok_lp = raw_lp.gather(1, tok[:, None])[:, 0]
        kmax = max((s.params.logprobs for s in seqs if s.params.logprobs is not None), default=None)
        top = torch.topk(raw_lp, min(kmax, raw_lp.shape[-1]), dim=-1) if kmax else None
        tokens, tok_lp = tok.tolist(), tok_lp.tolist()
        lps: list[PositionLogprobs | None] = [None] * len(seqs)
        if kmax is not None:
            vals = top.values.tolist() if top is not None else None
            ids = top.indices.tolist() if top is not None else None
            for b, seq in enumerate(seqs):
                k = seq.params.logprobs
                if k is not None:
                    lps[b] = position_logprobs(raw_lp[b], tokens[b], min(k, raw_lp.shape[-1]), token_str,
                                               (vals[b], ids[b]) if top is not None else None)
        return SampleResult(tokens, tok_lp, lps)
