"""What the Triton kernel tests share: whether triton is importable, whether it bundles the
ptxas that an sm_90 compile check needs, and the guard that the interpreter switch was set in
time (tests/conftest.py sets TRITON_INTERPRET=1 before any test module imports triton)."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
requires_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")


def has_bundled_ptxas() -> bool:
    spec = importlib.util.find_spec("triton")
    return bool(spec and spec.origin and (Path(spec.origin).parent / "backends/nvidia/bin/ptxas").exists())


requires_ptxas = pytest.mark.skipif(HAVE_TRITON and not has_bundled_ptxas(),
                                    reason="triton has no bundled ptxas to compile with")

if HAVE_TRITON and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    # triton.language's helpers are decorated at import: a late switch leaves them in compiled
    # mode ("outside of a kernel"), so fail loudly instead of testing the wrong thing
    raise RuntimeError("no GPU and TRITON_INTERPRET is not 1: tests/conftest.py should have set it "
                       f"before triton was imported (triton already imported: {'triton' in sys.modules})")
