"""FP8 block-128 dense weights kept as e4m3 + scales (Fp8BlockLinear, model/fp8_dense.py), the
GPU path: on CPU through the Triton kernel under TRITON_INTERPRET=1 and the torch reference; on a
GPU the same tests load the model on it (where keep_fp8=None must choose the FP8 path itself).
The CPU default (decode at load) is covered by test_quantized_checkpoints.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moet.checkpoint import open_checkpoint
from moet.errors import CheckpointError
from moet.formats import fp8_block
from moet.kernels.fp8_gemm_reference import fp8_block_gemm_reference
from moet.model import fp8_dense, load_weights
from moet.model.layers.linear import Fp8BlockLinear, Linear
from moet.model.model import CausalLM
from moet.testing.tiny_checkpoint import cached_checkpoint
from tests.kernels.triton_support import requires_triton

PROMPT = torch.tensor(list(range(60, 60 + 24)))
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@requires_triton
@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_module_runs_the_kernel_like_the_reference(mode):
    g = torch.Generator().manual_seed(11)
    w = torch.randn(136, 200, generator=g) * 0.05
    q, s = fp8_block.quantize(w)
    bias = torch.randn(136, generator=g)
    with torch.device(DEVICE):
        layer = Fp8BlockLinear(200, 136, True, torch.float32, mode=mode, backend="triton")
    layer.weight.weight_loader(layer.weight, "fp8_block", {"weight": q, "weight_scale_inv": s}, "test")
    layer.bias.data.copy_(bias)
    assert torch.equal(layer.weight.view(torch.uint8).cpu(), q.view(torch.uint8))
    assert torch.equal(layer.weight_scale_inv.cpu(), s)
    x = torch.randn(3, 200, generator=g)
    out = layer(x.to(DEVICE)).cpu()
    assert _rel(out, fp8_block_gemm_reference(x, q, s, mode=mode, bias=bias)) < 1e-5
    decoded = F.linear(x, fp8_block.dequantize(q, s), bias)      # what the CPU path computes
    assert _rel(out, decoded) < (1e-5 if mode == "w8a16" else 0.05)


def test_loader_rejects_a_non_fp8_weight():
    layer = Fp8BlockLinear(128, 128, False, torch.float32)
    with pytest.raises(CheckpointError, match="FP8 block-128"):
        layer.weight.weight_loader(layer.weight, "float", {"weight": torch.zeros(128, 128)}, "x.weight")
    q, s = fp8_block.quantize(torch.randn(128, 128))
    with pytest.raises(CheckpointError, match="do not match"):
        layer.weight.weight_loader(layer.weight, "fp8_block", {"weight": q, "weight_scale_inv": s[:, :0]}, "x.weight")


def _load(path, keep_fp8: bool | None):
    ckpt = open_checkpoint(path)
    with torch.device(DEVICE):
        model = CausalLM(ckpt.spec, torch.float32, load_mtp=False)
    load_weights(model, ckpt, expert_format="bf16", keep_fp8=keep_fp8, device=DEVICE)
    return model.eval()


def _logprobs(model):
    with torch.no_grad():
        return model(PROMPT.to(DEVICE), 0, model.new_cache(32, DEVICE)).log_softmax(-1).cpu()


@requires_triton
def test_fp8_checkpoint_through_the_kernel_matches_the_decoded_model():
    path = cached_checkpoint("deepseek_v3", "fp8")
    ckpt = open_checkpoint(path)
    names = fp8_dense.fp8_linear_names(ckpt)
    assert "model.layers.0.self_attn.q_a_proj" in names
    decoded = _load(path, keep_fp8=False)
    kept = _load(path, keep_fp8=None if DEVICE.type == "cuda" else True)     # on a GPU: automatic
    fp8_layers = [m for m in kept.modules() if isinstance(m, Fp8BlockLinear)]
    assert len(fp8_layers) >= 4
    assert isinstance(kept.model.layers[0].self_attn.kv_b_proj, Linear)       # absorbed MLA reads it
    assert kept.model.layers[0].self_attn.q_a_proj.weight.dtype == torch.float8_e4m3fn
    assert not any(isinstance(m, Fp8BlockLinear) for m in decoded.modules())
    want = _logprobs(decoded)
    for m in fp8_layers:
        m.mode, m.backend = "w8a16", "triton"
    got = _logprobs(kept)
    assert (got - want).abs().max() < 1e-4             # exact weights, fp32: only summation order differs
    for m in fp8_layers:
        m.mode, m.backend = "w8a8", "reference"
    w8a8 = _logprobs(kept)
    # activation rounding: present and bounded (a random tiny model amplifies it: routing flips)
    diff = (w8a8 - want).abs()
    print(f"w8a8 vs decoded logprobs: mean {float(diff.mean()):.4f} max {float(diff.max()):.4f}")
    assert 1e-5 < float(diff.mean()) < 0.2   # measured 0.06
