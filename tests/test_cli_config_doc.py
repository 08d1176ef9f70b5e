"""docs/config.md is generated from EngineConfig's knobs (its sub-configs' fields) and ServeConfig's
fields: it must match them (regenerate with `python -m moet.config_reference docs/config.md`),
describe every flag, and list each knob in its sub-config's section."""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from moet.config import SECTIONS, EngineConfig
from moet.config.engine import KNOB_SECTION
from moet.config_reference import main as reference_main
from moet.config_reference import render
from moet.serve.serve_config import ServeConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def test_docs_config_md_matches_the_fields():
    assert DOC.read_text() == render(), "docs/config.md is stale: python -m moet.config_reference docs/config.md"


def test_every_field_has_an_entry_with_its_default_and_text():
    text = render()
    sections = text.split("\n### ")[1:]
    by_flag = {}
    for sec in sections:
        head = sec.split("\n", 1)[0]
        flag = head.split("`")[1].split(" ")[0]
        by_flag[flag] = (head, " ".join(sec.split()))      # the entry on one line: a fact may wrap
    for cls, knobs in ((EngineConfig, EngineConfig.knob_fields()), (ServeConfig, fields(ServeConfig))):
        for f in knobs:
            flag = "MODEL" if f.name == "model" else "--" + f.name.replace("_", "-")
            head, sec = by_flag.pop(flag)
            assert f.metadata["doc"].split()[0] in sec, f.name
            if str(f.type) == "bool":
                assert f"`--no-{f.name.replace('_', '-')}`" in head
                assert f"default: `{'on' if f.default else 'off'}`" in sec
            elif f.name != "model":
                assert ("default: unset" if f.default is None else f"default: `{f.default}`") in sec, f.name
            for c in f.metadata.get("choices") or ():
                assert f"`{c}`" in sec
            assert (f"`LLM({f.name}=...)`" in sec) == (cls is EngineConfig)
            if f.name in KNOB_SECTION:
                assert f"`EngineConfig.{KNOB_SECTION[f.name]}.{f.name}`" in sec, f.name
    assert not by_flag                                     # no entry for a field that does not exist


def test_each_knob_is_listed_under_its_sub_config():
    """One `## title` section per sub-config (the model's first, holding MODEL), each knob in its own."""
    text = render()
    chapters = {c.split("\n", 1)[0]: c for c in text.split("\n## ")[1:]}
    for name, cls in SECTIONS.items():
        chapter = chapters[cls.title.split(" (")[0]]
        assert f"`EngineConfig.{name}`" in chapter and f"`{cls.__name__}`" in chapter
        for f in fields(cls):
            assert f"`EngineConfig.{name}.{f.name}`" in chapter, f.name
    assert "### `MODEL`" in chapters["model"] and list(chapters)[:2] == ["model", "server"]


def test_check_mode_reports_a_stale_file(tmp_path, capsys):
    stale = tmp_path / "config.md"
    stale.write_text(render().replace("--enforce-eager", "--enforce-eagre", 1))
    assert reference_main(["--check", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert reference_main([str(stale)]) == 0 and reference_main(["--check", str(stale)]) == 0
