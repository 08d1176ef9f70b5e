"""What the server needs from an engine: contract 2 (moet.engine.async_engine.AsyncEngine).
A typing.Protocol, so the server depends on the shape and tests can drive it with a test double."""
from __future__ import annotations

from typing import Any, AsyncIterator, Protocol

from moet.outputs import RequestOutput
from moet.sampling_params import SamplingParams


class EngineClient(Protocol):
    tokenizer: Any
    model_name: str
    max_model_len: int
    eos_token_ids: set[int]

    def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Cumulative RequestOutputs; the last has finished=True. Raises ConfigError before the
        first output for a request that can never run."""

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> Any: ...

    async def shutdown(self) -> None: ...
