"""The decode regime's slot alignment (up to moe_configs.SMALL_ALIGN_MAX_PAIRS pairs) in one
launch of _prep_small_kernel: its program 0 aligns the pairs as moe_align.moe_align_block_size
does (tiles of BM pairs, one slot per tile; slots in order of first appearance rather than
ascending, which the GEMMs do not care about; misses dropped and counted), its other programs copy
the hidden rows into the slot-major order the grouped GEMMs (moe_gemm.py) read. One program and
O(P^2) compares instead of a sort: no host sync and one launch where the pairs are few. Launched by
moe_triton.py. Importing this module needs triton.
"""
from __future__ import annotations

import triton
import triton.language as tl

from moet.kernels.pdl import pdl_enter as _pdl_enter  # programmatic dependent launch (sm_90+)


@triton.jit
def _prep_small_kernel(ids_ptr, table_ptr, sorted_ptr, bslot_ptr, nblk_ptr, miss_ptr, P, NB,
                       x_ptr, xp_ptr, s_x, out_ptr, H: tl.constexpr, UPW: tl.constexpr, BH: tl.constexpr,
                       BM: tl.constexpr, PP: tl.constexpr, QB: tl.constexpr, FILL: tl.constexpr,
                       ZERO_OUT: tl.constexpr, PDL: tl.constexpr):
    """Decode-regime preparation in one launch. Program 0 aligns the pairs: pair p (flattened
    [T, k]) of slot s goes to tile bstart(s) + rank // BM, row rank % BM, rank = #earlier
    pairs of s; slots in order of first appearance; padding rows hold P, unused tiles slot -1;
    misses (slot < 0) are added to miss_ptr[0]. Programs 1 + t * cdiv(H, BH) + c copy chunk c
    of hidden row t into the slot-major order the GEMM reads (xp[t, q, u] = x[t, UPW u + q]),
    and with ZERO_OUT zero that chunk of the layer output (the fused combine writes only tokens
    with a resident pair)."""
    _pdl_enter(PDL)
    pid = tl.program_id(0)
    if pid > 0:
        t = (pid - 1) // tl.cdiv(H, BH)
        k = ((pid - 1) % tl.cdiv(H, BH)) * BH + tl.arange(0, BH)
        km = k < H
        v = tl.load(x_ptr + t.to(tl.int64) * s_x + k, mask=km)
        tl.store(xp_ptr + t.to(tl.int64) * H + (k % UPW) * (H // UPW) + k // UPW,
                 v.to(xp_ptr.dtype.element_ty), mask=km)
        if ZERO_OUT:
            tl.store(out_ptr + t.to(tl.int64) * H + k, tl.zeros([BH], dtype=out_ptr.dtype.element_ty), mask=km)
    else:
        _align_small(ids_ptr, table_ptr, sorted_ptr, bslot_ptr, nblk_ptr, miss_ptr, P, NB, BM, PP, QB, FILL)


@triton.jit
def _align_small(ids_ptr, table_ptr, sorted_ptr, bslot_ptr, nblk_ptr, miss_ptr, P, NB,
                 BM: tl.constexpr, PP: tl.constexpr, QB: tl.constexpr, FILL: tl.constexpr):
    p = tl.arange(0, PP)
    pv = p < P
    s = tl.load(table_ptr + tl.load(ids_ptr + p, mask=pv, other=0), mask=pv, other=-1)
    res = pv & (s >= 0)
    rank = tl.zeros([PP], dtype=tl.int32)
    cnt = tl.zeros([PP], dtype=tl.int32)
    fpos = tl.full([PP], PP, dtype=tl.int32)
    for q0 in range(0, PP, QB):
        q = q0 + tl.arange(0, QB)
        qv = q < P
        sq = tl.load(table_ptr + tl.load(ids_ptr + q, mask=qv, other=0), mask=qv, other=-1)
        same = res[:, None] & (qv & (sq >= 0))[None, :] & (s[:, None] == sq[None, :])
        rank += tl.sum((same & (q[None, :] < p[:, None])).to(tl.int32), 1)
        cnt += tl.sum(same.to(tl.int32), 1)
        fpos = tl.minimum(fpos, tl.min(tl.where(same, q[None, :], PP), 1))
    nblk = tl.where(res & (rank == 0), (cnt + BM - 1) // BM, 0)
    tl.store(nblk_ptr + p, nblk)
    for f0 in range(0, PP * BM, FILL):                     # NB <= P <= PP (constexpr loop bounds)
        f = f0 + tl.arange(0, FILL)
        tl.store(sorted_ptr + f, tl.zeros([FILL], dtype=tl.int32) + P, mask=f < NB * BM)
        tl.store(bslot_ptr + f, tl.full([FILL], -1, dtype=tl.int32), mask=f < NB)
    tl.debug_barrier()                         # nblk and the fills visible to the whole program
    bstart = tl.zeros([PP], dtype=tl.int32)
    for q0 in range(0, PP, QB):
        q = q0 + tl.arange(0, QB)
        nq = tl.load(nblk_ptr + q)
        bstart += tl.sum(tl.where(q[None, :] < fpos[:, None], nq[None, :], 0), 1)
    blk = bstart + rank // BM
    row = rank % BM
    tl.store(sorted_ptr + blk * BM + row, p, mask=res)
    tl.store(bslot_ptr + blk, s, mask=res & (row == 0))
    misses = tl.sum((pv & (s < 0)).to(tl.int32), 0)
    old = tl.load(miss_ptr)
    tl.store(miss_ptr, old + misses.to(old.dtype))
