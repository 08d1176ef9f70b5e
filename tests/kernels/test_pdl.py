"""Programmatic dependent launch for the step's small kernels (moet.kernels.pdl): off the GPU it
never changes a launch; compiled for sm_90 every small kernel waits for its predecessor before it
touches memory; on a GPU the engine's outputs are bit-identical with it on and off."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels.triton_support import requires_ptxas, requires_triton

pytestmark = requires_triton

from moet.kernels import pdl  # noqa: E402


def test_launch_options_off_the_gpu_and_when_disabled():
    before = pdl.small_kernel_pdl()
    try:
        pdl.set_small_kernel_pdl(True)
        assert pdl.pdl_launch(torch.zeros(2)) == {"PDL": False}          # CPU / interpreter: never
        pdl.set_small_kernel_pdl(False)
        assert pdl.pdl_launch(torch.zeros(2)) == {"PDL": False}
        if torch.cuda.is_available():
            on_gpu = torch.zeros(2, device="cuda")
            assert pdl.pdl_launch(on_gpu) == {"PDL": False}
            pdl.set_small_kernel_pdl(True)
            want = torch.cuda.get_device_capability() >= (9, 0)
            assert pdl.pdl_launch(on_gpu) == ({"PDL": True, "launch_pdl": True} if want else {"PDL": False})
    finally:
        pdl.set_small_kernel_pdl(before)


def test_on_by_default_after_measurement():
    from moet.config import EngineConfig
    # on since run 18 on the H200 (GLM-4.5-Air 1.05x, Qwen3 1.09x single stream, bits unchanged)
    assert EngineConfig(model="x").small_kernel_pdl is True
    assert EngineConfig(model="x", small_kernel_pdl=False).small_kernel_pdl is False


@requires_ptxas
def test_small_kernels_wait_first_under_pdl_for_sm90():
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "src"), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-m", "tests.kernels.aot_compile_small"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [line.split() for line in r.stdout.splitlines()]
    names = {row[0] for row in rows}
    assert names == {"rmsnorm", "qk_norm_rope", "store_kv", "gqa_decode_split", "gqa_decode_fused_merge",
                     "merge_splits", "router_gemv", "router_topk"}, r.stdout
    for name, mode, wait, launch, order, sync in rows:
        assert sync == ("acq-rel" if name == "gqa_decode_fused_merge" else "n/a"), (name, r.stdout)
        if mode == "pdl":
            assert (wait, launch, order) == ("wait", "launch", "wait-first"), (name, r.stdout)
        else:
            assert (wait, launch) == ("-", "-"), (name, r.stdout)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_bit_identical_with_small_kernel_pdl_on_cuda():
    from tests.model.tiny_glm import greedy_outputs

    dev = torch.device("cuda")
    seed = int(torch.seed() % 2**31)
    outs = {}
    try:
        for on in (False, True):
            def flag(eng, model, on=on):
                assert pdl.small_kernel_pdl() is on
            for eager in (True, False):
                outs[on, eager] = greedy_outputs(dev, seed, flag, enforce_eager=eager, small_kernel_pdl=on)
    finally:
        pdl.set_small_kernel_pdl(False)
    assert outs[True, True] == outs[False, True] and outs[True, False] == outs[False, False]
