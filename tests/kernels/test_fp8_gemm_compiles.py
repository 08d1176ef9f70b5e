"""The FP8 block-128 GEMM kernels compile for sm_90 (H200) on this CPU machine: runs
tests/kernels/aot_compile_fp8.py in a subprocess (this process runs Triton's interpreter)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.kernels.triton_support import requires_ptxas, requires_triton

ROOT = Path(__file__).resolve().parents[2]


@requires_triton
@requires_ptxas
def test_fp8_gemm_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-m", "tests.kernels.aot_compile_fp8"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    lines = r.stdout.splitlines()
    assert sum(line.startswith("fp8 gemm") for line in lines) == 4, r.stdout
    assert sum(line.startswith(("act quant", "split sum")) for line in lines) == 2, r.stdout
