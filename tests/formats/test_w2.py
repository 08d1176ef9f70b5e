"""W2: the fast path equals the literal float64 reference bit for bit; sign symmetry, zero
modes, determinism, edge values, conversions from every checkpoint format, bad input."""
import math

import pytest
import torch
from hypothesis import given, strategies as st

from moet.errors import FormatError
from moet.formats import e2m1, fp8_block, mxfp4, nvfp4, w2


def same(a: w2.W2Tensor, b: w2.W2Tensor) -> bool:
    return torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales) and a.zero_mode == b.zero_mode


def weights(seed: int, n: int, kb: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    k = kb * 32
    if kind == "gauss":
        w = torch.randn(n, k, generator=g, dtype=torch.float64)
    elif kind == "laplace":
        u = torch.rand(n, k, generator=g, dtype=torch.float64) - 0.5
        w = -torch.sign(u) * torch.log1p(-2 * u.abs())
    elif kind == "wide":   # per-block magnitudes from 2**-140 to 2**130: clamped exponents on both ends
        w = torch.randn(n, k, generator=g, dtype=torch.float64) * torch.pow(
            2.0, torch.randint(-140, 130, (n, kb, 1), generator=g).double()).expand(n, kb, 32).reshape(n, k)
    elif kind == "zeros":  # many exact zeros of both signs, some all-zero blocks
        w = torch.randn(n, k, generator=g, dtype=torch.float64)
        w[torch.rand(n, k, generator=g) < 0.4] = 0.0
        w[torch.rand(n, k, generator=g) < 0.2] = -0.0
        w[:, :32] = 0.0
    elif kind == "grid":   # values exactly on e2m1 points and on the 2.5 tie, times powers of two
        pts = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 2.4999999, 2.5000001], dtype=torch.float64)
        w = pts[torch.randint(0, len(pts), (n, k), generator=g)] * torch.where(torch.rand(n, k, generator=g) < .5, -1.0, 1.0)
        w.view(n, kb, 32)[:, :, 0] = 6.0
        w = w * torch.pow(2.0, torch.randint(-20, 20, (n, kb, 1), generator=g).double()).expand(n, kb, 32).reshape(n, k)
    elif kind == "near_round":  # block maxima within 1 ulp of the exponent rounding threshold 6*2**(e+.5)
        w = torch.rand(n, k, generator=g, dtype=torch.float64)
        t = 6 * math.sqrt(2) * 2.0 ** torch.randint(-30, 30, (n, kb), generator=g).double()
        jitter = torch.tensor([math.nextafter(1, 0), 1.0, math.nextafter(1, 2)], dtype=torch.float64)
        t = t * jitter[torch.randint(0, 3, (n, kb), generator=g)]
        w = w.view(n, kb, 32) * t.unsqueeze(-1) / 2
        w[:, :, 3] = t
        w = w.reshape(n, k)
    else:
        raise AssertionError(kind)
    return w


KINDS = ["gauss", "laplace", "wide", "zeros", "grid", "near_round"]


@given(st.integers(0, 2**31), st.integers(1, 5), st.integers(1, 4), st.sampled_from(KINDS),
       st.sampled_from(["auto", "sign", "alt"]), st.sampled_from([torch.float64, torch.float32, torch.bfloat16]))
def test_fast_path_equals_float64_reference_bit_for_bit(seed, n, kb, kind, zero_mode, dtype):
    w = weights(seed, n, kb, kind)
    if dtype != torch.float64:
        w = w.clamp(-1e30, 1e30).to(dtype)      # stay finite in narrower types
    fast = w2.quantize(w, zero_mode=zero_mode)
    ref = w2.quantize_reference(w, zero_mode=zero_mode)
    assert same(fast, ref)


@given(st.integers(0, 2**31), st.integers(1, 4), st.integers(1, 3), st.sampled_from(KINDS))
def test_sign_symmetry_in_sign_mode(seed, n, kb, kind):
    w = weights(seed, n, kb, kind)
    pos = w2.dequantize(w2.quantize(w, zero_mode="sign"))
    neg = w2.dequantize(w2.quantize(-w, zero_mode="sign"))
    assert torch.equal(neg, -pos)
    # bit-level: negating the input flips every code c -> 3 - c and keeps the scales
    a, b = w2.quantize(w, zero_mode="sign"), w2.quantize(-w, zero_mode="sign")
    assert torch.equal(w2.unpack_codes(b.codes), 3 - w2.unpack_codes(a.codes)) and torch.equal(a.scales, b.scales)


def test_determinism_across_calls_and_copies():
    w = weights(7, 16, 8, "laplace")
    runs = [w2.quantize(w.clone()) for _ in range(3)] + [w2.quantize(w.flip(0).flip(0))]
    assert all(same(runs[0], r) for r in runs[1:])


def test_levels_code_order_and_byte_layout():
    # one block: element i gets value LEVELS[i % 4] * 2**e; check the documented bit positions
    vals = torch.tensor([-4.0, -1.0, 1.0, 4.0] * 8, dtype=torch.float64).reshape(1, 32) * 1.5  # amax 6 -> e = 0
    t = w2.quantize(vals, zero_mode="sign")
    assert t.scales.tolist() == [[127]]
    # codes 0,1,2,3 in bits 0-1, 2-3, 4-5, 6-7 -> 0b11100100
    assert t.codes.tolist() == [[0b11100100] * 8]
    assert w2.dequantize(t).tolist() == [[-4.0, -1.0, 1.0, 4.0] * 8]


def test_edge_values():
    k = 32
    # -0 keeps its sign in sign mode; an all-zero block gets exponent -127 (byte 0)
    z = torch.zeros(2, k, dtype=torch.float64)
    z[1] = -0.0
    t = w2.quantize(z, zero_mode="sign")
    assert t.scales.tolist() == [[0], [0]]
    d = w2.dequantize(t)
    assert (d[0] == 2.0 ** -127).all() and (d[1] == -(2.0 ** -127)).all()
    # alt: zeros alternate by K parity; auto picks alt when >95% of zeros share a sign
    ta = w2.quantize(z[:1], zero_mode="alt")
    assert w2.unpack_codes(ta.codes)[0].tolist() == [2, 1] * 16
    assert w2.quantize(z[:1], zero_mode="auto").zero_mode == "alt"
    mixed = torch.tensor([[0.0, -0.0] * 16], dtype=torch.float64)
    assert w2.quantize(mixed, zero_mode="auto").zero_mode == "sign"
    assert w2.quantize(torch.randn(2, 64, dtype=torch.float64), zero_mode="auto").zero_mode == "sign"  # no zeros
    # max float32 and min subnormal
    big = torch.full((1, k), torch.finfo(torch.float32).max, dtype=torch.float32)
    tb = w2.quantize(big)
    assert tb.scales.item() == 125 + 127 and torch.isfinite(w2.dequantize(tb)).all()
    tiny = torch.full((1, k), 2.0 ** -149, dtype=torch.float32)
    tt = w2.quantize(tiny)
    assert tt.scales.item() == 0 and (w2.dequantize(tt) == 2.0 ** -127).all()
    # exponent clamped at +127 for huge float64 blocks: values saturate at level 4
    huge = torch.full((1, k), 1e300, dtype=torch.float64)
    th = w2.quantize(huge)
    assert th.scales.item() == 254 and (w2.dequantize(th, dtype=torch.float64) == 4 * 2.0 ** 127).all()


def test_exponent_rounding_threshold_is_exact():
    """amax just below / above 6*2**(e+1/2) gives e / e+1 (round(log2(amax/6)))."""
    thr = 6 * math.sqrt(2)   # irrational threshold between e = 0 and e = 1
    for amax, want in [(math.nextafter(thr, 0), 0), (math.nextafter(thr, 100), 1), (6.0, 0), (12.0, 1), (3.0, -1)]:
        row = torch.zeros(1, 32, dtype=torch.float64)
        row[0, 0] = amax
        assert w2.quantize(row).scales.item() - 127 == want, amax


def test_magnitude_threshold_ties_go_to_level_1():
    row = torch.tensor([[6.0, 2.5, -2.5, 2.5000000001, 3.0, 2.0, 0.0, 5.0] * 4], dtype=torch.float64)
    vals = w2.dequantize(w2.quantize(row, zero_mode="sign")).tolist()[0][:8]
    assert vals == [4.0, 1.0, -1.0, 4.0, 4.0, 1.0, 1.0, 4.0]


@given(st.integers(0, 2**31), st.integers(1, 4), st.integers(1, 3))
def test_mse_rule_is_idempotent_on_w2_values_and_never_worse(seed, n, kb):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 4, (n, kb * 32), generator=g, dtype=torch.uint8)
    scales = torch.randint(60, 190, (n, kb), generator=g, dtype=torch.int32).to(torch.uint8)
    t = w2.W2Tensor(w2.pack_codes(codes), scales)
    v = w2.dequantize(t, dtype=torch.float64)
    back = w2.quantize(v, scale_rule="mse", zero_mode="sign")
    assert torch.equal(w2.dequantize(back, dtype=torch.float64), v)
    w = weights(seed, n, kb, "laplace")
    err = {r: ((w2.dequantize(w2.quantize(w, scale_rule=r), dtype=torch.float64) - w) ** 2).view(n, kb, 32).sum(-1)
           for r in ("published", "mse")}
    assert (err["mse"] <= err["published"]).all()


@given(st.integers(0, 2**31), st.integers(1, 4), st.integers(1, 3))
def test_from_checkpoint_formats_equal_quantizing_their_float64_values(seed, n, kb):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, kb * 32, generator=g)
    t = nvfp4.quantize(w)
    via = w2.from_nvfp4(t.weight, t.weight_scale, t.weight_scale_2)
    ref = w2.quantize_reference(nvfp4.dequantize(t.weight, t.weight_scale, t.weight_scale_2, dtype=torch.float64))
    assert same(via, ref)
    q, s = fp8_block.quantize(w * 3)
    assert same(w2.from_fp8_block(q, s), w2.quantize_reference(fp8_block.dequantize(q, s, dtype=torch.float64)))
    b, sc = mxfp4.quantize(w)
    assert same(w2.from_mxfp4(b, sc), w2.quantize_reference(mxfp4.dequantize(b, sc, dtype=torch.float64)))


def test_nvfp4_zeros_written_as_plus_zero_trigger_alternating_signs():
    """An exporter that writes every zero as +0 (e2m1 code 0) -> auto resolves to alt."""
    w = torch.randn(8, 64)
    w[torch.rand(8, 64) < 0.3] = 0.0
    t = nvfp4.quantize(w)
    codes = e2m1.unpack_nibbles(t.weight)
    codes[codes == 8] = 0                      # all zeros +0, as that exporter writes them
    weight = e2m1.pack_nibbles(codes)
    assert w2.from_nvfp4(weight, t.weight_scale, t.weight_scale_2).zero_mode == "alt"


def test_bad_input_names_the_tensor():
    with pytest.raises(FormatError, match="'layers.1.experts.3.up'.*not divisible by the block size 32"):
        w2.quantize(torch.randn(4, 48), name="layers.1.experts.3.up")
    with pytest.raises(FormatError, match="NaN"):
        w2.quantize(torch.tensor([[float("nan")] + [0.0] * 31]), name="w")
    with pytest.raises(FormatError, match="Inf"):
        w2.quantize(torch.tensor([[float("-inf")] + [0.0] * 31]), name="w")
    with pytest.raises(FormatError, match="floating-point"):
        w2.quantize(torch.zeros(2, 32, dtype=torch.int32), name="w")
    with pytest.raises(FormatError, match="zero_mode"):
        w2.quantize(torch.randn(2, 32), zero_mode="plus")
    with pytest.raises(FormatError, match="scale_rule"):
        w2.quantize(torch.randn(2, 32), scale_rule="best")
    with pytest.raises(FormatError, match="2-D"):
        w2.quantize(torch.randn(32), name="w")
    t = w2.quantize(torch.randn(2, 64))
    with pytest.raises(FormatError, match="scales shape"):
        w2.dequantize(w2.W2Tensor(t.codes, t.scales[:, :1]))


@given(st.integers(0, 2**31), st.integers(1, 4), st.integers(1, 3), st.sampled_from(["auto", "sign", "alt"]),
       st.sampled_from([1e-30, 1e-6, 0.37, 1.0, 3e4, 1e30]))
def test_nvfp4_code_domain_path_equals_reference_on_arbitrary_codes_and_scales(seed, n, kb, zero_mode, s2):
    """Every e2m1 code (incl. -0), e4m3 scales that are zero, -0, negative or subnormal."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randint(0, 256, (n, kb * 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scale_bytes = torch.randint(0, 256, (n, kb * 2), generator=g, dtype=torch.int32).to(torch.uint8)
    scale_bytes[scale_bytes & 0x7F == 0x7F] = 0x38          # no NaN scales (1.0 instead)
    scale_bytes[:, 0] = torch.tensor([0x00, 0x80, 0x01, 0xB8])[torch.randint(0, 4, (n,), generator=g)].to(torch.uint8)
    scale = scale_bytes.view(torch.float8_e4m3fn)
    s2t = torch.tensor(s2, dtype=torch.float32)
    fast = w2.from_nvfp4(weight, scale, s2t, zero_mode=zero_mode)
    ref = w2.quantize_reference(nvfp4.dequantize(weight, scale, s2t, dtype=torch.float64), zero_mode=zero_mode)
    assert same(fast, ref)


@given(st.integers(0, 2**31), st.integers(1, 4), st.integers(1, 3), st.sampled_from(["auto", "sign", "alt"]))
def test_mxfp4_code_domain_path_equals_reference_over_the_whole_scale_range(seed, n, kb, zero_mode):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, kb, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(0, 255, (n, kb), generator=g, dtype=torch.int32).to(torch.uint8)
    fast = w2.from_mxfp4(blocks, scales, zero_mode=zero_mode)
    ref = w2.quantize_reference(mxfp4.dequantize(blocks, scales, dtype=torch.float64), zero_mode=zero_mode)
    assert same(fast, ref)


@pytest.mark.parametrize("per_weight,cols", [(1 / 4, 64), (1 / 32, 8)])
def test_nb8t_row_tiles_round_trip_and_follow_the_documented_order(per_weight, cols):
    """tile_rows puts element (r, c) of [N, W] at ((r // 64) (W / cols) + c // cols) 64 cols +
    (r % 64) cols + c % cols (docs/formats.md, "Kernel layout nb8t"), batched over leading dims."""
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, 256, (2, 128, 3 * cols), dtype=torch.uint8, generator=g)
    t = w2.tile_rows(a, per_weight)
    assert t.shape == a.shape and torch.equal(w2.untile_rows(t, per_weight), a)
    flat = t.reshape(2, -1)
    for r, c in ((0, 0), (63, cols - 1), (64, 0), (70, cols + 5), (127, 3 * cols - 1)):
        off = ((r // 64) * 3 + c // cols) * 64 * cols + (r % 64) * cols + c % cols
        assert flat[1, off] == a[1, r, c]
    assert not torch.equal(t, a)


def test_nb8t_refuses_partial_tiles():
    with pytest.raises(FormatError, match="64 rows x 256 weights"):
        w2.tile_rows(torch.zeros(96, 64, dtype=torch.uint8), 1 / 4)
    with pytest.raises(FormatError, match="nb8t"):
        w2.untile_rows(torch.zeros(64, 42, dtype=torch.uint8), 1 / 32)   # 42 scale bytes: not whole 8-byte tile rows
