"""The command line of EngineConfig: one flag per knob, named after it with dashes (`max_num_seqs`
-> `--max-num-seqs`; a bool knob is a switch pair, `--enforce-eager` / `--no-enforce-eager`). The
flags stay flat, as the knobs' names are unique across the sub-configs; `--help` groups them by
sub-config (the sub-config's `title`), shows the `common` ones, and `--help-all` shows every flag.
`from_cli_args` builds the grouped EngineConfig from the parsed flags. ServeConfig's flags
(moet.serve.serve_config) use the same helpers, in the `server` group."""
from __future__ import annotations

import argparse
import re
from dataclasses import MISSING, fields

from moet.config.engine import SECTIONS, EngineConfig
from moet.config.load import LoadConfig
from moet.errors import ConfigError

# `--help` groups, in the order they are shown: the model first (MODEL and LoadConfig's knobs), the
# server's (ServeConfig's fields, `moet serve` only), then the other sub-configs'.
GROUP_MODEL = LoadConfig.title
GROUP_SERVER = "server"
GROUPS = (GROUP_MODEL, GROUP_SERVER) + tuple(cls.title for name, cls in SECTIONS.items() if name != "load")

HELP_ALL = "--help-all"
# What a user coming from `--flag true` may still type after a switch.
_BOOL_WORDS = ("true", "false", "yes", "no", "on", "off", "1", "0")


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def field_kind(f) -> tuple[str, type]:
    """('bool' | 'list' | 'value', element type): the annotations are strings here ("int | None")."""
    t = str(f.type)
    if t == "bool":
        return "bool", bool
    elem = t[5:] if t.startswith("list[") else t
    kind = int if elem.startswith("int") else float if elem.startswith("float") else str
    return ("list" if t.startswith("list[") else "value"), kind


def metavar(f) -> str:
    """How a field's value is written in `--help` (its metadata's, else its choices, else its type's)."""
    md = f.metadata
    if md.get("metavar"):
        return md["metavar"]
    if md.get("choices"):
        return "{" + ",".join(md["choices"]) + "}"
    elem = field_kind(f)[1]
    return "N" if elem is int else "X" if elem is float else "TEXT"


def default_text(f) -> str | None:
    """A field's default as the command line spells it (None: no default worth showing)."""
    default = None if f.default is MISSING else f.default
    if isinstance(default, bool):
        return "on" if default else "off"
    return None if default is None else str(default)


class HelpFormatter(argparse.HelpFormatter):
    """A switch pair shows as one `--[no-]name`, so each flag keeps to one line."""

    def __init__(self, prog, indent_increment=2, max_help_position=36, width=None):
        super().__init__(prog, indent_increment, max_help_position, width)

    def _format_action_invocation(self, action):
        if isinstance(action, argparse.BooleanOptionalAction):
            return "--[no-]" + action.option_strings[0][2:]
        return super()._format_action_invocation(action)

    def _format_args(self, action, default_metavar):
        if action.nargs == "+":                         # `NAME...`, not `NAME [NAME ...]`
            return self._metavar_formatter(action, default_metavar)(1)[0] + "..."
        return super()._format_args(action, default_metavar)


class _HelpAll(argparse.Action):
    """`--help-all`: the help with every flag, not only the common ones."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        for action in parser._actions:
            full = getattr(action, "moet_help", None)
            if full is not None:
                action.help = full
        parser.epilog = getattr(parser, "moet_epilog_all", parser.epilog)
        parser.print_help()
        parser.exit()


def add_help_all(parser: argparse.ArgumentParser, command: str) -> None:
    """`--help-all` on a parser whose uncommon flags are hidden from plain `--help`; both epilogs say
    where the rest is."""
    hidden = sum(1 for a in parser._actions if getattr(a, "moet_help", None) is not None)
    parser.add_argument(HELP_ALL, action=_HelpAll, help="show every flag (this help shows the common ones)")
    parser.epilog = (f"Common flags only: `moet {command} {HELP_ALL}` shows all of them ({hidden} more). "
                     "docs/config.md describes each flag: what it does, its default, when to change it.")
    parser.moet_epilog_all = ("docs/config.md describes each flag: what it does, its default, when to "
                              "change it.")


def argument_group(parser: argparse.ArgumentParser, title: str):
    """The parser's group with this title, made on first use (EngineConfig's and ServeConfig's
    fields share them)."""
    for g in parser._action_groups:
        if g.title == title:
            return g
    return parser.add_argument_group(title)


def add_field_argument(parser: argparse.ArgumentParser, f, *, group: str | None = None,
                       show_all: bool = False) -> argparse.Action:
    """One flag for one dataclass field (help, choices, default from its metadata) in the `--help`
    group `group` (else the field's metadata's `group`). A flag that is not `common` is hidden from
    plain `--help` and shown by `--help-all`."""
    md = f.metadata
    default = None if f.default is MISSING else f.default
    shown = default_text(f)
    help_text = md.get("help", "") + (f" (default: {shown})" if shown is not None else "")
    group = argument_group(parser, group or md["group"])
    kind, elem = field_kind(f)
    if kind == "bool":
        action = group.add_argument(flag_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                                    default=default, help=help_text)
    else:
        action = group.add_argument(flag_name(f.name), dest=f.name, type=elem, default=default,
                                    choices=md.get("choices"), nargs="+" if kind == "list" else None,
                                    metavar=metavar(f), help=help_text)
    if not (md.get("common") or show_all):
        action.moet_help = help_text
        action.help = argparse.SUPPRESS
    return action


def add_cli_arguments(parser: argparse.ArgumentParser, *, positional_model: bool = True,
                      show_all: bool = False) -> None:
    """One flag per EngineConfig knob (`model` is positional unless positional_model=False), each in
    its sub-config's `--help` group; show_all=True: no flag hidden from plain `--help`."""
    for title in GROUPS:
        argument_group(parser, title)
    model = fields(EngineConfig)[0]
    if positional_model:
        from moet.assets import default_model
        argument_group(parser, GROUP_MODEL).add_argument(
            "model", nargs="?", default=default_model(), metavar="MODEL",
            help=f"{model.metadata['help']} (default: moet-tiny)")
    else:
        add_field_argument(parser, model, group=GROUP_MODEL, show_all=show_all)
    for cls in SECTIONS.values():
        for f in fields(cls):
            add_field_argument(parser, f, group=cls.title, show_all=show_all)


def refuse_switch_values(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """`--enforce-eager true` (the old spelling) would hand `true` to the next positional (the
    checkpoint!): say how switches are written instead."""
    switches = {}
    for a in parser._actions:
        if isinstance(a, argparse.BooleanOptionalAction):
            switches.update({s: a.option_strings[0] for s in a.option_strings})
    for flag, value in zip(argv, argv[1:]):
        if flag in switches and value.lower() in _BOOL_WORDS:
            on = switches[flag]
            parser.error(f"{flag} takes no value: write {on} to turn it on, --no-{on[2:]} to turn it off")


def flag_message(message: str, names) -> str:
    """A config error in the command line's words: field names become their flags
    (`max_num_seqs=0 must be ...` -> `--max-num-seqs=0 must be ...`)."""
    for name in sorted(names, key=len, reverse=True):
        if name == "model":
            continue
        pattern = rf"(?<![\w-]){name}\b" if "_" in name else rf"(?<![\w-]){name}(?==)"
        message = re.sub(pattern, flag_name(name), message)
    return message


def from_cli_args(args: argparse.Namespace) -> EngineConfig:
    """The grouped EngineConfig of the parsed flags (a knob without a flag in `args` keeps its
    default); a bad value is a ConfigError in the flags' words."""
    try:
        sections = {name: {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
                    for name, cls in SECTIONS.items()}
        return EngineConfig(model=args.model, **sections)
    except ConfigError as exc:
        raise type(exc)(flag_message(str(exc), EngineConfig.field_names())) from None
