"""The paged KV layout: writes land in the slot the mapping names, -1 is skipped, reads walk the
block table across page boundaries, fp8 round trips stay within e4m3's error, byte counts match
SPEC 3."""
from __future__ import annotations

import pytest
import torch

from moet.errors import ConfigError
from moet.kernels.kv_cache import (KVFormat, dequantize_fp8, gqa_bytes_per_token, mla_bytes_per_token,
                                   new_gqa_layer, new_mla_layer, quantize_fp8, read_gqa_kv, read_mla_kv,
                                   write_gqa_kv, write_mla_kv)
from tests.kernels.paged import random_block_tables, slots_for

BS = 8
LENS = [1, BS - 1, BS, BS + 1, 3 * BS + 5]          # ragged, on and across page boundaries


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)   # fresh inputs every run


def _fp8_bound(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """e4m3 round-to-nearest: half an ulp, 2**-4 relative for normals, 2**-10 * scale absolute in
    the subnormal range (min normal 2**-6, step 2**-9)."""
    return torch.maximum(x.abs() * 2.0 ** -4, s * 2.0 ** -10) * (1 + 1e-6)


@pytest.mark.parametrize("fmt", [KVFormat("auto", dtype=torch.float32), KVFormat("fp8_e4m3", "tensor"),
                                 KVFormat("fp8_e4m3", "block", group=16)])
def test_gqa_write_read_through_random_block_table(fmt):
    g = _gen()
    hkv, d = 2, 32
    cache = new_gqa_layer(24, BS, hkv, d, d, fmt)
    table = random_block_tables(LENS, BS, 24, g)
    for b, n in enumerate(LENS):
        k, v = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
        slots = slots_for(table, b, range(n), BS)
        write_gqa_kv(cache, k, v, slots)
        k2, v2 = read_gqa_kv(cache, table[b], n)
        if fmt.is_fp8:
            sk = cache.k_scale if not fmt.block_scaled else k.abs().unflatten(-1, (d // 16, 16)).amax(-1).repeat_interleave(16, -1) / 448
            sv = cache.v_scale if not fmt.block_scaled else v.abs().unflatten(-1, (d // 16, 16)).amax(-1).repeat_interleave(16, -1) / 448
            assert ((k2 - k).abs() <= _fp8_bound(k, sk)).all()
            assert ((v2 - v).abs() <= _fp8_bound(v, sv)).all()
            assert not torch.equal(k2, k)      # it really was quantized
        else:
            assert torch.equal(k2, k) and torch.equal(v2, v)


def test_slot_minus_one_is_skipped_and_other_pages_untouched():
    g = _gen()
    cache = new_gqa_layer(4, BS, 1, 4, 4, KVFormat("auto", dtype=torch.float32))
    cache.k.fill_(7.0)
    cache.v.fill_(7.0)
    k = torch.randn(3, 1, 4, generator=g)
    write_gqa_kv(cache, k, k, torch.tensor([5, -1, 2 * BS + 3]))
    flat = cache.k.flatten(0, 1)
    assert torch.equal(flat[5], k[0]) and torch.equal(flat[2 * BS + 3], k[2])
    mask = torch.ones(4 * BS, dtype=torch.bool)
    mask[[5, 2 * BS + 3]] = False
    assert (flat[mask] == 7.0).all()


@pytest.mark.parametrize("fmt", [KVFormat("auto", dtype=torch.float32), KVFormat("fp8_e4m3", "tensor"),
                                 KVFormat("fp8_e4m3", "block", group=16)])
def test_mla_write_read(fmt):
    g = _gen()
    r, p = 64, 16
    cache = new_mla_layer(24, BS, r, p, fmt)
    table = random_block_tables(LENS, BS, 24, g)
    for b, n in enumerate(LENS):
        lat, rope = torch.randn(n, r, generator=g), torch.randn(n, p, generator=g)
        write_mla_kv(cache, lat, rope, slots_for(table, b, range(n), BS))
        lat2, rope2 = read_mla_kv(cache, table[b], n)
        if not fmt.is_fp8:
            assert torch.equal(lat2, lat) and torch.equal(rope2, rope)
        elif fmt.block_scaled:
            s = lat.abs().unflatten(-1, (r // 16, 16)).amax(-1).repeat_interleave(16, -1) / 448
            assert ((lat2 - lat).abs() <= _fp8_bound(lat, s)).all()
            assert torch.equal(rope2, rope.to(fmt.dtype).float())    # rope kept in bf16, as fp8_ds_mla
        else:
            assert ((lat2 - lat).abs() <= _fp8_bound(lat, cache.latent_scale)).all()
            assert ((rope2 - rope).abs() <= _fp8_bound(rope, cache.latent_scale)).all()


def test_fp8_tensor_scale_saturates_and_uses_the_scale():
    x = torch.tensor([[1000.0, -1000.0, 3.0, 0.0]])
    q, s = quantize_fp8(x, torch.tensor([2.0]), 128)
    assert s is None
    assert dequantize_fp8(q, torch.tensor([2.0])).tolist() == [[896.0, -896.0, 3.0, 0.0]]


def test_fp8_block_scale_is_group_amax_over_448_and_zero_groups_are_exact():
    g = _gen()
    x = torch.randn(5, 64, generator=g) * torch.logspace(-3, 3, 5)[:, None]
    x[2, :32] = 0
    q, s = quantize_fp8(x, None, 32)
    assert s.shape == (5, 2)
    assert torch.equal(s[2, 0], torch.tensor(1.0))
    exp = x.abs().unflatten(-1, (2, 32)).amax(-1) / 448
    assert torch.allclose(s[[0, 1, 3, 4]], exp[[0, 1, 3, 4]]) and torch.allclose(s[2, 1], exp[2, 1])
    y = dequantize_fp8(q, s)
    assert (y[2, :32] == 0).all()
    assert ((y - x).abs() <= _fp8_bound(x, s.repeat_interleave(32, -1))).all()


def test_bytes_per_token_match_spec_and_the_buffers():
    # SPEC 3: fp8_ds_mla is 656 B/token (512 fp8 latent + 4 fp32 scales + 64 bf16 rope)
    ds = KVFormat("fp8_e4m3", "block", group=128, dtype=torch.bfloat16)
    assert mla_bytes_per_token(512, 64, ds) == 656
    assert mla_bytes_per_token(512, 64, KVFormat("fp8_e4m3")) == 576
    assert mla_bytes_per_token(512, 64, KVFormat()) == 1152
    for fmt in (ds, KVFormat("fp8_e4m3"), KVFormat()):
        c = new_mla_layer(3, 16, 512, 64, fmt)
        assert c.buffer.shape[-1] * c.buffer.element_size() == mla_bytes_per_token(512, 64, fmt)
        assert c.latent.data_ptr() == c.buffer.data_ptr()            # one row per token
    # GLM-4.5: 8 kv heads x 128
    assert gqa_bytes_per_token(8, 128, 128, KVFormat()) == 4096
    assert gqa_bytes_per_token(8, 128, 128, KVFormat("fp8_e4m3")) == 2048
    assert gqa_bytes_per_token(8, 128, 128, KVFormat("fp8_e4m3", "block")) == 2048 + 64


def test_bad_formats_raise_config_errors():
    with pytest.raises(ConfigError, match="int4"):
        KVFormat("int4")
    with pytest.raises(ConfigError, match="multiple"):
        new_gqa_layer(2, 8, 1, 24, 24, KVFormat("nvfp4"))
    with pytest.raises(ConfigError, match="scale"):
        KVFormat("fp8_e4m3", "page")
    with pytest.raises(ConfigError, match="multiple"):
        new_gqa_layer(2, 8, 1, 24, 24, KVFormat("fp8_e4m3", "block", group=16))
