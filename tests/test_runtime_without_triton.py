"""The runtime install has no triton (scripts/install.sh without --test, a CPU machine): `moet
--help`, `moet generate` on the shipped moet-tiny and the server app answering a chat completion
must all work there. Each runs in a subprocess whose import system refuses `triton` and
`triton.*` (a meta-path finder that raises ImportError), and a CPU run must import no *_triton
kernel module either.

Nor has it what only the `test` extra installs (pytest, openai, lm-eval and everything they pull
in: requests, aiohttp, pandas, datasets, ...): the same finder refuses every module that the test
extra's dependency closure brings and the runtime dependencies' closure does not (pyproject.toml
read here, the installed packages' metadata followed), so a runtime path that came to need one
fails here although the test environment has it."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.slow

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _closure(requirements: list[str]) -> set[str]:
    """The installed distributions these requirements reach (canonical names), each one's
    requested extras followed; a requirement whose marker is false here, or one that is not
    installed, ends its branch."""
    extras: dict[str, frozenset[str]] = {}
    todo = [r for r in map(Requirement, requirements) if r.marker is None or r.marker.evaluate({"extra": ""})]
    while todo:
        req = todo.pop()
        name, wanted = canonicalize_name(req.name), frozenset(req.extras)
        if name in extras and wanted <= extras[name]:
            continue
        extras[name] = extras.get(name, frozenset()) | wanted
        try:
            requires = importlib.metadata.distribution(req.name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for r in map(Requirement, requires):
            if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in ("", *extras[name])):
                todo.append(r)
    return set(extras)


def _test_extra_only_modules() -> set[str]:
    """Top-level modules whose every providing distribution only the test extra brings."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    only = _closure(project["dependencies"] + project["optional-dependencies"]["test"]) - \
        _closure(project["dependencies"])
    return {m for m, dists in importlib.metadata.packages_distributions().items()
            if dists and all(canonicalize_name(d) in only for d in dists)}


REFUSED = sorted(_test_extra_only_modules() | {"triton"})

RUNTIME_INSTALL = textwrap.dedent('''
    import sys

    REFUSED = frozenset(__REFUSED__)

    class _RuntimeInstall:
        """As on a machine where triton and the test extra's packages are not installed."""
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in REFUSED:
                raise ModuleNotFoundError(f"No module named {name!r} (refused by the test)", name=name)
            return None

    sys.meta_path.insert(0, _RuntimeInstall())

    def imported_triton():
        return sorted(m for m in sys.modules if m == "triton" or m.startswith("triton.")
                      or (m.startswith("moet.kernels.") and m.endswith("_triton")))
''').replace("__REFUSED__", repr(REFUSED))


def _python(code: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RUNTIME_INSTALL + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_the_finder_refuses_triton():
    proc = _python("import triton")
    assert proc.returncode != 0 and "refused by the test" in proc.stderr


def test_the_finder_refuses_what_only_the_test_extra_installs():
    test_only = {"pytest", "hypothesis", "openai"}
    if importlib.util.find_spec("lm_eval") is not None:    # the GPU run goes without it (docs/testing.md)
        test_only |= {"lm_eval", "aiohttp", "datasets"}
    assert test_only <= set(REFUSED)
    assert not {"torch", "transformers", "fastapi", "uvicorn", "pydantic", "numpy", "moet"} & set(REFUSED)
    proc = _python("import " + ", ".join(sorted(test_only)))
    assert proc.returncode != 0 and "refused by the test" in proc.stderr


def test_cli_help():
    out = _ok(_python('''
        import runpy
        sys.argv = ["moet", "--help"]
        try:
            runpy.run_module("moet.cli", run_name="__main__")
        except SystemExit as e:
            assert e.code in (0, None), e.code
        print("IMPORTED", imported_triton())
    '''))
    assert "serve" in out and "generate" in out
    assert "IMPORTED []" in out


def test_generate_on_moet_tiny_and_a_served_chat_completion():
    out = _ok(_python('''
        import contextlib, io, json
        from moet.cli import main

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = main(["generate", "--device", "cpu", "--prompt", "The capital of Poland is", "--max-tokens", "4",
                       "--ignore-eos", "--json"])
        assert rc == 0, rc
        gen = json.loads(buf.getvalue().strip().splitlines()[-1])

        from starlette.testclient import TestClient
        from moet.assets import default_model
        from moet.config import EngineConfig
        from moet.serve.serve_cli import build_server_app
        from moet.serve.serve_config import ServeConfig

        app = build_server_app(EngineConfig(model=str(default_model()), device="cpu", expert_format="fp4",
                                            max_model_len=256, max_num_seqs=2),
                               ServeConfig(engine_process="false"))
        with TestClient(app) as client:
            r = client.post("/v1/chat/completions", json={
                "model": "moet-tiny", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of Poland?"}]})
        print("RESULT", json.dumps({"generate": gen, "status": r.status_code, "chat": r.json(),
                                    "imported": imported_triton()}))
    '''))
    res = json.loads(out.split("RESULT ", 1)[1])
    assert res["imported"] == []
    assert len(res["generate"]["token_ids"]) == 4 and isinstance(res["generate"]["text"], str)
    assert res["status"] == 200, res["chat"]
    choice = res["chat"]["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert res["chat"]["usage"]["completion_tokens"] == 4 or choice["finish_reason"] == "stop"
