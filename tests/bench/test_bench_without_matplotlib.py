"""matplotlib is the `bench` extra, not a dependency: `moet bench` without it still writes
bench.json and bench.md and says in one line how to get the plots; `moet --help` never imports
it. Each runs in a subprocess whose import system refuses matplotlib (a meta-path finder that
raises ImportError), as on a machine where it is not installed."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

NO_MATPLOTLIB = textwrap.dedent('''
    import sys

    class _NoMatplotlib:
        def find_spec(self, name, path=None, target=None):
            if name == "matplotlib" or name.startswith("matplotlib."):
                raise ImportError(f"No module named {name!r} (refused by the test)")
            return None

    sys.meta_path.insert(0, _NoMatplotlib())
''')


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_MATPLOTLIB + textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300)


def test_the_finder_refuses_matplotlib():
    proc = _python("import matplotlib")
    assert proc.returncode != 0 and "refused by the test" in proc.stderr


def test_bench_writes_json_and_markdown_and_says_how_to_get_plots(tmp_path):
    proc = _python(f'''
        from moet.cli import main
        rc = main(["bench", "decode", "--shape", "micro", "--device", "cpu", "--batch", "1", "--decode-tokens", "4",
                   "--prompt-len", "8", "--out", {str(tmp_path)!r}])
        print("RC", rc, "IMPORTED", sorted(m for m in sys.modules if m.startswith("matplotlib")))
    ''')
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RC 0 IMPORTED []" in proc.stdout
    assert proc.stdout.count("pip install 'moet[bench]'") == 1
    res = json.loads((tmp_path / "bench.json").read_text())
    assert [r["batch"] for r in res["rows"]] == [1] and res["rows"][0]["tok_s"] > 0
    assert "## decode" in (tmp_path / "bench.md").read_text()
    assert not list(tmp_path.glob("*.png"))


def test_cli_help_does_not_import_matplotlib():
    proc = _python('''
        import runpy
        sys.argv = ["moet", "--help"]
        try:
            runpy.run_module("moet.cli", run_name="__main__")
        except SystemExit as e:
            assert e.code in (0, None), e.code
        print("IMPORTED", sorted(m for m in sys.modules if m.startswith("matplotlib")))
    ''')
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "bench" in proc.stdout and "IMPORTED []" in proc.stdout
