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
frequency and presence over the output) -> the structured-output grammar's mask (engine/
structured_output.py) -> argmax | temperature -> top_k -> top_p -> min_p -> draw. Logprobs are of the raw model distribution (log_softmax of the unprocessed logits),
vLLM's default; rank = 1 + number of tokens strictly more likely.

One row's failure is that row's alone: every per-row step (blocked ids, penalties, filters and
the draw in launch; logprobs in finish) is caught per row, the row's exception recorded
(LaunchedSample.failed, then SampleResult.failed and seq.error) and the other rows keep their
tokens, bit for bit (each of them reads only its own row). The engine then fails that request.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from moet.engine.sequence import Sequence
from moet.engine.structured_output import apply_bitmask, fill_bitmask
from moet.outputs import Logprob, PositionLogprobs


@dataclass
class SampleResult:
    token_ids: list[int]
    token_logprobs: list[float]          # raw logprob of each sampled token
    logprobs: list[PositionLogprobs | None]  # per sequence: sampled token + top-k (None if not asked)
    failed: dict[int, BaseException] = field(default_factory=dict)   # row -> why it has no token


def new_generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def position_logprobs(lp_row: torch.Tensor | None, actual: int, k: int, token_str=None,
                      top: tuple[list[float], list[int]] | None = None,
                      actual_lp_rank: tuple[float, int] | None = None) -> PositionLogprobs:
    """vLLM semantics: the actual token (with its rank) plus the top-k, actual first when it
    is not among them. `top` = precomputed (values, ids) of at least k entries; actual_lp_rank =
    the actual token's precomputed (logprob, rank): with both, lp_row is not read (no device access)."""
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
        if actual_lp_rank is not None:
            lp, rank = actual_lp_rank
        else:
            lp = float(lp_row[actual])
            rank = int((lp_row > lp_row[actual]).sum()) + 1
        out = {actual: Logprob(lp, rank, s(actual)), **out}
    return out


def device_ids(ids: list[int], device: torch.device) -> torch.Tensor:
    """A small host list as a device index tensor without a host sync: a pageable copy would
    first wait for everything queued on the stream (the step an async decode overlaps)."""
    t = torch.tensor(ids, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _to_host_async(t: torch.Tensor) -> torch.Tensor:
    """t's values on the host: an async copy into pinned memory on a GPU (read after the
    sample's event), t itself on the CPU."""
    if not t.is_cuda:
        return t
    h = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    h.copy_(t, non_blocking=True)
    return h


@dataclass
class LaunchedSample:
    """Sampler.launch's result: the sampled ids on the device (`tok`: a later step may read them
    there) and host copies of what finish() needs, complete once `event` has passed."""
    tok: torch.Tensor
    tok_host: torch.Tensor
    lp_host: torch.Tensor
    rank_host: torch.Tensor | None
    top_host: tuple[torch.Tensor, torch.Tensor] | None
    event: torch.cuda.Event | None
    failed: dict[int, BaseException] = field(default_factory=dict)   # row -> its per-row edit's exception


class Sampler:
    def __init__(self, eos_token_ids: set[int]):
        self.eos_token_ids = set(eos_token_ids)

    def _blocked(self, seq: Sequence, vocab: int) -> list[int]:
        """Tokens that may not be sampled yet (EOS and stop ids before min_tokens). Only ids in
        [0, vocab): one outside can never be sampled, so blocking it is nothing, and as an index
        it would fail the row (on a GPU a device-side assert that ends every request)."""
        sp = seq.params
        if seq.num_output_tokens >= sp.min_tokens:
            return []
        ids = set(sp.stop_token_ids or []) | (set() if sp.ignore_eos else self.eos_token_ids)
        return sorted(t for t in ids if 0 <= t < vocab)

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
        return self.finish(self.launch(logits, seqs), seqs, token_str)

    def launch(self, logits: torch.Tensor, seqs: list[Sequence]) -> LaunchedSample:
        """Everything on the device, no host sync: the ids, their raw logprobs and ranks and the
        top-k that the sequences asking for logprobs need, copied to the host asynchronously."""
        logits = logits.float()
        raw_lp = torch.log_softmax(logits, dim=-1)
        proc = logits
        edited = False
        failed: dict[int, BaseException] = {}
        for b, seq in enumerate(seqs):                      # rare per-row edits first
            try:
                blocked = self._blocked(seq, logits.shape[-1])
                if not blocked and not seq.params.has_penalties:
                    continue
                if not edited:
                    proc, edited = logits.clone(), True
                if blocked:
                    proc[b, device_ids(blocked, proc.device)] = -math.inf
                if seq.params.has_penalties:
                    self._penalize(proc[b], seq)
            except Exception as exc:                        # this row only (module doc)
                failed[b] = exc
        constrained = [b for b, seq in enumerate(seqs) if seq.grammar is not None and b not in failed]
        if constrained:
            if not edited:
                proc, edited = logits.clone(), True
            try:
                mask, dead = fill_bitmask([seqs[b].grammar for b in constrained], seqs[constrained[0]].grammar.words)
                apply_bitmask(proc, constrained, mask)
            except Exception as exc:                        # the rows with a grammar only
                failed.update((b, exc) for b in constrained)
            else:
                for i in dead:                              # the engine finishes them (DEAD_END)
                    seqs[constrained[i]].grammar.dead_end = True
        tok = torch.argmax(proc, dim=-1)                    # greedy rows keep this
        for b, seq in enumerate(seqs):
            sp = seq.params
            if sp.temperature == 0 or b in failed or (seq.grammar is not None and seq.grammar.dead_end):
                continue
            try:
                probs = self._filter(proc[b] / sp.temperature, sp.top_k, sp.top_p, sp.min_p)
                noise = torch.empty_like(probs).exponential_(generator=seq.generator)
                tok[b] = torch.argmax(probs / noise)
            except Exception as exc:
                failed[b] = exc
        tok_lp = raw_lp.gather(1, tok[:, None])[:, 0]
        kmax = max((s.params.logprobs for s in seqs if s.params.logprobs is not None), default=None)
        rank = top = None
        if kmax is not None:
            rank = (raw_lp > tok_lp[:, None]).sum(-1) + 1        # 1 + tokens strictly more likely
            if kmax:
                t = torch.topk(raw_lp, min(kmax, raw_lp.shape[-1]), dim=-1)
                top = (_to_host_async(t.values), _to_host_async(t.indices))
        out = LaunchedSample(tok, _to_host_async(tok), _to_host_async(tok_lp),
                             _to_host_async(rank) if rank is not None else None, top, None, failed)
        if tok.is_cuda:
            out.event = torch.cuda.Event()
            out.event.record()
        return out

    @staticmethod
    def finish(sample: LaunchedSample, seqs: list[Sequence], token_str=None) -> SampleResult:
        """The host side of a launched sample: waits for its copies only (not for later work).
        A failed row's sequence gets seq.error: the engine fails it when it reads the token."""
        if sample.event is not None:
            sample.event.synchronize()
        tokens, tok_lp = sample.tok_host.tolist(), sample.lp_host.tolist()
        lps: list[PositionLogprobs | None] = [None] * len(seqs)
        failed = dict(sample.failed)
        if sample.rank_host is not None:
            ranks = sample.rank_host.tolist()
            vals = sample.top_host[0].tolist() if sample.top_host is not None else None
            ids = sample.top_host[1].tolist() if sample.top_host is not None else None
            for b, seq in enumerate(seqs):
                k = seq.params.logprobs
                if k is not None and b not in failed:
                    try:
                        lps[b] = position_logprobs(None, tokens[b], min(k, len(vals[b]) if vals else 0), token_str,
                                                   (vals[b], ids[b]) if vals is not None else None,
                                                   (tok_lp[b], ranks[b]))
                    except Exception as exc:
                        failed[b] = exc
        for b, exc in failed.items():
            seqs[b].error = exc
        return SampleResult(tokens, tok_lp, lps, failed)
