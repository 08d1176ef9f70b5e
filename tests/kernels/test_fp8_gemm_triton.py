"""The Triton FP8 block-128 GEMM (moet.kernels.fp8_gemm_triton) against its torch reference, under
TRITON_INTERPRET=1 when there is no GPU. Fresh random weights quantized with moet.formats.fp8_block
(partial edge blocks in N and K), both activation modes, split-K and unsplit, the split partials
poisoned with NaN, bit-identical reruns."""
from __future__ import annotations

import pytest
import torch

from moet.formats import fp8_block
from moet.kernels.fp8_gemm_reference import act_quant_reference, fp8_block_gemm_reference
from tests.kernels.triton_support import requires_triton

pytestmark = requires_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tri():
    from moet.kernels import fp8_gemm_triton
    return fp8_gemm_triton


def _weight(n: int, k: int, g: torch.Generator):
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g).add(0.1)   # rows of different scale
    q, s = fp8_block.quantize(w)
    return q.to(DEVICE), s.to(DEVICE)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def test_act_quant_matches_reference_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(11, 300, generator=g) * 3
    x[4] = 0.0                       # an all-zero token: scale 1, codes 0
    x[7, :128] *= 1e-30              # a group far below e4m3's range: still its own scale
    x = x.to(DEVICE)
    q, s = _tri().act_quant_triton(x)
    q_ref, s_ref = act_quant_reference(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert float(s[4].max()) == 1.0


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
@pytest.mark.parametrize("m,n,k", [(1, 200, 300), (5, 64, 256), (20, 136, 130)])
def test_gemm_matches_reference(mode, m, n, k):
    tri = _tri()
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w, s = _weight(n, k, g)
    x = (torch.randn(m, k, generator=g) * 2).to(DEVICE)
    ref = fp8_block_gemm_reference(x, w, s, mode=mode)
    cfg = tri.pick_config(m, n, k, mode, torch.device(DEVICE))
    assert cfg.split > 1                 # the interpreter's 4 "SMs" make small M split K
    parts = torch.full((tri.num_splits(k, cfg), m, n), float("nan"), device=DEVICE)
    out = tri.fp8_block_gemm_triton(x, w, s, mode=mode, partials=parts)
    assert _rel(out, ref) < 1e-5
    again = tri.fp8_block_gemm_triton(x, w, s, mode=mode)
    assert torch.equal(out, again)
    # unsplit (the prefill path), and for w8a8 the separate act-quant launch: same values
    for inline in (True, False):
        cfg1 = tri.Fp8GemmConfig(16, 64, 1, num_warps=4, num_stages=2, inline_quant=inline)
        out1 = tri.fp8_block_gemm_triton(x, w, s, mode=mode, config=cfg1)
        assert _rel(out1, ref) < 1e-5


def test_w8a8_inline_and_separate_quant_are_identical_and_differ_from_w8a16():
    tri = _tri()
    g = torch.Generator().manual_seed(7)
    w, s = _weight(128, 384, g)
    x = torch.randn(3, 384, generator=g).to(DEVICE)
    outs = [tri.fp8_block_gemm_triton(x, w, s, mode="w8a8",
                                      config=tri.Fp8GemmConfig(16, 64, 1, 4, 2, inline_quant=q)) for q in (True, False)]
    assert torch.equal(outs[0], outs[1])
    exact = fp8_block_gemm_reference(x, w, s, mode="w8a16")
    err = _rel(outs[0], exact)
    assert 1e-4 < err < 0.05             # the activation rounding is really there, and small


def test_bf16_input_bias_and_leading_dims():
    tri = _tri()
    g = torch.Generator().manual_seed(3)
    w, s = _weight(96, 160, g)
    x = torch.randn(2, 3, 160, generator=g).to(DEVICE).bfloat16()
    bias = torch.randn(96, generator=g).to(DEVICE).bfloat16()
    for mode in ("w8a16", "w8a8"):
        ref = fp8_block_gemm_reference(x, w, s, mode=mode, bias=bias)
        for cfg in (None, tri.Fp8GemmConfig(16, 32, 1, 4, 2)):
            out = tri.fp8_block_gemm_triton(x, w, s, mode=mode, bias=bias, config=cfg)
            assert out.shape == (2, 3, 96) and out.dtype == torch.bfloat16
            assert _rel(out, ref) < 1e-2     # one bf16 ulp (the interpreter truncates fp32 -> bf16)


def test_rejects_bad_shapes():
    tri = _tri()
    g = torch.Generator().manual_seed(4)
    w, s = _weight(64, 128, g)
    with pytest.raises(ValueError, match="weight_scale_inv"):
        tri.fp8_block_gemm_triton(torch.randn(1, 128, device=DEVICE), w, s[:, :0])
    with pytest.raises(ValueError, match="K="):
        tri.fp8_block_gemm_triton(torch.randn(1, 100, device=DEVICE), w, s)


def test_decode_config_quantizes_x_once_when_many_tiles_share_it(monkeypatch):
    """Few rows: inline quantization only while few N tiles repeat it (a wide weight would redo
    the divisions in every tile); a measured table entry still wins over the rule."""
    tri = _tri()
    monkeypatch.setattr(tri, "_table", lambda: {})
    dev = torch.device(DEVICE)
    narrow = tri.pick_config(1, 576, 7168, "w8a8", dev)            # 9 tiles of 64
    wide = tri.pick_config(1, 18432, 7168, "w8a8", dev)            # 288 tiles
    assert narrow.inline_quant and not wide.inline_quant
    edge = tri.INLINE_QUANT_MAX_N_TILES * narrow.block_n
    assert tri.pick_config(4, edge, 512, "w8a8", dev).inline_quant
    assert not tri.pick_config(4, edge + 1, 512, "w8a8", dev).inline_quant
    entry = dict(block_m=16, block_n=64, split=2, num_warps=4, num_stages=4, group_m=8, inline_quant=True)
    table = {tri._device_name(dev): {"18432x7168": {"w8a8": {"16": entry}}}}
    monkeypatch.setattr(tri, "_table", lambda: table)
    assert tri.pick_config(1, 18432, 7168, "w8a8", dev) == tri.Fp8GemmConfig(**entry)


def test_table_entries_stand_in_past_their_largest_t_only_from_prefill_sizes(monkeypatch):
    """A sweep cut short (entries up to T = 16) must not give its 16-row decode tile to a prefill;
    an entry swept up to a prefill size covers the larger T too."""
    tri = _tri()
    dev = torch.device(DEVICE)
    small = dict(block_m=16, block_n=64, split=3, num_warps=4, num_stages=4, group_m=8, inline_quant=False)
    big = dict(block_m=128, block_n=64, split=1, num_warps=4, num_stages=3, group_m=8, inline_quant=False)
    table = {tri._device_name(dev): {"7168x18432": {"w8a8": {"1": small, "16": small}},
                                      "24576x1536": {"w8a8": {"16": small, str(tri.TABLE_EXTRAPOLATE_FROM_T): big}}}}
    monkeypatch.setattr(tri, "_table", lambda: table)
    assert tri.pick_config(16, 7168, 18432, "w8a8", dev) == tri.Fp8GemmConfig(**small)
    assert tri.pick_config(2048, 7168, 18432, "w8a8", dev).block_m == 128          # the default, not `small`
    assert tri.pick_config(17, 7168, 18432, "w8a8", dev) != tri.Fp8GemmConfig(**small)
    assert tri.pick_config(8192, 24576, 1536, "w8a8", dev) == tri.Fp8GemmConfig(**big)
    assert tri.pick_config(100, 24576, 1536, "w8a8", dev) == tri.Fp8GemmConfig(**big)
    monkeypatch.setattr(tri, "_table", lambda: {})
    assert tri.pick_config(128, 7168, 18432, "w8a16", dev).block_m == 32
    assert tri.pick_config(128, 7168, 18432, "w8a8", dev).block_m == 64
