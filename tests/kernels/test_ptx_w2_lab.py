"""CPU tests of the PTX W2 decode-GEMV lab (tools/kernel_lab/ptx_w2): fm8 layout round trips,
the per-lane emulator against the torch reference, and that the generated PTX assembles for sm_90a."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

LAB = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "kernel_lab", "ptx_w2")
sys.path.insert(0, os.path.abspath(LAB))

import emulate as E  # noqa: E402
import gen_ptx as G  # noqa: E402
import layout as L  # noqa: E402


def _rand(n, k, t, seed):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (n, k // 4), dtype=np.uint8)
    scales = rng.integers(100, 140, (n, k // 32), dtype=np.uint8)
    xb, xs = E.quantize_x(torch.from_numpy(rng.standard_normal((t, k)).astype(np.float32)))
    return codes, scales, xb, xs


@pytest.mark.parametrize("n,k", [(8, 256), (24, 768), (16, 2048)])
def test_layout_round_trip(n, k):
    codes, scales, xb, _ = _rand(n, k, 5, n + k)
    cf, sf, xf = L.to_fm8_codes(codes), L.to_fm8_scales(scales), L.to_xfm(xb)
    assert cf.shape == (n // 8, k // 256, 32, 16) and cf.nbytes == codes.nbytes
    assert sf.shape == (n // 8, k // 256, 4, 16) and sf.nbytes == scales.nbytes
    np.testing.assert_array_equal(L.from_fm8_codes(cf, n, k), codes)
    np.testing.assert_array_equal(L.from_fm8_scales(sf, n, k), scales)
    np.testing.assert_array_equal(L.from_xfm(xf, 5, k), xb)
    # torch fast paths are the same bytes
    np.testing.assert_array_equal(L.to_fm8_codes_torch(torch.from_numpy(codes)).numpy(), cf)
    np.testing.assert_array_equal(L.to_fm8_scales_torch(torch.from_numpy(scales)).numpy(), sf)
    np.testing.assert_array_equal(L.to_xfm_torch(torch.from_numpy(xb)).numpy(), xf)


def test_layout_matches_docstring_positions():
    """Independent spot check of the documented bit positions: one non-zero code at a time."""
    n, k = 16, 512
    rng = np.random.default_rng(3)
    for _ in range(40):
        row, kk, code = int(rng.integers(n)), int(rng.integers(k)), int(rng.integers(1, 4))
        c = np.zeros((n, k), np.uint8)
        c[row, kk] = code
        fm = L.to_fm8_codes(L.pack_v1(c)).view("<u4").reshape(n // 8, k // 256, 32, 4)
        i, g = divmod(row, 8)
        ch, r = divmod(kk, 256)
        grp, kin = divmod(r, 32)
        q, jh = divmod(grp, 2)
        half, kq = divmod(kin, 16)
        t, nb = divmod(kq, 4)
        bit = 4 * (4 * jh + nb) + 2 * half
        expect = np.zeros_like(fm)
        expect[i, ch, 4 * g + t, q] = code << bit
        np.testing.assert_array_equal(fm, expect)


def test_prmt_semantics():
    a, b = np.uint32(0x33221100), np.uint32(0x77665544)
    assert int(E.prmt(a, b, 0x3210)) == 0x33221100
    assert int(E.prmt(a, b, 0x7654)) == 0x77665544
    assert int(E.prmt(a, b, 0x0004)) == 0x00000044 | (0x00 << 8)
    assert int(E.prmt(np.uint32(0x80), np.uint32(0), 0x8888)) == 0xFFFFFFFF  # sign replicate of 0x80
    assert int(E.prmt(np.uint32(0x7F), np.uint32(0), 0x0008)) == 0x7F7F7F00  # sign of 0x7F is 0
    assert int(E.prmt(np.uint32(0x12345678), np.uint32(0), 0xFFFF0123)) == 0x78563412  # bits 16.. ignored
    # the decode: code c selects byte c of the LUT word
    for c in range(4):
        assert int(E.prmt(L.LUT, 0, c * 0x1111)) == L.LEVEL_E4M3[c] * 0x01010101
    assert [E.E4M3[b] for b in L.LEVEL_E4M3] == [-4.0, -1.0, 1.0, 4.0]


@pytest.mark.parametrize("n,k,t,warps", [(8, 256, 1, 1), (16, 512, 4, 2), (24, 768, 8, 3), (8, 1024, 3, 4)])
def test_emulator_matches_reference(n, k, t, warps):
    codes, scales, xb, xs = _rand(n, k, t, 7 * n + k + t)
    y = E.gemv(L.to_fm8_codes(codes), L.to_fm8_scales(scales), L.to_xfm(xb), xs, n, k, t, warps)
    ref = E.reference(codes, scales, xb, xs)
    assert y.shape == (t, n)
    err = np.abs(y - ref).max() / np.abs(ref).max()
    assert err < 1e-6, err


def test_emulator_detects_a_wrong_layout():
    """The check has teeth: swapping the two k-halves of every B fragment (bits 0-1 vs 2-3 of
    each nibble) must not pass."""
    n, k, t = 8, 256, 2
    codes, scales, xb, xs = _rand(n, k, t, 11)
    w = L.to_fm8_codes(codes).view("<u4").copy()
    w = ((w & 0x33333333) << 2) | ((w & 0xCCCCCCCC) >> 2)
    y = E.gemv(w.view(np.uint8), L.to_fm8_scales(scales), L.to_xfm(xb), xs, n, k, t)
    ref = E.reference(codes, scales, xb, xs)
    assert np.abs(y - ref).max() / np.abs(ref).max() > 1e-2


def test_run_gpu_harness_cpu_dry():
    import run_gpu
    assert all(r["ok"] for r in run_gpu.cpu_dry())


@pytest.mark.skipif(G._bin_dir() is None, reason="ptxas not found: the triton wheel (triton==3.6.0) ships it")
@pytest.mark.parametrize("nt,warps", [(1, 4), (2, 4)])
def test_ptx_assembles_for_sm90a(nt, warps):
    r = G.report(nt, warps)
    assert r["spill_stores"] == 0
    assert r["loop_instr"] > 0
    assert any(op.startswith("HMMA") or op.startswith("QMMA") for op in r["loop_hist"])


# ----------------------------------------------------------------------------- next-step design (emulate_next)

def test_next_layout_is_a_permutation():
    import emulate_next as N
    n, k = 32, 512
    row, kk = N._code_index(n, k)
    flat = (row * k + kk).ravel()
    assert np.array_equal(np.sort(flat), np.arange(n * k))


def test_lut_fold_bytes_exact():
    """LUT + d * 0x08080808 is the e4m3 of level * 2^d for every d in [-6, 6] (no byte carries)."""
    import emulate_next as N
    for ref in (1, 7, 120, 248):
        for d in range(-N.RANGE, N.RANGE + 1):
            s = ref + d
            if not 0 <= s <= 255:
                continue
            w = int(N.lut_word(np.uint32(ref), np.uint32(s)))
            vals = [E.E4M3[(w >> (8 * i)) & 0xFF] for i in range(4)]
            assert vals == [lv * 2.0 ** d for lv in (-4.0, -1.0, 1.0, 4.0)], (ref, d, hex(w))


@pytest.mark.parametrize("n,k,t,lo,hi,zero_block", [(16, 256, 1, 120, 127, False), (32, 512, 8, 100, 140, False),
                                                    (16, 512, 3, 118, 124, True)])
def test_next_design_matches_reference(n, k, t, lo, hi, zero_block):
    import emulate_next as N
    rng = np.random.default_rng(n + k + t)
    codes = rng.integers(0, 256, (n, k // 4), dtype=np.uint8)
    scales = rng.integers(lo, hi, (n, k // 32), dtype=np.uint8)
    if zero_block:
        scales[3, 9] = 0          # the quantizer's all-zero block: forces the fallback for its chunk
    xb, xs = E.quantize_x(torch.from_numpy(rng.standard_normal((t, k)).astype(np.float32)))
    y, stats = N.gemv(codes, scales, xb, xs, t)
    ref = E.reference(codes, scales, xb, xs)
    assert np.abs(y - ref).max() / np.abs(ref).max() < 1e-6
    if zero_block:
        assert stats["fast_chunks"] >= 1 and stats["fallback_chunks"] >= 1


# ----------------------------------------------------------------------------- wgmma kernel (gen_wgmma + emulate_next)

def _wg_case(n, k, t, seed, lo=114, hi=126, fallback=()):
    """Canonical W2 (moet.formats.w2 v1) codes / scales: quantize a random float weight, then set
    the scale bytes to the requested range (and the listed (row, group) bytes) directly."""
    from moet.formats import w2 as W2F
    rng = np.random.default_rng(seed)
    q = W2F.quantize(torch.from_numpy(rng.standard_normal((n, k))))
    codes = q.codes.numpy().copy()
    scales = rng.integers(lo, hi + 1, (n, k // 32), dtype=np.uint8)
    for (r, g, v) in fallback:
        scales[r, g] = v
    xb, xs = E.quantize_x(torch.from_numpy(rng.standard_normal((t, k)).astype(np.float32)))
    return codes, scales, xb, xs


@pytest.mark.parametrize("n,k,t", [(64, 256, 1), (128, 768, 5), (64, 2048, 8)])
def test_wgmma_layouts_round_trip(n, k, t):
    import emulate_next as N
    codes, scales, xb, _ = _wg_case(n, k, t, n + k + t, fallback=[(3, 1, 0)])
    cf, sw, aux, xw = N.wgmma_inputs(codes, scales, xb)
    assert cf.shape == (n // 16, k // 256, 2, 32, 16) and cf.nbytes == codes.nbytes
    assert sw.shape == (n // 16, k // 256, 32, 4) and sw.nbytes == scales.nbytes
    assert aux.shape == (n // 64, k // 256, 64) and xw.shape == (k // 32, 2, 8, 16)
    np.testing.assert_array_equal(N.from_fa8i_codes(cf, n, k), codes)
    np.testing.assert_array_equal(N.from_sw8(sw, n, k), scales)
    np.testing.assert_array_equal(N.from_xw8(xw, t, k), xb)
    flags = N.fallback_flags(aux)
    assert flags[0, 0] == 1 and flags.sum() == 1          # the zero scale's (tile, chunk) only
    T = torch.from_numpy
    np.testing.assert_array_equal(N.to_fa8i_codes_torch(T(codes)).numpy(), cf)
    np.testing.assert_array_equal(N.to_sw8_torch(T(scales)).numpy(), sw)
    np.testing.assert_array_equal(N.to_aux_torch(T(scales)).numpy(), aux)
    np.testing.assert_array_equal(N.to_xw8_torch(T(xb)).numpy(), xw)


def test_wgmma_layout_positions():
    """Independent spot checks of the documented byte positions (gen_wgmma docstring)."""
    import emulate_next as N
    n, k = 64, 512
    rng = np.random.default_rng(5)
    scales = rng.integers(0, 256, (n, k // 32), dtype=np.uint8)
    sw = N.to_sw8(scales)
    x = rng.integers(0, 256, (8, k), dtype=np.uint8)
    xw = N.to_xw8(x)
    for _ in range(50):
        i, c, g, t, b, h = (int(rng.integers(v)) for v in (n // 16, k // 256, 8, 4, 2, 2))
        assert sw[i, c, 4 * g + t, 2 * b + h] == scales[16 * i + g + 8 * h, 8 * c + 4 * b + t]
        j, hh, tok, byte = (int(rng.integers(v)) for v in (k // 32, 2, 8, 16))
        B, m = divmod(j, 4)
        assert xw[j, hh, tok, byte] == x[tok, 32 * (4 * B + byte // 4) + 8 * m + 4 * hh + byte % 4]
    sc = np.full((n, k // 32), 120, np.uint8)
    sc[17, 3] = 126                                           # row 17 = warp 1, g 1, h 0; chunk 0
    aux = N.to_aux(sc)
    assert aux[0, 0, 16 * 1 + 2 * 1 + 0] == 120 and aux[0, 1, 18] == 114 and aux[0, 0, 0] == 114


@pytest.mark.parametrize("n,k,t,kg,fallback", [(64, 512, 3, 1, [(5, 9, 0)]), (128, 1024, 8, 2, [(70, 2, 100)]),
                                               (64, 768, 1, 2, [])])
def test_wgmma_emulator_matches_reference(n, k, t, kg, fallback):
    import emulate_next as N
    codes, scales, xb, xs = _wg_case(n, k, t, 3 * n + k + t, fallback=fallback)
    cf, sw, aux, xw = N.wgmma_inputs(codes, scales, xb)
    flags = N.fallback_flags(aux)
    assert flags.sum() == len(fallback) and (flags == 0).any()
    y = N.gemv_wgmma(cf, sw, aux, xw, xs, n, k, t, kg)
    ref = E.reference(codes, scales, xb, xs)
    assert np.abs(y - ref).max() / np.abs(ref).max() < 1e-6


def test_wgmma_emulator_detects_wrong_descriptor_step():
    """The check has teeth for the descriptor: B read with the two K halves swapped must not pass."""
    import emulate_next as N
    n, k, t = 64, 512, 4
    codes, scales, xb, xs = _wg_case(n, k, t, 9)
    cf, sw, aux, xw = N.wgmma_inputs(codes, scales, xb)
    xs2 = xw.copy()
    xs2[:, [0, 1]] = xw[:, [1, 0]]
    y = N.gemv_wgmma(cf, sw, aux, xs2, xs, n, k, t)
    ref = E.reference(codes, scales, xb, xs)
    assert np.abs(y - ref).max() / np.abs(ref).max() > 1e-2


@pytest.mark.skipif(G._bin_dir() is None, reason="ptxas not found: the triton wheel (triton==3.6.0) ships it")
@pytest.mark.parametrize("mg,kg,st,fallback", [(1, 1, 0, False), (1, 1, 4, True), (1, 2, 4, True)])
def test_wgmma_ptx_assembles_with_qgmma(mg, kg, st, fallback):
    import gen_wgmma as GW
    r = GW.report(mg, kg, fallback, st=st)
    assert not r["wgmma_serialized"], r["ptxas_warnings"]
    assert r["regs"] <= 128, "more than 128 registers: fewer than 4 warpgroups per SM"
    assert r["spill_stores"] == 0
    assert r["qgmma_register_a"], "no QGMMA with a register A operand in the SASS"
    assert any(op.startswith("QGMMA") for op in r["loop_hist"])
    assert not r["f2fp_or_hmma_in_loop"]
    assert r["instr_per_weight"] <= (1.0 if not fallback else 1.2), r["instr_per_weight"]
    if not fallback:
        assert "R2UR" not in r["loop_hist"], "descriptor not uniform: R2UR per wgmma"
