"""`moet serve [MODEL]`: the OpenAI-compatible HTTP server (default model: the shipped
moet-tiny, on the GPU when there is one). Engine flags are EngineConfig's, server flags
ServeConfig's; `--tool-call-parser` / `--reasoning-parser` default to what the checkpoint's
chat template writes."""
from __future__ import annotations

import argparse
import json
import logging
import os


def resolve_parsers(chat_template: str | None, architecture: str | None, tool_name: str, reasoning_name: str):
    """Flag values ("auto", "none" or a name) -> (tool parser class or None, reasoning parser or None)."""
    from moet.serve.reasoning import default_reasoning_parser, get_reasoning_parser
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


def build_server_app(engine_config, serve_config, engine=None):
    """The app for a checkpoint: starts the engine (unless given one) and resolves the parsers."""
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
    template = getattr(engine.tokenizer, "chat_template", None) if engine.tokenizer is not None else None
    if isinstance(template, dict):  # several named templates: the default one decides
        template = template.get("default") or next(iter(template.values()), None)
    tool, reasoning = resolve_parsers(template, arch, serve_config.tool_call_parser, serve_config.reasoning_parser)
    app = build_app(engine, serve_config, tool_parser=tool, reasoning_parser=reasoning,
                    generation_config=_read_json(os.path.join(model_dir, "generation_config.json")),
                    model_path=model_dir)
    logging.getLogger("moet.serve").info(
        "serving %s (max_model_len %d) tool-call parser %s, reasoning parser %s", engine.model_name,
        engine.max_model_len, tool.name if tool else "none", reasoning.name if reasoning else "none")
    return app


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from moet.config import from_cli_args
    from moet.serve.serve_config import serve_config_from_args

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve_config = serve_config_from_args(args)
    engine_config = from_cli_args(args)
    from moet.engine.gc_pauses import freeze_start_up, server_start_up
    with server_start_up():                         # its collections are not pauses while serving
        app = build_server_app(engine_config, serve_config)
    freeze_start_up()                               # start-up's objects out of the GC's walks while serving
    print(f"moet: serving {app.state.moet.model_name} at http://{serve_config.host}:{serve_config.port}/v1", flush=True)
    uvicorn.run(app, host=serve_config.host, port=serve_config.port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=5)
    return 0


def add_subcommand(subparsers) -> None:
    from moet.config import add_cli_arguments
    from moet.serve.serve_config import add_serve_arguments

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server", description=__doc__)
    add_cli_arguments(p)
    add_serve_arguments(p)
    p.set_defaults(func=run)
