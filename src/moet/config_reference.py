"""docs/config.md, generated from the fields of EngineConfig and ServeConfig (their `help` and
`doc` metadata, types, defaults and choices), so the reference cannot drift from the flags.

    python -m moet.config_reference docs/config.md     # rewrite it after changing a field
    python -m moet.config_reference --check docs/config.md

tests/test_cli_config_doc.py fails when the file and the fields disagree.
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from dataclasses import fields

from moet.config import GROUP_ADVANCED, GROUPS, EngineConfig, _field_kind, default_text, flag_name, metavar

_INTRO = """\
# Configuration reference

<!-- Generated from the fields of EngineConfig (src/moet/config.py) and ServeConfig
(src/moet/serve/serve_config.py) by `python -m moet.config_reference docs/config.md`; edit the
fields' help and doc there, not this file (tests/test_cli_config_doc.py checks the two agree). -->

Every engine setting is a field of `EngineConfig`: an `LLM(...)` keyword of the same name and a
flag of `moet serve` and `moet generate` with dashes (`max_num_seqs` -> `--max-num-seqs`). The
server's own settings (`ServeConfig`) are flags of `moet serve` only.

- Switches (on/off settings) take no value: `--enforce-eager` turns one on, `--no-enforce-eager`
  turns it off. From Python they are booleans: `LLM(path, enforce_eager=True)`.
- A setting with a list of names takes one or more values: `--served-model-name a b`.
- `moet serve --help` and `moet generate --help` show the common flags; `--help-all` shows every
  flag with its one-line summary. Every value is checked before the model loads; a bad one is
  one `moet: error: ...` line, exit status 2.

Settings by group: """


def _anchor(title: str) -> str:
    return "".join(c for c in title.lower().replace(" ", "-") if c.isalnum() or c == "-")


def _entry(f, owner: str) -> list[str]:
    md = f.metadata
    kind = _field_kind(f)[0]
    if f.name == "model":
        lines = ["### `MODEL` (the positional argument)", ""]
    else:
        value = "" if kind == "bool" else " " + metavar(f) + ("..." if kind == "list" else "")
        head = f"`{flag_name(f.name)}` / `--no-{f.name.replace('_', '-')}`" if kind == "bool" else \
            f"`{flag_name(f.name)}{value}`"
        lines = [f"### {head}", ""]
    facts = []
    if owner == "EngineConfig":
        facts.append(f"`LLM({f.name}=...)`")
    else:
        facts.append("`moet serve` only")
    if f.name == "model":
        facts.append("default: the shipped moet-tiny (`moet serve`, `moet generate`); required in `LLM(...)`")
    else:
        shown = default_text(f)
        facts.append(f"default: {'unset' if shown is None else '`' + shown + '`'}")
    if md.get("choices"):
        facts.append("one of: " + ", ".join(f"`{c}`" for c in md["choices"]))
    summary = md.get("help", "").rstrip(".")
    lines += [_fill("; ".join(facts) + "."), "", _fill(summary[:1].upper() + summary[1:] + ".")]
    if md.get("doc"):
        lines += ["", _fill(md["doc"])]
    lines.append("")
    return lines


def _fill(text: str) -> str:
    return textwrap.fill(text, width=100, break_long_words=False, break_on_hyphens=False)


def render() -> str:
    from moet.serve.serve_config import ServeConfig

    entries: dict[str, list[tuple]] = {g: [] for g in GROUPS}
    for cls in (EngineConfig, ServeConfig):
        for f in fields(cls):
            group = f.metadata.get("group") or GROUP_ADVANCED
            entries.setdefault(group, []).append((f, cls.__name__))
    groups = [g for g in entries if entries[g]]
    titles = {g: g.split(" (")[0] for g in groups}
    out = [_INTRO + ", ".join(f"[{titles[g]}](#{_anchor(titles[g])})" for g in groups) + ".", ""]
    for g in groups:
        out += [f"## {titles[g]}", ""]
        if titles[g] != g:                            # the group's note: "name (note)"
            note = g[len(titles[g]) + 2:-1]
            out += [_fill(note[:1].upper() + note[1:] + "."), ""]
        for f, owner in entries[g]:
            out += _entry(f, owner)
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moet.config_reference", description=__doc__.split("\n")[0])
    ap.add_argument("path", help="the file to write (docs/config.md)")
    ap.add_argument("--check", action="store_true", help="only compare: exit 1 when the file differs")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        try:
            with open(args.path) as fh:
                same = fh.read() == text
        except OSError:
            same = False
        if not same:
            print(f"{args.path} is out of date: python -m moet.config_reference {args.path}", file=sys.stderr)
        return 0 if same else 1
    with open(args.path, "w") as fh:
        fh.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
