"""The Triton paged attention kernels compile for sm_90 (H200) on this CPU machine: runs
tests/kernels/aot_compile.py in a subprocess, since the interpreter tests set TRITON_INTERPRET
for this process and an interpreted kernel cannot be compiled."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


from tests.kernels.triton_support import requires_ptxas, requires_triton
ROOT = Path(__file__).resolve().parents[2]


@requires_triton
@requires_ptxas
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-m", "tests.kernels.aot_compile"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    lines = r.stdout.splitlines()
    assert sum(line.startswith(("gqa split", "mla split")) for line in lines) == 6, r.stdout
    assert sum(line.startswith("merge") for line in lines) == 2, r.stdout      # GQA and MLA row widths
    # one line per (device, shape, num_stages) of the GQA decode launch table
    from moet.kernels.attention_configs import load_table
    entries = [e["num_stages"] for k in load_table()["devices"].values() for e in k["gqa_decode"].values()]
    want = sum(len(set(s.values())) if isinstance(s, dict) else 1 for s in entries)
    assert want and sum(line.startswith("gqa table") for line in lines) == want, r.stdout
    assert sum(line.startswith("gqa prefill") for line in lines) == 3, r.stdout
    assert sum(line.startswith("gqa fp32-q prefill") for line in lines) == 3, r.stdout
    assert sum(line.startswith("mla prefill *") for line in lines) == 3, r.stdout
    assert sum(line.startswith("mla prefill heads-M") for line in lines) == 2, r.stdout
    assert sum(line.startswith("mla heads-M") for line in lines) == 2, r.stdout
    assert sum(line.startswith(("mla fp32-q split", "mla fp32-q prefill")) for line in lines) == 6, r.stdout
    assert sum(line.startswith("kv write") for line in lines) == 3, r.stdout
    assert sum(line.startswith("gqa form") for line in lines) == 3, r.stdout       # fp8_words x 2, swap_ab
    assert sum(line.startswith("gqa prefetch") for line in lines) == 2, r.stdout   # bf16, fp8 words
    assert sum(line.startswith("gqa long partition") for line in lines) == 1, r.stdout
    assert [line for line in lines if line.startswith("gqa sinks")] == ["gqa sinks True True True True"], r.stdout
