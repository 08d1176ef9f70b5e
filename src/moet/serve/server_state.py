"""Everything the request handlers share: the engine, the served names, the chat template and
its guards, the parsers chosen at start-up, the sampling defaults, the metrics, the worker
threads that prepare requests, and the in-flight count behind the 429 bound."""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from moet.serve.engine_protocol import EngineClient
from moet.serve.errors import BadRequest, NotFound, Overloaded
from moet.serve.metrics import ServerMetrics
from moet.serve.reasoning import ReasoningParser
from moet.serve.serve_config import ServeConfig, usable_cpus
from moet.serve.template_sandbox import RequestTemplateRenderer, TemplateTimeout, render_with_deadline
from moet.serve.tool_parsers import ToolParser

T = TypeVar("T")


def prep_workers() -> int:
    # Tokenizing and rendering release the GIL only in parts; a few threads keep one huge request
    # from holding up the small ones behind it without competing with the engine for every core.
    return max(2, min(4, usable_cpus()))


@dataclass
class ServerState:
    engine: EngineClient
    config: ServeConfig
    model_name: str                      # the name responses carry (the first served name)
    metrics: ServerMetrics
    tool_parser: type[ToolParser] | None
    reasoning_parser: ReasoningParser | None
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    model_path: str | None = None
    model_names: list[str] = field(default_factory=list)   # every name the model answers to
    chat_template: str | None = None     # --chat-template, else the tokenizer's own
    in_flight: int = 0
    _prep: ThreadPoolExecutor | None = None
    _request_templates: RequestTemplateRenderer | None = None

    def __post_init__(self) -> None:
        if not self.model_names:
            self.model_names = [self.model_name]

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def check_model(self, name: str | None) -> None:
        """OpenAI clients must name a model; every served name and the checkpoint path work."""
        if name is None or name in self.model_names or (self.model_path and name == self.model_path):
            return
        raise NotFound(f"the model '{name}' does not exist; this server serves '{self.model_name}' "
                       "(GET /v1/models lists it)", param="model", code="model_not_found")

    def response_model_name(self, requested: str | None) -> str:
        """The name a response carries: the one the request used when it is a served name (an
        alias stays an alias, as vLLM answers), else the first served name."""
        return requested if requested in self.model_names else self.model_name

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

    # ------------------------------------------------------------------ off the event loop

    async def off_loop(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, **kwargs) in a request-preparation thread (parsing, templates, tokenizing):
        never on the event loop, where it would stall every stream and /health."""
        if self._prep is None:
            self._prep = ThreadPoolExecutor(prep_workers(), thread_name_prefix="moet-prep")
        return await asyncio.get_running_loop().run_in_executor(self._prep, functools.partial(fn, *args, **kwargs))

    def render_template(self, request_template: str | None = None, **kwargs) -> str:
        """apply_chat_template(tokenize=False) for a request (called in a preparation thread):
        the server's template under a deadline, or the request's own in the sandbox process."""
        tok = self.tokenizer
        if request_template is not None:
            if not self.config.trust_request_chat_template:
                raise BadRequest("this server does not accept chat templates in requests; start it with "
                                 "--trust-request-chat-template to allow them", param="chat_template")
            if self._request_templates is None:
                self._request_templates = RequestTemplateRenderer(tok, self.config.chat_template_timeout_s)
            return self._request_templates.render(chat_template=request_template, **kwargs)
        if tok is None or not (self.chat_template or getattr(tok, "chat_template", None)):
            raise BadRequest("this model has no chat template; use /v1/completions with a plain prompt, or start "
                             "the server with --chat-template FILE")
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        try:
            return render_with_deadline(tok, self.config.chat_template_timeout_s, **kwargs)
        except TemplateTimeout as exc:
            raise BadRequest(f"{exc} on this request (--chat-template-timeout-s)", param="messages") from None

    def close(self) -> None:
        if self._prep is not None:
            self._prep.shutdown(wait=False, cancel_futures=True)
        if self._request_templates is not None:
            self._request_templates.close()
