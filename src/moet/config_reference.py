"""docs/config.md, generated from the knobs of EngineConfig's sub-configs and ServeConfig's fields
(their `help` and `doc` metadata, types, defaults and choices), one section per sub-config, so the
reference cannot drift from the flags.

    python -m moet.config_reference docs/config.md     # rewrite it after changing a field
    python -m moet.config_reference --check docs/config.md

tests/test_cli_config_doc.py fails when the file and the fields disagree.
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from dataclasses import fields

from moet.config import GROUP_MODEL, GROUP_SERVER, SECTIONS, EngineConfig, default_text, field_kind, flag_name, metavar

_INTRO = """\
# Configuration reference

<!-- Generated from the knobs of EngineConfig's sub-configs (src/moet/config/) and ServeConfig
(src/moet/serve/serve_config.py) by `python -m moet.config_reference docs/config.md`; edit the
knobs' help and doc there, not this file (tests/test_cli_config_doc.py checks the two agree). -->

Every engine setting is a knob of one of `EngineConfig`'s sub-configs, grouped by what it controls
(`EngineConfig.cache.block_size`, `EngineConfig.scheduler.max_num_seqs`); each is also an
`LLM(...)` keyword of the same name and a flag of `moet serve` and `moet generate` with dashes
(`max_num_seqs` -> `--max-num-seqs`). The server's own settings (`ServeConfig`) are flags of
`moet serve` only.

- From Python, flat keywords and sub-configs mix: `EngineConfig(model=path, max_num_seqs=8,
  cache=CacheConfig(block_size=32))`; a flat keyword applies on top of the sub-config it belongs
  to. `LLM(path, **keywords)` takes the same keywords.

- Switches (on/off settings) take no value: `--enforce-eager` turns one on, `--no-enforce-eager`
  turns it off. From Python they are booleans: `LLM(path, enforce_eager=True)`.
- A setting with a list of names takes one or more values: `--served-model-name a b`.
- `moet serve --help` and `moet generate --help` show the common flags; `--help-all` shows every
  flag with its one-line summary. Every value is checked before the model loads; a bad one is
  one `moet: error: ...` line, exit status 2.

Settings by group: """


def _anchor(title: str) -> str:
    return "".join(c for c in title.lower().replace(" ", "-") if c.isalnum() or c == "-")


def _entry(f, owner: str | None) -> list[str]:
    """One knob's entry; owner: its EngineConfig attribute (`cache`, ...; "" for `model`), None for
    ServeConfig's fields."""
    md = f.metadata
    kind = field_kind(f)[0]
    if f.name == "model":
        lines = ["### `MODEL` (the positional argument)", ""]
    else:
        value = "" if kind == "bool" else " " + metavar(f) + ("..." if kind == "list" else "")
        head = f"`{flag_name(f.name)}` / `--no-{f.name.replace('_', '-')}`" if kind == "bool" else \
            f"`{flag_name(f.name)}{value}`"
        lines = [f"### {head}", ""]
    facts = []
    if owner is not None:
        facts.append(f"`LLM({f.name}=...)`")
        if owner:
            facts.append(f"`EngineConfig.{owner}.{f.name}`")
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

    # (title, its note, its about paragraph, [(field, owner)]): the model first (MODEL and LoadConfig),
    # the server, then the other sub-configs, as `--help` shows them.
    load = SECTIONS["load"]
    sections = [(GROUP_MODEL, load.about, [(fields(EngineConfig)[0], "")] + [(f, "load") for f in fields(load)]),
                (GROUP_SERVER, "`moet serve` only. From Python: `ServeConfig` (src/moet/serve/serve_config.py).",
                 [(f, None) for f in fields(ServeConfig)])]
    sections += [(cls.title, cls.about, [(f, name) for f in fields(cls)]) for name, cls in SECTIONS.items()
                 if name != "load"]
    titles = [t.split(" (")[0] for t, _, _ in sections]
    out = [_INTRO + ", ".join(f"[{t}](#{_anchor(t)})" for t in titles) + ".", ""]
    for (title, about, entries), short in zip(sections, titles):
        out += [f"## {short}", ""]
        if short != title:                            # the group's note: "name (note)"
            note = title[len(short) + 2:-1]
            out += [_fill(note[:1].upper() + note[1:] + "."), ""]
        out += [_fill(about), ""]
        for f, owner in entries:
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
