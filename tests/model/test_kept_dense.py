"""Quantized dense weights kept as the checkpoint stores them (model/kept_dense.py): FP8 block-128
as e4m3 + scales (Fp8BlockLinear) and NVFP4 as codes + scales (Nvfp4Linear), the GPU path: on CPU
through the Triton kernels under TRITON_INTERPRET=1 and the torch references; on a GPU the same
tests load the model on it (where keep_quantized_dense=None must choose the kept path itself).
The CPU default (decode at load) is covered by test_quantized_checkpoints.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moet.checkpoint import open_checkpoint
from moet.errors import CheckpointError, FormatError
from moet.formats import fp8_block, nvfp4
from moet.kernels.fp8_gemm_reference import fp8_block_gemm_reference
from moet.kernels.nvfp4_gemm_reference import nvfp4_gemm_reference
from moet.model import kept_dense, load_weights
from moet.model.layers.linear import Fp8BlockLinear, Linear, Nvfp4Linear
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


def _load(path, keep: bool | None):
    ckpt = open_checkpoint(path)
    with torch.device(DEVICE):
        model = CausalLM(ckpt.spec, torch.float32, load_mtp=False)
    load_weights(model, ckpt, expert_format="bf16", keep_quantized_dense=keep, device=DEVICE)
    return model.eval()


def _logprobs(model):
    with torch.no_grad():
        return model(PROMPT.to(DEVICE), 0, model.new_cache(32, DEVICE)).log_softmax(-1).cpu()


@requires_triton
def test_fp8_checkpoint_through_the_kernel_matches_the_decoded_model():
    path = cached_checkpoint("deepseek_v3", "fp8")
    ckpt = open_checkpoint(path)
    names = kept_dense.kept_linear_names(ckpt, "fp8_block")
    assert "model.layers.0.self_attn.q_a_proj" in names
    decoded = _load(path, keep=False)
    kept = _load(path, keep=None if DEVICE.type == "cuda" else True)     # on a GPU: automatic
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


# ---------------------------------------------------------------------------------------- NVFP4

def _nvfp4_weight(n: int, k: int, g: torch.Generator):
    """modelopt-style NVFP4 of a random weight whose rows span a few octaves (block scales differ)."""
    w = torch.randn(n, k, generator=g) * torch.exp2(torch.empty(n, 1).uniform_(-3, 1, generator=g))
    t = nvfp4.quantize(w)
    return t.weight, t.weight_scale, t.weight_scale_2


def _float64_gemm(x, q, s, s2, bias):
    w = nvfp4.dequantize(q, s, s2, dtype=torch.float64)
    y = x.double() @ w.T
    return y + bias.double() if bias is not None else y


@requires_triton
@pytest.mark.parametrize("m,n,k,xdtype,bias", [
    (1, 136, 208, torch.float32, True),       # decode: K split over programs (partials + fixed-order sum)
    (3, 72, 64, torch.float32, False),        # one K block: no split
    (40, 100, 160, torch.bfloat16, True),     # 32 < M <= 64 rows, N not a tile multiple
    (300, 130, 96, torch.float32, False),     # prefill tiles
])
def test_nvfp4_gemm_kernel_matches_float64(m, n, k, xdtype, bias):
    from moet.kernels.nvfp4_gemm_triton import nvfp4_gemm_triton
    g = torch.Generator().manual_seed(m * 1000 + n)
    q, s, s2 = _nvfp4_weight(n, k, g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(m, k, generator=g).to(xdtype)
    want = _float64_gemm(x, q, s, s2, b)
    ref = nvfp4_gemm_reference(x, q, s, s2, bias=b)
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    got = nvfp4_gemm_triton(dev(x), dev(q), dev(s), dev(s2), bias=dev(b)).cpu()
    assert got.dtype == xdtype and got.shape == (m, n)
    tol = 1e-6 if xdtype == torch.float32 else 2 ** -8
    assert _rel(ref, want) < tol and _rel(got, want) < tol
    # bit-identical reruns (the split path sums its partials in a fixed order)
    again = nvfp4_gemm_triton(dev(x), dev(q), dev(s), dev(s2), bias=dev(b)).cpu()
    assert torch.equal(got, again)


@requires_triton
def test_nvfp4_gemm_split_path_overwrites_every_partial():
    """A decode-sized call through the split path with NaN-poisoned partials: every partial the
    sum reads was written (a skipped K range would leave NaN in the output)."""
    from moet.kernels.nvfp4_gemm_triton import Nvfp4GemmConfig, nvfp4_gemm_triton
    g = torch.Generator().manual_seed(5)
    q, s, s2 = _nvfp4_weight(64, 512, g)
    x = torch.randn(2, 512, generator=g)
    cfg = Nvfp4GemmConfig(16, 64, 128, 4, num_warps=4, num_stages=2)
    partials = torch.full((4, 2, 64), float("nan"), device=DEVICE)
    got = nvfp4_gemm_triton(x.to(DEVICE), q.to(DEVICE), s.to(DEVICE), s2.to(DEVICE), config=cfg, partials=partials)
    assert torch.isfinite(got).all() and _rel(got.cpu(), _float64_gemm(x, q, s, s2, None)) < 1e-6


def test_nvfp4_gemm_rejects_malformed_weights():
    g = torch.Generator().manual_seed(2)
    q, s, s2 = _nvfp4_weight(32, 64, g)
    x = torch.randn(2, 64, generator=g)
    with pytest.raises(ValueError, match="x has K=48"):
        nvfp4_gemm_reference(x[:, :48], q, s, s2)
    with pytest.raises(ValueError, match="weight_scale must be"):
        nvfp4_gemm_reference(x, q, s[:, :2], s2)
    with pytest.raises(ValueError, match="uint8"):
        nvfp4_gemm_reference(x, q.float(), s, s2)


def test_nvfp4_module_loads_as_stored_and_refuses_other_formats():
    g = torch.Generator().manual_seed(3)
    q, s, s2 = _nvfp4_weight(48, 64, g)
    layer = Nvfp4Linear(64, 48, True, torch.float32, backend="reference")
    layer.weight.weight_loader(layer.weight, "nvfp4", {"weight": q, "weight_scale": s, "weight_scale_2": s2}, "x")
    assert torch.equal(layer.weight, q) and torch.equal(layer.weight_scale.view(torch.uint8), s.view(torch.uint8))
    assert float(layer.weight_scale_2) == float(s2)
    bias = torch.randn(48, generator=g)
    layer.bias.data.copy_(bias)
    x = torch.randn(5, 64, generator=g)
    assert _rel(layer(x), F.linear(x, nvfp4.dequantize(q, s, s2), bias)) < 1e-6   # = the CPU path's decode
    with pytest.raises(CheckpointError, match="set up for NVFP4"):
        layer.weight.weight_loader(layer.weight, "float", {"weight": torch.zeros(48, 64)}, "x.weight")
    with pytest.raises(CheckpointError, match="do not match"):
        layer.weight.weight_loader(layer.weight, "nvfp4", {"weight": q[:, :16], "weight_scale": s,
                                                           "weight_scale_2": s2}, "x.weight")
    with pytest.raises(FormatError, match="weight_scale_2"):
        layer.weight.weight_loader(layer.weight, "nvfp4", {"weight": q, "weight_scale": s,
                                                           "weight_scale_2": torch.tensor(float("inf"))}, "x.weight")


@requires_triton
@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v3"])
def test_nvfp4_checkpoint_through_the_kernel_matches_the_decoded_model(family):
    from moet.testing.tiny_checkpoint import FAMILIES
    if family not in FAMILIES:
        pytest.skip(f"this transformers has no {family} config")
    path = cached_checkpoint(family, "nvfp4")
    names = kept_dense.kept_linear_names(open_checkpoint(path), "nvfp4")
    assert "model.layers.0.mlp.gate_proj" in names
    decoded = _load(path, keep=False)
    kept = _load(path, keep=None if DEVICE.type == "cuda" else True)     # on a GPU: automatic
    layers = [m for m in kept.modules() if isinstance(m, Nvfp4Linear)]
    assert len(layers) >= 3 and kept.model.layers[0].mlp.gate_proj.weight.dtype == torch.uint8
    assert not any(isinstance(m, Nvfp4Linear) for m in decoded.modules())
    kept_bytes = sum(m.weight.numel() + m.weight_scale.numel() for m in layers)
    decoded_bytes = sum(decoded.get_submodule(n).weight.numel() * 4 for n, m in kept.named_modules() if m in layers)
    assert kept_bytes * 7 < decoded_bytes          # 4.5 bits a weight against float32's 32
    want, got = _logprobs(decoded), _logprobs(kept)
    assert (got - want).abs().max() < 1e-4         # exact weights, fp32: only summation order differs
