"""Sequence: one completion being generated (a request with n > 1 owns n of them) and its status.

A sequence is its token ids (prompt, then output) plus how many of them already have K/V in
the paged cache (`num_computed_tokens`) and the pages that hold them (`block_table`). The
scheduler moves it WAITING -> RUNNING -> FINISHED_*; preemption by recompute sends it back to
WAITING with no blocks and num_computed_tokens = 0 (its prompt and output so far are prefilled
again later, from the prefix cache where the blocks survived).
"""
from __future__ import annotations

from enum import Enum, auto
from typing import Any

from moet.outputs import PositionLogprobs
from moet.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED_STOPPED = auto()    # EOS, a stop token or a stop string
    FINISHED_LENGTH = auto()     # max_tokens or max_model_len
    FINISHED_ABORTED = auto()
    FINISHED_FAILED = auto()     # a fault inside the engine in this request's own work (vLLM's "error")

    @property
    def finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED,
                        SequenceStatus.FINISHED_FAILED)


FINISH_REASONS = {SequenceStatus.FINISHED_STOPPED: "stop", SequenceStatus.FINISHED_LENGTH: "length",
                  SequenceStatus.FINISHED_ABORTED: "abort", SequenceStatus.FINISHED_FAILED: "error"}


class Sequence:
    def __init__(self, seq_id: int, request_id: str, index: int, prompt_token_ids: list[int],
                 params: SamplingParams, max_new_tokens: int, arrival: int = 0):
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index                          # which of the request's n completions
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.max_new_tokens = max_new_tokens        # min(max_tokens, max_model_len - prompt)
        self.arrival = arrival                      # admission order (FCFS)
        self.status = SequenceStatus.WAITING
        # KV bookkeeping (block manager / scheduler)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []         # chained hashes of full blocks, computed lazily
        self.num_committed_blocks = 0               # leading full blocks already offered to the prefix cache
        self.num_cached_tokens = 0                  # prompt tokens served by the prefix cache at admission
        # positions ..repaired_upto hold KV that FP4 experts computed over the context they have now
        # (the confidence gate's repairs, an FP4 prefill): a repair need not recompute them again
        self.repaired_upto = -1
        # the recurrent-state slot of a model with per-sequence states (engine/state_slots.py); -1: none
        self.state_slot = -1
        # speculative decoding (engine/speculative.py): drafts for the positions after the newest
        # token, which the next step computes and verifies with it; [] when none
        self.spec_token_ids: list[int] = []
        # outputs (engine / sampler)
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.wants_prompt_logprobs = params.prompt_logprobs is not None and index == 0
        self.output_logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # the last token id is a placeholder: sampled on the device, not yet on the host
        # (engine/async_decode.py); it counts in num_tokens for the scheduler, not in the outputs
        self.pending_token = False
        self.generator: Any = None                  # the sampler's per-sequence torch.Generator
        self.grammar: Any = None                    # structured outputs: engine/structured_output.SequenceGrammar
        self.detok: Any = None                      # the detokenizer's incremental state
        # set by the sampler when this sequence's row failed: the engine fails the request when
        # it reads the row's token (LLMEngine._after_token), the other rows are unaffected
        self.error: BaseException | None = None

    # ------------------------------------------------------------------ tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:len(self.token_ids) - self.pending_token]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Still has prompt positions whose logprobs were not computed (they need every prompt
        row's hidden state, so such a sequence neither uses the prefix cache nor is cut short)."""
        return self.wants_prompt_logprobs and (self.prompt_logprobs is None
                                               or len(self.prompt_logprobs) < self.num_prompt_tokens)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, req={self.request_id}/{self.index}, {self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, blocks={self.block_table})")
