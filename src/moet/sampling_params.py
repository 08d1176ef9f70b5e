"""SamplingParams, shaped like vLLM's (same names, same defaults, same validation) so callers
can switch.

Order of operations in the sampler (moet/engine/sampler.py), as vLLM: min_tokens blocks EOS /
stop tokens -> repetition, frequency, presence penalties -> greedy argmax (temperature 0) or
temperature -> top_k -> top_p -> min_p -> a seeded draw. Logprobs are of the raw model
distribution (log_softmax of the logits before any of these), vLLM's default "raw_logprobs".
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field

from moet.errors import RequestError

SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1


def _integer(name: str, v) -> int:
    """v as a Python int; bools and floats are refused (True is not a token id or a count)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise RequestError(f"{name}={v!r} must be an integer", param=name)
    return int(v)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrained decoding (vLLM's StructuredOutputsParams; engine/structured_output.py): exactly
    one of the constraints. The tokens a sequence may sample next are those its grammar allows
    (xgrammar); once the grammar is complete, only its end-of-sequence tokens.
      json         a JSON schema (dict or JSON text): the output is one JSON value that matches it
      json_object  True: any JSON object
      regex        the output matches the regular expression (whole)
      choice       the output is exactly one of these strings
      grammar      an EBNF grammar (GBNF-style, as xgrammar reads it; the start rule is `root`)
    """
    json: str | dict | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "json_object", "regex", "choice", "grammar")
                 if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise RequestError("structured outputs take exactly one of json, json_object, regex, choice, grammar"
                               + (f" (got {', '.join(given)})" if given else ""), param="structured_outputs")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice) or not self.choice:
                raise RequestError("choice must be a non-empty list of strings", param="structured_outputs.choice")
            object.__setattr__(self, "choice", tuple(self.choice))
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise RequestError(f"{k} must be a non-empty string", param=f"structured_outputs.{k}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise RequestError("json must be a JSON schema (an object or its JSON text)", param="structured_outputs.json")

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "json_object", "regex", "choice", "grammar") if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    n: int = 1                      # completions per prompt (share the prompt's KV through the prefix cache)
    temperature: float = 1.0        # 0 = greedy (exact argmax)
    top_p: float = 1.0
    top_k: int = 0                  # 0 or -1 = no top-k filter
    min_p: float = 0.0              # drop tokens whose probability < min_p * the top probability
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and the output (CTRL rule)
    presence_penalty: float = 0.0   # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    max_tokens: int | None = 16     # None = up to max_model_len
    min_tokens: int = 0             # EOS / stop tokens / stop strings are ignored before this many tokens
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None     # per generated token: the sampled token + the top-k
    prompt_logprobs: int | None = None  # per prompt position: the actual token + the top-k
    seed: int | None = None         # same seed -> same output, whatever else is in the batch
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None   # constrained decoding (grammar, schema, ...)
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        """vLLM's checks plus the types: what needs no model. The engine checks what does (stop
        token ids and logprobs against the vocabulary, a seed for each of the n generators:
        LLMEngine.add_request). Every refusal is a RequestError naming the field."""
        for name in ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "seed"):
            v = getattr(self, name)
            if v is not None or name in ("n", "top_k", "min_tokens"):
                setattr(self, name, _integer(name, v))
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise RequestError(f"stop={self.stop!r} must be a string or a list of strings", param="stop")
        self.stop_list = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) for s in self.stop_list):
            raise RequestError(f"stop={self.stop!r} must be a string or a list of strings", param="stop")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                raise RequestError(f"stop_token_ids={self.stop_token_ids!r} must be a list of token ids",
                                   param="stop_token_ids")
            self.stop_token_ids = [_integer("stop_token_ids", t) for t in self.stop_token_ids]
            if any(t < 0 for t in self.stop_token_ids):
                raise RequestError(f"stop_token_ids={self.stop_token_ids} must be token ids (>= 0)",
                                   param="stop_token_ids")
        if self.n < 1:
            raise RequestError(f"n={self.n} must be an integer >= 1", param="n")
        if self.temperature < 0:
            raise RequestError(f"temperature={self.temperature} must be >= 0", param="temperature")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p={self.top_p} must be in (0, 1]", param="top_p")
        if self.top_k < -1:
            raise RequestError(f"top_k={self.top_k} must be -1 or 0 (no filter) or a positive integer", param="top_k")
        if not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p={self.min_p} must be in [0, 1]", param="min_p")
        if self.repetition_penalty <= 0:
            raise RequestError(f"repetition_penalty={self.repetition_penalty} must be > 0 (1 = off)",
                               param="repetition_penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2 <= v <= 2:
                raise RequestError(f"{name}={v} must be in [-2, 2]", param=name)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise RequestError(f"max_tokens={self.max_tokens} must be >= 1", param="max_tokens")
        if self.min_tokens < 0:
            raise RequestError(f"min_tokens={self.min_tokens} must be >= 0", param="min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}",
                               param="min_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise RequestError(f"{name}={v} must be >= 0", param=name)
        # vLLM's range (the OpenAI server's int64); torch.Generator takes [-2**63, 2**64), so
        # seed + i of every completion fits (the engine checks again what it is handed)
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise RequestError(f"seed={self.seed} must be a 64-bit signed integer, in [{SEED_MIN}, {SEED_MAX}]",
                               param="seed")
        if any(not s for s in self.stop_list):
            raise RequestError("stop strings must be non-empty", param="stop")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise RequestError("structured_outputs must be a StructuredOutputsParams", param="structured_outputs")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def has_filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0
