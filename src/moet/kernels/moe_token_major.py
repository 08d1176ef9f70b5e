"""Token-major MoE decode (MoEConfig.token_major): _tm_gate_up_kernel (row block, pair) and
_tm_down_kernel (row block, token), launched by moe_triton's driver. Its gate/up tile and down
rows are also the work items of the one-launch decode (moe_fused_decode). Importing this module
needs triton.
"""
from __future__ import annotations

import triton
import triton.language as tl

from moet.kernels.moe_tiles import _rows_dots, _swiglu, _x_slots
from moet.kernels.pdl import pdl_enter as _pdl_enter  # programmatic dependent launch (sm_90+)


# ====================================================================== token-major decode kernels
# MoEConfig.token_major, up to TOKEN_MAJOR_MAX_PAIRS pairs: each (token, expert) pair is its own
# one-row tile, so no slot alignment and no slot-major copy of the hidden states is needed, and
# each token's down projections and top-k combine are one program per row block. Two launches
# per layer instead of four or five: at T = 1 the launch boundaries (each a full ramp-up and
# drain of the GPU) were measured to cost more than the weight decode (docs/kernels.md, MoE).

@triton.jit
def _tm_gate_up_tile(pid_n, p, slot, x_ptr, wq_ptr, sc_ptr, s2_ptr, act_ptr, s_x, s_wq_slot, s_sc_slot, limit,
                     N: tl.constexpr, K: tl.constexpr, TOPK: tl.constexpr, FMT: tl.constexpr,
                     HAS_LIMIT: tl.constexpr, USE_ASM: tl.constexpr, BN: tl.constexpr, BKH: tl.constexpr):
    """Rows n of block pid_n of act[p] = SwiGLU(gate rows n, up rows N + n of resident slot
    `slot` against pair p's token row, read in natural order: slot q of unit u is element
    UPW u + q, a strided load, but the row is a few KiB and stays in L1), stored slot-major as
    the down projection reads it."""
    UPW: tl.constexpr = 8 if FMT == 0 else 4
    UNITS: tl.constexpr = K // UPW
    G: tl.constexpr = UNITS // 4
    STEPS: tl.constexpr = (UNITS + BKH - 1) // BKH
    n = pid_n * BN + tl.arange(0, BN)
    nmask = n < N
    slot64 = slot.to(tl.int64)
    wq = wq_ptr + slot64 * s_wq_slot
    sc = sc_ptr + slot64 * s_sc_slot
    hcols = tl.arange(0, BKH)
    gcols = tl.arange(0, BKH // 4)
    xb = x_ptr + (p // TOPK).to(tl.int64) * s_x
    acc = tl.zeros([BN, 1], dtype=tl.float32)
    acc2 = tl.zeros([BN, 1], dtype=tl.float32)
    for st in range(STEPS):
        u = st * BKH + hcols
        umask = u < UNITS
        g = st * (BKH // 4) + gcols
        gmask = g < G
        xm = umask[None, :]
        xp = xb + (u * UPW)[None, :]
        x0, x1, x2, x3, x4, x5, x6, x7 = _x_slots(xp, 1, xm, FMT, True, USE_ASM, "")
        acc = _rows_dots(acc, wq, sc, n, nmask, u, umask, g, gmask, x0, x1, x2, x3, x4, x5, x6, x7, st,
                         UNITS, G, FMT, BN, BKH, USE_ASM)
        acc2 = _rows_dots(acc2, wq, sc, n + N, nmask, u, umask, g, gmask, x0, x1, x2, x3, x4, x5, x6, x7, st,
                          UNITS, G, FMT, BN, BKH, USE_ASM)
    if FMT == 1:
        acc = acc * (tl.load(s2_ptr + slot64 * 2) * 256.0)
        acc2 = acc2 * (tl.load(s2_ptr + slot64 * 2 + 1) * 256.0)
    a = _swiglu(acc, acc2, limit, HAS_LIMIT)
    nperm = (n % UPW) * (N // UPW) + n // UPW
    tl.store(act_ptr + p.to(tl.int64) * N + nperm[:, None], a.to(act_ptr.dtype.element_ty), mask=nmask[:, None])


@triton.jit
def _down_rows(act_row, slot, n, nmask, wq_ptr, sc_ptr, s2_ptr, s_wq_slot, s_sc_slot,
               K: tl.constexpr, FMT: tl.constexpr, USE_ASM: tl.constexpr, BN: tl.constexpr, BKH: tl.constexpr,
               CACHE: tl.constexpr):
    """(W_down[slot] @ act_row)[n] as fp32 [BN, 1] (scale_2 applied for FP4): act_row is one
    slot-major activation row of K values (contiguous per slot)."""
    UPW: tl.constexpr = 8 if FMT == 0 else 4
    UNITS: tl.constexpr = K // UPW
    G: tl.constexpr = UNITS // 4
    STEPS: tl.constexpr = (UNITS + BKH - 1) // BKH
    hcols = tl.arange(0, BKH)
    gcols = tl.arange(0, BKH // 4)
    slot64 = slot.to(tl.int64)
    wq = wq_ptr + slot64 * s_wq_slot
    sc = sc_ptr + slot64 * s_sc_slot
    acc = tl.zeros([BN, 1], dtype=tl.float32)
    for st in range(STEPS):
        u = st * BKH + hcols
        umask = u < UNITS
        g = st * (BKH // 4) + gcols
        gmask = g < G
        xm = umask[None, :]
        xp = act_row + u[None, :]
        x0, x1, x2, x3, x4, x5, x6, x7 = _x_slots(xp, UNITS, xm, FMT, False, USE_ASM, CACHE)
        acc = _rows_dots(acc, wq, sc, n, nmask, u, umask, g, gmask, x0, x1, x2, x3, x4, x5, x6, x7, st,
                         UNITS, G, FMT, BN, BKH, USE_ASM)
    if FMT == 1:
        acc = acc * (tl.load(s2_ptr + slot64) * 256.0)
    return acc


@triton.jit
def _tm_gate_up_kernel(x_ptr, ids_ptr, table_ptr, wq_ptr, sc_ptr, s2_ptr, act_ptr, miss_ptr,
                       s_x, s_wq_slot, s_sc_slot, limit,
                       N: tl.constexpr, K: tl.constexpr, TOPK: tl.constexpr, FMT: tl.constexpr,
                       HAS_LIMIT: tl.constexpr, USE_ASM: tl.constexpr, BN: tl.constexpr, BKH: tl.constexpr,
                       PDL: tl.constexpr):
    """Grid (cdiv(N, BN), P): _tm_gate_up_item for row block pid_n of pair p."""
    _pdl_enter(PDL)
    _tm_gate_up_item(tl.program_id(0), tl.program_id(1), x_ptr, ids_ptr, table_ptr, wq_ptr, sc_ptr, s2_ptr,
                     act_ptr, miss_ptr, s_x, s_wq_slot, s_sc_slot, limit, N, K, TOPK, FMT, HAS_LIMIT, USE_ASM, BN, BKH)


@triton.jit
def _tm_gate_up_item(pid_n, p, x_ptr, ids_ptr, table_ptr, wq_ptr, sc_ptr, s2_ptr, act_ptr, miss_ptr,
                     s_x, s_wq_slot, s_sc_slot, limit,
                     N: tl.constexpr, K: tl.constexpr, TOPK: tl.constexpr, FMT: tl.constexpr,
                     HAS_LIMIT: tl.constexpr, USE_ASM: tl.constexpr, BN: tl.constexpr, BKH: tl.constexpr):
    """Row block pid_n of pair p: _tm_gate_up_tile when its expert is resident, else nothing
    written and the pair counted once (by row block 0) into the miss counter."""
    slot = tl.load(table_ptr + tl.load(ids_ptr + p))
    if slot < 0:
        if pid_n == 0:
            tl.atomic_add(miss_ptr, 1)
    else:
        _tm_gate_up_tile(pid_n, p, slot, x_ptr, wq_ptr, sc_ptr, s2_ptr, act_ptr, s_x, s_wq_slot, s_sc_slot, limit,
                         N, K, TOPK, FMT, HAS_LIMIT, USE_ASM, BN, BKH)


@triton.jit
def _tm_down_kernel(act_ptr, ids_ptr, table_ptr, tw_ptr, wq_ptr, sc_ptr, s2_ptr, out_ptr,
                    s_wq_slot, s_sc_slot, s_out,
                    N: tl.constexpr, K: tl.constexpr, TOPK: tl.constexpr, FMT: tl.constexpr,
                    USE_ASM: tl.constexpr, BN: tl.constexpr, BKH: tl.constexpr, PDL: tl.constexpr):
    """Grid (cdiv(N, BN), T): out[t, n] = sum_j w[t, j] * (W_down[slot of pair t k + j] @ act[t k + j])[n]
    in the fixed order j = 0..k-1 (fp32), the down rows of each resident pair read once; pairs whose
    expert is not resident add nothing (their act rows were never written)."""
    _pdl_enter(PDL)
    pid_n = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    n = pid_n * BN + tl.arange(0, BN)
    nmask = n < N
    out = tl.zeros([BN, 1], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        pr = t * TOPK + j
        slot = tl.load(table_ptr + tl.load(ids_ptr + pr))
        w = tl.load(tw_ptr + pr).to(tl.float32)
        if slot >= 0:
            out += _down_rows(act_ptr + pr * K, slot, n, nmask, wq_ptr, sc_ptr, s2_ptr, s_wq_slot, s_sc_slot,
                              K, FMT, USE_ASM, BN, BKH, "") * w
    tl.store(out_ptr + t * s_out + n[:, None], out.to(out_ptr.dtype.element_ty), mask=nmask[:, None])
