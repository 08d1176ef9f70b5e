"""Data flows one way (checkpoint -> quant -> store -> model -> engine -> serve, kernels beside) and
no import cycles: the import contracts in pyproject.toml [tool.importlinter] hold for this tree,
and they fail on a back-edge or a cycle added to a copy of it (lazy imports included), so CI
fails on a new one. lint-imports reads the source statically and runs in a subprocess whose
PYTHONPATH puts the tree under test first, ahead of whichever moet is installed."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = {"data-flow": "Data flows one way", "no-cycles": "No import cycles"}
# the console script `lint-imports`, wherever pip put it
LINT = ("import sys; from importlib.metadata import entry_points; "
        "(ep,) = entry_points(group='console_scripts', name='lint-imports'); sys.exit(ep.load()())")


def lint(src: Path, cwd: Path) -> subprocess.CompletedProcess:
    """lint-imports with the repository's contracts over the moet package under `src`."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run([sys.executable, "-c", LINT, "--no-cache", "--no-logo", str(ROOT / "pyproject.toml")],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_tree_keeps_every_import_contract(tmp_path):
    r = lint(ROOT / "src", tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    for name in CONTRACTS.values():
        assert f"{name} KEPT" in r.stdout, r.stdout
    # every source file was read: a folder without __init__.py is a namespace package, whose
    # modules the import graph leaves out, and whose imports no contract would then check
    files = [p for p in (ROOT / "src" / "moet").rglob("*.py") if "__pycache__" not in p.parts]
    analyzed = re.search(r"Analyzed (\d+) files", r.stdout)
    assert analyzed and int(analyzed.group(1)) == len(files), (r.stdout, len(files))


@pytest.mark.parametrize("module,edge,broken", [
    # the back-edges this layout removed: the store reaching up into the model (a cycle too: the
    # model's MoE layers read their experts through the store's ExpertSlots) and the engine
    ("store/replay.py", "from moet.model.layers.router import route", {"data-flow", "no-cycles"}),
    ("store/plan.py", "from moet.engine.expert_residency import store_reason", {"data-flow", "no-cycles"}),
    # the kernels reading a checkpoint type; requantization reaching back into the model
    ("kernels/router_triton.py", "from moet.checkpoint.spec import RouterSpec", {"data-flow"}),
    ("quant/requantize.py", "from moet.model.layers.moe import MoE", {"data-flow", "no-cycles"}),
    # a cycle inside one package, which no layer sees
    ("kernels/pools.py", "from moet.kernels.moe_dispatch import moe_experts", {"no-cycles"}),
])
def test_a_new_back_edge_or_cycle_breaks_its_contract(tmp_path, module, edge, broken):
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "moet", src / "moet", ignore=shutil.ignore_patterns("__pycache__"))
    # a lazy import inside a function: never run, still an edge
    with open(src / "moet" / module, "a") as f:
        f.write(f"\n\ndef _back_edge():\n    {edge}  # noqa: F401\n")
    r = lint(src, tmp_path)
    assert r.returncode != 0, r.stdout + r.stderr
    for cid, name in CONTRACTS.items():
        assert f"{name} {'BROKEN' if cid in broken else 'KEPT'}" in r.stdout, r.stdout
