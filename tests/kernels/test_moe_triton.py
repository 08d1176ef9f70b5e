"""The Triton grouped MoE (moet.kernels.moe_triton) against moe_experts_reference, the slot
alignments (decode kernel, torch prefill path) against a brute-force loop, the nb8 layout, the
config table and the dispatch; under TRITON_INTERPRET=1 when there is no GPU.

Inputs are fresh random per case: W2 codes over all 256 byte values (nb8 layout) with scale
bytes 115..125, NVFP4 tensors from nvfp4.quantize of Gaussian weights, slot tables with
non-resident experts. Every buffer the kernels write (workspaces and the output) is poisoned
before each run. Error bound ||out - ref|| / ||ref||: interpreter (fp32 operands, fp32
activations) <= 1e-5; GPU (bf16 operands, SwiGLU output rounded to bf16) <= 1e-2 (measured
2.2e-3..2.6e-3 on the H200 at real shapes).
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.kernels.triton_support import requires_ptxas, requires_triton

pytestmark = requires_triton

from moet.errors import ConfigError  # noqa: E402
from moet.formats import nvfp4, w2  # noqa: E402
from moet.kernels import moe_configs  # noqa: E402
from moet.kernels.moe_align import max_padded_rows, moe_align_block_size  # noqa: E402
from moet.kernels.moe_configs import GemmConfig, MoEConfig  # noqa: E402
from moet.kernels.pools import DensePool, FP4Pool, W2Pool, row_tiled  # noqa: E402
from moet.kernels.reference import ExpertActivation, moe_experts_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BOUND = 1e-2 if DEVICE == "cuda" else 1e-5
# small tiles keep the interpreter fast; SPLIT_K 2 on one side exercises the fixed-order sums
CFG = MoEConfig(16, GemmConfig(16, 16, 1, 4, 2), GemmConfig(32, 16, 2, 4, 2))
CFG_SPLIT_GU = MoEConfig(16, GemmConfig(32, 16, 2, 4, 2), GemmConfig(16, 16, 1, 4, 2))
# decode tiles of one or two pairs (the H200 table picks BM 1 at T = 1: no padded token rows)
CFG_BM1 = MoEConfig(1, GemmConfig(16, 16, 1, 2, 2), GemmConfig(32, 16, 1, 2, 2))
CFG_BM2 = MoEConfig(2, GemmConfig(32, 16, 1, 2, 2), GemmConfig(16, 16, 2, 2, 2))


def _mt():
    from moet.kernels import moe_triton
    return moe_triton


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the kernels write starts as NaN (floats) or -7 (ints)."""
    mt = _mt()
    made = []

    def ws(shape, dtype, device):
        x = torch.empty(shape, dtype=dtype, device=device)
        x.fill_(float("nan") if dtype.is_floating_point else -7)
        made.append(x)
        return x
    monkeypatch.setattr(mt, "_workspace", ws)
    return made


def _w2_pool(slots, h, i, g) -> W2Pool:
    def codes(*s):
        return w2.to_nb8(torch.randint(0, 256, s, generator=g, dtype=torch.uint8)).to(DEVICE)

    def scales(*s):
        return torch.randint(115, 126, s, generator=g, dtype=torch.uint8).to(DEVICE)
    return W2Pool(codes(slots, 2 * i, h // 4), scales(slots, 2 * i, h // 32),
                  codes(slots, h, i // 4), scales(slots, h, i // 32), layout="nb8")


def _fp4_pool(slots, h, i, g) -> FP4Pool:
    parts = [[], [], [], [], [], []]
    for _ in range(slots):
        a, b, d = (nvfp4.quantize(torch.randn(r, c, generator=g) * 0.1) for r, c in ((i, h), (i, h), (h, i)))
        for lst, v in zip(parts, (torch.cat([a.weight, b.weight]), torch.cat([a.weight_scale, b.weight_scale]),
                                  torch.stack([a.weight_scale_2.reshape(()), b.weight_scale_2.reshape(())]),
                                  d.weight, d.weight_scale, d.weight_scale_2.reshape(()))):
            lst.append(v)
    t = [torch.stack(p).to(DEVICE) for p in parts]
    return FP4Pool(t[0], t[1], t[2].float(), t[3], t[4], t[5].float())


def _pool_and_run(mt, fmt: str, g):
    """A 6-slot pool (H 64, I 32) of `fmt` and the kernel entry point that reads it."""
    if fmt == "w2":
        return _w2_pool(6, 64, 32, g), mt.moe_experts_w2_triton
    return _fp4_pool(6, 64, 32, g), mt.moe_experts_fp4_triton


def _inputs(t, k, h, num_experts, g, dtype=torch.float32):
    x = torch.randn(t, h, generator=g).to(dtype).to(DEVICE)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(t)]) if t else \
        torch.zeros(0, k, dtype=torch.long)                                              # distinct per token
    w = torch.rand(t, k, generator=g)
    return x, ids.to(DEVICE), (w / w.sum(-1, keepdim=True)).to(DEVICE)


def _table(entries):
    return torch.tensor(entries, dtype=torch.int32, device=DEVICE)


def _relerr(a, r) -> float:
    return float((a.double() - r.double()).norm() / r.double().norm())


# ---------------------------------------------------------------------------------- nb8 layout

def test_nb8_round_trip_and_bit_positions():
    g = torch.Generator().manual_seed(0)
    c = torch.randint(0, 256, (16, 64), generator=g, dtype=torch.uint8)
    c[0, :32] = torch.arange(0, 256, 8, dtype=torch.uint8)               # varied bytes in both halves
    nb = w2.to_nb8(c)
    assert nb.shape == c.shape and torch.equal(w2.from_nb8(nb), c)
    assert not torch.equal(nb, c)
    # one unit by hand: codes (0, 1, 2, 3, 3, 2, 1, 0) = (-4, -1, +1, +4, +4, +1, -1, -4)
    v1 = w2.pack_codes(torch.tensor([[0, 1, 2, 3, 3, 2, 1, 0]]))
    unit = int(w2.to_nb8(v1)[0, 0]) | int(w2.to_nb8(v1)[0, 1]) << 8
    for p, code in enumerate((0, 1, 2, 3, 3, 2, 1, 0)):
        assert (unit >> w2.NB8_NEG_BIT[p]) & 1 == (code < 2)
        assert (unit >> w2.NB8_BIG_BIT[p]) & 1 == (code in (0, 3))


def test_reference_reads_both_w2_layouts():
    g = torch.Generator().manual_seed(1)
    pool = _w2_pool(3, 64, 32, g)
    v1 = W2Pool(w2.from_nb8(pool.gate_up_codes), pool.gate_up_scales, w2.from_nb8(pool.down_codes),
                pool.down_scales)
    x, ids, w = _inputs(4, 2, 64, 3, g)
    tab = _table([2, 0, 1])
    m = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    assert torch.equal(moe_experts_reference(x, ids, w, tab, pool, m), moe_experts_reference(x, ids, w, tab, v1, m))


# ---------------------------------------------------------------------------------- alignment

def _align_brute(ids, table, num_slots, bm):
    flat, tab = ids.reshape(-1).tolist(), table.tolist()
    per, misses = {}, 0
    for pid, e in enumerate(flat):
        if tab[e] < 0:
            misses += 1
        else:
            per.setdefault(tab[e], []).append(pid)
    rows, bslots = [], []
    for s in sorted(per):
        lst = per[s] + [len(flat)] * (-len(per[s]) % bm)
        rows += lst
        bslots += [s] * (len(lst) // bm)
    return rows, bslots, misses, per


@pytest.mark.parametrize("t,k,num_experts,slots,bm,seed", [
    (5, 2, 6, 8, 16, 0), (40, 3, 6, 8, 4, 1), (7, 4, 9, 4, 1, 2), (0, 2, 6, 8, 16, 3), (33, 1, 5, 5, 8, 4)])
def test_torch_align_matches_brute_force(t, k, num_experts, slots, bm, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_experts, (t, k), generator=g).to(DEVICE)
    perm = torch.randperm(slots, generator=g)[:num_experts].tolist()
    table = _table([perm[e] if e < len(perm) and e % 3 != 1 else -1 for e in range(num_experts)])
    a = moe_align_block_size(ids, table, slots, bm)
    rows, bslots, misses, _ = _align_brute(ids.cpu(), table.cpu(), slots, bm)
    size = max_padded_rows(t * k, slots, bm)
    assert a.sorted_ids.shape == (size,) and a.block_slot.shape == (size // bm,)
    assert a.sorted_ids[:len(rows)].tolist() == rows and (a.sorted_ids[len(rows):] == t * k).all()
    assert a.block_slot[:len(bslots)].tolist() == bslots and (a.block_slot[len(bslots):] == -1).all()
    assert int(a.num_rows_post_padded.item()) == len(rows) and int(a.num_misses.item()) == misses


@pytest.mark.parametrize("t,k,num_experts,bm,seed", [(5, 2, 6, 16, 0), (24, 3, 4, 16, 1), (9, 4, 9, 4, 2),
                                                    (6, 3, 5, 1, 3)])
def test_small_align_kernel(t, k, num_experts, bm, seed):
    """The decode-regime alignment (slots in first-appearance order): every resident pair in
    exactly one tile of its slot, tiles per slot = cdiv(count, bm), padding P, unused tiles -1,
    misses added to the counter; and the slot-major copy of the hidden states."""
    from moet.kernels.moe_align_triton import _prep_small_kernel
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_experts, (t, k), generator=g).to(DEVICE)
    slots = num_experts + 2
    table = _table([(e * 5) % slots if e % 3 != 1 else -1 for e in range(num_experts)])
    p, h, upw = t * k, 64, 8
    nb = min(p, p // bm + min(p, slots))
    pp = 1 << (p - 1).bit_length()
    sorted_ids = torch.full((nb * bm,), -7, dtype=torch.int32, device=DEVICE)
    bslot = torch.full((nb,), -7, dtype=torch.int32, device=DEVICE)
    miss = torch.full((1,), 5, dtype=torch.int32, device=DEVICE)
    x = torch.randn(t, h, generator=g).to(DEVICE)
    xp = torch.full((t, upw, h // upw), float("nan"), device=DEVICE)
    _prep_small_kernel[(1 + t,)](ids.reshape(-1), table, sorted_ids, bslot, torch.empty(pp, dtype=torch.int32,
                                 device=DEVICE), miss, p, nb, x, xp, x.stride(0), x,
                                 H=h, UPW=upw, BH=64, BM=bm, PP=pp, QB=min(pp, 32), FILL=64, ZERO_OUT=False,
                                 PDL=False)
    _, _, misses, per = _align_brute(ids.cpu(), table.cpu(), slots, bm)
    assert int(miss.item()) == 5 + misses
    assert torch.equal(xp, x.reshape(t, h // upw, upw).transpose(1, 2))
    got = {}
    used = 0
    for b, s in enumerate(bslot.tolist()):
        tile = sorted_ids[b * bm:(b + 1) * bm].tolist()
        if s == -1:
            assert all(r == p for r in tile)
            continue
        used += 1
        real = [r for r in tile if r != p]
        assert real == sorted(real) and tile == real + [p] * (bm - len(real))      # padding at the end
        got.setdefault(s, []).extend(real)
    assert got == per
    assert used == sum(-(-len(v) // bm) for v in per.values())
    assert all(s == -1 for s in bslot.tolist()[used:])


# ------------------------------------------------------------------------ kernels vs reference

CASES = [
    # fmt, t, k, h, i, num_experts, slots, table, limit, cfg
    ("w2", 5, 2, 64, 32, 6, 8, [3, -1, 0, 7, -1, 5], None, CFG),
    ("w2", 5, 2, 96, 64, 6, 8, [3, -1, 0, 7, -1, 5], 1.0, CFG_SPLIT_GU),     # K tails (96 = 12 units)
    ("w2", 24, 3, 64, 32, 4, 4, [1, 3, 0, 2], 0.5, CFG),                       # several tiles per slot
    ("fp4", 5, 2, 64, 32, 6, 8, [3, -1, 0, 7, -1, 5], None, CFG_SPLIT_GU),
    ("fp4", 6, 2, 96, 48, 6, 8, [3, -1, 0, 7, -1, 5], 1.0, CFG),              # K tails (96 = 24 units)
    ("w2", 3, 2, 64, 32, 6, 8, [3, -1, 0, 7, -1, 5], None, CFG_BM1),          # one pair per tile
    ("w2", 9, 3, 96, 64, 4, 4, [1, 3, 0, 2], 1.0, CFG_BM2),                   # several 2-pair tiles per slot
    ("fp4", 3, 2, 64, 32, 6, 8, [3, -1, 0, 7, -1, 5], None, CFG_BM1),
]


@pytest.mark.parametrize("fmt,t,k,h,i,num_experts,slots,table,limit,cfg", CASES)
def test_matches_reference(poisoned, fmt, t, k, h, i, num_experts, slots, table, limit, cfg):
    mt = _mt()
    g = torch.Generator().manual_seed(100 + t + h + i)
    pool = (_w2_pool if fmt == "w2" else _fp4_pool)(slots, h, i, g)
    tab = _table(table)
    x, ids, w = _inputs(t, k, h, num_experts, g)
    ids[0, 0] = table.index(-1) if -1 in table else ids[0, 0]        # at least one miss where possible
    m_ref = torch.full((1,), 3, dtype=torch.int64, device=DEVICE)
    m_tri = torch.full((1,), 3, dtype=torch.int32, device=DEVICE)
    ref = moe_experts_reference(x, ids, w, tab, pool, m_ref, act=ExpertActivation(limit=limit))
    if limit is not None:    # the case must actually clamp something, or it tests nothing
        assert not torch.allclose(ref, moe_experts_reference(x, ids, w, tab, pool, torch.zeros_like(m_ref)))
    out = mt.moe_experts_triton(x, ids, w, tab, pool, m_tri, act=ExpertActivation(limit=limit), config=cfg)
    assert poisoned and not torch.isnan(out).any()
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert _relerr(out, ref) <= BOUND
    assert int(m_tri.item()) == int(m_ref.item()) and (-1 not in table or int(m_ref.item()) > 3)


def test_misses_zero_counted_slot_invariant_and_bit_identical(poisoned):
    """A token whose experts are all absent gets exactly zero; the counter (int32 or int64)
    grows by the misses; the same experts in other slots give the same bits; reruns are
    bit-identical (with every workspace re-poisoned)."""
    mt = _mt()
    g = torch.Generator().manual_seed(7)
    pool = _w2_pool(6, 64, 32, g)
    tab = _table([3, -1, 0, 5, -1, 1])
    x, ids, w = _inputs(5, 2, 64, 6, g)
    ids[0] = torch.tensor([1, 4])
    outs = []
    for counter_dtype in (torch.int32, torch.int64):
        m = torch.full((1,), 11, dtype=counter_dtype, device=DEVICE)
        outs.append(mt.moe_experts_w2_triton(x, ids, w, tab, pool, m, config=CFG))
        misses = int((tab.long()[ids.long()] < 0).sum())
        assert m.dtype == counter_dtype and int(m.item()) == 11 + misses and misses >= 2
    assert (outs[0][0] == 0).all() and (outs[0][1:] != 0).any()
    assert torch.equal(outs[0], outs[1])
    # slot s -> perm position: pool2[j] = pool[perm[j]], table2[e] = inv[table[e]]
    perm = torch.tensor([4, 2, 5, 0, 3, 1], device=DEVICE)
    inv = torch.argsort(perm).to(torch.int32)
    pool2 = W2Pool(*(getattr(pool, f)[perm] for f in ("gate_up_codes", "gate_up_scales", "down_codes", "down_scales")),
                   layout="nb8")
    tab2 = torch.where(tab >= 0, inv[tab.clamp(min=0).long()], tab)
    out2 = mt.moe_experts_w2_triton(x, ids, w, tab2, pool2, torch.zeros(1, dtype=torch.int64, device=DEVICE),
                                    config=CFG)
    assert torch.equal(out2, outs[0])


def test_prefill_path_and_token_chunks(poisoned, monkeypatch):
    """The sort-based alignment (P above the small-align limit) and token chunking (workspace
    cap) give the reference's result."""
    mt = _mt()
    monkeypatch.setattr(mt, "SMALL_ALIGN_MAX_PAIRS", 4)
    monkeypatch.setattr(mt, "MAX_WORKSPACE_BYTES", 12 * 2 * 64 * 4)       # 12 tokens per chunk
    g = torch.Generator().manual_seed(8)
    pool = _fp4_pool(4, 64, 32, g)
    tab = _table([2, -1, 0, 3, 1])
    x, ids, w = _inputs(30, 2, 64, 5, g, dtype=torch.bfloat16)
    m_ref, m_tri = (torch.zeros(1, dtype=torch.int64, device=DEVICE) for _ in range(2))
    ref = moe_experts_reference(x, ids, w, tab, pool, m_ref, act=ExpertActivation(limit=2.0))
    cfg = MoEConfig(16, GemmConfig(16, 16, 1, 4, 2), GemmConfig(32, 16, 1, 4, 2))
    out = mt.moe_experts_fp4_triton(x, ids, w, tab, pool, m_tri, act=ExpertActivation(limit=2.0), config=cfg)
    assert out.dtype == torch.bfloat16 and torch.equal(m_tri, m_ref) and int(m_ref.item()) > 0
    # both round once to bf16 from fp32 sums: within a few bf16 ulps
    assert _relerr(out, ref) <= 2 ** -7



# wide tiles: the interpreter's time grows with the programs, and nb8t needs K >= 512 to permute
CFG_WIDE = MoEConfig(16, GemmConfig(64, 32, 1, 4, 2), GemmConfig(64, 32, 2, 4, 2))
CFG_WIDE_BM1 = MoEConfig(1, GemmConfig(64, 32, 2, 2, 2), GemmConfig(64, 32, 1, 2, 2))
# K steps of 16 units, half a tile row: the per-element form of the tiled addressing
CFG_HALF_TILE = MoEConfig(1, GemmConfig(64, 16, 2, 2, 2), GemmConfig(64, 16, 1, 2, 2))


@pytest.mark.parametrize("t,cfg,small_align", [(2, CFG_WIDE_BM1, None), (6, CFG_WIDE, 4), (1, CFG_HALF_TILE, None)])
def test_row_tiled_nb8t_pool_gives_the_nb8_bits(poisoned, monkeypatch, t, cfg, small_align):
    """The nb8t layout (rows tiled 64 x 256 weights, moet.formats.w2.tile_rows) holds the same
    bytes permuted: the same kernels read it to the same bits as nb8 -- decode and (a lowered
    small-align limit) the sort-based path -- with the same misses."""
    mt = _mt()
    if small_align:
        monkeypatch.setattr(mt, "SMALL_ALIGN_MAX_PAIRS", small_align)
    g = torch.Generator().manual_seed(31)
    pool = _w2_pool(4, 512, 512, g)          # two 256-weight tile columns each way: a real permutation
    tp = row_tiled(pool)
    for f in ("gate_up_codes", "gate_up_scales", "down_codes", "down_scales"):
        per = 1 / 4 if "codes" in f else 1 / 32
        assert torch.equal(w2.untile_rows(getattr(tp, f), per), getattr(pool, f))
        assert not torch.equal(getattr(tp, f), getattr(pool, f))
    tab = _table([2, -1, 0, 3, 1])
    x, ids, w = _inputs(t, 2, 512, 5, g)
    ids[0] = torch.tensor([1, 3])                                   # one miss at least
    m1, m2 = (torch.zeros(1, dtype=torch.int64, device=DEVICE) for _ in range(2))
    a = mt.moe_experts_w2_triton(x, ids, w, tab, pool, m1, act=ExpertActivation(limit=3.0), config=cfg)
    b = mt.moe_experts_w2_triton(x, ids, w, tab, tp, m2, act=ExpertActivation(limit=3.0), config=cfg)
    assert torch.equal(a, b) and torch.equal(m1, m2) and int(m1.item()) > 0
    ref = moe_experts_reference(x, ids, w, tab, W2Pool(*(w2.from_nb8(getattr(pool, f)) if "codes" in f else
                                                        getattr(pool, f) for f in ("gate_up_codes", "gate_up_scales",
                                                                                   "down_codes", "down_scales"))),
                                torch.zeros(1, dtype=torch.int64, device=DEVICE), act=ExpertActivation(limit=3.0))
    assert _relerr(b, ref) <= BOUND




# FP4 steps: BKH 32 units = half a tile row (the per-element addressing), 64 = one (the scalar one)
CFG_FP4_HALF = MoEConfig(1, GemmConfig(64, 32, 2, 2, 2), GemmConfig(64, 32, 1, 2, 2))
CFG_FP4_ROW = MoEConfig(16, GemmConfig(64, 64, 1, 4, 2), GemmConfig(64, 64, 2, 4, 2))


@pytest.mark.parametrize("t,cfg,small_align", [(1, CFG_FP4_HALF, None), (5, CFG_FP4_ROW, 4)])
def test_row_tiled_nvfp4t_pool_gives_the_nvfp4_bits(poisoned, monkeypatch, t, cfg, small_align):
    """FP4's row-tiled layout (weights and block scales, 64 x 256-weight tiles) through the same
    kernels: the same bits as the row-major NVFP4 pool, the same misses; the reference reads it too."""
    mt = _mt()
    if small_align:
        monkeypatch.setattr(mt, "SMALL_ALIGN_MAX_PAIRS", small_align)
    g = torch.Generator().manual_seed(34)
    pool = _fp4_pool(3, 512, 512, g)
    tp = row_tiled(pool)
    assert not torch.equal(tp.gate_up_weight, pool.gate_up_weight)
    assert not torch.equal(tp.down_scale.view(torch.uint8), pool.down_scale.view(torch.uint8))
    tab = _table([2, -1, 0, 1])
    x, ids, w = _inputs(t, 2, 512, 4, g)
    ids[0] = torch.tensor([1, 3])                                   # one miss at least
    m1, m2, m3 = (torch.zeros(1, dtype=torch.int64, device=DEVICE) for _ in range(3))
    a = mt.moe_experts_fp4_triton(x, ids, w, tab, pool, m1, config=cfg)
    b = mt.moe_experts_fp4_triton(x, ids, w, tab, tp, m2, config=cfg)
    assert torch.equal(a, b) and torch.equal(m1, m2) and int(m1.item()) > 0
    ref_rm = moe_experts_reference(x, ids, w, tab, pool, torch.zeros(1, dtype=torch.int64, device=DEVICE))
    ref_t = moe_experts_reference(x, ids, w, tab, tp, m3)
    assert torch.equal(ref_rm, ref_t) and _relerr(b, ref_t) <= BOUND

def test_row_tiled_pool_refuses_what_it_cannot_serve():
    mt = _mt()
    g = torch.Generator().manual_seed(32)
    with pytest.raises(w2.FormatError, match="nb8t"):
        w2.tile_rows(torch.zeros(2, 96, 64, dtype=torch.uint8), 1 / 4)          # 96 rows: not whole 64-row tiles
    pool = row_tiled(_w2_pool(2, 256, 256, g))
    x, ids, w = _inputs(1, 2, 256, 2, g)
    m = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    bad = W2Pool(*(getattr(_w2_pool(2, 64, 64, g), f) for f in ("gate_up_codes", "gate_up_scales", "down_codes",
                                                                 "down_scales")), layout="nb8t")
    x, ids, w = _inputs(1, 2, 64, 2, g)
    with pytest.raises(ValueError, match="multiples of 256"):
        mt.moe_experts_w2_triton(x, ids, w, _table([0, 1]), bad, m, config=CFG)

def test_empty_and_rejected_pools():
    mt = _mt()
    g = torch.Generator().manual_seed(9)
    pool = _w2_pool(2, 32, 32, g)
    x0, ids0, w0 = _inputs(0, 2, 32, 2, g)
    m = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    assert mt.moe_experts_w2_triton(x0, ids0, w0, _table([0, 1]), pool, m).shape == (0, 32)
    v1 = W2Pool(pool.gate_up_codes, pool.gate_up_scales, pool.down_codes, pool.down_scales)   # layout v1
    x, ids, w = _inputs(1, 1, 32, 2, g)
    with pytest.raises(ValueError, match="nb8"):
        mt.moe_experts_w2_triton(x, ids, w, _table([0, 1]), v1, m)
    with pytest.raises(TypeError):
        mt.moe_experts_triton(x, ids, w, _table([0, 1]), DensePool(torch.zeros(2, 64, 32), torch.zeros(2, 32, 32)), m)
    with pytest.raises(TypeError):
        mt.moe_experts_fp4_triton(x, ids, w, _table([0, 1]), pool, m)


# ------------------------------------------------------------------------- configs + dispatch

def test_config_table_lookup(monkeypatch):
    table = moe_configs.load_table()
    assert table["devices"], "the repo's moe_configs.json has no tuned device"
    for shapes in table["devices"].values():
        for buckets in shapes.values():
            for cfg in buckets.values():
                c = MoEConfig.from_json(cfg)
                assert MoEConfig.from_json(c.to_json()) == c and c.BM >= 1 and c.BM & (c.BM - 1) == 0
    pdl = MoEConfig(1, GemmConfig(), GemmConfig(), pdl=True)
    assert MoEConfig.from_json(pdl.to_json()) == pdl and "pdl" not in MoEConfig(1, GemmConfig(), GemmConfig()).to_json()
    # the deleted few-token decodes (docs/kernels.md, MoE): an old table's false keys read as before, a
    # true one is refused in one line instead of running another path than the table asks for
    old = CFG_BM1.to_json()
    assert MoEConfig.from_json(old | {"token_major": False, "fused": False}) == CFG_BM1
    for key in ("token_major", "fused"):
        with pytest.raises(ConfigError, match=f"MoEConfig.{key}, a decode path moet no longer has"):
            MoEConfig.from_json(old | {key: True})
    fake = {"version": 1, "devices": {"GPU X": {"w2 H64 I32": {
        "8": MoEConfig(16, GemmConfig(16), GemmConfig(32)).to_json(),
        "64": MoEConfig(16, GemmConfig(64), GemmConfig(64)).to_json(),
        "4096": MoEConfig(64, GemmConfig(128), GemmConfig(128)).to_json()}}}}
    monkeypatch.setattr(moe_configs, "load_table", lambda: fake)
    assert moe_configs.lookup("w2", 64, 32, 8, "GPU X").gate_up.BN == 16
    assert moe_configs.lookup("w2", 64, 32, 9, "GPU X").gate_up.BN == 64          # next bucket up
    assert moe_configs.lookup("w2", 64, 32, 500, "GPU X").gate_up.BN == 64        # stays in the decode regime
    assert moe_configs.lookup("w2", 64, 32, 513, "GPU X").BM == 64                # prefill bucket
    assert moe_configs.lookup("w2", 64, 32, 10 ** 6, "GPU X").BM == 64
    assert moe_configs.lookup("fp4", 64, 32, 8, "GPU X") == moe_configs.default_config(8)
    assert moe_configs.lookup("w2", 64, 32, 8, "GPU Y") == moe_configs.default_config(8)


def test_dispatch_picks_the_reference_off_gpu():
    from moet.kernels.moe_dispatch import moe_experts, uses_triton
    g = torch.Generator().manual_seed(10)
    pool = _w2_pool(3, 64, 32, g)
    x, ids, w = _inputs(3, 2, 64, 3, g)
    tab = _table([0, 2, 1])
    m1, m2 = torch.zeros(1, dtype=torch.int64, device=DEVICE), torch.zeros(1, dtype=torch.int64, device=DEVICE)
    assert uses_triton(pool) == (DEVICE == "cuda")
    assert not uses_triton(DensePool(torch.zeros(1, 2, 2, device=DEVICE), torch.zeros(1, 2, 1, device=DEVICE)))
    out = moe_experts(x, ids, w, tab, pool, m1)
    ref = moe_experts_reference(x, ids, w, tab, pool, m2)
    if DEVICE == "cpu":
        assert torch.equal(out, ref)
    else:
        assert _relerr(out, ref) <= BOUND


# ----------------------------------------------------------- compiles for sm_90 (no GPU needed)

@requires_ptxas
def test_kernels_compile_for_sm90():
    """The interpreter runs the plain decode; the GPU path (inline-asm decoders, bf16 dots)
    is compiled here for sm_90 in a subprocess without TRITON_INTERPRET."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "src"), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-m", "tests.kernels.aot_compile_moe", "--quick"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    kinds = [line.split()[0] for line in r.stdout.splitlines()]
    assert kinds.count("gemm") == 8 and {"align", "swiglu", "combine"} <= set(kinds), r.stdout
    assert "gpt-oss True True True True" in r.stdout.splitlines(), r.stdout      # biases + alpha activation
    gemms = [line for line in r.stdout.splitlines() if line.startswith("gemm ")]
    assert all(line.endswith(" e4m3-cvt") == (line.split()[1] == "fp4") for line in gemms), r.stdout
    # GemmConfig.kwidth2: the scale bytes behind the branch give the MMA operands kWidth 2; without
    # it Triton 3.6 packs K by 4 (the 8-bit scale load; moe_tiles._scale_values)
    kw = [line.split() for line in r.stdout.splitlines() if line.startswith("kwidth ")]
    assert len(kw) == 4 and all(w[3:] == ["4", "2"] for w in kw), r.stdout
    assert kinds.count("gemm-tiled") == 8, r.stdout          # nb8t / nvfp4t: whole- / half-tile steps, prefill
    assert kinds.count("gemm-chains2") == 4, r.stdout        # W2 / FP4 gate/up and down, two MMA chains
    assert kinds.count("gemm-even") == 4, r.stdout           # W2 / FP4 gate/up and down, constant masks
    pf = [line for line in r.stdout.splitlines() if line.startswith("gemm-prefetch")]
    assert len(pf) == 2 and all(line.endswith(" before-wait") for line in pf), r.stdout
    # the split gate/up with its SwiGLU finish in its last programs: the hand-off compiled in
    for kind in ("gemm-fused-finish", "gemm-fused-combine"):
        ff = [line for line in r.stdout.splitlines() if line.startswith(kind)]
        assert len(ff) == 2 and all(line.endswith(" handoff") for line in ff), r.stdout


def test_reference_w2_decode_is_the_formats_dequantize_in_both_layouts():
    """The reference's table decode (one gather per byte / 16-bit unit, times the group's power
    of two) gives the bits of moet.formats.w2.dequantize, scale bytes 0, 1, 254, 255 included
    (subnormal and infinite results)."""
    from moet.kernels.reference import decode_w2
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    codes = torch.randint(0, 256, (9, 64 // 4), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 256, (9, 64 // 32), generator=g, dtype=torch.uint8)
    scales[0] = torch.tensor([0, 255], dtype=torch.uint8)
    scales[1] = torch.tensor([1, 254], dtype=torch.uint8)
    want = w2.dequantize(w2.W2Tensor(codes, scales))
    for got in (decode_w2(codes, scales), decode_w2(w2.to_nb8(codes), scales, "nb8")):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.isinf(want[0, 32:]).any() and (want[0, :32].abs() < 2.0 ** -120).all()


def test_table_tile_grows_with_pairs_per_expert():
    """A decode config tuned at T = 1 (BM 1) used for many pairs per expert gets a larger token
    tile (each expert's weights read once per tile); tuned tiles are never lowered, prefill untouched."""
    mt = _mt()
    one = MoEConfig(1, GemmConfig(), GemmConfig())
    assert mt.fit_token_tile(one, 8, 256) is one                       # 1 pair per expert
    assert mt.fit_token_tile(one, 256, 128).BM == 2                    # ~111 experts hit, 2.3 pairs each
    assert mt.fit_token_tile(one, 512, 128).BM == 4
    assert mt.fit_token_tile(one, 128, 16).BM == 8                     # moet-tiny at batch 32
    assert mt.fit_token_tile(MoEConfig(8, GemmConfig(), GemmConfig()), 64, 64).BM == 8
    assert mt.fit_token_tile(one, 4096, 128) is one                    # prefill regime: its own table


@pytest.mark.parametrize("fmt,cfg", [("w2", MoEConfig(16, GemmConfig(32, 16, 2, 4, 2), GemmConfig(16, 16, 1, 4, 2))),
                                     ("fp4", MoEConfig(1, GemmConfig(16, 16, 3, 2, 2), GemmConfig(32, 16, 1, 2, 2)))])
def test_fused_finish_is_the_finish_kernels_result(poisoned, fmt, cfg):
    """MoEConfig.fused_finish (the split gate/up's last program per tile and row block does the
    SwiGLU finish, no finish launch): the two-launch result bit for bit under the interpreter
    (within fp32 rounding compiled), misses counted alike, the counters zero after the launch,
    the SwiGLU clamp on; and the JSON round trip."""
    mt = _mt()
    g = torch.Generator().manual_seed(31 if fmt == "w2" else 32)
    pool, run = _pool_and_run(mt, fmt, g)
    tab = _table([3, -1, 0, 5, -1, 1])
    x, ids, w = _inputs(5, 4, 64, 6, g)
    m1 = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    m2 = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    two = run(x, ids, w, tab, pool, m1, act=ExpertActivation(limit=1.5), config=cfg)
    ff = replace(cfg, fused_finish=True)
    one = run(x, ids, w, tab, pool, m2, act=ExpertActivation(limit=1.5), config=ff)
    if DEVICE == "cpu":
        assert torch.equal(one, two)
    else:
        assert _relerr(one, two) <= 1e-6
    assert int(m1.item()) == int(m2.item()) > 0
    assert int(mt._finish_counters(one.device).abs().sum()) == 0
    assert torch.equal(one, run(x, ids, w, tab, pool, m2, act=ExpertActivation(limit=1.5), config=ff))
    ref = moe_experts_reference(x, ids, w, tab, pool, torch.zeros(1, dtype=torch.int64, device=DEVICE),
                                act=ExpertActivation(limit=1.5))
    assert _relerr(one, ref) <= BOUND
    assert MoEConfig.from_json(ff.to_json()) == ff and "fused_finish" not in cfg.to_json()


@pytest.mark.parametrize("fmt,cfg", [
    ("w2", MoEConfig(16, GemmConfig(32, 16, 2, 4, 2), GemmConfig(16, 16, 2, 4, 2), fused_finish=True)),
    ("w2", MoEConfig(1, GemmConfig(16, 16, 1, 2, 2), GemmConfig(32, 16, 1, 2, 2))),
    ("fp4", MoEConfig(2, GemmConfig(16, 16, 3, 2, 2), GemmConfig(16, 16, 1, 2, 2), fused_finish=True))])
def test_fused_combine_is_the_combine_kernels_result(poisoned, fmt, cfg):
    """MoEConfig.fused_combine (the down GEMM's last program per (token, row block) sums the
    token's pairs, no combine launch): the two-launch result bit for bit under the interpreter,
    tiles of one and of several pairs, split and unsplit down, a token whose experts are all
    absent (its row zero: the prep kernel wrote it), counters zero after, the JSON round trip."""
    mt = _mt()
    g = torch.Generator().manual_seed(41 if fmt == "w2" else 42)
    pool, run = _pool_and_run(mt, fmt, g)
    tab = _table([3, -1, 0, 5, -1, 1])
    x, ids, w = _inputs(5, 2, 64, 6, g)
    ids[2] = torch.tensor([1, 4])                            # token 2: both experts absent
    m1 = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    m2 = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    two = run(x, ids, w, tab, pool, m1, config=cfg)
    fc = replace(cfg, fused_combine=True)
    one = run(x, ids, w, tab, pool, m2, config=fc)
    if DEVICE == "cpu":
        assert torch.equal(one, two)
    else:
        assert _relerr(one, two) <= 1e-6
    assert bool((one[2] == 0).all()) and int(m1.item()) == int(m2.item()) >= 2
    assert int(mt._finish_counters(one.device).abs().sum()) == 0
    assert torch.equal(one, run(x, ids, w, tab, pool, m2, config=fc))
    ref = moe_experts_reference(x, ids, w, tab, pool, torch.zeros(1, dtype=torch.int64, device=DEVICE))
    assert _relerr(one, ref) <= BOUND
    assert MoEConfig.from_json(fc.to_json()) == fc and "fused_combine" not in cfg.to_json()


@pytest.mark.parametrize("fmt", ["w2", "fp4"])
def test_unrolled_k_loop_and_wider_token_tile_change_no_bits(poisoned, fmt):
    """GemmConfig.unroll (the K loop body repeated: run 21's cure for the decode GEMMs' x stall)
    runs the same dots in the same order: the tiled path's bits; a token tile wider than the
    pairs per expert (BM 4: the rows past them are masked) the same per-row sums to rounding;
    split and unsplit K, odd step counts (K = 64 over BKH 16: W2 one step, FP4 a step left over
    for the second copy of the body to mask), misses counted alike; the JSON round trip."""
    mt = _mt()
    g = torch.Generator().manual_seed(51 if fmt == "w2" else 52)
    pool, run = _pool_and_run(mt, fmt, g)
    tab = _table([3, -1, 0, 5, -1, 1])
    x, ids, w = _inputs(3, 2, 64, 6, g)
    base = MoEConfig(1, GemmConfig(16, 16, 1, 2, 2), GemmConfig(32, 16, 2, 2, 2))
    m0 = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    ref = run(x, ids, w, tab, pool, m0, act=ExpertActivation(limit=1.5), config=base)
    for cfg in (replace(base, gate_up=replace(base.gate_up, unroll=2), down=replace(base.down, unroll=2)),
                replace(base, BM=4, gate_up=replace(base.gate_up, unroll=2)),
                replace(base, gate_up=GemmConfig(16, 16, 3, 2, 2, unroll=2), down=replace(base.down, unroll=3))):
        m1 = torch.zeros(1, dtype=torch.int64, device=DEVICE)
        out = run(x, ids, w, tab, pool, m1, act=ExpertActivation(limit=1.5), config=cfg)
        if cfg.BM == base.BM:
            assert torch.equal(out, ref), cfg
        else:   # another tile shape: another matmul kernel under the interpreter, another compiled one on a GPU
            assert _relerr(out, ref) <= 1e-6
        assert int(m1.item()) == int(m0.item()) > 0
        assert MoEConfig.from_json(cfg.to_json()) == cfg
    assert GemmConfig().unroll == 1 and MoEConfig.from_json({"BM": 1, "gate_up": {"BN": 32}, "down": {}}).gate_up.unroll == 1


@pytest.mark.parametrize("fmt", ["w2", "fp4"])
def test_two_mma_chains(poisoned, fmt):
    """GemmConfig.chains 2: on gate/up the gate and up dots of a K step alternate, each accumulator
    getting the same dots in the same order (the same bits); on down even and odd slots go to two
    accumulators summed after the K loop (the same sum in another fp32 order: close, and the same
    bits run to run). Split and unsplit K, misses counted alike; the JSON round trip."""
    mt = _mt()
    g = torch.Generator().manual_seed(53 if fmt == "w2" else 54)
    pool, run = _pool_and_run(mt, fmt, g)
    tab = _table([3, -1, 0, 5, -1, 1])
    x, ids, w = _inputs(3, 2, 64, 6, g)
    for base in (MoEConfig(1, GemmConfig(16, 16, 1, 2, 2), GemmConfig(32, 16, 2, 2, 2)),
                 MoEConfig(4, GemmConfig(16, 16, 2, 2, 2), GemmConfig(32, 16, 1, 2, 2))):
        m0, m1 = (torch.zeros(1, dtype=torch.int64, device=DEVICE) for _ in range(2))
        ref = run(x, ids, w, tab, pool, m0, act=ExpertActivation(limit=1.5), config=base)
        cfg = replace(base, gate_up=replace(base.gate_up, chains=2))
        out = run(x, ids, w, tab, pool, m1, act=ExpertActivation(limit=1.5), config=cfg)
        assert torch.equal(out, ref), cfg
        assert int(m1.item()) == int(m0.item()) > 0 and out.abs().max() > 0
        assert MoEConfig.from_json(cfg.to_json()) == cfg
        both = replace(cfg, down=replace(base.down, chains=2))
        m2 = torch.zeros(1, dtype=torch.int64, device=DEVICE)
        two = run(x, ids, w, tab, pool, m2, act=ExpertActivation(limit=1.5), config=both)
        assert _relerr(two, ref) <= (1e-6 if DEVICE == "cpu" else 1e-3) and int(m2.item()) == int(m0.item())
        assert torch.equal(two, run(x, ids, w, tab, pool, torch.zeros_like(m2), act=ExpertActivation(limit=1.5), config=both))
        assert MoEConfig.from_json(both.to_json()) == both
    assert GemmConfig().chains == 1
    with pytest.raises(ValueError, match="chains"):
        GemmConfig(chains=3)


@pytest.mark.parametrize("fmt", ["w2", "fp4"])
def test_kwidth2_scale_branch(poisoned, fmt):
    """GemmConfig.kwidth2 (the scale bytes behind an always-taken branch, so the compiled MMAs pack
    K by 2): the same products, so the layer matches the kWidth-4 form (on a GPU up to the fp32 order
    of the MMA sums), on gate/up, down and both, split and unsplit K; misses counted alike; the same
    bits run to run; the JSON round trip."""
    mt = _mt()
    g = torch.Generator().manual_seed(61 if fmt == "w2" else 62)
    pool, run = _pool_and_run(mt, fmt, g)
    tab = _table([2, 0, -1, 4, 1, -1])
    x, ids, w = _inputs(3, 2, 64, 6, g)
    ids[0] = torch.tensor([2, 0], device=DEVICE)               # one pair of a non-resident expert at least
    for base in (MoEConfig(1, GemmConfig(16, 16, 2, 2, 2), GemmConfig(32, 16, 1, 2, 2)),
                 MoEConfig(4, GemmConfig(16, 16, 1, 2, 2), GemmConfig(32, 16, 2, 2, 2))):
        m0 = torch.zeros(1, dtype=torch.int64, device=DEVICE)
        ref = run(x, ids, w, tab, pool, m0, act=ExpertActivation(limit=1.5), config=base)
        for cfg in (replace(base, gate_up=replace(base.gate_up, kwidth2=True)),
                    replace(base, down=replace(base.down, kwidth2=True)),
                    replace(base, gate_up=replace(base.gate_up, kwidth2=True), down=replace(base.down, kwidth2=True))):
            m1 = torch.zeros(1, dtype=torch.int64, device=DEVICE)
            out = run(x, ids, w, tab, pool, m1, act=ExpertActivation(limit=1.5), config=cfg)
            assert _relerr(out, ref) <= (1e-6 if DEVICE == "cpu" else 1e-3), cfg
            assert int(m1.item()) == int(m0.item()) > 0 and out.abs().max() > 0
            assert torch.equal(out, run(x, ids, w, tab, pool, torch.zeros_like(m1), act=ExpertActivation(limit=1.5), config=cfg))
            assert MoEConfig.from_json(cfg.to_json()) == cfg
    assert GemmConfig().kwidth2 is False


def _mask_case(mt, fmt: str, seed: int):
    """(generator, H, I, a 4-slot pool, its layer function, FMT) at shapes every test tile divides."""
    g = torch.Generator().manual_seed(seed)
    h, i = 512, 256
    pool = _w2_pool(4, h, i, g) if fmt == "w2" else _fp4_pool(4, h, i, g)
    run = mt.moe_experts_w2_triton if fmt == "w2" else mt.moe_experts_fp4_triton
    return g, h, i, pool, run, (mt.FMT_W2 if fmt == "w2" else mt.FMT_FP4)


def _switched(monkeypatch, mt, switch: str, call) -> list:
    """[(output, misses)] of call(miss_counter) with moe_triton's A/B switch on, then off."""
    outs = []
    for on in (True, False):
        monkeypatch.setattr(mt, switch, on)
        m = torch.zeros(1, dtype=torch.int64, device=DEVICE)
        outs.append((call(m), int(m.item())))
    return outs


@pytest.mark.parametrize("fmt", ["w2", "fp4"])
def test_even_tiles_run_unmasked_to_the_same_bits(poisoned, monkeypatch, fmt):
    """Tiles that divide their GEMM exactly (EVEN_K: whole K steps, as many per split; EVEN_N: whole
    row blocks) load with constant masks: the same values, so the same bits as the masked form,
    misses alike; a split that leaves one split a step short, or a partial row block, keeps masks."""
    mt = _mt()
    g, h, i, pool, run, f = _mask_case(mt, fmt, 57 if fmt == "w2" else 58)
    cfg = MoEConfig(1, GemmConfig(32, 32, 2, 2, 2), GemmConfig(64, 32, 1, 2, 2))
    assert mt._even_tiles(i, h, f, cfg.gate_up, cfg.BM) == {"EVEN_K": True, "EVEN_N": True, "X_CLAMP": True}
    assert mt._even_tiles(h, i, f, cfg.down, cfg.BM) == {"EVEN_K": True, "EVEN_N": True, "X_CLAMP": True}
    assert not mt._even_tiles(i, h, f, GemmConfig(32, 32, 3, 2, 2), cfg.BM)["EVEN_K"]   # 2 or 4 steps, 3 splits
    assert not mt._even_tiles(100, h, f, cfg.gate_up, cfg.BM)["EVEN_N"]
    tab = _table([2, -1, 0, 3, 1])
    x, ids, w = _inputs(3, 2, h, 5, g)
    ids[0] = torch.tensor([1, 3])                                   # expert 1 is not resident: a miss
    outs = _switched(monkeypatch, mt, "UNMASK_EVEN_TILES", lambda m: run(x, ids, w, tab, pool, m, act=ExpertActivation(limit=2.0),
                                                                         config=cfg))
    assert torch.equal(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1] > 0 and outs[0][0].abs().max() > 0
    assert mt._even_tiles(i, h, f, cfg.gate_up, cfg.BM) == {}                                # the switch is off


@pytest.mark.parametrize("fmt", ["w2", "fp4"])
def test_clamped_x_rows_give_the_same_bits(poisoned, monkeypatch, fmt):
    """X_CLAMP: on constant-mask tiles the padding rows of a token tile read pair P - 1's x row
    unmasked. Here pair P - 1 is a miss, so its act row is never written (NaN-poisoned) and the
    down's padding columns multiply NaN: the stored output is still bit-identical to the masked
    loads, misses alike, with BM 2 tiles that hold 1-2 pairs and padding."""
    mt = _mt()
    g, h, i, pool, run, f = _mask_case(mt, fmt, 61 if fmt == "w2" else 62)
    cfg = MoEConfig(2, GemmConfig(32, 32, 1, 2, 2), GemmConfig(64, 32, 1, 2, 2))
    assert mt._even_tiles(i, h, f, cfg.gate_up, cfg.BM)["X_CLAMP"]
    assert mt._even_tiles(h, i, f, cfg.down, cfg.BM)["X_CLAMP"]
    tab = _table([2, -1, 0, 3, 1])
    x, ids, w = _inputs(3, 2, h, 5, g)
    ids[2] = torch.tensor([0, 1])                                   # the last pair (P - 1) a miss
    ids[0] = torch.tensor([0, 2])                                   # expert 0 three times: a full tile
    ids[1] = torch.tensor([3, 0])                                   # and one of a pair and padding
    outs = _switched(monkeypatch, mt, "CLAMP_X_ROWS", lambda m: run(x, ids, w, tab, pool, m, act=ExpertActivation(limit=2.0),
                                                                    config=cfg))
    assert torch.isfinite(outs[0][0]).all() and outs[0][0].abs().max() > 0
    assert torch.equal(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1] == 1
    assert not mt._even_tiles(i, h, f, cfg.gate_up, cfg.BM)["X_CLAMP"]                       # the switch is off
    assert not mt._even_tiles(i, h, f, GemmConfig(32, 32, 3, 2, 2), cfg.BM)["X_CLAMP"]      # no constant K masks
    monkeypatch.setattr(mt, "CLAMP_X_ROWS", True)
    assert not mt._even_tiles(i, h, f, cfg.gate_up, mt.X_CLAMP_MAX_BM * 2)["X_CLAMP"]  # x via shared memory


def test_down_prefetch_config_and_points():
    """MoEConfig.down_prefetch needs PDL (it prefetches before the PDL wait), survives the JSON, and
    asks for one point per 128 bytes of a row-major row, one per tile row of a row-tiled one, over
    the split's K span (a power of two: the prefetch tile)."""
    mt = _mt()
    with pytest.raises(ValueError, match="pdl=True"):
        MoEConfig(1, GemmConfig(), GemmConfig(), down_prefetch=True)
    c = MoEConfig(1, GemmConfig(32, 32, 2, 2, 4), GemmConfig(32, 32, 1, 2, 4), pdl=True, down_prefetch=True)
    assert MoEConfig.from_json(c.to_json()) == c and "down_prefetch" not in replace(c, down_prefetch=False).to_json()
    assert mt.prefetch_points(replace(c, down_prefetch=False), mt.FMT_W2, 2048, True) == 0
    assert mt.prefetch_points(c, mt.FMT_W2, 2048, True) == 8       # 256 units, a tile row = 32 units
    assert mt.prefetch_points(c, mt.FMT_W2, 2048, False) == 4      # 256 units, 64 units = 128 bytes a point
    assert mt.prefetch_points(c, mt.FMT_FP4, 2048, True) == 8      # 512 units, a tile row = 64 units
    split = replace(c, down=GemmConfig(32, 32, 2, 2, 4))
    assert mt.prefetch_points(split, mt.FMT_W2, 2048, True) == 4   # half the K span each
    assert mt.prefetch_points(split, mt.FMT_W2, 1408, False) == 2  # 176 units: 6 steps of 32, 3 a split: 96 units
    first = replace(c, down_prefetch_steps=2)                        # the first 2 steps only: 64 units
    assert mt.prefetch_points(first, mt.FMT_W2, 2048, True) == 2 and MoEConfig.from_json(first.to_json()) == first
    assert mt.prefetch_points(replace(c, down_prefetch_steps=99), mt.FMT_W2, 2048, True) == 8
    with pytest.raises(ValueError, match="down_prefetch_steps"):
        replace(c, down_prefetch_steps=-1)
    assert mt.prefetch_points(replace(first, down_prefetch=False), mt.FMT_W2, 2048, True) == 0   # unused without it


@pytest.mark.skipif(DEVICE != "cuda", reason="the prefetch is issued under PDL only, a GPU launch (the "
                                             "interpreter has neither); its points are tested on the CPU above")
@pytest.mark.parametrize("fmt", ["w2", "fp4"])
def test_down_prefetch_changes_no_bits(poisoned, fmt):
    """The L2 prefetch before the down GEMM's PDL wait is a hint: the same bits as PDL alone."""
    mt = _mt()
    g = torch.Generator().manual_seed(55 if fmt == "w2" else 56)
    pool, run = _pool_and_run(mt, fmt, g)
    tab = _table([3, -1, 0, 5, -1, 1])
    x, ids, w = _inputs(3, 2, 64, 6, g)
    base = MoEConfig(1, GemmConfig(16, 16, 2, 2, 2), GemmConfig(32, 16, 2, 2, 2), pdl=True)
    m0, m1 = (torch.zeros(1, dtype=torch.int64, device=DEVICE) for _ in range(2))
    ref = run(x, ids, w, tab, pool, m0, act=ExpertActivation(limit=1.5), config=base)
    out = run(x, ids, w, tab, pool, m1, act=ExpertActivation(limit=1.5), config=replace(base, down_prefetch=True))
    assert torch.equal(out, ref) and int(m1.item()) == int(m0.item()) > 0
    first = run(x, ids, w, tab, pool, m1, act=ExpertActivation(limit=1.5),
                config=replace(base, down_prefetch=True, down_prefetch_steps=1))
    assert torch.equal(first, ref)


def _run_asm(asm: str, regs: dict) -> dict:
    """A small interpreter of the decoders' PTX (the instructions they use), vectorised over numpy
    uint32 arrays: regs maps "$i" / local names to values; returns them after the block. fma.rn.bf16x2
    is computed exactly per half and rounded to bf16 once (torch's round to nearest even)."""
    import numpy as np
    r = dict(regs)

    def val(tok):
        tok = tok.strip().rstrip(";")
        return np.uint32(int(tok, 0)) if tok[0].isdigit() else r[tok]

    def bf16_halves(v):
        lo = torch.from_numpy((v & 0xFFFF).astype(np.int32)).to(torch.int16).view(torch.bfloat16).double()
        hi = torch.from_numpy((v >> 16).astype(np.int32)).to(torch.int16).view(torch.bfloat16).double()
        return lo, hi

    def to_word(lo, hi):
        bits = lambda t: t.to(torch.bfloat16).view(torch.int16).numpy().astype(np.uint32) & 0xFFFF
        return bits(lo) | (bits(hi) << 16)

    for line in asm.splitlines():
        line = line.strip()
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        args = [a.strip() for a in rest.rstrip(";").split(",")]
        d = args[0]
        if op == "mov.b32":
            r[d] = np.broadcast_to(val(args[1]), np.shape(next(iter(regs.values())))).astype(np.uint32)
        elif op == "and.b32":
            r[d] = val(args[1]) & val(args[2])
        elif op == "or.b32":
            r[d] = val(args[1]) | val(args[2])
        elif op == "shr.u32":
            r[d] = (val(args[1]) >> val(args[2])).astype(np.uint32)
        elif op == "shl.b32":
            r[d] = (val(args[1]).astype(np.uint64) << val(args[2])).astype(np.uint32)
        elif op == "mul.lo.u32":
            r[d] = (val(args[1]).astype(np.uint64) * val(args[2])).astype(np.uint32)
        elif op == "mad.lo.u32":
            r[d] = (val(args[1]).astype(np.uint64) * val(args[2]) + val(args[3])).astype(np.uint32)
        elif op == "fma.rn.bf16x2":
            (al, ah), (bl, bh), (cl, ch) = (bf16_halves(val(x)) for x in args[1:])
            r[d] = to_word(al * bl + cl, ah * bh + ch)
        else:
            raise AssertionError(f"the emulator does not know {op}")
    return r


def test_fp4_and_nb8_asm_decoders_match_their_plain_twins():
    """The inline-asm decoders (what the GPU runs; the interpreter runs the plain twins) emulated
    instruction by instruction on numpy: FP4_ASM over every pair of 16-bit NVFP4 units sampled with
    every byte value in each position, against the e2m1 table times the multiplier (exactly what
    _fp4_plain computes), for several e4m3 scales; NB8_ASM against the nb8 decode (+-1 / +-4 times
    2^(s - 127)) for scale bytes 1, 100, 127 and 252 (252: the top of its exact range)."""
    import numpy as np
    from moet.kernels import moe_tiles as mt      # the decoders' device functions live there
    from moet.kernels.reference import E2M1_VALUES
    rng = np.random.default_rng(0)
    b = np.arange(256, dtype=np.uint32)
    words = np.concatenate([b | (rng.integers(0, 256, 256, dtype=np.uint32) << 8) | (rng.integers(0, 65536, 256, dtype=np.uint32) << 16),
                            rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32), b << 24, b << 16, b << 8])
    e2m1 = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    for scale in (0.25, 1.0, 3.75, 448.0, 2.0 ** -9):
        mult = torch.tensor(scale * 2.0 ** 118, dtype=torch.float64).to(torch.bfloat16)
        mbits = int(mult.view(torch.int16).item()) & 0xFFFF
        r = _run_asm(str(mt.FP4_ASM.value if hasattr(mt.FP4_ASM, "value") else mt.FP4_ASM),
                     {"$4": words, "$5": np.full(words.shape, mbits | (mbits << 16), dtype=np.uint32)})
        nb = words                                                          # NVFP4 bytes, as the pool holds them
        for p in range(4):
            for half in (0, 1):
                code = (nb >> (16 * half + 4 * p)) & 15                     # element 4u + p of that unit
                want = e2m1[torch.from_numpy(code.astype(np.int64))] * 2.0 ** -126 * mult.double()
                got = torch.from_numpy(((r[f"${p}"] >> (16 * half)) & 0xFFFF).astype(np.int32)).to(torch.int16) \
                    .view(torch.bfloat16).double()
                assert torch.equal(got, want), (scale, p, half)
    units = rng.integers(0, 2**32, 2048, dtype=np.uint64).astype(np.uint32)
    for s in (1, 100, 127, 252):
        r = _run_asm(str(mt.NB8_ASM.value if hasattr(mt.NB8_ASM, "value") else mt.NB8_ASM),
                     {"$8": units, "$9": np.full(units.shape, s, dtype=np.uint32)})
        for p in range(8):
            big_bit, neg_bit = w2.NB8_BIG_BIT[p], w2.NB8_NEG_BIT[p]
            for half in (0, 1):
                u = (units >> (16 * half)) & 0xFFFF
                lvl = np.where((u >> big_bit) & 1, 4.0, 1.0) * np.where((u >> neg_bit) & 1, -1.0, 1.0)
                want = torch.from_numpy(lvl) * 2.0 ** (s - 127)
                got = torch.from_numpy(((r[f"${p}"] >> (16 * half)) & 0xFFFF).astype(np.int32)).to(torch.int16) \
                    .view(torch.bfloat16).double()
                assert torch.equal(got, want), (s, p, half)


def test_fp4_scale_conversions_agree_on_every_e4m3_byte():
    """The FP4 scale multiplier (e4m3 * 2^118) has two forms: integer bit placement (_e4m3_times_2p118:
    the interpreter and GPUs below sm_89) and Triton's float8e4nv conversion (sm_89+, asm_level 2).
    Both must give torch's e4m3 value * 2^118 for every byte except the two NaN encodings, so the
    GPU's bits do not depend on which one a device takes."""
    import triton
    import triton.language as tl
    global _e4m3_times_2p118                       # a jit function reaches helpers through its globals
    from moet.kernels import moe_tiles
    _e4m3_times_2p118 = moe_tiles._e4m3_times_2p118

    @triton.jit
    def conv(b_ptr, out_ptr, out2_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        b = tl.load(b_ptr + i)
        tl.store(out_ptr + i, _e4m3_times_2p118(b.to(tl.int32)))
        tl.store(out2_ptr + i, b.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 2.0 ** 118)

    b = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(DEVICE)
    got, got2 = (torch.empty(256, dtype=torch.float32, device=DEVICE) for _ in range(2))
    conv[(1,)](b, got, got2, N=256)
    want = b.cpu().view(torch.float8_e4m3fn).float() * 2.0 ** 118
    ok = ~torch.isnan(want)
    assert int(ok.sum()) == 254
    assert torch.equal(got.cpu()[ok], want[ok]) and torch.equal(got2.cpu()[ok], want[ok])
    assert bool((got.cpu()[~ok].abs() == 480 * 2.0 ** 118).all())    # the integer form: 0x7F / 0xFF read as +-480


def test_asm_level_follows_the_device(monkeypatch):
    """USE_ASM per device: 0 off the GPU (the interpreter's plain decoders), 1 below sm_89 (no e4m3
    type in Triton there: the FP4 scales by integer ops), 2 from sm_89 on (the hardware conversion)."""
    mt = _mt()
    assert mt.asm_level(torch.device("cpu")) == 0
    for cap, want in (((8, 0), 1), ((8, 6), 1), ((8, 9), 2), ((9, 0), 2), ((12, 0), 2)):
        mt._cuda_asm_level.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None, cap=cap: cap)
        assert mt.asm_level(torch.device("cuda", 0)) == want, cap
    mt._cuda_asm_level.cache_clear()


@pytest.mark.parametrize("fmt,cfg", [("w2", CFG), ("w2", CFG_SPLIT_GU), ("fp4", CFG_SPLIT_GU), ("fp4", CFG_BM1),
                                     ("w2", replace(CFG_SPLIT_GU, fused_finish=True))],
                         ids=["w2", "w2-split", "fp4-split", "fp4-bm1", "w2-fused-finish"])
def test_gpt_oss_activation_and_biases_match_reference(poisoned, fmt, cfg):
    """gpt-oss's expert activation (clamp 2, gate * sigmoid(1.702 gate) * (up + 1)) with gate/up
    biases by expert id, in the gate/up epilogue (one split), the finish kernel and the fused finish
    (split gate/up): the reference's result, and far from the plain SwiGLU's."""
    mt = _mt()
    g = torch.Generator().manual_seed(41)
    table = [3, -1, 0, 7, -1, 5]
    pool = (_w2_pool if fmt == "w2" else _fp4_pool)(8, 64, 32, g)
    tab = _table(table)
    x, ids, w = _inputs(5, 2, 64, 6, g)
    bias = (0.5 * torch.randn(6, 64, generator=g)).to(DEVICE)
    act = ExpertActivation(limit=2.0, alpha=1.702, gate_up_bias=bias)
    m_ref, m_tri = (torch.zeros(1, dtype=torch.int64, device=DEVICE) for _ in range(2))
    ref = moe_experts_reference(x, ids, w, tab, pool, m_ref, act=act)
    out = mt.moe_experts_triton(x, ids, w, tab, pool, m_tri, act=act, config=cfg)
    assert _relerr(out, ref) <= BOUND and torch.equal(m_tri, m_ref)
    plain = moe_experts_reference(x, ids, w, tab, pool, torch.zeros_like(m_ref), act=ExpertActivation(limit=2.0))
    assert _relerr(plain, ref) > 0.1
    no_bias = moe_experts_reference(x, ids, w, tab, pool, torch.zeros_like(m_ref),
                                    act=ExpertActivation(limit=2.0, alpha=1.702))
    assert _relerr(no_bias, ref) > 0.05
