"""The `moet` command line. Each subcommand lives next to the code it drives and registers
itself through a module-level `add_subcommand(subparsers)`; this file only lists them, so
`moet --help` stays fast (modules are imported lazily, only when their command runs).
"""
from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading

from moet import __version__
from moet.errors import MoetError

# (command name, module that defines add_subcommand, one-line help)
SUBCOMMANDS: list[tuple[str, str, str]] = [
    ("generate", "moet.generate_cli", "generate text offline from a checkpoint (default: the shipped moet-tiny)"),
    ("serve", "moet.serve.serve_cli", "OpenAI-compatible HTTP server (default: the shipped moet-tiny)"),
    ("inspect", "moet.checkpoint.inspect_cli", "family, parameter counts, bytes per format and what fits where"),
    ("plan", "moet.store.plan_cli", "W2 experts per tier (GPU / host arena / disk) and predicted decode tok/s"),
    ("probe", "moet.probe.cli", "quality probes: code loss, facts, arithmetic, needle, tool calls, MTP"),
    ("bench", "moet.bench.cli", "benchmarks: decode, prefill, residency, serve (tables, JSON, markdown, plots)"),
    ("quant-study", "moet.quant.study_cli", "which 4-level codebook each routed-expert tensor of a checkpoint wants"),
]


def build_parser(argv_command: str | None = None) -> argparse.ArgumentParser:
    return _build(argv_command)[0]


def _build(argv_command: str | None) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser | None]:
    """The parser, and the command's own parser when argv_command names one."""
    parser = argparse.ArgumentParser(
        prog="moet",
        description="moet: serve Mixture-of-Experts LLMs too big for the GPU.",
        epilog="`moet COMMAND --help` describes a command's flags.",
    )
    parser.add_argument("--version", action="version", version=f"moet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    command_parser = None
    for name, module, help_text in SUBCOMMANDS:
        if argv_command == name:
            # Only the command being run is imported: its module adds the real parser.
            command_parser = importlib.import_module(module).add_subcommand(sub)
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser, command_parser


def main(argv: list[str] | None = None) -> int:
    from moet.config import HELP_ALL, refuse_switch_values

    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    for i in range(len(argv) - 1):                  # `--help all` is `--help-all`
        if argv[i] in ("-h", "--help") and argv[i + 1] == "all":
            argv[i:i + 2] = [HELP_ALL]
            break
    parser, command_parser = _build(command if command in {n for n, _, _ in SUBCOMMANDS} else None)
    if command_parser is not None:
        refuse_switch_values(command_parser, argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except MoetError as exc:
        print(f"moet: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # one Ctrl-C is the whole request: a second SIGINT during teardown (a terminal's repeat, a
        # signal still pending when threads are joined) must not turn exit 130 into a traceback or
        # a death by signal
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("moet: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
