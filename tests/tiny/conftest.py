"""Fixtures for moet-tiny tests: the shipped checkpoint, read once per session."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # tools/train_tiny is a recipe, not part of the installed package
    sys.path.insert(0, str(REPO))


@pytest.fixture(scope="session")
def ckpt() -> Path:
    from moet.probe.loader import default_checkpoint
    path = default_checkpoint()
    assert (path / "config.json").exists(), f"shipped checkpoint missing at {path}"
    return path


@pytest.fixture(scope="session")
def tensors(ckpt):
    from moet.probe.loader import read_tensors
    return read_tensors(ckpt)


@pytest.fixture(scope="session")
def config(ckpt) -> dict:
    import json
    return json.loads((ckpt / "config.json").read_text())


@pytest.fixture(scope="session")
def tiny_nvfp4(ckpt, tensors):
    """transformers' DeepseekV3ForCausalLM with the NVFP4 experts decoded (fp32, CPU)."""
    import torch
    from moet.probe.loader import load
    torch.manual_seed(0)
    return load(ckpt, "nvfp4", "cpu", tensors=tensors)
