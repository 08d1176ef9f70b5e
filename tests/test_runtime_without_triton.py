"""The runtime install has no triton (scripts/install.sh without --test, a CPU machine): `moet
--help`, `moet generate` on the shipped moet-tiny and the server app answering a chat completion
must all work there. Each runs in a subprocess whose import system refuses `triton` and
`triton.*` (a meta-path finder that raises ImportError), and a CPU run must import no *_triton
kernel module either."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

NO_TRITON = textwrap.dedent('''
    import sys

    class _NoTriton:
        """As on a machine where triton is not installed."""
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ImportError(f"No module named {name!r} (refused by the test)")
            return None

    sys.meta_path.insert(0, _NoTriton())

    def imported_triton():
        return sorted(m for m in sys.modules if m == "triton" or m.startswith("triton.")
                      or (m.startswith("moet.kernels.") and m.endswith("_triton")))
''')


def _python(code: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_TRITON + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_the_finder_refuses_triton():
    proc = _python("import triton")
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
