"""Tests of the Triton e4m3 byte-permute W2 GEMV lab (tools/kernel_lab/w2e4_gemv.py, docs/perf.md
"Run 26"): the e4w / tiled layouts round-trip, the per-chunk refs and exact-path flags, and the
kernel against a float64 reference in every form it has (row-major / tiled, 1-2 chunks a step,
split-K, the exact launch): on CPU under the interpreter (the asm's values built with plain integer
ops), on a GPU compiled, with the asm (the kernel's operands live on the device there)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.kernels.triton_support import requires_triton

pytestmark = requires_triton

LAB = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "kernel_lab")
sys.path.insert(0, os.path.abspath(LAB))


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# relative error bound against the float64 reference: the interpreter's dots are exact fp32 products;
# on a GPU they are Hopper's fp8 wgmma, whose accumulator keeps fewer bits (docs/perf.md, the w2e4
# lab's correctness notes). A chunk left out (no exact launch) is off by orders of magnitude more.
TOL = 1e-3 if DEVICE == "cuda" else 1e-6
MISSING = 1e-2 if DEVICE == "cuda" else 1e-3


def _dev(*ts):
    return [t.to(DEVICE) for t in ts]


def _lab():
    import w2e4_gemv
    return w2e4_gemv


def _problem(n, k, t, seed, wide=True):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 4), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 128, (n, k // 32), dtype=torch.uint8, generator=g)
    if wide:
        scales[5, 3] = 0              # an all-zero block: its chunk takes the exact path
        scales[70, 9] = 90            # a span of 30+ octaves: chunk 1 of rows 64..127
    xq, xs = _lab().quantize_x(torch.randn(t, k, generator=g))
    return codes, scales, xq, xs


def _relerr(y, r):
    return float((y.double() - r).norm() / r.norm())


def test_layouts_round_trip_and_group_order():
    L = _lab()
    codes, scales, xq, _ = _problem(128, 512, 2, 0)
    e4w = L.to_e4w(codes)
    assert torch.equal(L.from_e4w(e4w), codes)
    # word J = 8q + 4h + t of a chunk holds group 4q + t: words J and J + 4 share a scale group
    c = L.unpack_v1(codes)[0, :256]
    w = L._words_order(c[None])[0]                                # [16 words, 4 p, 4 i]
    for j in range(16):
        q, h, t = j // 8, (j % 8) // 4, j % 4
        assert torch.equal(w[j].flatten(), c[128 * q + 32 * t + 16 * h: 128 * q + 32 * t + 16 * h + 16])
    assert torch.equal(L._natural_order(w[None])[0], c)
    flat = L.tile_rows(e4w, 2)
    assert flat.numel() == e4w.numel() and torch.equal(flat.view(2, 2, 64, 64)[1, 0, 3], e4w[64 + 3, :64])


def test_refs_and_flags():
    L = _lab()
    _, scales, _, _ = _problem(128, 512, 1, 1)
    ref, flags = L.refs_and_flags(scales)
    assert ref[5, 0] == 0 and ref[70, 1] == 0                      # the two wide chunks
    assert flags.tolist() == [[1, 0], [0, 1]]
    ok = ref != 0
    s = scales.to(torch.int32).view(128, 2, 8)
    d = s - ref.to(torch.int32)[..., None]
    assert bool(((d >= -6) & (d <= 6))[ok].all())                  # every unflagged chunk in the table's range


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("t", [1, 3])
def test_gemv_matches_float64_reference(tiled, t):
    L = _lab()
    codes, scales, xq, xs = _problem(128, 512, t, 10 + t)
    ref, flags = L.refs_and_flags(scales)
    c = L.to_e4w(codes)
    ops = (L.tile_rows(c, 2), L.tile_rows(scales, 2), L.tile_rows(ref, 2), flags) if tiled else (c, scales, ref, flags)
    xp = L.slot_major_x(xq)
    r = L.reference(codes, scales, xq, xs)
    ops, (xp, xs) = _dev(*ops), _dev(xp, xs)
    y = torch.full((t, 128), float("nan"), device=DEVICE)
    L.w2e4_gemv(*ops, xp, xs, bn=64, y=y, tiled=tiled)
    y = y.cpu()
    assert not torch.isnan(y).any()
    assert _relerr(y, r) < TOL
    assert float((y[:, 70].double() - r[:, 70]).abs().max()) < TOL * float(r.abs().max())
    y2 = torch.full((t, 128), float("nan"), device=DEVICE)
    L.w2e4_gemv(*ops, xp, xs, bn=64, y=y2, tiled=tiled)
    assert torch.equal(y, y2.cpu())
    # the flagged chunks count zero in the main launch alone: without the exact launch the rows differ
    y3 = torch.full((t, 128), float("nan"), device=DEVICE)
    L.w2e4_gemv(*ops, xp, xs, bn=64, y=y3, tiled=tiled, exact_path=False)
    y3 = y3.cpu()
    assert float((y3[:, 70].double() - r[:, 70]).abs().max()) > MISSING * float(r.abs().max())


@pytest.mark.parametrize("split_k,cps", [(2, 1), (1, 2)])
def test_gemv_split_k_and_chunks_per_step(split_k, cps):
    L = _lab()
    codes, scales, xq, xs = _problem(64, 512, 2, 20, wide=False)
    ref, flags = L.refs_and_flags(scales)
    assert not bool(flags.any())
    c, xp = L.to_e4w(codes), L.slot_major_x(xq)
    r = L.reference(codes, scales, xq, xs)
    c, scales, ref, flags, xp, xs = _dev(c, scales, ref, flags, xp, xs)
    y = L.w2e4_gemv(c, scales, ref, flags, xp, xs, bn=64, split_k=split_k, cps=cps, exact_path=False).cpu()
    if split_k > 1:
        y = y.sum(0)
    assert _relerr(y, r) < TOL
    with pytest.raises(ValueError, match="256-chunks"):
        L.w2e4_gemv(c, scales, ref, flags, xp, xs, bn=64, split_k=4, exact_path=False)
