"""ServeConfig: the HTTP server's own knobs (the engine's are EngineConfig's). Each field is a
`moet serve` flag with dashes, derived from the field like EngineConfig's, so help text and
defaults live in one place."""
from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, dataclass, field, fields

from moet.errors import ConfigError


# auto's threshold: the engine process pays only when it gets a core of its own next to the
# server's event loop (H200 box, 16 cores, moet-tiny 16 streams: HTTP 8,330 tok/s with the process
# vs 5,579 with the thread, run 16 in docs/perf.md; a 2-core box shared with another job: the
# process's steps starved, no gain, docs/architecture.md).
ENGINE_PROCESS_MIN_CPUS = 4
ENGINE_PROCESS_CHOICES = ("auto", "true", "false")


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, as a container's cpuset limits it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _knob(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class ServeConfig:
    host: str = _knob("127.0.0.1", "address to listen on (0.0.0.0 for every interface)")
    port: int = _knob(8000, "TCP port")
    api_key: str | None = _knob(None, "when set, every /v1 request needs 'Authorization: Bearer KEY' (else 401)")
    tool_call_parser: str = _knob("auto", "tool-call syntax to parse: glm45, hermes, deepseek_v3, kimi_k2, none, "
                                          "or auto (from the chat template's markup)")
    reasoning_parser: str = _knob("auto", "move <think>...</think> into reasoning_content: think, none, or auto "
                                          "(think when the chat template writes think blocks)")
    max_pending_requests: int = _knob(256, "requests in flight (running + waiting) before new ones get 429")
    request_timeout_s: float = _knob(600.0, "a request still generating after this many seconds is aborted (504)")
    max_request_bytes: int = _knob(16 * 1024 * 1024, "largest accepted request body (else 413)")
    served_model_name: list[str] | None = _knob(
        None, "names the API serves the model under (the first is the one responses carry, the rest are "
              "aliases); default: the checkpoint's folder name")
    chat_template: str | None = _knob(
        None, "a Jinja chat template (a file, or the template itself) used instead of the checkpoint's")
    trust_request_chat_template: bool = _knob(
        False, "accept a chat template sent in a request (chat_template / chat_template_kwargs.chat_template); "
               "off: such requests get 400. A client template runs in a sandbox with a time limit either way")
    chat_template_timeout_s: float = _knob(
        10.0, "longest a chat template may take to render one request (else 400)")
    max_sequences_per_request: int = _knob(
        128, "most sequences one request may ask for (prompts x n); more gets 400")
    log_requests: bool = _knob(True, "log one line per request (method, path, status, tokens, seconds)")
    engine_process: str = _knob("auto", "run the engine in a process of its own (spawned), so the server's Python "
                                        "never takes GIL time from it: true, false (a thread of the server process), "
                                        f"or auto (a process when this machine gives it >= {ENGINE_PROCESS_MIN_CPUS} "
                                        "CPUs, else a thread)")

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


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    for f in fields(ServeConfig):
        default = None if f.default is MISSING else f.default
        t = str(f.type)
        kind = int if t.startswith("int") else float if t.startswith("float") else _bool if t == "bool" else str
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=default, metavar="X",
                            help=f"{f.metadata['help']} (default: {default})")


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    return ServeConfig(**{f.name: getattr(args, f.name) for f in fields(ServeConfig)})
