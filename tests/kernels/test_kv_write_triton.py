"""The Triton KV write kernels store the same bytes as the torch reference writes
(kv_cache.write_gqa_kv / write_mla_kv; GQA's k and v in one launch): every format (model
dtype, fp8 per-tensor, fp8 per-token groups; MLA's fp8_ds_mla row), float32 and bf16 sources,
random slots across pages, skipped slots (-1), saturation past 448 * scale and all-zero groups.
Under TRITON_INTERPRET=1 without a GPU; small shapes."""
from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_support import requires_triton

pytestmark = requires_triton

from moet.kernels import kv_cache  # noqa: E402
from moet.kernels.kv_cache import KVFormat, new_gqa_layer, new_mla_layer  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NB, BS = 6, 16


def _tri():
    from moet.kernels import kv_write_triton
    return kv_write_triton


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def _slots(t: int, g: torch.Generator) -> torch.Tensor:
    """t distinct random slots over the whole cache, two of them -1 (skipped)."""
    s = torch.randperm(NB * BS, generator=g)[:t].to(torch.int64)
    s[torch.randperm(t, generator=g)[:2]] = -1
    return s


def _data(shape, g, src_dtype):
    x = torch.randn(shape, generator=g) * 4        # scale 0.02 -> |x| / s > 448 for some: saturation
    x.view(-1, shape[-1])[0].zero_()               # one all-zero row / group (scale stays 1)
    return x.to(src_dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


FORMATS = [KVFormat("auto", dtype=torch.float32), KVFormat("auto", dtype=torch.bfloat16),
           KVFormat("fp8_e4m3", "tensor"), KVFormat("fp8_e4m3", "block", group=8)]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.name}-{f.scale}-{f.dtype}")
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_gqa_write_bytes_equal_reference(fmt, src_dtype):
    g = _gen()
    t, hkv, d, dv = 11, 2, 24, 16                   # d = 3 groups of 8: not a power of two
    k, v, slots = _data((t, hkv, d), g, src_dtype), _data((t, hkv, dv), g, src_dtype), _slots(t, g)
    want = new_gqa_layer(NB, BS, hkv, d, dv, fmt)
    got = new_gqa_layer(NB, BS, hkv, d, dv, fmt, device=DEVICE)
    if fmt.is_fp8 and not fmt.block_scaled:
        for c in (want, got):
            c.k_scale.fill_(0.02)
            c.v_scale.fill_(0.03)
    kv_cache.write_gqa_kv(want, k, v, slots)
    _tri().write_gqa_kv(got, k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE))
    assert torch.equal(_bytes(got.k.cpu()), _bytes(want.k)) and torch.equal(_bytes(got.v.cpu()), _bytes(want.v))
    if fmt.block_scaled:
        assert torch.equal(got.k_scale.cpu(), want.k_scale) and torch.equal(got.v_scale.cpu(), want.v_scale)
    assert want.k.float().abs().sum() > 0           # something was written


@pytest.mark.parametrize("fmt", FORMATS + [KVFormat("fp8_e4m3", "block", group=16, dtype=torch.float32)],
                         ids=lambda f: f"{f.name}-{f.scale}-{f.dtype}")
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_mla_write_bytes_equal_reference(fmt, src_dtype):
    g = _gen()
    t, r, p = 9, 32, 16
    lat, rope, slots = _data((t, r), g, src_dtype), _data((t, p), g, src_dtype), _slots(t, g)
    want = new_mla_layer(NB, BS, r, p, fmt)
    got = new_mla_layer(NB, BS, r, p, fmt, device=DEVICE)
    if fmt.is_fp8 and not fmt.block_scaled:
        want.latent_scale.fill_(0.02)
        got.latent_scale.fill_(0.02)
    kv_cache.write_mla_kv(want, lat, rope, slots)
    _tri().write_mla_kv(got, lat.to(DEVICE), rope.to(DEVICE), slots.to(DEVICE))
    assert torch.equal(_bytes(got.buffer.cpu()), _bytes(want.buffer))    # the whole row: latent, scales, rope
    assert want.latent.float().abs().sum() > 0


def test_rounding_ties_and_every_e4m3_value():
    """Inputs on and exactly between representable values (where round-to-nearest-even and the
    interpreter's own casts part ways): every e4m3 magnitude, every midpoint between neighbours
    (subnormal and normal), bf16 ties with even and odd upper halves."""
    codes = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()   # 0 .. 448
    mids = (codes[1:] + codes[:-1]) / 2
    vals = torch.cat([codes, mids, -codes, -mids, torch.tensor([500.0, -1000.0])])       # + saturation
    r = 512
    lat = torch.zeros(2, r)
    lat.view(-1)[:vals.numel()] = vals
    bits = torch.randint(0, 2**15, (2 * r,), generator=_gen()).to(torch.int32) << 16 | 0x8000   # bf16 ties
    lat.view(-1)[vals.numel():] = bits[vals.numel():].view(torch.float32)
    lat = torch.nan_to_num(lat, nan=1.0, posinf=2.0, neginf=-2.0)
    rope = lat[:, :16].clone()
    slots = torch.tensor([3, 17])
    for fmt in (KVFormat("fp8_e4m3", "tensor"), KVFormat("auto", dtype=torch.bfloat16)):
        want, got = new_mla_layer(NB, BS, r, 16, fmt), new_mla_layer(NB, BS, r, 16, fmt, device=DEVICE)
        kv_cache.write_mla_kv(want, lat, rope, slots)
        _tri().write_mla_kv(got, lat.to(DEVICE), rope.to(DEVICE), slots.to(DEVICE))
        assert torch.equal(_bytes(got.buffer.cpu()), _bytes(want.buffer)), fmt


def test_gqa_write_is_one_launch_and_mixed_dtypes_fall_back(monkeypatch):
    """GQA's k and v go in one launch (_store_kv_kernel); k and v of different dtypes (no caller
    does that) take the two per-part launches and still store the reference's bytes."""
    tri = _tri()
    launches = []

    class Counted:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launches.append(self.name)
            return self.kernel[grid]

    monkeypatch.setattr(tri, "_store_kv_kernel", Counted("kv", tri._store_kv_kernel))
    monkeypatch.setattr(tri, "_store_rows_kernel", Counted("rows", tri._store_rows_kernel))
    g = _gen()
    fmt = KVFormat("fp8_e4m3", "block", group=8)
    t, hkv, d, dv = 5, 2, 16, 8
    k, v, slots = _data((t, hkv, d), g, torch.bfloat16), _data((t, hkv, dv), g, torch.float32), _slots(t, g)
    for vv, want_launches in ((v.to(torch.bfloat16), ["kv"]), (v, ["rows", "rows"])):
        launches.clear()
        want = new_gqa_layer(NB, BS, hkv, d, dv, fmt)
        got = new_gqa_layer(NB, BS, hkv, d, dv, fmt, device=DEVICE)
        kv_cache.write_gqa_kv(want, k, vv, slots)
        tri.write_gqa_kv(got, k.to(DEVICE), vv.to(DEVICE), slots.to(DEVICE))
        assert launches == want_launches
        assert torch.equal(_bytes(got.k.cpu()), _bytes(want.k)) and torch.equal(_bytes(got.v.cpu()), _bytes(want.v))
        assert torch.equal(got.k_scale.cpu(), want.k_scale) and torch.equal(got.v_scale.cpu(), want.v_scale)
