"""SamplingParams, shaped like vLLM's (same names, same defaults) so callers can switch."""
from __future__ import annotations

from dataclasses import dataclass, field

from moet.errors import ConfigError


@dataclass
class SamplingParams:
    temperature: float = 1.0        # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                  # 0 or -1 = no top-k filter
    max_tokens: int | None = 16     # None = up to max_model_len
    min_tokens: int = 0             # EOS / stop tokens are ignored before this many tokens
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None     # per generated token: the sampled token + the top-k
    prompt_logprobs: int | None = None  # per prompt position: the actual token + the top-k
    seed: int | None = None
    skip_special_tokens: bool = True
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stop_list = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError(f"max_tokens={self.max_tokens} must be >= 1")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ConfigError(f"{name}={v} must be >= 0")
