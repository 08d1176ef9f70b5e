"""Every `moet serve` / `moet generate` argument is checked before the model loads (one
`moet: error:` line, exit 2); the port is bound before the engine loads and "serving at" is printed
once it listens; a Hugging Face repo id is found in the local cache or refused with how to get it."""
from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from moet.assets import default_model
from moet.checkpoint.reader import CheckpointReader
from moet.checkpoint.resolve import resolve_checkpoint
from moet.cli import main as moet_main
from moet.errors import CheckpointError, MoetError


class _Loaded(MoetError):
    """Raised by the stand-ins below: reaching it means the model would have loaded."""


@pytest.fixture
def no_load(monkeypatch):
    """The model loaders replaced by a recorder that stops the command (the real ones take seconds)."""
    calls = []

    def loader(*args, **kwargs):
        calls.append((args, kwargs))
        raise _Loaded("load reached")

    import moet.llm
    import moet.serve.serve_cli
    monkeypatch.setattr(moet.serve.serve_cli, "build_server_app", loader)
    monkeypatch.setattr(moet.llm, "LLM", loader)
    return calls


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err                                   # one line, no traceback
    assert err[0].startswith("moet: error: ")
    return err[0]


@pytest.mark.parametrize("argv,expect", [
    (["generate", "--max-tokens", "-3"], "--max-tokens=-3 must be >= 1"),
    (["generate", "--temperature", "-1"], "--temperature=-1.0 must be >= 0"),
    (["generate", "--prompt", ""], "--prompt is empty"),
    (["generate", "--max-num-seqs", "0"], "--max-num-seqs=0 must be a positive integer"),
    (["generate", "--device", "tpu"], "--device='tpu' is not supported"),
    (["serve", "--port", "70000"], "--port=70000 must be in 1..65535"),
    (["serve", "--api-key", ""], "--api-key is empty"),
    (["serve", "--api-key", "  "], "--api-key is empty"),
    (["serve", "--tool-call-parser", "glm99"], "glm99"),
    (["serve", "--reasoning-parser", "thinking"], "thinking"),
    (["serve", "--max-num-batched-tokens", "8"], "--max-num-batched-tokens=8 must be >= --max-num-seqs=64"),
    (["serve", "--served-model-name", ""], "--served-model-name=[''] must be one or more non-empty names"),
    (["serve", "/nonexistent/ckpt"], "/nonexistent/ckpt: checkpoint directory not found"),
    (["serve", "--chat-template", "/no/such/template.jinja"], "--chat-template /no/such/template.jinja: no such file"),
    (["serve", "--chat-template", "{% for m in messages %}{{ m.content }"], "not a valid Jinja template"),
])
def test_bad_arguments_stop_before_the_model_loads(argv, expect, no_load, capsys):
    assert moet_main(argv) == 2
    assert expect in _error_line(capsys)
    assert not no_load                                          # nothing was loaded


def test_argparse_level_mistakes_are_usage_errors(capsys):
    for argv in (["serve", "--port", "http"], ["generate", "--max-tokens", "many"], ["serve", "--expert-format",
                                                                                       "int3"]):
        with pytest.raises(SystemExit) as e:
            moet_main(argv)
        assert e.value.code == 2
        assert "Traceback" not in capsys.readouterr().err


def _listening() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_port_in_use_is_found_before_loading(no_load, capsys):
    with _listening() as taken:
        port = taken.getsockname()[1]
        assert moet_main(["serve", "--port", str(port)]) == 2
        line = _error_line(capsys)
        assert f"--port {port}" in line and "already in use" in line
        assert not no_load
        # the arguments come first: a bad one is reported even with the port taken
        assert moet_main(["serve", "--port", str(port), "--max-num-seqs", "0"]) == 2
        assert "--max-num-seqs" in _error_line(capsys)


def test_port_is_bound_before_the_engine_loads_and_released_after(monkeypatch, no_load, capsys):
    import moet.serve.serve_cli as serve_cli

    with socket.socket() as probe:                              # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    seen = []

    def loader(engine_config, serve_config, **kwargs):
        with socket.socket() as other:                          # held by moet while the model loads
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            seen.append(other.connect_ex(("127.0.0.1", port)))  # bound, not listening yet: refused
            with pytest.raises(OSError):
                other.bind(("127.0.0.1", port))
                other.listen()
        raise _Loaded("stop")

    monkeypatch.setattr(serve_cli, "build_server_app", loader)
    assert moet_main(["serve", "--port", str(port)]) == 2
    assert _error_line(capsys) == "moet: error: stop"
    assert seen and seen[0] != 0                                # connections refused while loading
    with socket.socket() as again:                              # closed on the way out
        again.bind(("127.0.0.1", port))
    assert moet_main(["serve", "--host", "203.0.113.7", "--port", str(port)]) == 2   # TEST-NET-3: not ours
    assert "--host 203.0.113.7" in _error_line(capsys)


def test_serving_at_is_printed_once_the_socket_listens(monkeypatch, capsys):
    """The real start-up with a stand-in engine: when "serving at" is printed a client can connect."""
    import threading

    import moet.serve.serve_cli as serve_cli
    from moet.config import EngineConfig
    from moet.serve.serve_config import ServeConfig
    from tests.serve.fake_engine import FakeAsyncEngine

    real_build, real_make = serve_cli.build_server_app, serve_cli._make_server
    monkeypatch.setattr(serve_cli, "build_server_app",
                        lambda ec, sc, **kw: real_build(EngineConfig(model=default_model()), sc, engine=FakeAsyncEngine(), **kw))
    state = {}

    def make(config, on_started):
        def started():
            with socket.create_connection(("127.0.0.1", state["port"]), timeout=2):
                state["connected"] = True                       # the socket listens when the line is printed
            on_started()
            server.should_exit = True
        server = real_make(config, started)
        return server

    monkeypatch.setattr(serve_cli, "_make_server", make)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        state["port"] = probe.getsockname()[1]
    result = {}
    t = threading.Thread(target=lambda: result.update(rc=moet_main(["serve", "--port", str(state["port"])])))
    t.start()
    t.join(timeout=120)
    assert not t.is_alive() and result["rc"] == 0
    out = capsys.readouterr().out
    assert state.get("connected") and out.count("moet: serving moet-tiny at http://127.0.0.1:") == 1


# ---- Hugging Face repo ids

def _fake_cache(root: Path, repo: str, files) -> Path:
    """The Hugging Face hub cache layout: models--org--name/{refs/main, snapshots/<commit>/...}."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snap.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(snap.name)
    for f in files:
        (snap / f.name).symlink_to(f)
    return snap


def test_repo_id_without_a_local_copy_says_how_to_download(tmp_path, monkeypatch, no_load, capsys):
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(CheckpointError) as e:
        resolve_checkpoint("Qwen/Qwen3-30B-A3B")
    msg = str(e.value)
    assert "hf download Qwen/Qwen3-30B-A3B --local-dir" in msg and "huggingface-cli download" in msg
    assert "local checkpoints" in msg
    assert moet_main(["serve", "Qwen/Qwen3-30B-A3B"]) == 2
    assert "hf download Qwen/Qwen3-30B-A3B" in _error_line(capsys) and not no_load
    assert moet_main(["generate", "Qwen/Qwen3-30B-A3B"]) == 2
    assert "hf download" in _error_line(capsys) and not no_load
    assert moet_main(["inspect", "Qwen/Qwen3-30B-A3B"]) == 2
    assert "hf download" in _error_line(capsys)


def test_repo_id_in_the_hf_cache_is_used(tmp_path, monkeypatch, no_load, capsys):
    import huggingface_hub.constants

    import moet.serve.serve_cli as serve_cli
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    snap = _fake_cache(tmp_path, "acme/tiny-moe", sorted(Path(default_model()).iterdir()))
    assert resolve_checkpoint("acme/tiny-moe") == str(snap)
    reader = CheckpointReader.open("acme/tiny-moe")              # the reader resolves repo ids too
    assert reader.path == os.path.abspath(snap) and reader.tensors
    seen = {}

    def loader(engine_config, serve_config, **kwargs):
        seen.update(model=engine_config.model, names=serve_config.served_model_name)
        raise _Loaded("stop")

    monkeypatch.setattr(serve_cli, "build_server_app", loader)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert moet_main(["serve", "acme/tiny-moe", "--port", str(port)]) == 2
    assert seen == {"model": str(snap), "names": ["acme/tiny-moe"]}
    assert moet_main(["serve", "acme/tiny-moe", "--port", str(port), "--served-model-name", "tiny"]) == 2
    assert seen["names"] == ["tiny"]
    capsys.readouterr()
    assert moet_main(["inspect", "acme/tiny-moe"]) == 0
    assert "deepseek_v3" in capsys.readouterr().out


def test_partial_cache_and_wrong_paths(tmp_path, monkeypatch):
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    _fake_cache(tmp_path / "hub", "acme/half", [Path(default_model()) / "config.json"])
    with pytest.raises(CheckpointError, match="holds only part of this repo.*hf download acme/half"):
        resolve_checkpoint("acme/half")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        resolve_checkpoint(str(tmp_path / "file.txt"))
    with pytest.raises(CheckpointError, match="checkpoint directory not found"):
        resolve_checkpoint(str(tmp_path / "missing"))
    assert resolve_checkpoint(default_model()) == default_model()
