"""NVFP4 (modelopt), MXFP4 (gpt-oss) and FP8 block-128 (DeepSeek): decode against element-wise
float64 definitions, encode/decode round trips on representable values, bad input."""
import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from moet.errors import FormatError
from moet.formats import e2m1, fp8, fp8_block, mxfp4, nvfp4

shapes = st.tuples(st.integers(1, 6), st.integers(1, 4))  # (rows, blocks of 32)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def random_e4m3_positive(shape, g, lo=-6, hi=6):
    """Random positive finite e4m3 values (normal range) as float32."""
    mant = torch.randint(0, 8, shape, generator=g).float()
    exp = torch.randint(lo, hi, shape, generator=g).float()
    return ((1 + mant / 8) * torch.pow(2.0, exp)).to(torch.float8_e4m3fn)


# ------------------------------------------------------------------------------------ NVFP4

def nvfp4_reference(weight, scale, scale2):
    w, s = weight.numpy(), scale.float().double().numpy()
    n, half = w.shape
    out = np.zeros((n, half * 2))
    for r in range(n):
        for i in range(half):
            for k, code in ((2 * i, w[r, i] & 0xF), (2 * i + 1, w[r, i] >> 4)):  # low nibble first
                out[r, k] = e2m1.VALUES[code] * s[r, k // 16] * float(scale2)
    return torch.from_numpy(out)


@given(shapes, st.integers(0, 2**31))
def test_nvfp4_dequantize_matches_elementwise_definition(shape, seed):
    n, kb = shape
    g = _gen(seed)
    weight = torch.randint(0, 256, (n, kb * 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scale = random_e4m3_positive((n, kb * 2), g)
    scale2 = torch.tensor(float(torch.rand((), generator=g)) * 1e-2 + 1e-4, dtype=torch.float32)
    got = nvfp4.dequantize(weight, scale, scale2, dtype=torch.float64)
    assert torch.equal(got, nvfp4_reference(weight, scale, scale2))
    got32 = nvfp4.dequantize(weight, scale, scale2)
    assert got32.dtype == torch.float32 and torch.allclose(got32.double(), got, rtol=1e-7, atol=0)


@given(shapes, st.integers(0, 2**31), st.integers(-8, 8))
def test_nvfp4_round_trip_on_representable_values(shape, seed, s2_exp):
    """Blocks whose max code is +-6 with a power-of-two scale_2: quantize(dequantize(x)) == x."""
    n, kb = shape
    g = _gen(seed)
    codes = torch.randint(0, 16, (n, kb * 32), generator=g, dtype=torch.uint8)
    codes.view(n, kb * 2, 16)[:, :, 0] = torch.where(torch.rand(n, kb * 2, generator=g) < 0.5, 7, 15).to(torch.uint8)
    weight = e2m1.pack_nibbles(codes)
    scale = random_e4m3_positive((n, kb * 2), g)
    s2 = torch.tensor(2.0 ** s2_exp, dtype=torch.float32)
    w = nvfp4.dequantize(weight, scale, s2)
    t = nvfp4.quantize(w, weight_scale_2=float(s2))
    assert torch.equal(t.weight, weight)
    assert torch.equal(t.weight_scale.view(torch.uint8), scale.view(torch.uint8))
    assert t.weight_scale_2.item() == s2.item()


def test_nvfp4_quantize_error_is_small_and_deterministic():
    w = torch.randn(64, 256, generator=_gen(1))
    t1, t2 = nvfp4.quantize(w), nvfp4.quantize(w.clone())
    assert torch.equal(t1.weight, t2.weight) and torch.equal(t1.weight_scale.view(torch.uint8), t2.weight_scale.view(torch.uint8))
    back = nvfp4.dequantize(t1.weight, t1.weight_scale, t1.weight_scale_2)
    rel = ((back - w).norm() / w.norm()).item()
    assert 0.02 < rel < 0.12, rel  # FP4 with e4m3 block-16 scales on Gaussian data: ~9%
    assert t1.weight.shape == (64, 128) and t1.weight_scale.shape == (64, 16) and t1.weight_scale_2.shape == ()


def test_nvfp4_bad_input_names_the_tensor():
    w = torch.randn(8, 64)
    t = nvfp4.quantize(w)
    with pytest.raises(FormatError, match="experts.0.w1.*weight_scale has shape"):
        nvfp4.dequantize(t.weight, t.weight_scale[:, :3], t.weight_scale_2, name="experts.0.w1")
    with pytest.raises(FormatError, match="must be uint8"):
        nvfp4.dequantize(t.weight.float(), t.weight_scale, t.weight_scale_2, name="x")
    with pytest.raises(FormatError, match="NaN"):
        nvfp4.quantize(torch.tensor([[float("nan")] * 16]), name="x")
    with pytest.raises(FormatError, match="not divisible"):
        nvfp4.quantize(torch.randn(4, 24), name="x")
    bad_scale = t.weight_scale.clone().view(torch.uint8)
    bad_scale[0, 0] = 0x7F  # e4m3fn NaN
    with pytest.raises(FormatError, match="NaN"):
        nvfp4.dequantize(t.weight, bad_scale.view(torch.float8_e4m3fn), t.weight_scale_2, name="x")


# ------------------------------------------------------------------------------------ MXFP4

@given(st.integers(1, 3), st.integers(1, 5), st.integers(1, 3), st.integers(0, 2**31))
def test_mxfp4_dequantize_matches_transformers_gpt_oss_reader(e, n, g_count, seed):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    g = _gen(seed)
    blocks = torch.randint(0, 256, (e, n, g_count, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(100, 150, (e, n, g_count), generator=g, dtype=torch.int32).to(torch.uint8)
    ours = mxfp4.dequantize(blocks, scales)                                  # [E, N, K]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N] (transposed)
    assert torch.equal(ours, theirs.transpose(1, 2))


@given(shapes, st.integers(0, 2**31))
def test_mxfp4_round_trip_on_representable_values(shape, seed):
    n, kb = shape
    g = _gen(seed)
    codes = torch.randint(0, 16, (n, kb, 32), generator=g, dtype=torch.uint8)
    codes[:, :, 5] = torch.tensor([6, 7, 14, 15])[torch.randint(0, 4, (n, kb), generator=g)].to(torch.uint8)  # |max| in {4, 6}
    blocks = e2m1.pack_nibbles(codes)
    scales = torch.randint(1, 254, (n, kb), generator=g, dtype=torch.int32).to(torch.uint8)
    w = mxfp4.dequantize(blocks, scales, dtype=torch.float64)
    b2, s2 = mxfp4.quantize(w)
    assert torch.equal(b2, blocks) and torch.equal(s2, scales)


def test_mxfp4_bad_input():
    b = torch.zeros(2, 3, 16, dtype=torch.uint8)
    with pytest.raises(FormatError, match="scales shape"):
        mxfp4.dequantize(b, torch.zeros(2, 2, dtype=torch.uint8), name="w")
    with pytest.raises(FormatError, match="255"):
        mxfp4.dequantize(b, torch.full((2, 3), 255, dtype=torch.uint8), name="w")
    with pytest.raises(FormatError, match="blocks must be"):
        mxfp4.dequantize(torch.zeros(2, 3, 15, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8))


# ------------------------------------------------------------------------------------ FP8 block-128

@given(st.integers(1, 300), st.integers(1, 300), st.integers(0, 2**31))
def test_fp8_block_dequantize_matches_elementwise_definition_including_partial_blocks(n, k, seed):
    g = _gen(seed)
    w = fp8.to_e4m3(torch.randn(n, k, generator=g) * 100)  # saturating: torch < 2.12 casts >448 to NaN
    s = torch.rand((-(-n // 128), -(-k // 128)), generator=g) + 0.01
    got = fp8_block.dequantize(w, s, dtype=torch.float64)
    wv, sv = w.double().numpy(), s.double().numpy()
    ref = np.empty((n, k))
    for r in range(n):
        ref[r] = wv[r] * np.repeat(sv[r // 128], 128)[:k]
    assert torch.equal(got, torch.from_numpy(ref))


@given(st.integers(1, 200), st.integers(1, 200), st.integers(0, 2**31))
def test_fp8_block_round_trip_on_representable_values(n, k, seed):
    g = _gen(seed)
    w = fp8.to_e4m3(torch.randn(n, k, generator=g) * 50)
    nb, kb = -(-n // 128), -(-k // 128)
    wf = w.float()
    wf[::128, ::128] = 448.0       # every block holds the e4m3 max, so amax / 448 = 1
    scale = torch.pow(2.0, torch.randint(-10, 10, (nb, kb), generator=g).float())
    values = fp8_block.dequantize(wf.to(torch.float8_e4m3fn), scale)
    q, s = fp8_block.quantize(values)
    assert torch.equal(s, scale)
    assert torch.equal(q.view(torch.uint8), wf.to(torch.float8_e4m3fn).view(torch.uint8))


def test_fp8_block_bad_input():
    w = torch.zeros(130, 10).to(torch.float8_e4m3fn)
    with pytest.raises(FormatError, match="weight_scale_inv has shape"):
        fp8_block.dequantize(w, torch.ones(1, 1), name="layers.3.mlp.down_proj")
    with pytest.raises(FormatError, match="must be float8_e4m3fn"):
        fp8_block.dequantize(w.float(), torch.ones(2, 1), name="x")
    with pytest.raises(FormatError, match="Inf"):
        fp8_block.quantize(torch.tensor([[float("inf"), 1.0]]), name="x")
