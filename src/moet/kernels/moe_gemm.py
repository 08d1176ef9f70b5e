"""The grouped GEMM kernels of the Triton MoE (the pipeline and the operand layouts: moe_triton's
docstring, which also launches them): _moe_gemm_kernel, one stage's grouped GEMM over the slot
tiles (gate/up with the SwiGLU epilogue, or down), with its optional fused SwiGLU finish and fused
top-k combine (_combine_tail); _swiglu_finish_kernel, the split gate/up's finish; _combine_kernel,
the fixed-order top-k combine. The weight tiles are decoded by moe_tiles' device functions.
Importing this module needs triton.
"""
from __future__ import annotations

import triton
import triton.language as tl

from moet.kernels.grid_sync import acquired, gpu_fence, signal
from moet.kernels.moe_tiles import (_add_gate_up_bias, _prefetch_slab, _rows_dots, _rows_dots_pair, _rows_dots_split,
                                    _swiglu, _x_slots)
from moet.kernels.pdl import pdl_enter as _pdl_enter  # programmatic dependent launch (sm_90+)


@triton.jit
def _moe_gemm_kernel(x_ptr, wq_ptr, sc_ptr, s2_ptr, sorted_ptr, bslot_ptr, out_ptr, act_ptr, cnt_ptr,
                     ids_ptr, table_ptr, tw_ptr, s_x, s_wq_slot, s_sc_slot, limit, P,
                     N: tl.constexpr, K: tl.constexpr, TOPK: tl.constexpr, GATE_UP: tl.constexpr,
                     FMT: tl.constexpr, SPLIT_K: tl.constexpr, HAS_LIMIT: tl.constexpr, USE_ASM: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BKH: tl.constexpr, FUSED_FINISH: tl.constexpr,
                     FUSED_COMBINE: tl.constexpr, PDL: tl.constexpr, UNROLL: tl.constexpr = 1,
                     TILED: tl.constexpr = False, CHAINS: tl.constexpr = 1, PREFETCH: tl.constexpr = 0,
                     EVEN_K: tl.constexpr = False, EVEN_N: tl.constexpr = False, X_CLAMP: tl.constexpr = False,
                     PREFETCH_STEPS: tl.constexpr = 0, KW2: tl.constexpr = False,
                     bias_ptr=None, alpha=1.0, HAS_BIAS: tl.constexpr = False, HAS_ALPHA: tl.constexpr = False):
    """Grid (cdiv(N, BN), tiles, SPLIT_K). GATE_UP: x = hidden [T, K] (row = pair // TOPK),
    weights rows n (gate) and N + n (up) of [2N, K]; else x = act [P, K] (row = pair), weights
    [N, K]. Output: act [P, N] (GATE_UP, SPLIT_K 1) or fp32 partials [SPLIT_K, P, 2N or N].
    FUSED_FINISH (GATE_UP, SPLIT_K > 1): the last of a (tile, row block)'s SPLIT_K programs also
    does _swiglu_finish_kernel's work for it -- the same sums in the same order -- into act_ptr,
    counting arrivals in cnt_ptr (zero again when it is done), so no finish launch follows.
    FUSED_COMBINE (down): each pair's program counts itself for its (token, row block) in cnt_ptr;
    the program that brings it to (resident pairs of the token) x SPLIT_K does _combine_kernel's
    sum for that token's rows into act_ptr (the layer output [T, N]) -- the same order, j then s --
    and re-zeroes the counter. Tokens with no resident pair get no arrival: the prep kernel zeroed
    their rows.
    PREFETCH (down under PDL only, MoEConfig.down_prefetch; points per row): before the PDL wait,
    the program prefetches its weight slab into L2, so its DRAM reads overlap the kernels before
    it. Safe: the weights and the tile's slot (bslot_ptr) were written before the gate/up launch,
    and this kernel cannot launch before every gate/up program has passed its own wait.
    PREFETCH_STEPS (MoEConfig.down_prefetch_steps; 0 = the whole slab): only the slab's first K steps,
    the bytes the program's pipeline asks for first (the whole down did not fit in L2 beside
    gate/up's reads at T = 1).
    KW2 (GemmConfig.kwidth2): the scale values behind an always-taken branch, so the MMAs pack K by 2
    (_scale_values).
    HAS_BIAS / HAS_ALPHA (gate/up, gpt-oss): the pair's expert's gate / up biases (bias_ptr [E, 2N],
    by expert id) added to the summed products, and the activation with alpha (_swiglu)."""
    if PREFETCH:
        slot_pf = tl.load(bslot_ptr + tl.program_id(1))
        if slot_pf >= 0:
            UPW_PF: tl.constexpr = 8 if FMT == 0 else 4
            UNITS_PF: tl.constexpr = K // UPW_PF
            PER_PF: tl.constexpr = ((UNITS_PF + BKH - 1) // BKH + SPLIT_K - 1) // SPLIT_K
            SPAN_PF: tl.constexpr = PER_PF if PREFETCH_STEPS == 0 else min(PER_PF, PREFETCH_STEPS)
            _prefetch_slab(wq_ptr + slot_pf.to(tl.int64) * s_wq_slot, sc_ptr + slot_pf.to(tl.int64) * s_sc_slot,
                           tl.program_id(0) * BN + tl.arange(0, BN), N, tl.program_id(2) * PER_PF * BKH, UNITS_PF,
                           UNITS_PF // 4, FMT, SPAN_PF * BKH, PREFETCH, TILED)
    _pdl_enter(PDL)
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    ks = tl.program_id(2)
    slot = tl.load(bslot_ptr + b)
    if slot >= 0:
        UPW: tl.constexpr = 8 if FMT == 0 else 4          # weights per 16-bit unit
        UNITS: tl.constexpr = K // UPW
        G: tl.constexpr = UNITS // 4                       # one scale byte per 4 units (32 / 16 weights)
        STEPS: tl.constexpr = (UNITS + BKH - 1) // BKH
        PER: tl.constexpr = (STEPS + SPLIT_K - 1) // SPLIT_K
        pair = tl.load(sorted_ptr + b * BM + tl.arange(0, BM))
        pmask = pair < P
        # X_CLAMP (with EVEN_K): a padding row (pair P) reads the x row of pair P - 1 instead of
        # zeros, so the x loads need no predicate; its column of the product is never stored
        # (omask), and an MMA's columns do not mix, so the stored bits are the same
        if X_CLAMP:
            xpair = tl.minimum(pair, P - 1)
        else:
            xpair = pair
        if GATE_UP:
            xrow = (xpair // TOPK).to(tl.int64)
        else:
            xrow = xpair.to(tl.int64)
        n = pid_n * BN + tl.arange(0, BN)
        if EVEN_N:                                         # N % BN == 0: every row is in (a constant
            nmask = tl.full([BN], 1, tl.int1)              # mask: the loads lose their predicates)
        else:
            nmask = n < N
        slot64 = slot.to(tl.int64)
        wq = wq_ptr + slot64 * s_wq_slot
        sc = sc_ptr + slot64 * s_sc_slot
        hcols = tl.arange(0, BKH)
        gcols = tl.arange(0, BKH // 4)
        xb = x_ptr + xrow[:, None] * s_x                   # x rows in slot-major order [UPW, UNITS]
        acc = tl.zeros([BN, BM], dtype=tl.float32)
        acc2 = tl.zeros([BN, BM], dtype=tl.float32)
        # UNROLL (GemmConfig.unroll): the K loop body repeated, so one copy's activation loads can
        # be issued during the other's dots (with BM < 4 Triton loads x straight into the MMA
        # registers at the top of each step: the top stall in Nsight Compute; on the H200 it
        # bought nothing at T = 1, so it is the tuner's to try, not a default). Same dots, same
        # order, same bits.
        # CHAINS 2 (GemmConfig.chains): two independent MMA chains a step instead of one (sm_90 SASS
        # otherwise chains all of a step's HMMAs; W2 has twice FP4's MMAs per byte and streams
        # markedly slower than FP4). Gate/up: the gate and up dots alternate, each accumulator
        # getting the same dots in the same order (same bits). Down: even and odd slots go to two
        # accumulators, summed after the K loop (other bits than CHAINS 1: the fp32 order of the sum
        # changes).
        for i in tl.range(0, PER, loop_unroll_factor=UNROLL):
            st = ks * PER + i                              # steps past STEPS are fully masked
            u = st * BKH + hcols
            g = st * (BKH // 4) + gcols
            if EVEN_K:                                     # whole steps, as many for every split: no
                umask = tl.full([BKH], 1, tl.int1)         # unit is out of range (constant masks)
                gmask = tl.full([BKH // 4], 1, tl.int1)
            else:
                umask = u < UNITS
                gmask = g < G
            if X_CLAMP:                                    # no pair mask (umask: constant with EVEN_K)
                xm = tl.broadcast_to(umask[None, :], (BM, BKH))
            else:
                xm = pmask[:, None] & umask[None, :]
            xp = xb + u[None, :]
            # one [BM, BKH] tile per slot, contiguous along u: cp.async-able, no shuffles
            x0, x1, x2, x3, x4, x5, x6, x7 = _x_slots(xp, UNITS, xm, FMT)
            if CHAINS == 2:
                if GATE_UP:
                    acc, acc2 = _rows_dots_pair(acc, acc2, wq, sc, n, n + N, nmask, u, umask, g, gmask,
                                                x0, x1, x2, x3, x4, x5, x6, x7, st, UNITS, G, FMT, BN, BKH, USE_ASM,
                                                TILED, KW2)
                else:
                    acc, acc2 = _rows_dots_split(acc, acc2, wq, sc, n, nmask, u, umask, g, gmask,
                                                 x0, x1, x2, x3, x4, x5, x6, x7, st, UNITS, G, FMT, BN, BKH, USE_ASM,
                                                 TILED, KW2)
            else:
                acc = _rows_dots(acc, wq, sc, n, nmask, u, umask, g, gmask, x0, x1, x2, x3, x4, x5, x6, x7, st,
                                 UNITS, G, FMT, BN, BKH, USE_ASM, TILED, KW2)
                if GATE_UP:
                    acc2 = _rows_dots(acc2, wq, sc, n + N, nmask, u, umask, g, gmask, x0, x1, x2, x3, x4, x5, x6,
                                      x7, st, UNITS, G, FMT, BN, BKH, USE_ASM, TILED, KW2)
        if CHAINS == 2:
            if not GATE_UP:
                acc = acc + acc2                           # the odd slots' chain
        if FMT == 1:   # per-tensor scale_2 (gate / up / down) and the 2^8 the decode left out
            if GATE_UP:
                acc = acc * (tl.load(s2_ptr + slot64 * 2) * 256.0)
                acc2 = acc2 * (tl.load(s2_ptr + slot64 * 2 + 1) * 256.0)
            else:
                acc = acc * (tl.load(s2_ptr + slot64) * 256.0)
        omask = nmask[:, None] & pmask[None, :]
        p64 = pair.to(tl.int64)
        if GATE_UP:
            if SPLIT_K == 1:
                if HAS_BIAS:
                    acc, acc2 = _add_gate_up_bias(acc, acc2, bias_ptr, tl.load(ids_ptr + p64, mask=pmask, other=0)[None, :],
                                                  n[:, None], omask, N)
                a = _swiglu(acc, acc2, limit, HAS_LIMIT, alpha, HAS_ALPHA)
                nperm = (n % UPW) * (N // UPW) + n // UPW      # slot-major, as the down GEMM reads it
                tl.store(out_ptr + p64[None, :] * N + nperm[:, None], a.to(out_ptr.dtype.element_ty), mask=omask)
            else:
                base = out_ptr + (ks.to(tl.int64) * P + p64[None, :]) * (2 * N) + n[:, None]
                tl.store(base, acc, mask=omask)
                tl.store(base + N, acc2, mask=omask)
                if FUSED_FINISH:
                    c = cnt_ptr + b * tl.num_programs(0) + pid_n
                    if signal(c, USE_ASM) == SPLIT_K - 1:        # the tile's last split for these rows
                        tl.atomic_xchg(c, 0, sem="relaxed")
                        acquired(USE_ASM)
                        g_sum = tl.zeros([BN, BM], dtype=tl.float32)
                        u_sum = tl.zeros([BN, BM], dtype=tl.float32)
                        for s in tl.static_range(SPLIT_K):
                            row = out_ptr + (s * P + p64[None, :]) * (2 * N) + n[:, None]
                            g_sum += tl.load(row, mask=omask, other=0.0, cache_modifier=".cg")
                            u_sum += tl.load(row + N, mask=omask, other=0.0, cache_modifier=".cg")
                        if HAS_BIAS:
                            g_sum, u_sum = _add_gate_up_bias(g_sum, u_sum, bias_ptr,
                                                             tl.load(ids_ptr + p64, mask=pmask, other=0)[None, :],
                                                             n[:, None], omask, N)
                        a = _swiglu(g_sum, u_sum, limit, HAS_LIMIT, alpha, HAS_ALPHA)
                        nperm = (n % UPW) * (N // UPW) + n // UPW
                        tl.store(act_ptr + p64[None, :] * N + nperm[:, None], a.to(act_ptr.dtype.element_ty),
                                 mask=omask)
        else:
            tl.store(out_ptr + (ks.to(tl.int64) * P + p64[None, :]) * N + n[:, None], acc, mask=omask)
            if FUSED_COMBINE:
                _combine_tail(out_ptr, act_ptr, cnt_ptr, ids_ptr, table_ptr, tw_ptr, pair, pmask, n, nmask, pid_n,
                              P, N, TOPK, SPLIT_K, BM, BN, USE_ASM)


@triton.jit
def _combine_tail(y_ptr, out_ptr, cnt_ptr, ids_ptr, table_ptr, tw_ptr, pair, pmask, n, nmask, pid_n, P,
                  N: tl.constexpr, TOPK: tl.constexpr, SPLIT_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  USE_ASM: tl.constexpr):
    """FUSED_COMBINE's hand-off and sum for the BM pairs of one down program (see _moe_gemm_kernel)."""
    tok = (pair // TOPK).to(tl.int64)                     # [BM]; padding rows (pair == P) are masked
    resident = tl.zeros([BM], dtype=tl.int32)
    for j in tl.static_range(TOPK):
        sj = tl.load(table_ptr + tl.load(ids_ptr + tok * TOPK + j, mask=pmask, other=0), mask=pmask, other=-1)
        resident += (sj >= 0).to(tl.int32)
    gpu_fence(USE_ASM)                                     # this program's y rows, GPU-wide
    tl.debug_barrier()
    c = cnt_ptr + tok * tl.num_programs(0) + pid_n
    prev = tl.atomic_add(c, tl.full([BM], 1, tl.int32), mask=pmask, sem="acq_rel")
    last = pmask & (prev == resident * SPLIT_K - 1)
    if tl.max(last.to(tl.int32), 0) > 0:                   # the last arrival of some token here
        tl.atomic_xchg(c, tl.zeros([BM], dtype=tl.int32), mask=last, sem="relaxed")
        acquired(USE_ASM)
        acc = tl.zeros([BN, BM], dtype=tl.float32)
        m2 = nmask[:, None] & last[None, :]
        for j in tl.static_range(TOPK):
            pr = tok * TOPK + j
            sj = tl.load(table_ptr + tl.load(ids_ptr + pr, mask=last, other=0), mask=last, other=-1)
            w = tl.load(tw_ptr + pr, mask=last, other=0.0).to(tl.float32)
            v = tl.zeros([BN, BM], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                v += tl.load(y_ptr + (s * P + pr[None, :]) * N + n[:, None], mask=m2 & (sj >= 0)[None, :],
                             other=0.0, cache_modifier=".cg")
            acc += tl.where((sj >= 0)[None, :], v * w[None, :], 0.0)
        tl.store(out_ptr + tok[None, :] * N + n[:, None], acc.to(out_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _swiglu_finish_kernel(ws_ptr, act_ptr, ids_ptr, table_ptr, limit, P, I: tl.constexpr, UPW: tl.constexpr,
                          SPLIT_K: tl.constexpr, HAS_LIMIT: tl.constexpr, BI: tl.constexpr, PDL: tl.constexpr,
                          bias_ptr=None, alpha=1.0, HAS_BIAS: tl.constexpr = False, HAS_ALPHA: tl.constexpr = False):
    """Grid (P, cdiv(I, BI)): act[p] = swiglu(sum_s gate_s[p], sum_s up_s[p]) in split order,
    stored slot-major (element n at (n % UPW) * I / UPW + n // UPW)."""
    _pdl_enter(PDL)
    p = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    expert = tl.load(ids_ptr + p)
    slot = tl.load(table_ptr + expert)
    if slot >= 0:
        n = nb * BI + tl.arange(0, BI)
        m = n < I
        g = tl.zeros([BI], dtype=tl.float32)
        u = tl.zeros([BI], dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            row = ws_ptr + (s * P + p) * (2 * I)
            g += tl.load(row + n, mask=m, other=0.0)
            u += tl.load(row + I + n, mask=m, other=0.0)
        if HAS_BIAS:
            g, u = _add_gate_up_bias(g, u, bias_ptr, expert, n, m, I)
        a = _swiglu(g, u, limit, HAS_LIMIT, alpha, HAS_ALPHA)
        tl.store(act_ptr + p * I + (n % UPW) * (I // UPW) + n // UPW, a.to(act_ptr.dtype.element_ty), mask=m)


@triton.jit
def _combine_kernel(ws_ptr, ids_ptr, table_ptr, tw_ptr, out_ptr, P, H: tl.constexpr, TOPK: tl.constexpr,
                    SPLIT_K: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr):
    """Grid (T, cdiv(H, BH)): out[t] = sum_j w[t, j] * sum_s y_s[t k + j], j then s in fixed
    order; pairs whose expert is not resident add nothing (their rows were never written)."""
    _pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = h < H
    acc = tl.zeros([BH], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        pr = t * TOPK + j
        slot = tl.load(table_ptr + tl.load(ids_ptr + pr))
        w = tl.load(tw_ptr + pr).to(tl.float32)
        v = tl.zeros([BH], dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            v += tl.load(ws_ptr + (s * P + pr) * H + h, mask=hm & (slot >= 0), other=0.0)
        acc += tl.where(slot >= 0, v * w, 0.0)
    tl.store(out_ptr + t * H + h, acc.to(out_ptr.dtype.element_ty), mask=hm)
