"""SamplingParams, shaped like vLLM's (same names, same defaults, same validation) so callers
can switch.

Order of operations in the sampler (moet/engine/sampler.py), as vLLM: min_tokens blocks EOS /
stop tokens -> repetition, frequency, presence penalties -> greedy argmax (temperature 0) or
temperature -> top_k -> top_p -> min_p -> a seeded draw. Logprobs are of the raw model
distribution (log_softmax of the logits before any of these), vLLM's default "raw_logprobs".
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moet.errors import ConfigError


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
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stop_list = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"n={self.n} must be an integer >= 1")
        if self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < -1:
            raise ConfigError(f"top_k={self.top_k} must be -1 or 0 (no filter) or a positive integer")
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p={self.min_p} must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise ConfigError(f"repetition_penalty={self.repetition_penalty} must be > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2 <= v <= 2:
                raise ConfigError(f"{name}={v} must be in [-2, 2]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError(f"max_tokens={self.max_tokens} must be >= 1")
        if self.min_tokens < 0:
            raise ConfigError(f"min_tokens={self.min_tokens} must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ConfigError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ConfigError(f"{name}={v} must be >= 0")
        if any(not s for s in self.stop_list):
            raise ConfigError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def has_filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0
