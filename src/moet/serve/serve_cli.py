"""`moet serve [MODEL]`: the OpenAI-compatible HTTP server (default model: the shipped
moet-tiny, on the GPU when there is one). Engine flags are EngineConfig's, server flags
ServeConfig's; `--tool-call-parser` / `--reasoning-parser` default to what the checkpoint's
chat template writes.

Start-up order (`run`): every argument is checked first (flags, configs, parser names, the
checkpoint path), then the port is bound, then the engine loads; so a mistake costs no load
time and a taken port is found before minutes of loading, not after. "serving at" is printed
once uvicorn listens. Ctrl-C: one line, exit 130 (moet.cli), the engine shut down.
"""
from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import signal
import socket


def resolve_parsers(chat_template: str | None, architecture: str | None, tool_name: str, reasoning_name: str):
    """Flag values ("auto", "none" or a name) -> (tool parser class or None, reasoning parser or None)."""
    from moet.serve.reasoning_parsers import default_reasoning_parser, get_reasoning_parser
    from moet.serve.tool_parsers import default_tool_parser, get_tool_parser

    if tool_name == "auto":
        tool_name = default_tool_parser(chat_template, architecture) or "none"
    if reasoning_name == "auto":
        reasoning_name = default_reasoning_parser(chat_template) or "none"
    tool = None if tool_name == "none" else get_tool_parser(tool_name)
    reasoning = None if reasoning_name == "none" else get_reasoning_parser(reasoning_name)
    return tool, reasoning


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}


def load_chat_template(value: str) -> str:
    """--chat-template: a file holding a Jinja template, or the template itself (vLLM takes both).
    Checked before the model loads: a path that does not exist and holds no Jinja is an error,
    not a one-line template."""
    from moet.errors import ConfigError

    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--chat-template {value}: cannot read it ({exc})") from None
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ConfigError(f"--chat-template {value}: no such file (give a Jinja template file, or the template itself)")
    try:   # compiled as transformers compiles it (its extensions, e.g. {% generation %}, included)
        from transformers.utils.chat_template_utils import _compile_jinja_template
        _compile_jinja_template(text)
    except ImportError:
        pass
    except Exception as exc:  # jinja2's TemplateSyntaxError and friends
        raise ConfigError(f"--chat-template {value}: not a valid Jinja template ({exc})") from None
    return text


def build_server_app(engine_config, serve_config, engine=None, chat_template: str | None = None):
    """The app for a checkpoint: starts the engine (unless given one) and resolves the parsers.
    chat_template: --chat-template already read (load_chat_template), else read here."""
    from moet.serve.api_server import build_app
    from moet.serve.serve_config import uses_engine_process

    if engine is None:
        in_process = uses_engine_process(serve_config)
        logging.getLogger("moet.serve").info("engine in %s (--engine-process %s)",
                                             "a process of its own" if in_process else "a thread of the server",
                                             serve_config.engine_process)
        if in_process:
            from moet.engine.engine_process import EngineProcess
            engine = EngineProcess.from_config(engine_config)
        else:
            from moet.engine.async_engine import AsyncEngine
            engine = AsyncEngine.from_config(engine_config)
    model_dir = engine_config.model
    arch = (_read_json(os.path.join(model_dir, "config.json")).get("architectures") or [None])[0]
    override = chat_template if chat_template is not None else \
        (load_chat_template(serve_config.chat_template) if serve_config.chat_template else None)
    template = override or (getattr(engine.tokenizer, "chat_template", None) if engine.tokenizer is not None else None)
    if isinstance(template, dict):  # several named templates: the default one decides
        template = template.get("default") or next(iter(template.values()), None)
    tool, reasoning = resolve_parsers(template, arch, serve_config.tool_call_parser, serve_config.reasoning_parser)
    app = build_app(engine, serve_config, tool_parser=tool, reasoning_parser=reasoning,
                    generation_config=_read_json(os.path.join(model_dir, "generation_config.json")),
                    model_path=model_dir, chat_template=override)
    logging.getLogger("moet.serve").info(
        "serving %s (max_model_len %d) tool-call parser %s, reasoning parser %s", engine.model_name,
        engine.max_model_len, tool.name if tool else "none", reasoning.name if reasoning else "none")
    return app


def check_parser_names(serve_config) -> None:
    """A misspelt --tool-call-parser / --reasoning-parser, refused before the model loads (auto is
    resolved later, from the chat template)."""
    from moet.serve.reasoning_parsers import get_reasoning_parser
    from moet.serve.tool_parsers import get_tool_parser

    if serve_config.tool_call_parser not in ("auto", "none"):
        get_tool_parser(serve_config.tool_call_parser)
    if serve_config.reasoning_parser not in ("auto", "none"):
        get_reasoning_parser(serve_config.reasoning_parser)


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not yet listening: until uvicorn listens on it, connections are
    refused, not queued), or one ConfigError line naming the flag to change."""
    from moet.errors import ConfigError

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host}: not an address of this machine ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn: a TIME_WAIT port is free
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"--port {port}: {host}:{port} is already in use (another server?); choose another "
                              "--port or stop the process that holds it") from None
        if exc.errno == errno.EACCES:
            raise ConfigError(f"--port {port}: no permission to listen on {host}:{port} (ports below 1024 need "
                              "privileges); choose a port above 1023") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(f"--host {host}: not an address of this machine (127.0.0.1 for this machine only, "
                              "0.0.0.0 for every interface)") from None
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror}); check --host and --port") from None
    return sock


def _url(host: str, port: int) -> str:
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}/v1"


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from moet.checkpoint.resolve import looks_like_repo_id, resolve_checkpoint
    from moet.config import from_cli_args
    from moet.serve.serve_config import serve_config_from_args

    # 1. the arguments, all of them, before anything is loaded
    serve_config = serve_config_from_args(args)
    given = args.model
    args.model = resolve_checkpoint(given)
    engine_config = from_cli_args(args)
    if args.model != os.path.expanduser(given) and looks_like_repo_id(given) and serve_config.served_model_name is None:
        serve_config.served_model_name = [given]      # found in the Hugging Face cache: served as the repo id
    check_parser_names(serve_config)
    chat_template = load_chat_template(serve_config.chat_template) if serve_config.chat_template else None
    # 2. the port: a taken one is found now, not after the model has loaded
    sock = bind_socket(serve_config.host, serve_config.port)
    try:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        # 3. the engine
        from moet.engine.gc_pauses import freeze_start_up, server_start_up
        with server_start_up():                         # its collections are not pauses while serving
            app = build_server_app(engine_config, serve_config, chat_template=chat_template)
        freeze_start_up()                               # start-up's objects out of the GC's walks while serving
        # 4. serve on the bound socket; "serving at" once uvicorn listens on it
        url = _url(serve_config.host, serve_config.port)
        server = _make_server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5),
                         lambda: print(f"moet: serving {app.state.moet.model_name} at {url}", flush=True))
        server.run(sockets=[sock])
    finally:
        sock.close()
    if server.interrupted:
        raise KeyboardInterrupt                         # moet.cli: one line, exit 130
    return 0


def _make_server(config, on_started):
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server that reports when it listens and whether Ctrl-C stopped it."""

        def __init__(self):
            super().__init__(config)
            self.interrupted = False

        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started and not self.should_exit:
                on_started()

        def handle_exit(self, sig, frame):
            self.interrupted = self.interrupted or sig == signal.SIGINT
            super().handle_exit(sig, frame)

    return Server()


def add_subcommand(subparsers) -> argparse.ArgumentParser:
    from moet.config import HelpFormatter, add_cli_arguments, add_help_all
    from moet.serve.serve_config import add_serve_arguments

    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server", formatter_class=HelpFormatter,
        usage="moet serve [MODEL] [options]",
        description="Serve a checkpoint through an OpenAI-compatible HTTP API (default: the shipped moet-tiny).")
    add_cli_arguments(p)
    add_serve_arguments(p)
    add_help_all(p, "serve")
    p.set_defaults(func=run)
    return p
