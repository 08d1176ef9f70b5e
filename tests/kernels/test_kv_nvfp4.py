"""The nvfp4 KV cache (docs/kv-cache.md): the torch reference against a float64 pipeline (error
bounds of e2m1 codes under e4m3 block-16 scales, nearest-even codes, exactly representable values
round-tripping bit for bit, skipped slots, byte counts, the dtype checks), then every Triton
kernel that reads or writes it against the reference under TRITON_INTERPRET=1 (small shapes,
pages of 16): the write byte for byte, the GQA and MLA decode and prefill/extend."""
from __future__ import annotations

import pytest
import torch

from moet.errors import ConfigError
from moet.formats import e2m1
from moet.kernels import attention_reference as ref
from moet.kernels import kv_cache
from moet.kernels.kv_cache import (KVFormat, gqa_bytes_per_token, kv_cache_dtypes_for, kv_format_for,
                                   mla_bytes_per_token, new_gqa_layer, new_mla_layer, read_gqa_kv, read_mla_kv,
                                   write_gqa_kv, write_mla_kv)
from tests.kernels.paged import random_block_tables, slots_for
from tests.kernels.triton_support import requires_triton

FMT = KVFormat("nvfp4", dtype=torch.float32)
BS = 16
NB = 12
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GRID = torch.tensor(e2m1.MAGNITUDES, dtype=torch.float64)


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)   # fresh inputs every run


def _nonzero(shape, g, spread: float = 2.0) -> torch.Tensor:
    """Random values, never zero, magnitudes over a few octaves per row (|x| >= 0.05)."""
    x = torch.randn(shape, generator=g)
    x = torch.sign(x) * (0.05 + x.abs())
    return x * torch.exp2(torch.empty(shape[:-1] + (1,)).uniform_(-spread, spread, generator=g))


def _check_float64(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, s2: float) -> None:
    """x [..., D] float32 and its nvfp4 (codes [..., D/2], e4m3 scales [..., D/16]) under scale_2 s2,
    checked in float64: each block scale is amax / (6 s2) rounded to a neighbouring e4m3 value
    (within half an e4m3 ulp, 2**-4 relative; normal here), each code the nearest e2m1 magnitude of
    |x| / (s s2) (ties to the even code, saturating at 6) with x's sign, and so the round trip is
    within max(|x|, s s2) / 4 (the grid's half-step: 0.25 up to 2, 0.5 up to 4, 1 above, saturation
    at 6 of at most 6 * 2**-4 past it)."""
    x64 = x.double()
    d = x.shape[-1]
    s = scales.double().repeat_interleave(16, -1) * s2                       # [..., D]: s * s2
    amax = x64.unflatten(-1, (d // 16, 16)).abs().amax(-1)
    want_s = amax / (6 * s2)
    assert (want_s >= 2.0 ** -6).all(), "the test keeps block scales normal in e4m3"
    assert ((scales.double() - want_s).abs() <= want_s * 2.0 ** -4 * (1 + 1e-9)).all()
    c = e2m1.unpack_nibbles(codes).long()
    deq = e2m1.decode(c, torch.float64) * s
    assert torch.equal(torch.signbit(deq), torch.signbit(x64))               # signs kept (never zero input)
    m = (x64.abs() / s).clamp(max=6.0)
    dist = (m[..., None] - GRID).abs()
    best = dist.min(-1).values
    got = dist.gather(-1, (c & 7)[..., None])[..., 0]
    assert torch.equal(got, best)                                             # a nearest magnitude
    tie = (dist == best[..., None]).sum(-1) > 1
    assert ((c[tie] & 7) % 2 == 0).all()                                      # ties go to the even code
    assert ((deq - x64).abs() <= torch.maximum(x64.abs(), s) / 4).all()


# ---------------------------------------------------------------------------- reference

@pytest.mark.parametrize("s2", [1.0, 0.37], ids=["scale2-1", "scale2-0.37"])
def test_gqa_write_read_against_float64(s2):
    g = _gen()
    hkv, d, dv = 2, 48, 32
    cache = new_gqa_layer(NB, BS, hkv, d, dv, FMT)
    cache.scale_2.fill_(s2)
    lens = [1, BS + 3, 3 * BS]
    table = random_block_tables(lens, BS, NB, g)
    for b, n in enumerate(lens):
        k, v = _nonzero((n, hkv, d), g), _nonzero((n, hkv, dv), g)
        write_gqa_kv(cache, k, v, slots_for(table, b, range(n), BS))
        blocks = table[b, :-(-n // BS)].long()
        for x, codes, scales in ((k, cache.k, cache.k_scale), (v, cache.v, cache.v_scale)):
            _check_float64(x, codes[blocks].flatten(0, 1)[:n], scales[blocks].flatten(0, 1)[:n], s2)
        k2, v2 = read_gqa_kv(cache, table[b], n)
        assert k2.shape == k.shape and v2.shape == v.shape
        assert float((k2 - k).norm() / k.norm()) < 0.2 and not torch.equal(k2, k)


def test_mla_write_read_against_float64():
    g = _gen()
    r, p = 64, 16
    cache = new_mla_layer(NB, BS, r, p, FMT)
    cache.scale_2.copy_(torch.tensor([0.5, 0.25]))
    lens = [5, 2 * BS + 1]
    table = random_block_tables(lens, BS, NB, g)
    for b, n in enumerate(lens):
        lat, rope = _nonzero((n, r), g), _nonzero((n, p), g)
        write_mla_kv(cache, lat, rope, slots_for(table, b, range(n), BS))
        blocks = table[b, :-(-n // BS)].long()
        _check_float64(lat, cache.latent[blocks].flatten(0, 1)[:n], cache.latent_scale[blocks].flatten(0, 1)[:n], 0.5)
        lat2, rope2 = read_mla_kv(cache, table[b], n)
        # the rope part: e4m3 of rope / 0.25 (normal here), half an ulp = 2**-4 relative
        assert ((rope2.double() - rope.double()).abs() <= rope.double().abs() * 2.0 ** -4 * (1 + 1e-9)).all()
        assert float((lat2 - lat).norm() / lat.norm()) < 0.2


@pytest.mark.parametrize("s2", [1.0, 2.0 ** -6, 4.0])
def test_exactly_representable_values_round_trip_bit_exact(s2):
    """Values e2m1 x e4m3 x scale_2 whose block maximum is 6 x its scale: the write recovers the
    scale and every code, so the read gives the same bits (GQA and MLA), zeros and -0 included."""
    g = _gen()
    t, d = 9, 64
    vals = torch.tensor(e2m1.VALUES)[torch.randint(0, 16, (t, d // 16, 16), generator=g)]
    vals[..., 0] = 6.0 * torch.sign(torch.randn(t, d // 16, generator=g))          # amax = 6 s exactly
    e4 = torch.arange(8, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()   # normal e4m3
    sc = e4[torch.randint(0, e4.numel(), (t, d // 16), generator=g)]
    x = (vals * (sc * s2)[..., None]).flatten(-2)
    cache = new_gqa_layer(NB, BS, 1, d, d, FMT)
    cache.scale_2.fill_(s2)
    slots = torch.randperm(NB * BS, generator=g)[:t]
    write_gqa_kv(cache, x[:, None], -x[:, None], slots)
    flat = lambda part: part.flatten(0, 1)[slots][:, 0]                          # noqa: E731
    assert torch.equal(flat(cache.k_scale).float(), sc)
    assert torch.equal(e2m1.unpack_nibbles(flat(cache.k)), e2m1.encode(vals.flatten(-2)))
    table = torch.arange(NB, dtype=torch.int32)
    k2, v2 = read_gqa_kv(cache, table, NB * BS)
    assert torch.equal(k2[slots][:, 0], x) and torch.equal(v2[slots][:, 0], -x)
    mla = new_mla_layer(NB, BS, d, 16, FMT)
    mla.scale_2.fill_(s2)
    write_mla_kv(mla, x, x[:, :16], slots)
    lat, _ = read_mla_kv(mla, table, NB * BS)
    assert torch.equal(lat[slots], x)


def test_slot_minus_one_is_skipped_everywhere():
    g = _gen()
    gqa = new_gqa_layer(4, BS, 2, 32, 32, FMT)
    mla = new_mla_layer(4, BS, 32, 16, FMT)
    for part in (gqa.k, gqa.v, gqa.k_scale.view(torch.uint8), gqa.v_scale.view(torch.uint8), mla.buffer):
        part.fill_(0xAB)
    slots = torch.tensor([5, -1, 2 * BS + 3, -1])
    write_gqa_kv(gqa, _nonzero((4, 2, 32), g), _nonzero((4, 2, 32), g), slots)
    write_mla_kv(mla, _nonzero((4, 32), g), _nonzero((4, 16), g), slots)
    keep = torch.ones(4 * BS, dtype=torch.bool)
    keep[[5, 2 * BS + 3]] = False
    for part in (gqa.k, gqa.v, gqa.k_scale.view(torch.uint8), gqa.v_scale.view(torch.uint8), mla.buffer):
        flat = part.flatten(0, 1)
        assert (flat[keep] == 0xAB).all() and (flat[~keep] != 0xAB).any()


def test_bytes_per_token_and_the_buffers():
    # SPEC 3: 352 B/token at R = 512, P = 64 (256 code bytes + 32 e4m3 scales + 64 e4m3 rope)
    assert mla_bytes_per_token(512, 64, FMT) == 352
    c = new_mla_layer(2, BS, 512, 64, FMT)
    assert c.buffer.shape[-1] == 352 and c.buffer.dtype == torch.uint8 and c.kv_lora_rank == 512
    assert c.latent.data_ptr() == c.buffer.data_ptr() and c.rope.dtype == torch.float8_e4m3fn
    # GQA: per head and part D/2 + D/16 bytes; GLM-4.5 8 x 128, Qwen3-30B-A3B 4 x 128
    assert gqa_bytes_per_token(8, 128, 128, FMT) == 8 * 2 * (64 + 8) == 1152
    assert gqa_bytes_per_token(4, 128, 128, FMT) == 576
    gq = new_gqa_layer(2, BS, 4, 128, 64, FMT)
    held = sum(t[0, 0].numel() * t.element_size() for t in (gq.k, gq.v, gq.k_scale, gq.v_scale))
    assert held == gqa_bytes_per_token(4, 128, 64, FMT) and (gq.head_dim, gq.v_head_dim) == (128, 64)


def test_dtype_names_and_the_attention_check():
    from types import SimpleNamespace as NS
    mla = NS(kind="mla", kv_lora_rank=512, qk_rope_head_dim=64)
    gqa = NS(kind="gqa", num_kv_heads=4, head_dim=128, v_head_dim=128)
    odd = NS(kind="gqa", num_kv_heads=2, head_dim=24, v_head_dim=24)
    assert kv_cache_dtypes_for(mla) == kv_cache_dtypes_for(gqa) == ("auto", "bf16", "fp8", "nvfp4")
    assert kv_format_for("nvfp4", torch.bfloat16, mla) == KVFormat("nvfp4", dtype=torch.bfloat16)
    assert kv_cache.kv_layer_bytes_per_token(mla, kv_format_for("nvfp4", torch.bfloat16)) == 352
    with pytest.raises(ConfigError) as e:
        kv_format_for("nvfp4", torch.bfloat16, odd)
    msg = str(e.value)
    assert "\n" not in msg and "nvfp4" in msg and "head_dim 24" in msg and msg.endswith("auto, bf16, fp8")
    with pytest.raises(ConfigError, match="choose auto, bf16, fp8, nvfp4"):
        kv_format_for("int4", torch.bfloat16)


def test_reference_attention_moves_by_quantization_only():
    """Decode through the nvfp4 cache against the same attention over the bf16 cache: close
    (nvfp4's error, not O(1): a dropped scale_2 or block scale gives O(1)) but not equal."""
    g = _gen()
    lens = [3 * BS + 5, 20]
    table = random_block_tables(lens, BS, NB, g)
    sl = torch.tensor(lens, dtype=torch.int32)
    nv, bf = new_gqa_layer(NB, BS, 2, 64, 64, FMT), new_gqa_layer(NB, BS, 2, 64, 64, KVFormat("auto"))
    nv.scale_2.copy_(torch.tensor([0.3, 3.0]))
    for b, n in enumerate(lens):
        k, v, slots = torch.randn(n, 2, 64, generator=g), torch.randn(n, 2, 64, generator=g), \
            slots_for(table, b, range(n), BS)
        write_gqa_kv(nv, k, v, slots)
        write_gqa_kv(bf, k, v, slots)
    q = torch.randn(2, 8, 64, generator=g)
    a, b_ = ref.paged_decode_gqa(q, nv, table, sl, 0.125), ref.paged_decode_gqa(q, bf, table, sl, 0.125)
    err = float((a - b_).norm() / b_.norm())
    assert 0.01 < err < 0.4, err


# ---------------------------------------------------------------------------- Triton (interpreted)

def _tri(name: str):
    import importlib
    return importlib.import_module(f"moet.kernels.{name}")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@requires_triton
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_triton_writes_store_the_reference_bytes(src_dtype):
    """GQA (k and v in one launch, head dims 48 and 32: a non-power-of-two tile) and MLA rows:
    random slots with -1s, an all-zero block, a block whose scale underflows e4m3 (stored as signed
    zeros), a block past 6 * 448 * scale_2 (saturated scale), scale_2 not 1."""
    g = _gen()
    t = 9
    slots = torch.randperm(NB * BS, generator=g)[:t]
    slots[[2, 6]] = -1
    k, v = torch.randn(t, 2, 48, generator=g) * 3, torch.randn(t, 2, 32, generator=g)
    k[0, 0, :16] = 0
    k[1, 1, 16:32] *= 1e-5
    k[3, 0, 32:] *= 2000
    lat, rope = torch.randn(t, 64, generator=g), torch.randn(t, 16, generator=g) * 40
    lat[4, :16] *= -1e-5
    k, v, lat, rope = (x.to(src_dtype) for x in (k, v, lat, rope))
    kw = _tri("kv_write_triton")
    for make, write, ref_write, args in (
            (lambda dev: new_gqa_layer(NB, BS, 2, 48, 32, FMT, device=dev), kw.write_gqa_kv, write_gqa_kv, (k, v)),
            (lambda dev: new_mla_layer(NB, BS, 64, 16, FMT, device=dev), kw.write_mla_kv, write_mla_kv, (lat, rope))):
        want, got = make("cpu"), make(DEVICE)
        for c in (want, got):
            c.scale_2.copy_(torch.tensor([0.37, 0.125]))
        ref_write(want, *args, slots)
        write(got, *(a.to(DEVICE) for a in args), slots.to(DEVICE))
        parts = ("k", "v", "k_scale", "v_scale") if hasattr(want, "k") else ("buffer",)
        for name in parts:
            assert torch.equal(_bytes(getattr(got, name).cpu()), _bytes(getattr(want, name))), name


@requires_triton
def test_triton_write_ties_and_saturation():
    """|x| / scale exactly on every e2m1 midpoint (ties to the even code) and past 6 (saturation:
    amax / 6 = 1.0625 is an e4m3 tie, rounded down to the even 1.0), both signs: the Triton write's
    codes are the reference's."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 6.0, 6.2, 1e-3, 3.0, 0.125, 4.5, 5.5])
    row = torch.cat([torch.tensor([6.375]), mids])                   # amax 6.375 -> scale 1 (scale_2 1)
    x = torch.stack([row, -row, row * 0.5, row * 32.0])               # scales 1, 1, 0.5, 32
    x = x.reshape(1, 4 * 16).repeat(3, 1)
    slots = torch.tensor([1, 20, 33])
    want, got = new_mla_layer(4, BS, 64, 16, FMT), new_mla_layer(4, BS, 64, 16, FMT, device=DEVICE)
    write_mla_kv(want, x, x[:, :16], slots)
    _tri("kv_write_triton").write_mla_kv(got, x.to(DEVICE), x[:, :16].to(DEVICE), slots.to(DEVICE))
    assert torch.equal(got.buffer.cpu(), want.buffer)
    codes = e2m1.unpack_nibbles(want.latent.flatten(0, 1)[1]).view(4, 16)
    assert want.latent_scale.flatten(0, 1)[1].float().tolist() == [1.0, 1.0, 0.5, 32.0]
    assert codes[0].tolist() == [7, 0, 2, 2, 4, 4, 6, 6, 1, 7, 7, 0, 5, 0, 6, 7]
    assert torch.equal(codes[1], codes[0] | 8) and torch.equal(codes[2], codes[0]) and torch.equal(codes[3], codes[0])


def _gqa_setup(lens, hkv, d, dv, g, s2=(0.5, 0.25)):
    cache = new_gqa_layer(NB, BS, hkv, d, dv, FMT, device=DEVICE)
    cache.scale_2.copy_(torch.tensor(s2))
    table = random_block_tables(lens, BS, NB, g)
    for b, n in enumerate(lens):
        kv_cache.write_gqa_kv(cache, torch.randn(n, hkv, d, generator=g).to(DEVICE),
                              torch.randn(n, hkv, dv, generator=g).to(DEVICE),
                              slots_for(table, b, range(n), BS).to(DEVICE))
    return cache, table.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE)


def _cpu(cache):
    from dataclasses import replace
    return replace(cache, **{f: getattr(cache, f).cpu() for f in ("k", "v", "k_scale", "v_scale", "scale_2")}) \
        if hasattr(cache, "k") else _mla_cpu(cache)


def _mla_cpu(cache):
    c = new_mla_layer(cache.num_blocks, cache.block_size, cache.kv_lora_rank, cache.rope.shape[-1], cache.fmt)
    c.buffer.copy_(cache.buffer.cpu())
    c.scale_2.copy_(cache.scale_2.cpu())
    return c


def _close(got, want, qdtype):
    if qdtype == torch.float32:
        torch.testing.assert_close(got.cpu(), want, rtol=2e-5, atol=2e-5)
    else:                                   # bf16 operands and output: bf16 accuracy
        assert float((got.float().cpu() - want).norm() / want.norm()) < 2e-2


GQA_CASES = [
    # lens, hq, hkv, d, dv, window, split_tokens, qdtype, swap_ab
    ([1, BS - 1, 3 * BS + 5], 4, 2, 32, 32, None, 32, torch.float32, False),
    ([2 * BS + 3, 9], 8, 2, 48, 32, 20, 16, torch.float32, False),            # d not a power of two, window
    ([3 * BS + 1, 7], 4, 2, 32, 32, None, 32, torch.bfloat16, False),
    ([3 * BS + 1, 7], 4, 2, 32, 32, None, 32, torch.float32, True),           # tokens as the MMAs' M
]


@requires_triton
@pytest.mark.parametrize("lens,hq,hkv,d,dv,window,split,qdtype,swap_ab", GQA_CASES)
def test_triton_gqa_decode_reads_nvfp4(lens, hq, hkv, d, dv, window, split, qdtype, swap_ab):
    g = _gen()
    cache, table, sl = _gqa_setup(lens, hkv, d, dv, g)
    q = torch.randn(len(lens), hq, d, generator=g).to(DEVICE, qdtype)
    want = ref.paged_decode_gqa(q.float().cpu(), _cpu(cache), table.cpu(), sl.cpu(), 0.3, window)
    got = _tri("attention_triton").paged_decode_gqa(q, cache, table, sl, 0.3, window, split_tokens=split,
                                                    swap_ab=swap_ab)
    _close(got, want, qdtype)


@requires_triton
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16], ids=["q-fp32", "q-bf16"])
def test_triton_gqa_prefill_reads_nvfp4(qdtype):
    """Two sequences with cached context and a chunk each, one with a window; head dims 48 / 32."""
    g = _gen()
    lens, qlens = [2 * BS + 5, 20], [9, 20]
    cache, table, sl = _gqa_setup(lens, 2, 48, 32, g)
    cu = torch.tensor([0, qlens[0], sum(qlens)], dtype=torch.int32)
    q = torch.randn(sum(qlens), 8, 48, generator=g)
    pt = _tri("prefill_triton")
    for window in (None, 13):
        want = ref.paged_prefill_gqa(q, _cpu(cache), table.cpu(), cu, sl.cpu(), 0.3, window)
        got = pt.paged_prefill_gqa(q.to(DEVICE, qdtype), cache, table, cu.to(DEVICE), sl, 0.3, window)
        _close(got, want, qdtype)


MLA_CASES = [
    # lens, heads, split_tokens, block_h, qdtype, heads_m
    ([1, BS - 1, 3 * BS + 5], 4, 32, None, torch.float32, False),
    ([3 * BS - 2, 7], 20, 48, 16, torch.float32, True),                       # two head blocks, 16-token steps
    ([3 * BS - 2, 7], 4, 32, None, torch.bfloat16, True),
    ([3 * BS - 2, 7], 4, 32, None, torch.bfloat16, False),
]


@requires_triton
@pytest.mark.parametrize("lens,h,split,block_h,qdtype,heads_m", MLA_CASES)
def test_triton_mla_decode_and_prefill_read_nvfp4(lens, h, split, block_h, qdtype, heads_m):
    g = _gen()
    r, p = 32, 16
    cache = new_mla_layer(NB, BS, r, p, FMT, device=DEVICE)
    cache.scale_2.copy_(torch.tensor([0.5, 0.25]))
    table = random_block_tables(lens, BS, NB, g)
    for b, n in enumerate(lens):
        kv_cache.write_mla_kv(cache, torch.randn(n, r, generator=g).to(DEVICE),
                              (torch.randn(n, p, generator=g) * 4).to(DEVICE),
                              slots_for(table, b, range(n), BS).to(DEVICE))
    cpu, table_d = _mla_cpu(cache), table.to(DEVICE)
    sl = torch.tensor(lens, dtype=torch.int32)
    ql, qr = torch.randn(len(lens), h, r, generator=g), torch.randn(len(lens), h, p, generator=g)
    want = ref.paged_decode_mla(ql, qr, cpu, table, sl, 0.2)
    got = _tri("mla_decode_triton").paged_decode_mla(
        ql.to(DEVICE, qdtype), qr.to(DEVICE, qdtype), cache, table_d, sl.to(DEVICE), 0.2, split_tokens=split,
        block_h=block_h, heads_m=heads_m, block_n=16 if heads_m else None)
    _close(got, want, qdtype)
    qlens = [min(6, n) for n in lens]
    cu = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    ql, qr = torch.randn(sum(qlens), h, r, generator=g), torch.randn(sum(qlens), h, p, generator=g)
    want = ref.paged_prefill_mla(ql, qr, cpu, table, cu, sl, 0.2)
    got = _tri("mla_prefill_triton").paged_prefill_mla(ql.to(DEVICE, qdtype), qr.to(DEVICE, qdtype), cache, table_d,
                                                       cu.to(DEVICE), sl.to(DEVICE), 0.2, block_h=block_h,
                                                       heads_m=heads_m)
    _close(got, want, qdtype)


@requires_triton
def test_triton_mla_refuses_a_latent_width_other_than_the_cache():
    cache = new_mla_layer(2, BS, 32, 16, FMT, device=DEVICE)
    q = torch.zeros(1, 4, 48, device=DEVICE)
    with pytest.raises(ConfigError, match="kv_lora_rank 32"):
        _tri("mla_decode_triton").paged_decode_mla(q, q[..., :16], cache, torch.zeros(1, 1, dtype=torch.int32,
                                                                                        device=DEVICE),
                                                   torch.ones(1, dtype=torch.int32, device=DEVICE), 0.2)


