"""e2m1, e4m3fn, e5m2 and UE8M0 against independent bit-level definitions."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from moet.errors import FormatError
from moet.formats import e2m1, fp8


def e2m1_value_from_bits(code: int) -> float:
    """Independent definition: sign | 2-bit exponent (bias 1) | 1-bit mantissa, subnormal at exp 0."""
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    mag = (m * 0.5) if e == 0 else (1 + m * 0.5) * 2.0 ** (e - 1)
    return -mag if s else mag


def test_all_16_e2m1_codes_decode_to_their_bit_definition():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = e2m1.decode(codes)
    for c in range(16):
        assert vals[c].item() == e2m1_value_from_bits(c)
        assert math.copysign(1.0, vals[c].item()) == (-1.0 if c >= 8 else 1.0)  # -0 keeps its sign


def test_e2m1_encode_inverts_decode_for_every_code_including_minus_zero():
    codes = torch.arange(16, dtype=torch.uint8)
    for rounding in ("nearest_even", "nearest_lower"):
        assert torch.equal(e2m1.encode(e2m1.decode(codes), rounding), codes)


def _nearest_code(x: float, ties: str) -> int:
    mags = e2m1.MAGNITUDES
    a = min(abs(x), 6.0)
    d = [abs(a - m) for m in mags]
    best = min(d)
    cands = [i for i in range(8) if d[i] == best]
    i = cands[0] if ties == "lower" else next(c for c in cands if c % 2 == 0) if len(cands) > 1 else cands[0]
    return i | (8 if math.copysign(1.0, x) < 0 else 0)


@given(st.lists(st.one_of(st.floats(-8, 8, allow_nan=False, width=32),
                          st.sampled_from([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, -5.0, 7.0, -100.0])),
                min_size=1, max_size=64))
def test_e2m1_encode_is_round_to_nearest_with_the_requested_ties(xs):
    x = torch.tensor(xs, dtype=torch.float32)
    even = e2m1.encode(x, "nearest_even").tolist()
    lower = e2m1.encode(x, "nearest_lower").tolist()
    for v, ce, cl in zip(x.tolist(), even, lower):
        assert ce == _nearest_code(v, "even"), v
        assert cl == _nearest_code(v, "lower"), v


@given(st.integers(1, 8), st.integers(1, 16))
def test_nibble_packing_puts_even_elements_in_the_low_nibble(rows, half):
    codes = torch.randint(0, 16, (rows, 2 * half), dtype=torch.uint8)
    packed = e2m1.pack_nibbles(codes)
    assert packed.shape == (rows, half)
    assert torch.equal(packed & 0xF, codes[:, 0::2]) and torch.equal(packed >> 4, codes[:, 1::2])
    assert torch.equal(e2m1.unpack_nibbles(packed), codes)


def e4m3fn_from_bits(b: int) -> float:
    s, e, m = b >> 7, (b >> 3) & 0xF, b & 7
    if e == 0xF and m == 7:
        return float("nan")
    mag = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if s else mag


def e5m2_from_bits(b: int) -> float:
    s, e, m = b >> 7, (b >> 2) & 0x1F, b & 3
    if e == 0x1F:
        mag = float("inf") if m == 0 else float("nan")
    else:
        mag = (m / 4) * 2.0 ** -14 if e == 0 else (1 + m / 4) * 2.0 ** (e - 15)
    return -mag if s else mag


@pytest.mark.parametrize("view,ref", [(fp8.e4m3_from_bytes, e4m3fn_from_bits), (fp8.e5m2_from_bytes, e5m2_from_bits)])
def test_all_256_fp8_bytes_decode_to_their_bit_definition(view, ref):
    got = view(torch.arange(256, dtype=torch.int32).to(torch.uint8)).double().tolist()
    for b in range(256):
        want = ref(b)
        if math.isnan(want):
            assert math.isnan(got[b]), b
        else:
            assert got[b] == want and math.copysign(1, got[b]) == math.copysign(1, want), b


def _rne_reference(x: float, finite: list[float], codes_even: list[bool]) -> float:
    best = min(abs(x - f) for f in finite)
    cands = [(f, ev) for f, ev in zip(finite, codes_even) if abs(x - f) == best]
    if len(cands) > 1:
        cands = [c for c in cands if c[1]]
    return cands[0][0]


@pytest.mark.parametrize("name,encode,view,vmax", [
    ("e4m3", fp8.to_e4m3, fp8.e4m3_from_bytes, fp8.E4M3_MAX),
    ("e5m2", fp8.to_e5m2, fp8.e5m2_from_bytes, fp8.E5M2_MAX),
])
def test_fp8_encode_is_nearest_even_and_saturates(name, encode, view, vmax):
    table = view(torch.arange(256, dtype=torch.int32).to(torch.uint8)).double()
    ok = torch.isfinite(table)
    finite, even = table[ok].tolist(), [(b & 1) == 0 for b in range(256) if ok[b]]
    # every finite value round-trips
    assert torch.equal(encode(table[ok].float()).double(), table[ok])
    rng = np.random.default_rng(0)
    xs = np.concatenate([rng.standard_normal(300) * vmax / 8, rng.uniform(-vmax, vmax, 200),
                         (np.array(finite[:-1]) + np.diff(finite)[:] / 2)[::7]])  # many exact midpoints
    got = encode(torch.tensor(xs, dtype=torch.float64)).double().tolist()
    for x, g in zip(xs.tolist(), got):
        assert g == _rne_reference(x, finite, even), (name, x, g)
    sat = encode(torch.tensor([vmax * 4, -vmax * 4, float(vmax) * 1.01], dtype=torch.float32)).float().tolist()
    assert sat == [vmax, -vmax, vmax]


def test_ue8m0_bytes_decode_to_powers_of_two_and_255_is_nan():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = fp8.ue8m0_decode(b, torch.float64)
    for i in range(255):
        assert v[i].item() == 2.0 ** (i - 127)
    assert math.isnan(v[255].item())
    e = torch.arange(-127, 128)
    assert torch.equal(fp8.ue8m0_encode(e), torch.arange(0, 255, dtype=torch.int32).to(torch.uint8))
    with pytest.raises(FormatError, match="out of range"):
        fp8.ue8m0_encode(torch.tensor([128]))
