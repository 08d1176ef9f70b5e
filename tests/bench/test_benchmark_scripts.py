"""Every script in benchmarks/ (outside the package) runs as `python benchmarks/.../X.py --help`
from the repository root: its imports resolve and its usage says what it measures."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "benchmarks").rglob("*.py"))


def test_the_scripts_are_found():
    assert {"benchmarks/kernels/benchmark_moe.py", "benchmarks/kernels/tune_moe.py",
            "benchmarks/kernels/benchmark_attention.py", "benchmarks/kernels/benchmark_fp8_gemm.py",
            "benchmarks/benchmark_store.py", "benchmarks/benchmark_formats.py",
            "benchmarks/benchmark_serve_overhead.py", "benchmarks/benchmark_prefetch_accuracy.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script):
    proc = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage:") and "--help" in proc.stdout
