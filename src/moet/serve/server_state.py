"""Everything the request handlers share: the engine, the parsers chosen at start-up, the
sampling defaults, the metrics, and the in-flight count behind the 429 bound."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moet.serve.engine_protocol import EngineClient
from moet.serve.errors import NotFound, Overloaded
from moet.serve.metrics import ServerMetrics
from moet.serve.reasoning import ReasoningParser
from moet.serve.serve_config import ServeConfig
from moet.serve.tool_parsers import ToolParser


@dataclass
class ServerState:
    engine: EngineClient
    config: ServeConfig
    model_name: str
    metrics: ServerMetrics
    tool_parser: type[ToolParser] | None
    reasoning_parser: ReasoningParser | None
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    model_path: str | None = None
    in_flight: int = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def check_model(self, name: str | None) -> None:
        """OpenAI clients must name a model; the served name and the checkpoint path both work."""
        if name is None or name == self.model_name or (self.model_path and name == self.model_path):
            return
        raise NotFound(f"the model '{name}' does not exist; this server serves '{self.model_name}' "
                       "(GET /v1/models lists it)", param="model", code="model_not_found")

    def admit(self) -> None:
        if self.in_flight >= self.config.max_pending_requests:
            self.metrics.rejected.labels("queue_full").inc()
            raise Overloaded(f"the server already has {self.in_flight} requests in flight "
                             f"(--max-pending-requests {self.config.max_pending_requests}); retry later")
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)

    def release(self) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.set(self.in_flight)
