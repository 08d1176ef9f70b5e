"""Triton grouped MoE over W2 and FP4 expert pools: moe_experts_w2_triton and
moe_experts_fp4_triton, with moe_experts_reference's signature and semantics
(moet.kernels.reference). Importing this module needs triton.

Pipeline (decode: 4 launches, 5 with split-K on gate/up; no host synchronisation, no atomics;
CUDA-graph capturable in both regimes):
  1. slot alignment: the (token, expert) pairs grouped by pool SLOT (through the slot table)
     into tiles of BM pairs, one slot per tile, each resident slot's pairs in as few tiles as
     possible, so each active expert's bytes are read once per tile. Misses (slot -1) are
     dropped and counted into the device miss counter. Up to SMALL_ALIGN_MAX_PAIRS pairs
     (decode) this is one Triton program of _prep_small_kernel, whose other programs copy the
     hidden states into the slot-major order below; above it the sort-based
     moe_align_block_size and a torch copy (prefill).
  2. gate/up: per (row block of I, tile, K split): gate rows n and up rows I + n of the tile's
     slot against the tile's token rows; without split-K the SwiGLU (clamp in fp32 where
     given) runs in the epilogue and writes act [P, I]; with split-K the fp32 partials go to a
     workspace and
  2b. _swiglu_finish_kernel sums them in split order and writes act.
  3. down: per (row block of H, tile, K split): fp32 partials y_s [P, H].
  4. _combine_kernel: out[t] = sum_j w[t, j] * sum_s y_s[t * k + j] in the fixed order
     j = 0..k-1, s = 0..SPLIT_K-1; pairs of non-resident experts are skipped (zero).
Every output element has one writer and a fixed summation order: reruns are bit-identical,
and an expert gives the same bits whichever slot holds it.
One-launch decode (MoEConfig.fused, up to FUSED_MAX_PAIRS pairs): moet.kernels.moe_fused_decode,
a persistent kernel whose gate/up and down items wait on each other through counters.
Token-major decode (MoEConfig.token_major, table-driven, up to TOKEN_MAJOR_MAX_PAIRS pairs;
moet.kernels.moe_token_major): 2 launches, no alignment and no hidden-state copy: _tm_gate_up_kernel (row block, pair) reads its
token's hidden row in natural order and writes act with the SwiGLU epilogue; _tm_down_kernel
(row block, token) runs the token's k down projections in order j and sums them with the router
weights (the combine), writing out directly. An expert shared by two pairs is read twice, which
is why it is for one or two tokens only.

The weight tile is the MMA's A operand, decoded in registers (the device functions of
moet.kernels.moe_tiles); the activation rows (padded to
BM, masked rows read nothing) are the B operand. Codes are read as 16-bit units (8 W2 / 4 FP4
weights); the K order inside a unit is split into slot tensors (slot p = weight UPW * u + p),
one tl.dot per slot. The activations are kept slot-major per row (hidden is copied so once per
call, [T, UPW, H / UPW]; the gate/up epilogue writes act so), so each slot's tile is one
contiguous, cp.async-pipelined load. (Splitting a natural-order tile in registers instead
costs 16-bit shared-memory stores and a fence before every wgmma, and was slower on the H200.)
  W2 (pool layout "nb8", moet.formats.w2.to_nb8): one LOP3 + one IMAD per two bf16 weights,
     the UE8M0 scale folded into the exponent (NB8_ASM; docs/kernels.md, W2 decode). Exact
     for scale bytes 1..252 (the range any bf16/fp32 source produces); byte 0 decodes the +-1
     level as +-0 instead of +-2^-127.
  FP4 (NVFP4 bytes as in the checkpoint): per bf16 pair the e2m1 bits are placed under a bf16
     exponent bias of 2^-126 (shift + mask) and multiplied (fma.rn.bf16x2) by the group's e4m3
     scale times 2^118, which is exact (<= 6 significant bits); the remaining 2^8 and the
     per-tensor scale_2 multiply the fp32 accumulator.
Operands are bf16 with fp32 accumulation on the GPU: the weights are exact in bf16, the
activations of gate/up are the bf16 hidden states, and the SwiGLU output is rounded to bf16
before the down projection (as vLLM's fused_moe does), so against the fp32 reference
||out - ref|| / ||ref|| is a few 1e-3 on the H200 at real shapes, asserted <= 1e-2. (An fp32
hidden input is rounded to bf16 as well.) An e4m3 NaN scale byte (0x7F)
decodes as 480 below sm_89 and as NaN from sm_89 on (NVFP4 encoders never write it).
Under TRITON_INTERPRET=1 (CPU tests) the inline asm cannot run: the same bits are built with
plain Triton integer ops in fp32, dots are fp32 "ieee" and act stays fp32 (bound 1e-5).
Launch configurations: moet.kernels.moe_configs (table in the repo, tuning script
moet.bench.moe_kernel_tune). Measured speed and its limits: docs/perf.md.
"""
from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch
import triton
import triton.language as tl

from moet.errors import ConfigError
from moet.kernels.launch_tables import device_name as _device_name
from moet.kernels.moe_align import moe_align_block_size
from moet.kernels.moe_configs import (FUSED_MAX_PAIRS, SMALL_ALIGN_MAX_PAIRS, TOKEN_MAJOR_MAX_PAIRS, MoEConfig,
                                      lookup)
from moet.kernels.grid_sync import COUNTERS, acquired, device_counters, gpu_fence, signal
from moet.kernels.moe_fused_decode import run_fused_decode
from moet.kernels.moe_tiles import _prefetch_slab, _rows_dots, _rows_dots_pair, _rows_dots_split, _swiglu, _x_slots
from moet.kernels.moe_token_major import _tm_down_kernel, _tm_gate_up_kernel
from moet.kernels.pdl import pdl_enter as _pdl_enter  # programmatic dependent launch (sm_90+)
from moet.kernels.pools import FP4Pool, W2Pool

FMT_W2 = 0
FMT_FP4 = 1
# prefill workspaces (fp32 partial outputs [SPLIT_K, P, H]) are capped by chunking the tokens
MAX_WORKSPACE_BYTES = 1 << 30


# ===================================================================================== kernels

@triton.jit
def _moe_gemm_kernel(x_ptr, wq_ptr, sc_ptr, s2_ptr, sorted_ptr, bslot_ptr, out_ptr, act_ptr, cnt_ptr,
                     ids_ptr, table_ptr, tw_ptr, s_x, s_wq_slot, s_sc_slot, limit, P,
                     N: tl.constexpr, K: tl.constexpr, TOPK: tl.constexpr, GATE_UP: tl.constexpr,
                     FMT: tl.constexpr, SPLIT_K: tl.constexpr, HAS_LIMIT: tl.constexpr, USE_ASM: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BKH: tl.constexpr, FUSED_FINISH: tl.constexpr,
                     FUSED_COMBINE: tl.constexpr, PDL: tl.constexpr, UNROLL: tl.constexpr = 1,
                     TILED: tl.constexpr = False, CHAINS: tl.constexpr = 1, PREFETCH: tl.constexpr = 0,
                     EVEN_K: tl.constexpr = False, EVEN_N: tl.constexpr = False, X_CLAMP: tl.constexpr = False,
                     PREFETCH_STEPS: tl.constexpr = 0, KW2: tl.constexpr = False):
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
    (_scale_values)."""
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
            x0, x1, x2, x3, x4, x5, x6, x7 = _x_slots(xp, UNITS, xm, FMT, False, USE_ASM, "")
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
                a = _swiglu(acc, acc2, limit, HAS_LIMIT)
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
                        a = _swiglu(g_sum, u_sum, limit, HAS_LIMIT)
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
                          SPLIT_K: tl.constexpr, HAS_LIMIT: tl.constexpr, BI: tl.constexpr, PDL: tl.constexpr):
    """Grid (P, cdiv(I, BI)): act[p] = swiglu(sum_s gate_s[p], sum_s up_s[p]) in split order,
    stored slot-major (element n at (n % UPW) * I / UPW + n // UPW)."""
    _pdl_enter(PDL)
    p = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    slot = tl.load(table_ptr + tl.load(ids_ptr + p))
    if slot >= 0:
        n = nb * BI + tl.arange(0, BI)
        m = n < I
        g = tl.zeros([BI], dtype=tl.float32)
        u = tl.zeros([BI], dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            row = ws_ptr + (s * P + p) * (2 * I)
            g += tl.load(row + n, mask=m, other=0.0)
            u += tl.load(row + I + n, mask=m, other=0.0)
        a = _swiglu(g, u, limit, HAS_LIMIT)
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


# ====================================================================================== driver

def asm_level(device: torch.device) -> int:
    """The kernels' USE_ASM constexpr: 0 under the interpreter (plain-Triton decoders, fp32 dots),
    1 on a GPU (inline-asm decoders, bf16 dots), 2 on a GPU that also converts e4m3 natively
    (sm_89+: the FP4 scales through Triton's float8e4nv)."""
    if device.type != "cuda":
        return 0
    return _cuda_asm_level(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_asm_level(index: int) -> int:          # once per device: every MoE layer call asks
    return 2 if torch.cuda.get_device_capability(index) >= (8, 9) else 1


def _workspace(shape, dtype, device) -> torch.Tensor:
    """Every buffer the kernels write (tests replace this to poison them)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _format(pool) -> tuple[int, str]:
    if isinstance(pool, W2Pool):
        if pool.layout not in ("nb8", "nb8t"):
            raise ValueError(f"the W2 Triton kernels read the nb8 (or row-tiled nb8t) code layout, this pool is "
                             f"{pool.layout!r}: convert its codes with moet.formats.w2.to_nb8 (moet.quant.requantize "
                             "does at fill time)")
        return FMT_W2, "w2"
    if isinstance(pool, FP4Pool):
        if pool.layout not in ("nvfp4", "nvfp4t"):
            raise ValueError(f"the FP4 Triton kernels read the nvfp4 (or row-tiled nvfp4t) layout, this pool is "
                             f"{pool.layout!r}")
        return FMT_FP4, "fp4"
    raise TypeError(f"the Triton MoE kernels take a W2Pool or an FP4Pool, got {type(pool).__name__}")


def _operands(pool, fmt: int):
    """(gate_up units int16 [S, 2I, K/UPW], gate_up scales uint8, gate_up scale_2 fp32,
    down units, down scales, down scale_2) in the kernels' views."""
    if fmt == FMT_W2:
        gu_q, gu_s, dn_q, dn_s = pool.gate_up_codes, pool.gate_up_scales, pool.down_codes, pool.down_scales
        gu_s2 = dn_s2 = gu_s                 # unused by the W2 path; any pointer
    else:
        gu_q, gu_s, dn_q, dn_s = pool.gate_up_weight, pool.gate_up_scale, pool.down_weight, pool.down_scale
        gu_s, dn_s = gu_s.view(torch.uint8), dn_s.view(torch.uint8)
        gu_s2, dn_s2 = pool.gate_up_scale_2.float().contiguous(), pool.down_scale_2.float().contiguous()
    for t in (gu_q, gu_s, dn_q, dn_s):
        if not t.is_contiguous():
            raise ValueError("the expert pool tensors must be contiguous")
    return gu_q.view(torch.int16), gu_s, gu_s2, dn_q.view(torch.int16), dn_s, dn_s2


def _check_shapes(hidden: torch.Tensor, fmt: int, ops) -> tuple[int, int]:
    gu_q, gu_s, _, dn_q, dn_s, _ = ops
    h = hidden.shape[1]
    upw, gs = (8, 32) if fmt == FMT_W2 else (4, 16)
    two_i = gu_q.shape[1]
    i = two_i // 2
    if (two_i % 2 or h % gs or i % gs or gu_q.shape[2] * upw != h or gu_s.shape[1:] != (two_i, h // gs)
            or dn_q.shape[1:] != (h, i // upw) or dn_s.shape[1:] != (h, i // gs)):
        raise ValueError(f"expert pool shapes {tuple(gu_q.shape)}, {tuple(dn_q.shape)} (16-bit units) do not fit "
                         f"hidden size {h}")
    return h, i


FINISH_COUNTERS = COUNTERS                 # (tile | token, row block) pairs of one fused-finish / -combine launch


def _finish_counters(device: torch.device) -> torch.Tensor:
    """The fused finish's and fused combine's counters (grid_sync.device_counters)."""
    return device_counters("moe_triton", device)


def fit_token_tile(config: MoEConfig, pairs: int, num_slots: int) -> MoEConfig:
    """A table config tuned at fewer pairs than this call (the nearest bucket is smaller) can carry
    a token tile far below the pairs each expert now gets: BM 1 at 4 pairs per expert reads every
    expert's weights 4 times. Raise BM to the mean pairs per active slot (power of two, <= 16) when
    the tile is below half of it; never lower a tuned tile. The active slots are the expected
    number of distinct experts among `pairs` uniform draws (GLM-4.5-Air at 32 streams: 256 pairs
    hit ~111 of 128 experts, 2.3 each; counting all 128 slots said 2 and kept BM 1)."""
    if pairs > SMALL_ALIGN_MAX_PAIRS:
        return config
    slots = max(1, num_slots)
    active = max(1.0, min(pairs, slots * (1.0 - (1.0 - 1.0 / slots) ** pairs)))
    mean = pairs / active
    if config.BM >= mean / 2:
        return config
    return replace(config, BM=min(16, 1 << int(math.log2(mean))))


def _align_launch(pp: int) -> dict:
    """Compare-chunk width and warps of the one-program slot alignment: its [PP, QB] compare
    tiles live in registers, and at PP 512 with QB 32 on 4 warps (128 values a thread a tile)
    they spilled and the call took over ten times as long as at PP 256 (H200), so the chunk shrinks
    as PP grows and the program gets 8 warps from PP 256."""
    return dict(QB=max(1, min(pp, 32, 2048 // pp)), num_warps=8 if pp >= 256 else 4)


def _run(hidden, topk_ids, topk_weights, slot_table, pool, miss_counter, swiglu_limit,
         config: MoEConfig | None, out: torch.Tensor) -> None:
    fmt, fname = _format(pool)
    ops = _operands(pool, fmt)
    h, i = _check_shapes(hidden, fmt, ops)
    # row-tiled pools (nb8t, nvfp4t: moet.formats.row_tiles): the tiled GEMM path only; 64-row x
    # 256-weight tiles
    tiled = pool.layout in ("nb8t", "nvfp4t")
    if tiled and (h % 256 or i % 256):
        raise ValueError(f"a row-tiled ({pool.layout}) pool needs hidden and intermediate sizes that are multiples of "
                         f"256, got {h} and {i}")
    gu_q, gu_s, gu_s2, dn_q, dn_s, dn_s2 = ops
    t, k = topk_ids.shape
    p = t * k
    dev = hidden.device
    use_asm = asm_level(dev)
    if config is None:
        config = fit_token_tile(lookup(fname, h, i, p, _device_name(dev)), p, gu_q.shape[0])
        if tiled:                # the fused / token-major kernels read row-major pools only
            config = replace(config, fused=False, token_major=False)
    # programmatic dependent launch (config.pdl, table-driven): every kernel of the layer starts
    # with griddepcontrol.wait, so the next launch overlaps the kernel before
    pdl = dict(PDL=bool(use_asm) and config.pdl, **({"launch_pdl": config.pdl} if use_asm else {}))
    bm, cg, cd = config.BM, config.gate_up, config.down
    ids = topk_ids.reshape(-1).contiguous()
    table = slot_table.contiguous()
    num_slots = gu_q.shape[0]
    # operands: bf16 on the GPU (tensor cores), fp32 under the interpreter. The activations are
    # stored slot-major per row ([UPW, K / UPW]: element UPW * u + q at q * K / UPW + u), so each
    # slot's K tile is one contiguous load; the gate/up epilogue writes act in that order.
    op_dtype = torch.bfloat16 if use_asm else torch.float32
    upw = 8 if fmt == FMT_W2 else 4
    limit = float(swiglu_limit) if swiglu_limit is not None else 0.0
    has_limit = swiglu_limit is not None
    tw = topk_weights.reshape(-1).contiguous()
    if tiled and ((config.fused and p <= FUSED_MAX_PAIRS) or (config.token_major and p <= TOKEN_MAJOR_MAX_PAIRS)):
        raise ConfigError(f"MoEConfig.fused / token_major read row-major pools; a row-tiled ({pool.layout}) pool "
                          "takes the tiled GEMM path (a config with fused=False, token_major=False)")
    if config.fused and p <= FUSED_MAX_PAIRS:       # one persistent launch (moe_fused_decode)
        run_fused_decode(hidden, ids, table, tw, ops, fmt, t, k, h, i, limit, has_limit, config, miss_counter, out,
                         _workspace, use_asm, pdl)
        return
    if config.token_major and p <= TOKEN_MAJOR_MAX_PAIRS:
        act = _workspace((p, i), op_dtype, dev)
        _tm_gate_up_kernel[(triton.cdiv(i, cg.BN), p)](
            hidden, ids, table, gu_q, gu_s, gu_s2, act, miss_counter, hidden.stride(0), gu_q.stride(0),
            gu_s.stride(0), limit, N=i, K=h, TOPK=k, FMT=fmt, HAS_LIMIT=has_limit, USE_ASM=use_asm,
            BN=cg.BN, BKH=cg.BKH, num_warps=cg.num_warps, num_stages=cg.num_stages, **pdl)
        _tm_down_kernel[(triton.cdiv(h, cd.BN), t)](
            act, ids, table, tw, dn_q, dn_s, dn_s2, out, dn_q.stride(0), dn_s.stride(0), out.stride(0),
            N=h, K=i, TOPK=k, FMT=fmt, USE_ASM=use_asm, BN=cd.BN, BKH=cd.BKH,
            num_warps=cd.num_warps, num_stages=cd.num_stages, **pdl)
        return
    x_perm = _workspace((t, upw, h // upw), op_dtype, dev)
    # the top-k combine in the down GEMM's last programs (MoEConfig.fused_combine): one launch fewer;
    # decode regime only (the prep kernel zeroes the rows of tokens no pair writes)
    fuse_combine = (config.fused_combine and p <= SMALL_ALIGN_MAX_PAIRS
                    and t * triton.cdiv(h, cd.BN) <= FINISH_COUNTERS)
    if p <= SMALL_ALIGN_MAX_PAIRS:
        nb = min(p, p // bm + min(p, num_slots))
        pp = triton.next_power_of_2(p)
        sorted_ids = _workspace((nb * bm,), torch.int32, dev)
        bslot = _workspace((nb,), torch.int32, dev)
        nblk = _workspace((pp,), torch.int32, dev)
        bh = min(2048, triton.next_power_of_2(h))
        _prep_small_kernel[(1 + t * triton.cdiv(h, bh),)](
            ids, table, sorted_ids, bslot, nblk, miss_counter, p, nb, hidden, x_perm, hidden.stride(0), out,
            H=h, UPW=upw, BH=bh, BM=bm, PP=pp, FILL=1024, ZERO_OUT=fuse_combine, **_align_launch(pp), **pdl)
    else:
        aligned = moe_align_block_size(topk_ids, slot_table, num_slots, bm)
        sorted_ids, bslot, nb = aligned.sorted_ids, aligned.block_slot, aligned.num_blocks
        miss_counter += aligned.num_misses.to(miss_counter.dtype)
        x_perm.copy_(hidden.view(t, h // upw, upw).transpose(1, 2))
    act = _workspace((p, i), op_dtype, dev)
    common = dict(TOPK=k, FMT=fmt, HAS_LIMIT=has_limit, USE_ASM=use_asm, BM=bm)
    if cg.SPLIT_K == 1:
        gu_out = act
    else:
        gu_out = _workspace((cg.SPLIT_K, p, 2 * i), torch.float32, dev)
    # the SwiGLU finish of a split gate/up in its last programs (MoEConfig.fused_finish): one launch less
    fuse_finish = config.fused_finish and cg.SPLIT_K > 1 and nb * triton.cdiv(i, cg.BN) <= FINISH_COUNTERS
    cnt = _finish_counters(dev) if fuse_finish else gu_out          # any pointer when not fused
    _moe_gemm_kernel[(triton.cdiv(i, cg.BN), nb, cg.SPLIT_K)](
        x_perm, gu_q, gu_s, gu_s2, sorted_ids, bslot, gu_out, act, cnt, ids, table, tw, h, gu_q.stride(0),
        gu_s.stride(0), limit, p, N=i, K=h, GATE_UP=True, SPLIT_K=cg.SPLIT_K, BN=cg.BN, BKH=cg.BKH,
        FUSED_FINISH=fuse_finish, FUSED_COMBINE=False, UNROLL=cg.unroll, TILED=tiled, CHAINS=cg.chains,
        KW2=cg.kwidth2, **_even_tiles(i, h, fmt, cg, bm), num_warps=cg.num_warps,
        num_stages=cg.num_stages,
        **common, **pdl)
    if cg.SPLIT_K > 1 and not fuse_finish:
        bi = min(1024, triton.next_power_of_2(i))
        _swiglu_finish_kernel[(p, triton.cdiv(i, bi))](gu_out, act, ids, table, limit, p, I=i, UPW=upw,
                                                         SPLIT_K=cg.SPLIT_K,
                                                         HAS_LIMIT=has_limit, BI=bi, num_warps=4, **pdl)
    y = _workspace((cd.SPLIT_K, p, h), torch.float32, dev)
    # the counters are shared with the fused finish: each launch leaves them zero, and the down
    # launch starts after the gate/up one has finished (stream order; under PDL its griddepcontrol.wait)
    cnt = _finish_counters(dev) if fuse_combine else y
    _moe_gemm_kernel[(triton.cdiv(h, cd.BN), nb, cd.SPLIT_K)](
        act, dn_q, dn_s, dn_s2, sorted_ids, bslot, y, out, cnt, ids, table, tw, act.stride(0), dn_q.stride(0),
        dn_s.stride(0), limit, p, N=h, K=i, GATE_UP=False, SPLIT_K=cd.SPLIT_K, BN=cd.BN, BKH=cd.BKH,
        FUSED_FINISH=False, FUSED_COMBINE=fuse_combine, UNROLL=cd.unroll, TILED=tiled, CHAINS=cd.chains,
        KW2=cd.kwidth2, **_even_tiles(h, i, fmt, cd, bm), num_warps=cd.num_warps,
        num_stages=cd.num_stages, PREFETCH=prefetch_points(config, fmt, i, tiled) if pdl["PDL"] else 0,
        PREFETCH_STEPS=config.down_prefetch_steps,
        **common, **pdl)
    if not fuse_combine:
        bh = min(1024, triton.next_power_of_2(h))
        _combine_kernel[(t, triton.cdiv(h, bh))](y, ids, table, tw, out, p, H=h, TOPK=k, SPLIT_K=cd.SPLIT_K,
                                                 BH=bh, num_warps=4, **pdl)


# Tiles that divide their GEMM exactly run with constant (all-true) K / row masks, so the loads lose
# their predicates and selects (moe_triton EVEN_K / EVEN_N; the same values are loaded, the same
# bits). A switch for A/B timing (moe_kernel_tune --masked-tiles), not a user setting.
UNMASK_EVEN_TILES = True
# On such tiles with at most X_CLAMP_MAX_BM pairs the x loads lose their pair mask too (X_CLAMP:
# padding rows read a real row whose product column is dropped): the same bits. Only below BM 4,
# where x goes straight to registers: from BM 4 on it is staged by cp.async, which zero-fills a
# masked row without reading it, so a clamped row costs a real read (on the H200 clamping was
# slower at BM 8 and a little faster at BM 1, DeepSeek-V3 W2, T = 1). A/B switch (moe_kernel_tune
# --masked-x), not a setting.
CLAMP_X_ROWS = True
X_CLAMP_MAX_BM = 2


def _even_tiles(n: int, k: int, fmt: int, c, bm: int) -> dict:
    """EVEN_K / EVEN_N / X_CLAMP for a GEMM of N rows (each half, for gate/up) over K weights with
    launch c and bm pairs a tile."""
    if not UNMASK_EVEN_TILES:
        return {}
    units = k // (8 if fmt == FMT_W2 else 4)
    even_k = units % c.BKH == 0 and triton.cdiv(units, c.BKH) % c.SPLIT_K == 0
    return dict(EVEN_K=even_k, EVEN_N=n % c.BN == 0, X_CLAMP=even_k and CLAMP_X_ROWS and bm <= X_CLAMP_MAX_BM)


def prefetch_points(config: MoEConfig, fmt: int, k: int, tiled: bool) -> int:
    """The down GEMM's L2 prefetch points per row (_prefetch_slab; 0 = none): MoEConfig.down_prefetch
    over a K of k weights split as config.down says."""
    if not config.down_prefetch:
        return 0
    c = config.down
    units = k // (8 if fmt == FMT_W2 else 4)
    per = triton.cdiv(triton.cdiv(units, c.BKH), c.SPLIT_K)
    if config.down_prefetch_steps:
        per = min(per, config.down_prefetch_steps)
    pstep = (32 if fmt == FMT_W2 else 64) if tiled else 64
    return triton.next_power_of_2(triton.cdiv(per * c.BKH, pstep))


def moe_experts_triton(
    hidden: torch.Tensor,            # [T, H]
    topk_ids: torch.Tensor,          # [T, k] int, expert ids
    topk_weights: torch.Tensor,      # [T, k] float, router weights (already scaled)
    slot_table: torch.Tensor,        # int32 [num_experts], -1 = not resident
    pool: W2Pool | FP4Pool,
    miss_counter: torch.Tensor,      # int [1], incremented by the number of missed pairs
    *,
    swiglu_limit: float | None = None,
    config: MoEConfig | None = None,
) -> torch.Tensor:
    """moe_experts_reference for a W2Pool (layout nb8) or an FP4Pool, on the GPU (or the Triton
    interpreter). Long prefills run in token chunks that keep the fp32 workspace <= 1 GiB."""
    _format(pool)
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    t, k = topk_ids.shape
    out = _workspace(hidden.shape, hidden.dtype, hidden.device)
    if t == 0:
        return out
    if k == 0:
        return out.zero_()
    h = hidden.shape[1]
    split = config.down.SPLIT_K if config is not None else 1
    chunk = max(SMALL_ALIGN_MAX_PAIRS // k + 1, MAX_WORKSPACE_BYTES // (k * h * 4 * split))
    for t0 in range(0, t, chunk):
        t1 = min(t, t0 + chunk)
        _run(hidden[t0:t1], topk_ids[t0:t1], topk_weights[t0:t1], slot_table, pool, miss_counter,
             swiglu_limit, config, out[t0:t1])
    return out


def moe_experts_w2_triton(hidden, topk_ids, topk_weights, slot_table, pool: W2Pool, miss_counter, *,
                          swiglu_limit: float | None = None, config: MoEConfig | None = None) -> torch.Tensor:
    """As moe_experts_reference for a W2Pool in the nb8 layout."""
    if not isinstance(pool, W2Pool):
        raise TypeError(f"moe_experts_w2_triton needs a W2Pool, got {type(pool).__name__}")
    return moe_experts_triton(hidden, topk_ids, topk_weights, slot_table, pool, miss_counter,
                              swiglu_limit=swiglu_limit, config=config)


def moe_experts_fp4_triton(hidden, topk_ids, topk_weights, slot_table, pool: FP4Pool, miss_counter, *,
                           swiglu_limit: float | None = None, config: MoEConfig | None = None) -> torch.Tensor:
    """As moe_experts_reference for an FP4Pool (NVFP4 bytes)."""
    if not isinstance(pool, FP4Pool):
        raise TypeError(f"moe_experts_fp4_triton needs an FP4Pool, got {type(pool).__name__}")
    return moe_experts_triton(hidden, topk_ids, topk_weights, slot_table, pool, miss_counter,
                              swiglu_limit=swiglu_limit, config=config)
