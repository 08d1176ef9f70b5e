"""The nvfp4 KV paths of the attention kernels and the nvfp4 KV write compile for sm_90 on this
CPU machine: runs tests/kernels/aot_compile_nvfp4.py in a subprocess (this process runs Triton's
interpreter, and an interpreted kernel cannot be compiled)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.kernels.triton_support import requires_ptxas, requires_triton

ROOT = Path(__file__).resolve().parents[2]


@requires_triton
@requires_ptxas
def test_nvfp4_kv_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-m", "tests.kernels.aot_compile_nvfp4"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    lines = r.stdout.splitlines()
    assert sum(line.startswith(("gqa split nvfp4", "gqa prefill nvfp4")) for line in lines) == 3, r.stdout
    assert sum(line.startswith(("mla split nvfp4", "mla prefill nvfp4")) for line in lines) == 3, r.stdout
    assert sum(line.startswith("kv write nvfp4") for line in lines) == 2, r.stdout
