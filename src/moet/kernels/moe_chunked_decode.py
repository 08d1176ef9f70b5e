"""Chunked MoE decode (MoEConfig.chunked, decode regime): gate/up + SwiGLU and the down projection
of one chunk of the intermediate dimension in the same program, so the layer's two GEMMs are one
launch with no dependency between programs.

Why: on the tiled path the down GEMM waits for the whole gate/up grid (a grid-wide dependency per
layer), starts on an empty GPU and streams its short-K weights at ~1.8 TB/s (DeepSeek-V3 W2, T = 1,
H200 run 30: gate/up 27.6 us at 2.4 TB/s, down 18.5 us at 1.8 TB/s, docs/perf.md). But the down
projection is linear in act, so it splits exactly along I: y = sum_c W_down[:, chunk c] @ act[chunk c].
The program that computes act[chunk c] (gate/up rows of chunk c over the whole K = H, then the
SwiGLU) already holds everything the chunk's down term needs, so it goes on to stream the down
weights' columns of its chunk, [H, C], and writes that term as fp32 partials y[c] [P, H]:

  program (chunk c, tile b):  act[pairs of b][chunk c] = SwiGLU(W_gate/up[rows of c] @ x)   (bf16)
                              y[c][pairs of b] = W_down[:, chunk c] @ act[pairs of b][chunk c]
  combine (moe_triton._combine_kernel, SPLIT_K = number of chunks):
                              out[t] = sum_j w[t, j] * sum_c y[c][t k + j], j then c

No counters, no waits, no atomics: each y element has one writer and the combine's order is fixed,
so reruns are bit-identical and an expert gives the same bits in any slot. The price is the
partials, NC x P x H fp32 written once and read once (DeepSeek-V3 T = 1 with 128-row chunks:
16 x 8 x 7168 x 4 B = 3.7 MB, against the 99 MB of weights), so this is for few tokens.

The chunk's act is handed from the gate/up phase to the down phase through global memory (the
program's own C x BM values, act's slot-major layout, as the tiled down GEMM reads them) behind a
CTA barrier: Triton has no explicit shared memory, and the down's activation tiles are a
different register layout than the gate/up accumulator. The down phase then runs the tiled down
GEMM's step (_rows_dots) for K = the chunk's C / UPW code units, once per block of down rows.

Config fields (MoEConfig.chunked): gate_up.BN = the chunk's rows C (a power of two, C / UPW >= 16
code units: the down step's dot K), gate_up.BKH / num_warps / num_stages / chains as on the tiled path, for the
launch and its gate/up loop; down.BN = down rows a step, down.num_stages = the down loop's stages;
down.BKH (= C / UPW here) and both SPLIT_Ks (1) are not used.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moet.kernels.moe_triton import (_combine_kernel, _pdl_enter, _rows_dots, _rows_dots_pair, _swiglu,
                                     _x_slots)


@triton.jit
def _moe_chunk_kernel(x_ptr, gq_ptr, gs_ptr, gs2_ptr, dq_ptr, ds_ptr, ds2_ptr, sorted_ptr, bslot_ptr, act_ptr,
                      y_ptr, s_x, s_gq, s_gs, s_dq, s_ds, limit, P,
                      H: tl.constexpr, I: tl.constexpr, TOPK: tl.constexpr, FMT: tl.constexpr,
                      HAS_LIMIT: tl.constexpr, USE_ASM: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr,
                      BKH: tl.constexpr, BND: tl.constexpr, DN_STAGES: tl.constexpr, TILED: tl.constexpr,
                      CHAINS: tl.constexpr, EVEN_K: tl.constexpr, EVEN_C: tl.constexpr, EVEN_H: tl.constexpr,
                      PDL: tl.constexpr):
    """Grid (cdiv(I, BC), tiles). x = hidden slot-major [T, UPW, H / UPW] (row = pair // TOPK);
    gate/up weights rows n (gate) and I + n (up) of [2I, H]; down weights [H, I]. Writes act [P, I]
    (slot-major: its own chunk's part, read back by the down phase) and y [cdiv(I, BC), P, H] fp32."""
    _pdl_enter(PDL)
    c = tl.program_id(0)
    b = tl.program_id(1)
    slot = tl.load(bslot_ptr + b)
    if slot >= 0:
        UPW: tl.constexpr = 8 if FMT == 0 else 4
        UNITS: tl.constexpr = H // UPW                     # gate/up K in 16-bit units
        G: tl.constexpr = UNITS // 4
        STEPS: tl.constexpr = (UNITS + BKH - 1) // BKH
        DUNITS: tl.constexpr = I // UPW                    # down K in units
        KU: tl.constexpr = BC // UPW                       # the chunk's down units (one down K step)
        pair = tl.load(sorted_ptr + b * BM + tl.arange(0, BM))
        pmask = pair < P
        p64 = pair.to(tl.int64)
        slot64 = slot.to(tl.int64)
        # ---- gate/up: rows n of the chunk (gate) and I + n (up), over K = H
        n = c * BC + tl.arange(0, BC)
        if EVEN_C:
            nmask = tl.full([BC], 1, tl.int1)
        else:
            nmask = n < I
        gq = gq_ptr + slot64 * s_gq
        gs = gs_ptr + slot64 * s_gs
        xb = x_ptr + (pair // TOPK).to(tl.int64)[:, None] * s_x
        hcols = tl.arange(0, BKH)
        gcols = tl.arange(0, BKH // 4)
        acc = tl.zeros([BC, BM], dtype=tl.float32)
        acc2 = tl.zeros([BC, BM], dtype=tl.float32)
        for st in tl.range(0, STEPS):
            u = st * BKH + hcols
            g = st * (BKH // 4) + gcols
            if EVEN_K:
                umask = tl.full([BKH], 1, tl.int1)
                gmask = tl.full([BKH // 4], 1, tl.int1)
            else:
                umask = u < UNITS
                gmask = g < G
            x0, x1, x2, x3, x4, x5, x6, x7 = _x_slots(xb + u[None, :], UNITS, pmask[:, None] & umask[None, :], FMT,
                                                      False, USE_ASM, "")
            if CHAINS == 2:
                acc, acc2 = _rows_dots_pair(acc, acc2, gq, gs, n, n + I, nmask, u, umask, g, gmask,
                                            x0, x1, x2, x3, x4, x5, x6, x7, st, UNITS, G, FMT, BC, BKH, USE_ASM, TILED)
            else:
                acc = _rows_dots(acc, gq, gs, n, nmask, u, umask, g, gmask, x0, x1, x2, x3, x4, x5, x6, x7, st,
                                 UNITS, G, FMT, BC, BKH, USE_ASM, TILED)
                acc2 = _rows_dots(acc2, gq, gs, n + I, nmask, u, umask, g, gmask, x0, x1, x2, x3, x4, x5, x6, x7,
                                  st, UNITS, G, FMT, BC, BKH, USE_ASM, TILED)
        if FMT == 1:   # per-tensor scale_2 (gate / up) and the 2^8 the decode left out
            acc = acc * (tl.load(gs2_ptr + slot64 * 2) * 256.0)
            acc2 = acc2 * (tl.load(gs2_ptr + slot64 * 2 + 1) * 256.0)
        a = _swiglu(acc, acc2, limit, HAS_LIMIT)
        nperm = (n % UPW) * DUNITS + n // UPW              # slot-major, as the down step reads it
        tl.store(act_ptr + p64[None, :] * I + nperm[:, None], a.to(act_ptr.dtype.element_ty),
                 mask=nmask[:, None] & pmask[None, :])
        tl.debug_barrier()                                 # the chunk's act, visible to the whole program
        # ---- down: y[c] = W_down[:, chunk c] @ act[chunk c], BND rows a step
        du = c * KU + tl.arange(0, KU)
        dg = c * (KU // 4) + tl.arange(0, KU // 4)
        if EVEN_C:
            dumask = tl.full([KU], 1, tl.int1)
            dgmask = tl.full([KU // 4], 1, tl.int1)
        else:
            dumask = du < DUNITS
            dgmask = dg < DUNITS // 4
        # ".cg": the act rows were written by this program during this launch (past L1)
        v0, v1, v2, v3, v4, v5, v6, v7 = _x_slots(act_ptr + p64[:, None] * I + du[None, :], DUNITS,
                                                  pmask[:, None] & dumask[None, :], FMT, False, USE_ASM, ".cg")
        dq = dq_ptr + slot64 * s_dq
        ds = ds_ptr + slot64 * s_ds
        if FMT == 1:
            dscale = tl.load(ds2_ptr + slot64) * 256.0
        ybase = y_ptr + (c.to(tl.int64) * P + p64[None, :]) * H
        for hb in tl.range(0, (H + BND - 1) // BND, num_stages=DN_STAGES):
            r = hb * BND + tl.arange(0, BND)
            if EVEN_H:
                rmask = tl.full([BND], 1, tl.int1)
            else:
                rmask = r < H
            accd = tl.zeros([BND, BM], dtype=tl.float32)
            accd = _rows_dots(accd, dq, ds, r, rmask, du, dumask, dg, dgmask, v0, v1, v2, v3, v4, v5, v6, v7, c,
                              DUNITS, DUNITS // 4, FMT, BND, KU, USE_ASM, TILED)
            if FMT == 1:
                accd = accd * dscale
            tl.store(ybase + r[:, None], accd, mask=rmask[:, None] & pmask[None, :])


def check_chunked(config, fmt: int, h: int, i: int) -> None:
    """ValueError where config cannot run chunked at this shape."""
    upw = 8 if fmt == 0 else 4
    c = config.gate_up.BN
    if c < 16 * upw or c & (c - 1):
        raise ValueError(f"MoEConfig.chunked needs gate_up.BN (the chunk) a power of two >= {16 * upw}: the down "
                         f"step's K is the chunk's {c} // {upw} code units, and a dot's K is at least 16; got {c}")
    if config.gate_up.SPLIT_K != 1 or config.down.SPLIT_K != 1:
        raise ValueError("MoEConfig.chunked splits the down projection by chunk: both SPLIT_Ks must be 1")


def combine_block(t: int, h: int) -> int:
    """The combine's row block: at one or two tokens the many chunk partials (NC x k rows a token)
    need enough programs to read them at bandwidth, not cdiv(H, 1024) of them."""
    bh = min(1024, triton.next_power_of_2(h))
    while bh > 128 and t * triton.cdiv(h, bh) < 264:
        bh //= 2
    return bh


def run_chunked_decode(x_perm, ops, fmt, sorted_ids, bslot, nb, ids, table, tw, t, k, h, i, limit, has_limit,
                       config, out, workspace, use_asm, tiled, op_dtype, pdl) -> None:
    """The chunk launch and the combine, after moe_triton's decode preparation (alignment, x_perm)."""
    check_chunked(config, fmt, h, i)
    gu_q, gu_s, gu_s2, dn_q, dn_s, dn_s2 = ops
    p = t * k
    cg, cd = config.gate_up, config.down
    nc = triton.cdiv(i, cg.BN)
    upw = 8 if fmt == 0 else 4
    act = workspace((p, i), op_dtype, x_perm.device)
    y = workspace((nc, p, h), torch.float32, x_perm.device)
    _moe_chunk_kernel[(nc, nb)](
        x_perm, gu_q, gu_s, gu_s2, dn_q, dn_s, dn_s2, sorted_ids, bslot, act, y, h, gu_q.stride(0),
        gu_s.stride(0), dn_q.stride(0), dn_s.stride(0), limit, p, H=h, I=i, TOPK=k, FMT=fmt, HAS_LIMIT=has_limit,
        USE_ASM=use_asm, BM=config.BM, BC=cg.BN, BKH=cg.BKH, BND=cd.BN, DN_STAGES=cd.num_stages, TILED=tiled,
        CHAINS=cg.chains, EVEN_K=(h // upw) % cg.BKH == 0, EVEN_C=i % cg.BN == 0, EVEN_H=h % cd.BN == 0,
        num_warps=cg.num_warps, num_stages=cg.num_stages, **pdl)
    bh = combine_block(t, h)
    _combine_kernel[(t, triton.cdiv(h, bh))](y, ids, table, tw, out, p, H=h, TOPK=k, SPLIT_K=nc, BH=bh,
                                             num_warps=4, **pdl)
