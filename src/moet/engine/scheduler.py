"""Scheduler: which sequences run in the next step, and how many new tokens each computes.

One token budget per step (max_num_batched_tokens) shared by decodes and prefills, vLLM V1's
shape: every sequence simply has `num_tokens - num_computed_tokens` tokens still to compute,
1 for a decode, many for a (chunked) prefill, so a step can mix both.
  1. RUNNING sequences, oldest first, each gets min(its remaining tokens, budget left). When
     the pool cannot give one of them the block it needs, the newest running sequence is
     preempted (blocks freed, back to the front of WAITING, recomputed later) until it can.
  2. If nothing was preempted, WAITING sequences are admitted in arrival order while there
     are seats (max_num_seqs), budget and blocks, reusing prefix-cache hits. Without chunked
     prefill a prompt must fit the budget whole; with it the first one that does not fit
     takes the rest of the budget and continues next step.
The step's list is ordered decodes first (AttentionBatch's convention). Aborting frees a
sequence's blocks at once. No device or rank appears here (see block_manager.py).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from moet.engine.block_manager import BlockManager
from moet.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def context_len(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this step computes the sequence's last known token: its logits give the next."""
        return self.seq.num_computed_tokens + self.num_new_tokens >= self.seq.num_tokens

    @property
    def num_drafts(self) -> int:
        """Speculative drafts this step computes after the last known token (engine/speculative.py)."""
        return max(0, self.seq.num_computed_tokens + self.num_new_tokens - self.seq.num_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queues

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Remove a running or waiting sequence for good and free its blocks now."""
        assert status.finished
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return                                 # already finished
        self.bm.free_seq(seq)
        seq.status = status

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free_seq(seq)                      # recompute: nothing is kept but the tokens
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = seq.num_tokens - seq.num_computed_tokens
            # a decoding sequence's drafts ride along (speculative decoding); as many as the budget takes
            drafts = seq.spec_token_ids if remaining == 1 else []
            n = min(remaining + len(drafts), budget)
            if n < remaining + len(drafts):
                seq.spec_token_ids = drafts[:max(0, n - remaining)]
            need = self.bm.new_blocks_needed(seq, seq.num_computed_tokens + n)
            while need > self.bm.num_free_blocks:
                victim = self.running.pop()        # the newest: least work lost
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break                              # seq itself was preempted: everything after it too
            self.bm.allocate(seq, seq.num_computed_tokens + n)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1

        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                cached = self.bm.lookup_prefix(seq)
                start = len(cached) * self.bm.block_size
                remaining = seq.num_tokens - start
                n = min(remaining, budget)
                if n < remaining and (not self.enable_chunked_prefill):
                    break
                new_blocks = self.bm.blocks_for(start + n) - len(cached)
                if self.bm.admission_cost(cached, new_blocks) > self.bm.num_free_blocks:
                    break
                self.waiting.popleft()
                self.bm.allocate_prefix(seq, cached)
                self.bm.allocate(seq, start + n)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n

        out.scheduled.sort(key=lambda s: s.num_new_tokens != 1)   # decodes first, stable
        for s in out.scheduled:            # drafts the step does not compute are dropped
            if len(s.seq.spec_token_ids) > s.num_drafts:
                s.seq.spec_token_ids = s.seq.spec_token_ids[:s.num_drafts]
        return out
