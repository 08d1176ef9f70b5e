"""The model's W2 and FP4 pools take the row-tiled nb8t / nvfp4t layouts where the expert shapes
allow (moet.quant.requantize.pool_layout), and filling one holds the row-major pool's bytes, tiled."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moet.formats import w2
from moet.kernels.pools import FP4Pool, W2Pool
from moet.kernels.reference import moe_experts_reference
from moet.quant import requantize


@pytest.mark.parametrize("h,i,tiled", [(7168, 2048, True), (2048, 768, True), (4096, 1408, False),
                                       (384, 256, False), (256, 256, True)])
@pytest.mark.parametrize("fmt,layouts", [("w2", ("nb8", "nb8t")), ("fp4", ("nvfp4", "nvfp4t"))])
def test_layout_follows_the_shapes(h, i, tiled, fmt, layouts):
    want = layouts[tiled]
    assert requantize.pool_layout(fmt, h, i) == want
    if h * i <= 2048 * 768:               # small enough to allocate here
        assert requantize.new_pool(SimpleNamespace(hidden_size=h, moe_intermediate_size=i), fmt, 1,
                                torch.float32, "cpu").layout == want


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (the fill re-encodes on the pool's device)"))])
def test_filled_nb8t_pool_is_the_nb8_pool_tiled_and_decodes_the_same(device):
    h, i = 512, 256
    spec = SimpleNamespace(hidden_size=h, moe_intermediate_size=i)
    tiled = requantize.new_pool(spec, "w2", 2, torch.float32, device)
    assert tiled.layout == "nb8t"
    plain = W2Pool(*(torch.zeros_like(getattr(tiled, f)) for f in ("gate_up_codes", "gate_up_scales", "down_codes",
                                                                     "down_scales")), layout="nb8")
    g = torch.Generator().manual_seed(5)
    for slot in range(2):
        for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            parts = {"weight": torch.randn(*shape, generator=g)}
            for pool in (tiled, plain):
                requantize.convert_into(pool, slot, spec, proj, "float", parts, {}, f"slot {slot} {proj}")
    for f, per in (("gate_up_codes", 1 / 4), ("gate_up_scales", 1 / 32), ("down_codes", 1 / 4),
                   ("down_scales", 1 / 32)):
        assert torch.equal(getattr(tiled, f), w2.tile_rows(getattr(plain, f), per)), f
    x = torch.randn(3, h, generator=g).to(device)
    ids = torch.tensor([[0, 1], [1, 0], [0, 1]], device=device)
    wts = torch.rand(3, 2, generator=g).to(device)
    table = torch.tensor([0, 1], dtype=torch.int32, device=device)
    outs = [moe_experts_reference(x, ids, wts, table, p, torch.zeros(1, dtype=torch.int64, device=device))
            for p in (tiled, plain)]
    assert torch.equal(outs[0], outs[1]) and outs[0].abs().max() > 0


def test_filled_nvfp4t_pool_is_the_nvfp4_pool_tiled():
    """FP4's row-tiled pool: a fill gives the row-major pool's bytes, tiled, and the same layer output."""
    h, i = 512, 256
    spec = SimpleNamespace(hidden_size=h, moe_intermediate_size=i)
    tiled = requantize.new_pool(spec, "fp4", 1, torch.float32, "cpu")
    assert tiled.layout == "nvfp4t"
    plain = FP4Pool(*(torch.zeros_like(getattr(tiled, f)) for f in FP4Pool.__slots__ if f != "layout"), layout="nvfp4")
    g = torch.Generator().manual_seed(6)
    for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
        parts = {"weight": torch.randn(*shape, generator=g)}
        for pool in (tiled, plain):
            requantize.convert_into(pool, 0, spec, proj, "float", parts, {}, proj)
    for f, per in (("gate_up_weight", 1 / 2), ("gate_up_scale", 1 / 16), ("down_weight", 1 / 2), ("down_scale", 1 / 16)):
        want = w2.tile_rows(getattr(plain, f).view(torch.uint8), per)
        assert torch.equal(getattr(tiled, f).view(torch.uint8), want), f
    assert torch.equal(tiled.gate_up_scale_2, plain.gate_up_scale_2)
    x = torch.randn(4, h, generator=g)
    ids = torch.zeros(4, 1, dtype=torch.long)
    wts = torch.rand(4, 1, generator=g)
    table = torch.zeros(1, dtype=torch.int32)
    outs = [moe_experts_reference(x, ids, wts, table, p, torch.zeros(1, dtype=torch.int64)) for p in (tiled, plain)]
    assert torch.equal(outs[0], outs[1]) and outs[0].abs().max() > 0
