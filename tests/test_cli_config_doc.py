"""docs/config.md is generated from EngineConfig's and ServeConfig's fields: it must match them
(regenerate with `python -m moet.config_reference docs/config.md`) and describe every flag."""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from moet.config import EngineConfig
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
        by_flag[flag] = sec
    for cls in (EngineConfig, ServeConfig):
        for f in fields(cls):
            flag = "MODEL" if f.name == "model" else "--" + f.name.replace("_", "-")
            sec = by_flag.pop(flag)
            assert f.metadata["doc"].split()[0] in sec, f.name
            if str(f.type) == "bool":
                assert f"`--no-{f.name.replace('_', '-')}`" in sec.split("\n", 1)[0]
                assert f"default: `{'on' if f.default else 'off'}`" in sec
            elif f.name != "model":
                assert ("default: unset" if f.default is None else f"default: `{f.default}`") in sec, f.name
            for c in f.metadata.get("choices") or ():
                assert f"`{c}`" in sec
            assert (f"`LLM({f.name}=...)`" in sec) == (cls is EngineConfig)
    assert not by_flag                                     # no entry for a field that does not exist


def test_check_mode_reports_a_stale_file(tmp_path, capsys):
    stale = tmp_path / "config.md"
    stale.write_text(render().replace("--enforce-eager", "--enforce-eagre", 1))
    assert reference_main(["--check", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert reference_main([str(stale)]) == 0 and reference_main(["--check", str(stale)]) == 0
