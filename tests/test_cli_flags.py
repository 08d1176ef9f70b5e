"""`moet serve` / `moet generate` flags as a vLLM / llama.cpp user expects them: switches without a
value (`--x` / `--no-x`) for every bool field, lists as several values, a short grouped `--help`
with `--help-all` for the rest, help lines without run notes."""
from __future__ import annotations

import argparse
import re
from dataclasses import fields

import pytest

from moet.cli import main as moet_main
from moet.config import EngineConfig, add_cli_arguments, from_cli_args
from moet.errors import ConfigError
from moet.serve.serve_config import ServeConfig, add_serve_arguments, serve_config_from_args


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_cli_arguments(p)
    add_serve_arguments(p)
    return p


def _bool_fields(cls):
    knobs = cls.knob_fields() if cls is EngineConfig else fields(cls)
    return [f for f in knobs if str(f.type) == "bool"]


def test_every_bool_field_is_a_switch_pair():
    p = _serve_parser()
    engine_bools, serve_bools = _bool_fields(EngineConfig), _bool_fields(ServeConfig)
    assert len(engine_bools) >= 15 and len(serve_bools) >= 2      # the fields this test is about exist
    for cls, bools, build in ((EngineConfig, engine_bools, from_cli_args), (ServeConfig, serve_bools,
                                                                           serve_config_from_args)):
        for f in bools:
            flag = "--" + f.name.replace("_", "-")
            on = build(p.parse_args(["m", flag]))
            off = build(p.parse_args(["m", "--no-" + flag[2:]]))
            default = build(p.parse_args(["m"]))
            assert getattr(on, f.name) is True and getattr(off, f.name) is False, f.name
            assert getattr(default, f.name) == f.default, f.name


def test_switches_map_to_the_same_config_as_llm_keywords():
    p = _serve_parser()
    cfg = from_cli_args(p.parse_args(["m", "--no-load-mtp", "--enforce-eager", "--no-enable-prefix-caching",
                                      "--rebuild-pack", "--max-num-seqs", "8"]))
    assert cfg == EngineConfig(model="m", load_mtp=False, enforce_eager=True, enable_prefix_caching=False,
                               rebuild_pack=True, max_num_seqs=8)


def test_served_model_name_takes_several_values():
    p = _serve_parser()
    assert serve_config_from_args(p.parse_args(["m", "--served-model-name", "a", "b"])).served_model_name == ["a", "b"]
    assert serve_config_from_args(p.parse_args(["m", "--served-model-name", "a"])).served_model_name == ["a"]
    assert serve_config_from_args(p.parse_args(["m"])).served_model_name is None
    with pytest.raises(SystemExit):
        p.parse_args(["m", "--served-model-name"])


@pytest.mark.parametrize("argv", [["serve", "--enforce-eager", "true"], ["generate", "--load-mtp", "false"],
                                  ["serve", "--no-log-requests", "on"]])
def test_old_value_spelling_is_one_line_that_says_the_new_one(argv, capsys):
    with pytest.raises(SystemExit) as e:
        moet_main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    flag = argv[1].replace("--no-", "--")
    assert err[-1].startswith(f"moet {argv[0]}: error: {argv[1]} takes no value")
    assert flag in err[-1] and "--no-" + flag[2:] in err[-1]
    assert len(err) == 2                                   # usage + the error


def test_config_errors_name_the_flag():
    p = _serve_parser()
    with pytest.raises(ConfigError, match=r"^--max-num-batched-tokens=8 must be >= --max-num-seqs=64"):
        from_cli_args(p.parse_args(["m", "--max-num-batched-tokens", "8"]))
    with pytest.raises(ConfigError, match=r"^--port=0 must be in 1\.\.65535"):
        serve_config_from_args(p.parse_args(["m", "--port", "0"]))
    with pytest.raises(ConfigError, match="expert_cache_slots"):    # the Python API keeps the field names
        EngineConfig(model="m", expert_cache_slots=0)


# ---- --help

COMMON_SERVE = ("--port", "--host", "--api-key", "--served-model-name", "--expert-format", "--max-model-len",
                "--gpu-memory-utilization", "--max-num-seqs", "--[no-]enforce-eager", "--help-all")


def _help(argv, capsys, columns=100, monkeypatch=None) -> str:
    with pytest.raises(SystemExit) as e:
        moet_main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_plain_help_is_about_one_screen_and_points_to_the_rest(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    short = _help([command, "--help"], capsys)
    every = _help([command, "--help-all"], capsys)
    assert _help([command, "--help", "all"], capsys) == every
    assert len(short.splitlines()) <= 55, short
    assert len(every.splitlines()) > len(short.splitlines()) + 20
    assert f"moet {command} --help-all" in short and "docs/config.md" in short
    for flag in COMMON_SERVE if command == "serve" else ("--prompt", "--max-tokens", "--temperature",
                                                          "--expert-format", "--help-all"):
        assert flag in short, flag
    for title in ("model:", "memory and KV cache:", "scheduling:", "kernels (how steps run on the GPU"):
        assert f"\n{title}" in short and f"\n{title}" in every
    # every field is in --help-all, only common ones in --help
    names = [f for f in EngineConfig.knob_fields() if f.name != "model"]
    if command == "serve":
        names += list(fields(ServeConfig))
    for f in names:
        shown = ("--[no-]" if str(f.type) == "bool" else "--") + f.name.replace("_", "-")
        assert re.search(re.escape(shown) + r"[ \n]", every), shown
        assert bool(re.search(re.escape(shown) + r"[ \n]", short)) == bool(f.metadata.get("common")), shown
    # one short line per flag at 100 columns: a help text never wraps (an indented line follows only a
    # flag too long to share its line)
    lines = every.splitlines()
    wrapped = [ln for prev, ln in zip(lines, lines[1:]) if re.match(r"^ {30,}\S", ln)
               and not re.fullmatch(r"  \S+( \S+)?", prev)]
    assert not wrapped, wrapped


def test_help_texts_say_what_a_knob_does_not_how_it_measured():
    """No measured figures, run numbers, dates or design-document references in the flags'
    summaries or their reference text (docs/perf.md is where numbers live)."""
    banned = re.compile(r"tok/s|\brun \d|\bruns? \d|\b20\d\d-\d\d|\bSPEC\b|KERNEL-NOTES|developers' guide|"
                        r"\d+(\.\d+)?x\b|\bH200\b|\bissue \d")
    for knobs in (EngineConfig.knob_fields(), fields(ServeConfig)):
        for f in knobs:
            for key in ("help", "doc"):
                text = f.metadata.get(key) or ""
                assert not banned.search(text), (f.name, key, banned.search(text).group(0))
            assert f.metadata.get("help") and f.metadata.get("doc"), f.name
            assert len(f.metadata["help"]) <= 62, (f.name, "a --help line fits next to its flag at 100 columns")
