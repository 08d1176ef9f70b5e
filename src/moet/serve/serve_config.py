"""ServeConfig: the HTTP server's own knobs (the engine's are EngineConfig's). Each field is a
`moet serve` flag with dashes, derived from the field like EngineConfig's, so help text and
defaults live in one place."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields

from moet.config import GROUP_SERVER, add_field_argument, flag_message
from moet.errors import ConfigError


# auto's threshold: the engine process pays off only when it gets a core of its own next to the
# server's event loop; with fewer CPUs the two processes take turns on the same cores and the
# process's steps starve (docs/architecture.md, docs/perf.md).
ENGINE_PROCESS_MIN_CPUS = 4
ENGINE_PROCESS_CHOICES = ("auto", "true", "false")


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, as a container's cpuset limits it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _knob(default, help: str, *, doc: str = "", common: bool = False, metavar: str | None = None):
    return field(default=default, metadata={"help": help, "group": GROUP_SERVER, "doc": doc, "common": common,
                                            "metavar": metavar})


@dataclass
class ServeConfig:
    host: str = _knob(
        "127.0.0.1", "listen address, 0.0.0.0 for all", common=True, metavar="ADDR",
        doc="127.0.0.1 accepts connections from this machine only; 0.0.0.0 (or ::) from the network too, "
            "which is when --api-key matters.")
    port: int = _knob(
        8000, "TCP port to listen on", common=True, metavar="PORT",
        doc="Checked before the model loads: a port that is taken or out of range is an error at once.")
    api_key: str | None = _knob(
        None, "require 'Authorization: Bearer KEY' on /v1 requests", common=True, metavar="KEY",
        doc="A /v1 request without the key gets 401; /health and /metrics stay open. An empty key is refused.")
    tool_call_parser: str = _knob(
        "auto", "tool-call syntax; auto: from the template", common=True, metavar="NAME",
        doc="How tool calls are found in the generated text and returned as tool_calls: glm45 (glm47), hermes, "
            "deepseek_v3 (deepseek_v31), kimi_k2, minimax_m2, openai (gpt-oss's harmony; harmony); auto picks the "
            "syntax from the chat template's markup; none returns the text as it is (docs/serve.md).")
    reasoning_parser: str = _knob(
        "auto", "think, harmony or none; auto: from template", common=True, metavar="NAME",
        doc="think moves <think>...</think> into reasoning_content; harmony (gpt-oss) the analysis channel, "
            "the final channel into content and messages to functions.* on to the tool-call parser; auto "
            "uses harmony when the chat template writes harmony channels, think when it writes think blocks; "
            "none leaves the text in content.")
    max_pending_requests: int = _knob(
        256, "requests in flight before new ones get 429",
        doc="Running and waiting requests together; beyond it a request is answered 429 at once instead of "
            "queueing. Raise it for many clients, lower it to keep latency bounded.")
    request_timeout_s: float = _knob(
        600.0, "abort a request after this long (504)", metavar="SECONDS",
        doc="A request that has not finished after this many seconds is aborted and answered 504.")
    max_request_bytes: int = _knob(
        16 * 1024 * 1024, "largest request body (else 413)", metavar="BYTES",
        doc="Raise it for very long prompts sent as JSON.")
    served_model_name: list[str] | None = _knob(
        None, "names to serve the model under (default: its folder)", common=True, metavar="NAME",
        doc="One or more names (`--served-model-name a b`): the first is the one responses carry, the rest are "
            "aliases a request may use. Default: the checkpoint's folder name (for a checkpoint found in "
            "the Hugging Face cache, its repo id).")
    chat_template: str | None = _knob(
        None, "Jinja chat template (file or text) instead of the checkpoint's", common=True,
        metavar="TEMPLATE",
        doc="For checkpoints without a chat template, or to change how conversations are rendered.")
    trust_request_chat_template: bool = _knob(
        False, "accept a chat template sent in a request",
        doc="A request's chat_template (or chat_template_kwargs.chat_template) is refused with 400 unless this "
            "is on. A client's template runs in a sandbox with a time limit either way.")
    chat_template_timeout_s: float = _knob(
        10.0, "template render time limit (else 400)", metavar="SECONDS",
        doc="Bounds the time a template (the checkpoint's, or a request's) spends on one request.")
    max_sequences_per_request: int = _knob(
        128, "most prompts x n per request (else 400)",
        doc="Bounds what one request may add to the engine at once.")
    log_requests: bool = _knob(
        True, "log one line per request",
        doc="Method, path, status, tokens and seconds of each request, at INFO level.")
    engine_process: str = _knob(
        "auto", "run the engine in its own process", metavar="{auto,true,false}",
        doc="true: a spawned process, so the server's Python never takes time from the engine; false: a "
            f"thread of the server process; auto: a process when this machine gives moet at least "
            f"{ENGINE_PROCESS_MIN_CPUS} CPUs, else a thread.")

    def __post_init__(self) -> None:
        if isinstance(self.engine_process, bool):     # ServeConfig(engine_process=True) from Python
            self.engine_process = "true" if self.engine_process else "false"
        self.engine_process = str(self.engine_process).lower()
        if self.engine_process not in ENGINE_PROCESS_CHOICES:
            raise ConfigError(f"engine_process={self.engine_process!r}: expected one of {', '.join(ENGINE_PROCESS_CHOICES)}")
        if not 0 < self.port < 65536:
            raise ConfigError(f"port={self.port} must be in 1..65535")
        if isinstance(self.served_model_name, str):
            self.served_model_name = [self.served_model_name]
        if self.served_model_name is not None and (not self.served_model_name
                                                   or not all(isinstance(n, str) and n for n in self.served_model_name)):
            raise ConfigError(f"served_model_name={self.served_model_name!r} must be one or more non-empty names")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("api_key is empty: give a key, or leave --api-key out to serve without one")
        if not self.chat_template_timeout_s > 0:
            raise ConfigError(f"chat_template_timeout_s={self.chat_template_timeout_s} must be > 0")
        for name in ("max_pending_requests", "max_request_bytes", "max_sequences_per_request"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if not self.request_timeout_s > 0:
            raise ConfigError(f"request_timeout_s={self.request_timeout_s} must be > 0")


def uses_engine_process(config: ServeConfig, cpus: int | None = None) -> bool:
    """Whether `moet serve` runs the engine in its own process (engine_process resolved; auto by
    the CPUs this process may use)."""
    if config.engine_process != "auto":
        return config.engine_process == "true"
    return (usable_cpus() if cpus is None else cpus) >= ENGINE_PROCESS_MIN_CPUS


def add_serve_arguments(parser: argparse.ArgumentParser, *, show_all: bool = False) -> None:
    """One flag per ServeConfig field, in the `server` group (see moet.config.add_field_argument)."""
    for f in fields(ServeConfig):
        add_field_argument(parser, f, show_all=show_all)


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    try:
        return ServeConfig(**{f.name: getattr(args, f.name) for f in fields(ServeConfig)})
    except ConfigError as exc:
        raise ConfigError(flag_message(str(exc), [f.name for f in fields(ServeConfig)])) from None
