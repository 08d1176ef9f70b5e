"""AsyncDecode: pure decode steps launched one step ahead of the host
(EngineConfig.scheduler.async_scheduling).

Why: a synchronous step ends with the host waiting for the sampled ids (the step's only sync),
then updating the scheduler, detokenizing, checking stops and building the next batch while
the GPU idles: several percent of a GLM-4.5-Air single-stream step on the H200 (docs/perf.md).
vLLM's async scheduling and SGLang's overlap scheduler hide it the same way:

    step N+1 (a call of LLMEngine.step):
      schedule()            every running sequence got a placeholder token at step N, so each
                            is scheduled for exactly one token, at the placeholder's position
      forward + sample      the input ids are step N's samples, still on the device
      resolve step N        only now wait for step N's ids (their copy, not step N+1), replace
                            the placeholders, run the stop checks / detokenizer / outputs: this
                            host work overlaps step N+1 on the GPU
      placeholders          each sequence still running gets one for step N+1's sample

A sequence that finished at step N on a stop token or string was computed once more in step
N+1 (one that reaches its length limit is seen coming: the pending step is read first); that row is dropped (it
only wrote KV into blocks it has just freed, and stream order puts any later owner's writes
after it). Prefix-cache hashes are taken after the resolve, so a block is never hashed with a
placeholder in it. Before anything else happens -- a request waiting or admitted, n > 1 siblings
to release, a possible preemption, the set of running sequences changed -- the pending step is
resolved synchronously and the step runs as before, so scheduling decisions never see a
placeholder. Not pipelined: steps with prefill rows, sequences with penalties or a structured-
output grammar (they need the previous token on the host), prompt logprobs, and engines with
the expert store (its replays).
Tokens, logprobs and sampling draws are those of the synchronous engine, step for step: the
device runs the same work in the same order; what differs is the extra row a sequence that
stopped on a stop token or string adds to the step after it, so batch-variant kernels may move
other rows' last bits there (a logprob's 1e-5 on the CPU test model). An aborted request's
last output can be one token behind the synchronous engine's (its newest token was not read).
"""
from __future__ import annotations

import weakref

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moet.engine.sampler import LaunchedSample, device_ids
from moet.engine.scheduler import SchedulerOutput
from moet.engine.sequence import Sequence

if TYPE_CHECKING:
    from moet.engine.llm_engine import LLMEngine, Request

PLACEHOLDER = -1          # the token id a sequence carries while its sample is on the device


@dataclass
class PendingStep:
    seqs: list[Sequence]      # the rows of `sample`, in order
    keep: list[bool]          # False: the row is dropped (its sequence finished the step before)
    sample: LaunchedSample


def eligible_seq(seq: Sequence) -> bool:
    return not seq.params.has_penalties and not seq.needs_prompt_logprobs and seq.grammar is None


class AsyncDecode:
    def __init__(self, engine: "LLMEngine"):
        # A weak reference: the engine owns this object, and a cycle back to it would keep the
        # model's device memory alive after the last `del engine` until a gc pass (the server
        # bench's next phase, a new process, then found the GPU full).
        self._engine = weakref.ref(engine)
        self.pending: PendingStep | None = None
        self.num_pipelined_steps = 0          # steps launched before the previous one was read
        self.num_sync_resolves = 0            # pending steps read before scheduling (the pipeline broke)

    @property
    def engine(self) -> "LLMEngine":
        e = self._engine()
        if e is None:
            raise RuntimeError("AsyncDecode: its engine is gone")
        return e

    def live(self) -> list[Sequence]:
        p = self.pending
        return [] if p is None else [s for s, k in zip(p.seqs, p.keep) if k and s.pending_token and not s.is_finished]

    def can_continue(self) -> bool:
        """The next schedule() gives exactly the pending sequences one token each, with no
        admission, release or preemption: the step may be launched before resolving."""
        e, live = self.engine, self.live()
        sch = e.scheduler
        if not live or sch.waiting or any(r.pending for r in e.requests.values()):
            return False
        if len(live) != len(sch.running) or {id(s) for s in live} != {id(s) for s in sch.running}:
            return False
        if len(live) > sch.max_num_batched_tokens:
            return False
        # a sequence whose pending token is its last (max_tokens / max_model_len) would be computed
        # once more for nothing and change the next step's batch: read it first, as the synchronous
        # engine does (only stop tokens and stop strings, which nobody can see coming, add a row)
        if any(s.num_output_tokens >= s.max_new_tokens for s in live):
            return False
        bm = e.block_manager
        return sum(bm.new_blocks_needed(s, s.num_computed_tokens + 1) for s in live) <= bm.num_free_blocks

    def before_schedule(self, touched: dict[str, "Request"]) -> None:
        """Read the pending step now (synchronously) unless the next step can be launched over it:
        scheduling must see real tokens."""
        if self.pending is not None and not self.can_continue():
            self.num_sync_resolves += 1
            self.resolve(touched)

    def eligible_step(self, sched: SchedulerOutput) -> bool:
        # the confidence gate reads each step's logits on the host before it samples
        if self.engine.residency is not None or self.engine.gate is not None or sched.preempted or not sched.scheduled:
            return False
        return all(s.num_new_tokens == 1 and s.samples and eligible_seq(s.seq) for s in sched.scheduled)

    def resolve(self, touched: dict[str, "Request"]) -> None:
        """Step N's samples to the host: placeholders replaced, stop checks, outputs touched."""
        p, self.pending = self.pending, None
        if p is None:
            return
        e = self.engine
        res = e.sampler.finish(p.sample, p.seqs, e._token_str)
        for seq, keep, tok, lp, lps in zip(p.seqs, p.keep, res.token_ids, res.token_logprobs, res.logprobs):
            if not keep or not seq.pending_token or seq.is_finished:   # dropped, or aborted since
                continue
            seq.token_ids[-1] = tok
            seq.pending_token = False
            e._after_token(seq, tok, lp, lps)
            e._stats.generation_tokens_total += 1
            req = e.requests.get(seq.request_id)
            if req is not None:
                touched[seq.request_id] = req

    def run(self, sched: SchedulerOutput, touched: dict[str, "Request"]) -> None:
        """One pipelined decode step (module doc); sched is eligible_step."""
        e, prev = self.engine, self.pending
        seqs = [s.seq for s in sched.scheduled]
        ids = None
        if prev is not None:
            self.num_pipelined_steps += 1
            if not all(s.pending_token for s in seqs):
                raise AssertionError("async decode: a scheduled sequence has no pending token")
            row = {id(s): i for i, (s, k) in enumerate(zip(prev.seqs, prev.keep)) if k}
            idx = [row[id(s)] for s in seqs]
            tok = prev.sample.tok
            ids = tok if idx == list(range(tok.shape[0])) else tok[device_ids(idx, tok.device)]
        elif any(s.pending_token for s in seqs):
            raise AssertionError("async decode: pending tokens without a pending step")
        ids, batch = e.runner.build_batch(sched, ids)
        hidden = e.runner.forward(ids, batch)
        logits = e.runner.logits(hidden[batch.logits_indices])
        launched = e.sampler.launch(logits, seqs)
        for s in seqs:
            s.num_computed_tokens += 1
        self.resolve(touched)                       # overlaps this step on the device
        keep = []
        for s in seqs:
            if s.is_finished:                       # finished by the token just resolved: drop its row
                keep.append(False)
                continue
            e.block_manager.commit_full_blocks(s)    # every computed token is known now
            s.token_ids.append(PLACEHOLDER)
            s.pending_token = True
            keep.append(True)
        self.pending = PendingStep(seqs, keep, launched) if any(keep) else None   # all finished: nothing to read

    def forget(self, seq: Sequence) -> None:
        """An aborted sequence drops its placeholder (its outputs never show one)."""
        if seq.pending_token:
            seq.token_ids.pop()
            seq.pending_token = False
