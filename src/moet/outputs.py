"""Request outputs, shaped like vLLM's RequestOutput / CompletionOutput / Logprob."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None          # 1 = most likely
    decoded_token: str | None = None


# per position: token id -> Logprob (the actual / sampled token plus the top-k)
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (failed inside the engine)
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    # set when the request failed inside the engine (finished is then True, and each completion
    # that had not ended has finish_reason "error", vLLM's): moet.errors.RequestFailed for a fault
    # in this request's own work, a MoetError when the whole step failed. AsyncEngine and
    # EngineProcess raise it from generate() instead of yielding this output.
    error: Exception | None = None
