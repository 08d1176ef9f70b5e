"""The Triton RMSNorm (with and without the fused residual add) and rotary kernels compute what
the torch modules compute (model/layers/norm.py, rope.py): fresh random inputs each run, bf16 and
fp32, rows of several widths, partial and interleaved rotary. Rotary and the residual sum are
bit-identical; the norm may differ in the last bit where the tree-ordered fp32 mean rounds
differently. Under TRITON_INTERPRET=1 without a GPU; on CUDA the same checks run compiled."""
from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_support import requires_triton

pytestmark = requires_triton

from moet.checkpoint.spec import RopeSpec  # noqa: E402
from moet.model.layers.norm import RMSNorm  # noqa: E402
from moet.model.layers.rope import Rotary  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tri():
    from moet.kernels import norm_rope_triton
    return norm_rope_triton


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def _torch_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """The module's torch path (on CPU tensors), whatever device the test runs on."""
    return norm.cpu()(x.cpu())


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in units of the last place of the model dtype at b's magnitude."""
    eps = torch.finfo(b.dtype).eps
    scale = b.float().abs().clamp_min(torch.finfo(torch.float32).tiny)
    return float(((a.float() - b.float()).abs() / (scale * eps)).max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 16), (1, 200)])
def test_rms_norm_matches_module(dtype, shape):
    g = _gen()
    n = shape[-1]
    norm = RMSNorm(n, 1e-6, dtype)
    norm.weight.data = (1 + 0.5 * torch.randn(n, generator=g)).to(dtype)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    got, total = _tri().rms_norm(x.to(DEVICE), norm.weight.to(DEVICE), norm.eps)
    assert total is None and got.shape == x.shape and got.dtype == dtype
    want = _torch_norm(norm, x)
    if dtype == torch.bfloat16:
        assert _ulps(got.cpu(), want) <= 1.0
        assert (got.cpu() == want).float().mean() > 0.9       # differences are rare last bits
    else:                                                     # fp32: the sum order shows in a few ulps
        assert _ulps(got.cpu(), want) <= 16.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_fused_residual_add(dtype):
    g = _gen()
    n = 96
    norm = RMSNorm(n, 1e-5, dtype)
    norm.weight.data = (1 + 0.5 * torch.randn(n, generator=g)).to(dtype)
    x = torch.randn(7, n, generator=g).to(dtype)
    res = (10 * torch.randn(7, n, generator=g)).to(dtype)
    got, total = _tri().rms_norm(x.to(DEVICE), norm.weight.to(DEVICE), norm.eps, residual=res.to(DEVICE))
    assert torch.equal(total.cpu(), res + x)                 # the bf16 add torch does, bit for bit
    assert _ulps(got.cpu(), _torch_norm(norm, res + x)) <= (1.0 if dtype == torch.bfloat16 else 16.0)
    # the module's add() gives the same pair on CPU
    h, s = norm.add(x, res)
    assert torch.equal(s, res + x) and torch.equal(h, _torch_norm(norm, res + x))


def _rotary(dim: int, interleave: bool) -> Rotary:
    return Rotary(RopeSpec(dim=dim, theta=10000.0, interleave=interleave), 4096)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d,rd,interleave", [(16, 16, False), (16, 8, False), (8, 8, True), (32, 32, True)])
def test_rope_matches_rotary_apply(dtype, d, rd, interleave):
    g = _gen()
    rot = _rotary(rd, interleave)
    t, h = 6, 3
    pos = torch.randint(0, 4000, (t,), generator=g)
    cos, sin = rot.cos_sin(pos, dtype)
    # a strided view, as q/k come out of a fused projection
    wide = torch.randn(t, h, d + 8, generator=g).to(dtype)
    x = wide[..., 4:4 + d]
    got = _tri().rope(x.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), interleave)
    want = rot.apply(x, cos, sin)                             # torch path (CPU tensors)
    assert got.shape == (t, h, d)
    if dtype == torch.bfloat16 or DEVICE == "cpu":
        assert torch.equal(got.cpu(), want)
    else:       # fp32 on the GPU: the compiler contracts x*c + p*s into one FMA (one rounding
        # fewer), which shows as many ulps where the two terms cancel: compare to the row scale
        assert float((got.cpu() - want).abs().max()) <= 1e-6 * float(want.abs().max())


def test_rope_rejects_partial_interleave():
    x = torch.randn(2, 1, 16)
    cos = torch.randn(2, 8)
    with pytest.raises(ValueError, match="interleaved"):
        _tri().rope(x, cos, cos, True)
