"""Emit PTX for the bf16-activation wgmma W2 decode GEMV on sm_90a (README "bf16-activation wgmma
kernel") and assemble it with the triton wheel's ptxas. Layouts and per-lane arithmetic:
emulate_bf16.py (numpy emulation of exactly this kernel; tests/kernels/test_ptx_w2_lab.py).

  python3 tools/kernel_lab/ptx_w2/gen_wgmma_bf16.py [--mg 1 2] [--kg 1 2] [--st 0 4] [--out DIR]

Kernel `w2_gemv_wgmma_bf16(codes, scales, x, y, N, K, T, desc)` (pointers global u64):
  codes  uint8 fb16 [N/16, K/256, 2, 32, 16]  lane's 2 x 16 B per chunk = its words for 16 wgmmas
  scales uint8 sw8  [N/16, K/256, 32, 4]       lane word: byte 2b + hr = s(row g + 8hr, group 8c + 4b + t)
  x      bf16  xw16 [K/16, 2, 8, 8]            activations (NOT quantized) in the smem order wgmma B
                                               reads (K permuted like the codes; tokens >= T zero)
  y      f32 [T, N];  desc u64: the B descriptor template (LBO / SBO / swizzle; start address 0)
Grid (N / (64 MG)), block (128 MG, KG), dynamic shared 16 K bytes (x, staged once per CTA with
cp.async) + MG KG ST 4608 (cp.async ring); warpgroup = 64 weight rows (warp w: rows 16w..16w+15),
KG warpgroups split the K/256 chunks, partials summed in kg order through shared memory.
Per thread and chunk (128 weights): codes 2 x 16 B + scales 4 B (register prefetch one chunk ahead,
ST 0, or a per-thread cp.async ring of ST stages); per block b (half chunk, 64 weights): 2 x (PRMT +
SHL) scale words S = s * 0x00800080, 4 words x 17 ops (LOP3 + IMAD per bf16 pair, slot 0: 2 LOP3 +
IMAD) into 32 A registers (double buffered over blocks), wgmma.fence, 8 x
wgmma.mma_async.m64n8k16.f32.bf16.bf16 into ONE accumulator chained over the whole K (the scale is in
the bf16 exponent: no FFMA, no fallback), commit, wait_group 1 (the decode of block b + 1 overlaps the
wgmmas of block b).
Persistent form `w2_gemv_wgmma_bf16_p` (same parameters; gen(persistent=True), config suffix `p`):
grid G <= N / (64 MG), CTA b serves row-tile groups b, b + G, ... with x staged once; the ring runs
over the flat (tile, chunk) sequence; tile ends (wait_group 0, epilogue, D = 0) out of line. Needs
(K / 256) % KG == 0; the aligned build (gen(..., aligned=True)) needs (K / 256 / KG) % ST == 0 and
tests for tile ends once per ST chunks. Shared memory: smem_bytes(k, mg, kg, st, persistent).
"""
from __future__ import annotations

import argparse
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_ptx  # noqa: E402
import gen_wgmma  # noqa: E402
from emulate_bf16 import slot_mask  # noqa: E402

KERNEL = "w2_gemv_wgmma_bf16"
KERNEL_P = "w2_gemv_wgmma_bf16_p"       # persistent form (gen(persistent=True))
RING_STAGE = 4608       # bytes per warpgroup per chunk: 128 x 32 B codes + 128 x 4 B scales
desc_template = gen_wgmma.desc_template
DESC_VARIANTS = gen_wgmma.DESC_VARIANTS


def smem_bytes(k: int, mg: int = 1, kg: int = 1, st: int = 0, persistent: bool = False) -> int:
    return 16 * k + mg * kg * st * RING_STAGE + (mg * kg * 128 * 16 if persistent and kg > 1 else 0)


def _decode_word(e, w, S, q, A):
    """17 integer ops: the 8 bf16 pairs of code word q (rows g + 8 (q >> 1), 16 k) into A registers."""
    hr, u = q >> 1, q & 1
    for p in range(8):
        dst = A[4 * (4 * u + p // 2) + hr + 2 * (p & 1)]
        if p == 0:
            e(f"    and.b32 m, {w}, 0x00010001; lop3.b32 v, {w}, 0x80008000, {S}, 0xEA; mad.lo.u32 {dst}, m, 256, v;")
        else:
            e(f"    and.b32 m, {w}, {slot_mask(p):#010x}; mad.lo.u32 {dst}, m, {1 << p}, {S};")


def _block(e, b, ls, first_pred=None):
    """Block b (half chunk) of the chunk in load set ls: scale words, decode into A{b}, fence, 8 wgmmas,
    commit, wait_group 1. first_pred: predicate for scale-d of the block's first wgmma (None: 1)."""
    A = [f"A{b}_{i}" for i in range(32)]
    for hr, S in ((0, "S0"), (1, "S1")):
        i = 2 * b + hr
        e(f"    prmt.b32 {S}, sw{ls}, 0, {i | 4 << 4 | i << 8 | 4 << 12:#06x}; shl.b32 {S}, {S}, 7;")
    for q in range(4):
        _decode_word(e, f"cw{ls}_{4 * b + q}", "S1" if q >> 1 else "S0", q, A)
    e("    wgmma.fence.sync.aligned;")
    for jj in range(8):
        J = 8 * b + jj
        sd = first_pred if (jj == 0 and first_pred) else "1"
        e(f"    add.s64 dsc, dbs, {16 * J};")
        e(f"    wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {{D0, D1, D2, D3}}, "
          f"{{{A[4 * jj]}, {A[4 * jj + 1]}, {A[4 * jj + 2]}, {A[4 * jj + 3]}}}, dsc, {sd}, 1, 1, 0;")
    e("    wgmma.commit_group.sync.aligned;")
    e("    wgmma.wait_group.sync.aligned 1;")


def _issue(e, slot, pred):
    o = slot * RING_STAGE
    e(f"    @{pred} cp.async.cg.shared.global [rb+{o}], [cp], 16;")
    e(f"    @{pred} cp.async.cg.shared.global [rb+{o + 2048}], [cp+512], 16;")
    e(f"    @{pred} cp.async.ca.shared.global [rs+{o}], [sp], 4;")
    e("    cp.async.commit_group;")


def _fetch(e, slot):
    o = slot * RING_STAGE
    e(f"    ld.shared.v4.u32 {{cw0_0, cw0_1, cw0_2, cw0_3}}, [rb+{o}];")
    e(f"    ld.shared.v4.u32 {{cw0_4, cw0_5, cw0_6, cw0_7}}, [rb+{o + 2048}];")
    e(f"    ld.shared.u32 sw0, [rs+{o}];")


def _stage_x(e, nthr):
    """The permuted bf16 x (16 K bytes) into shared memory with cp.async, all threads of the CTA."""
    e("    mov.u32 xa, xsm;")
    e("    mov.u32 tmp2, k;                              // 16-byte pieces")
    e("    mov.u32 tmp, tid;")
    e("STAGE:")
    e("    setp.lt.u32 pe, tmp, tmp2;")
    e("    @!pe bra STAGED;")
    e("    mul.wide.u32 off, tmp, 16; add.u64 a64, px, off;")
    e("    shl.b32 sel, tmp, 4; add.u32 sel, sel, xa;")
    e("    cp.async.cg.shared.global [sel], [a64], 16;")
    e(f"    add.u32 tmp, tmp, {nthr};")
    e("    bra.uni STAGE;")
    e("STAGED:")
    e("    cp.async.wait_all;")
    e("    fence.proxy.async.shared::cta;")
    e("    bar.sync 0;")


def _epilogue(e, mg, kg, part, tag=""):
    """D (after wait_group 0) -> y rows (tile 64 + 16 warp + g (+8)), tokens 2t, 2t + 1; kg > 1: partials
    through shared memory at `part` (a register holding the byte address) summed in kg order."""
    e("    mov.f32 acc0, D0; mov.f32 acc1, D1; mov.f32 acc2, D2; mov.f32 acc3, D3;")
    e("    mad.lo.u32 tmp2, tile, 64, gq; shl.b32 tmp, warp, 4; add.u32 tmp2, tmp2, tmp;   // row g")
    if kg > 1:
        e("    bar.sync 0;                                   // previous readers of the partial area done")
        e(f"    mad.lo.u32 tmp, kgi, {mg}, mgi; mad.lo.u32 tmp, tmp, 128, wt; shl.b32 tmp, tmp, 4; add.u32 tmp, tmp, {part};")
        e("    st.shared.v4.f32 [tmp], {acc0, acc1, acc2, acc3};")
        e("    bar.sync 0;")
        e("    setp.ne.u32 pe, kgi, 0;")
        e(f"    @pe bra EPI_END{tag};")
        for q in range(4):
            e(f"    mov.f32 acc{q}, 0f00000000;")
        for kk in range(kg):
            e(f"    mad.lo.u32 tmp, mgi, 128, wt; add.u32 tmp, tmp, {kk * mg * 128}; shl.b32 tmp, tmp, 4; add.u32 tmp, tmp, {part};")
            e("    ld.shared.v4.f32 {fv0, fv1, fv2, fv3}, [tmp];")
            e("    add.rn.f32 acc0, acc0, fv0; add.rn.f32 acc1, acc1, fv1; add.rn.f32 acc2, acc2, fv2; add.rn.f32 acc3, acc3, fv3;")
    for q in range(4):
        e(f"    shl.b32 tmp, tq, 1; add.u32 tmp, tmp, {q % 2}; setp.lt.u32 pt, tmp, tt;   // token")
        e(f"    @!pt bra SKIP{q}{tag};")
        e(f"    add.u32 sel, tmp2, {8 * (q // 2)}; mad.lo.u32 sel, tmp, n, sel;")
        e(f"    mul.wide.u32 off, sel, 4; add.u64 a64, py, off; st.global.f32 [a64], acc{q};")
        e(f"SKIP{q}{tag}:")
    if kg > 1:
        e(f"EPI_END{tag}:")


def _header(e, name, mg, kg, st, arch, maxnreg, nls):
    e("// generated by tools/kernel_lab/ptx_w2/gen_wgmma_bf16.py -- edit the generator")
    e(f"// {name} MG={mg} KG={kg} ST={st}")
    e(".version 8.7")
    e(f".target {arch}")
    e(".address_size 64")
    e(".extern .shared .align 1024 .b8 xsm[];")
    e("")
    e(f".visible .entry {name}(")
    e("    .param .u64 p_codes, .param .u64 p_scales, .param .u64 p_x, .param .u64 p_y,")
    e("    .param .u32 p_n, .param .u32 p_k, .param .u32 p_t, .param .u64 p_desc)")
    e(f".reqntid {128 * mg}, {kg}, 1")
    if maxnreg:
        e(f".maxnreg {maxnreg}")
    e("{")
    e("    .reg .pred pv, pl, pe, pt, pj, pz;")
    e("    .reg .b32 tid, wg, wt, warp, lane, gq, tq, mgi, kgi, blk, tile, t16, n, k, tt, nch, per, c0, c1, c;")
    e("    .reg .b32 tmp, tmp2, xa, dlo, dhi, sel, rb, rs, m, v, S0, S1;")
    e("    .reg .b32 G, nr, ntc, nloc, F, f, fc, pfc, r, part;")
    e("    .reg .b64 pc, ps, px, py, off, a64, cp, sp, dsc, dtm, dbs, dbs0, jc, js;")
    e("    .reg .f32 acc<4>, fv<4>;")
    for q in range(nls):
        e(f"    .reg .b32 cw{q}_<8>, sw{q};")
    for p in range(2):
        e(f"    .reg .b32 A{p}_<32>;")
    e("    .reg .f32 D<4>;")
    e("")
    e("    ld.param.u64 pc, [p_codes]; ld.param.u64 ps, [p_scales]; ld.param.u64 px, [p_x]; ld.param.u64 py, [p_y];")
    e("    ld.param.u32 n, [p_n]; ld.param.u32 k, [p_k]; ld.param.u32 tt, [p_t]; ld.param.u64 dtm, [p_desc];")
    e("    cvta.to.global.u64 pc, pc; cvta.to.global.u64 ps, ps; cvta.to.global.u64 px, px; cvta.to.global.u64 py, py;")
    e("    mov.u32 wg, %tid.x; mov.u32 kgi, %tid.y; shr.u32 mgi, wg, 7; and.b32 wt, wg, 127; shr.u32 warp, wt, 5;")
    e(f"    mad.lo.u32 tid, kgi, {128 * mg}, wg;")
    e("    and.b32 lane, wg, 31; shr.u32 gq, lane, 2; and.b32 tq, lane, 3;")
    e("    mov.u32 blk, %ctaid.x;")
    e("    shr.u32 nch, k, 8;")
    for q in range(4):
        e(f"    mov.f32 D{q}, 0f00000000;")


def gen(mg: int = 1, kg: int = 1, st: int = 4, arch: str = "sm_90a", maxnreg: int = 0, persistent: bool = False,
        aligned: bool = False) -> str:
    """st = 0: codes / scales loaded one chunk ahead into a second register set (ping-pong);
    st >= 2: a per-thread cp.async ring of st shared-memory stages (st - 1 chunks ahead).
    persistent (st >= 2 only; kernel KERNEL_P): grid G <= N / (64 MG) CTAs, CTA b serves the row-tile
    groups b, b + G, ... with x staged once; the ring runs over the flat (tile, chunk) sequence, so the
    next tile's first chunks are in flight while the current tile finishes; needs (K / 256) % KG == 0.
    aligned (persistent only): tile-boundary checks once per st chunks; needs (K / 256 / KG) % st == 0."""
    if persistent:
        return _gen_persistent(mg, kg, st, arch, maxnreg, aligned)
    assert st == 0 or st >= 2
    nls = 1 if st else 2
    unroll = st if st else 2
    L: list[str] = []
    e = L.append
    nthr = 128 * mg * kg
    _header(e, KERNEL, mg, kg, st, arch, maxnreg, nls)
    e(f"    mad.lo.u32 tile, blk, {mg}, mgi;")
    e("    mad.lo.u32 t16, tile, 4, warp;")
    if kg == 1:
        e("    mov.u32 c0, 0; mov.u32 c1, nch;")
    else:
        e(f"    add.u32 per, nch, {kg - 1}; div.u32 per, per, {kg};")
        e("    mul.lo.u32 c0, kgi, per; add.u32 c1, c0, per; min.u32 c1, c1, nch; min.u32 c0, c0, nch;")
    e("    mad.lo.u32 tmp, t16, nch, c0;")
    e("    mul.wide.u32 off, tmp, 1024; add.u64 cp, pc, off; mul.wide.u32 off, lane, 16; add.u64 cp, cp, off;")
    e("    mul.wide.u32 off, tmp, 128; add.u64 sp, ps, off; mul.wide.u32 off, lane, 4; add.u64 sp, sp, off;")
    if st:
        e("    mov.u32 xa, xsm; shl.b32 tmp, k, 4; add.u32 tmp, tmp, xa;")
        e(f"    mad.lo.u32 tmp2, kgi, {mg}, mgi; mad.lo.u32 tmp, tmp2, {st * RING_STAGE}, tmp;")
        e("    mad.lo.u32 rb, wt, 16, tmp;")
        e("    add.u32 rs, tmp, 4096; mad.lo.u32 rs, wt, 4, rs;")
    e("    setp.lt.u32 pl, c0, c1;")

    def loads(q, pred):
        pp = f"@{pred} " if pred else ""
        e(f"    {pp}ld.global.nc.v4.u32 {{cw{q}_0, cw{q}_1, cw{q}_2, cw{q}_3}}, [cp];")
        e(f"    {pp}ld.global.nc.v4.u32 {{cw{q}_4, cw{q}_5, cw{q}_6, cw{q}_7}}, [cp+512];")
        e(f"    {pp}ld.global.nc.u32 sw{q}, [sp];")

    def advance():
        e("    add.u64 cp, cp, 1024; add.u64 sp, sp, 128;")

    for q in range(st - 1 if st else 1):          # first chunks' loads go out before the x staging
        if q:
            e(f"    add.u32 tmp, c0, {q}; setp.lt.u32 pv, tmp, c1;")
        if st:
            _issue(e, q, "pl" if q == 0 else "pv")
        else:
            loads(q, "pl")
        advance()
    _stage_x(e, nthr)
    # descriptor: template | ((xsm + c * 4096 + J * 256) >> 4)
    e("    mov.b64 {dlo, dhi}, dtm;")
    e("    shl.b32 tmp, c0, 12; add.u32 tmp, tmp, xa; shr.u32 tmp, tmp, 4; and.b32 tmp, tmp, 0x3FFF;")
    e("    or.b32 dlo, dlo, tmp; mov.b64 dbs, {dlo, dhi};")
    e("    mov.u32 c, c0;")
    e("    @!pl bra DONE;")
    e("LOOP:")
    for u in range(unroll):
        ls = u % nls
        if st:
            e(f"    add.u32 tmp, c, {st - 1}; setp.lt.u32 pv, tmp, c1;")
            _issue(e, (u + st - 1) % st, "pv")
            advance()
            e(f"    cp.async.wait_group {st - 1};")
            _fetch(e, u % st)
        else:
            e("    add.u32 tmp, c, 1; setp.lt.u32 pv, tmp, c1;")
            loads((u + 1) % nls, "pv")
            advance()
        _block(e, 0, ls)
        _block(e, 1, ls)
        e("    add.u32 c, c, 1; add.s64 dbs, dbs, 256; setp.lt.u32 pe, c, c1;")
        if u < unroll - 1:
            e("    @!pe bra DONE;")
        else:
            e("    @pe bra LOOP;")
    e("DONE:")
    e("    wgmma.wait_group.sync.aligned 0;")
    _epilogue(e, mg, kg, "xa")                   # kg > 1: its first bar.sync = every wgmma done reading x
    e("    ret;")
    e("}")
    return "\n".join(L) + "\n"


def _gen_persistent(mg, kg, st, arch, maxnreg, aligned=False):
    """Producer (cp.async issue, st - 1 chunks ahead) and consumer walk the same flat (tile group, chunk)
    sequence; each keeps a chunk-in-tile counter and a tiles-left counter and leaves the loop body
    only through uniform out-of-line branches: PH (producer hop to the next group's first chunk) and
    TE (tile end: wait_group 0, epilogue, D = 0, next group or exit)."""
    assert st >= 2
    L: list[str] = []
    e = L.append
    nthr = 128 * mg * kg
    _header(e, KERNEL_P, mg, kg, st, arch, maxnreg, 1)
    e(f"// persistent, aligned={int(aligned)}: needs (K / 256 / KG) % {st if aligned else 1} == 0")
    e("    .reg .b32 ptl, ctl;")
    e("    .reg .pred pp;")
    e("    mov.u32 G, %nctaid.x;")
    e(f"    shr.u32 nr, n, {6 + (mg - 1).bit_length()};            // row-tile groups of 64 MG rows (MG a power of 2)")
    e("    sub.u32 ntc, nr, blk; add.u32 ntc, ntc, G; sub.u32 ntc, ntc, 1; div.u32 ntc, ntc, G;   // groups of this CTA")
    e(f"    div.u32 nloc, nch, {kg}; mul.lo.u32 c0, kgi, nloc;    // (K / 256) % KG == 0 (host checks)")
    e("    mov.u32 r, blk; mov.u32 ptl, ntc; mov.u32 ctl, ntc; setp.ne.u32 pp, ptl, 0;")
    e(f"    mad.lo.u32 tile, r, {mg}, mgi;")
    e("    mad.lo.u32 t16, tile, 4, warp;")
    e("    mad.lo.u32 tmp, t16, nch, c0;")
    e("    mul.wide.u32 off, tmp, 1024; add.u64 cp, pc, off; mul.wide.u32 off, lane, 16; add.u64 cp, cp, off;")
    e("    mul.wide.u32 off, tmp, 128; add.u64 sp, ps, off; mul.wide.u32 off, lane, 4; add.u64 sp, sp, off;")
    # hop from the end of a tile's chunk range to the start of the next group's: 4 MG G 16-row tiles on,
    # nloc chunks back
    e(f"    mul.lo.u32 tmp, G, {4 * mg}; mul.lo.u32 tmp, tmp, nch; sub.u32 tmp, tmp, nloc;")
    e("    mul.wide.u32 jc, tmp, 1024; mul.wide.u32 js, tmp, 128;")
    e("    mov.u32 xa, xsm; shl.b32 tmp, k, 4; add.u32 tmp, tmp, xa;")
    e(f"    mad.lo.u32 tmp2, kgi, {mg}, mgi; mad.lo.u32 tmp, tmp2, {st * RING_STAGE}, tmp;")
    e("    mad.lo.u32 rb, wt, 16, tmp;")
    e("    add.u32 rs, tmp, 4096; mad.lo.u32 rs, wt, 4, rs;")
    e(f"    shl.b32 part, k, 4; add.u32 part, part, xa; add.u32 part, part, {mg * kg * st * RING_STAGE};   // kg partials")
    e("    mov.u32 pfc, 0;")

    def hop_body():
        e("    add.u64 cp, cp, jc; add.u64 sp, sp, js; mov.u32 pfc, 0;")
        e("    max.u32 ptl, ptl, 1; sub.u32 ptl, ptl, 1; setp.ne.u32 pp, ptl, 0;   // saturating: the producer runs past the end")

    for q in range(st - 1):        # prologue (straight-line, predicated hop)
        _issue(e, q, "pp")
        e("    add.u64 cp, cp, 1024; add.u64 sp, sp, 128; add.u32 pfc, pfc, 1; setp.eq.u32 pj, pfc, nloc;")
        e("    @pj add.u64 cp, cp, jc; @pj add.u64 sp, sp, js; @pj mov.u32 pfc, 0; @pj max.u32 ptl, ptl, 1; @pj sub.u32 ptl, ptl, 1;")
        e("    setp.ne.u32 pp, ptl, 0;")
    _stage_x(e, nthr)
    e("    mov.b64 {dlo, dhi}, dtm;")
    e("    shl.b32 tmp, c0, 12; add.u32 tmp, tmp, xa; shr.u32 tmp, tmp, 4; and.b32 tmp, tmp, 0x3FFF;")
    e("    or.b32 dlo, dlo, tmp; mov.b64 dbs0, {dlo, dhi}; mov.b64 dbs, dbs0;")
    e("    mov.u32 fc, 0;")
    e("    setp.eq.u32 pe, ctl, 0;")
    e("    @pe bra DONE;")
    e("LOOP:")
    # aligned ((K / 256 / KG) % st == 0): a tile's chunks start at unroll slot 0, so the producer can
    # only cross a tile boundary at slot 0 and the consumer only end a tile at slot st - 1
    checks_p = [0] if aligned else list(range(st))
    checks_c = [st - 1] if aligned else list(range(st))
    for u in range(st):
        _issue(e, (u + st - 1) % st, "pp")
        e("    add.u64 cp, cp, 1024; add.u64 sp, sp, 128; add.u32 pfc, pfc, 1;")
        if u in checks_p:
            e("    setp.eq.u32 pj, pfc, nloc;")
            e(f"    @pj bra.uni PH{u};")
        e(f"PC{u}:")
        e(f"    cp.async.wait_group {st - 1};")
        _fetch(e, u % st)
        _block(e, 0, 0)
        _block(e, 1, 0)
        e("    add.u32 fc, fc, 1; add.s64 dbs, dbs, 256;")
        if u in checks_c:
            e("    setp.eq.u32 pj, fc, nloc;")
            e(f"    @pj bra.uni TE{u};")
        e(f"CONT{u}:")
    e("    bra.uni LOOP;")
    for u in sorted(set(checks_p) | set(checks_c)):             # out of line
        if u in checks_p:
            e(f"PH{u}:")
            hop_body()
            e(f"    bra.uni PC{u};")
        if u not in checks_c:
            continue
        e(f"TE{u}:")
        e("    wgmma.wait_group.sync.aligned 0;")
        _epilogue(e, mg, kg, "part", tag=f"_{u}")
        for q in range(4):
            e(f"    mov.f32 D{q}, 0f00000000;")
        e("    sub.u32 ctl, ctl, 1; setp.eq.u32 pe, ctl, 0;")
        e("    @pe bra DONE;")
        e("    add.u32 r, r, G;")
        e(f"    mad.lo.u32 tile, r, {mg}, mgi;")
        e("    mov.u32 fc, 0; mov.b64 dbs, dbs0;")
        e(f"    bra.uni CONT{u};")
    e("DONE:")
    e("    wgmma.wait_group.sync.aligned 0;")
    e("    ret;")
    e("}")
    return "\n".join(L) + "\n"


def main_loop_stats(text: str):
    """Opcode histogram of the main loop: the backward branch with the lowest target whose body holds
    an HGMMA. Out-of-line blocks that ptxas lays out inside that range (the persistent form's tile-end
    epilogues: a forward branch skipping a range that stores y, STG, and holds no HGMMA) are taken out,
    as in gen_wgmma.main_loop_stats. Returns (fast-path histogram, its length, never-executed `@!PT`
    instructions in it: padding ptxas places next to LDGSTS, counted in the length, whole range length)."""
    import collections
    ins = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
    tgt_re = re.compile(r"BRA\S*\s+(?:`\(\.L_x_\d+\)\s*)?(0x[0-9a-f]+)")
    lines = [(int(m.group(1), 16), m.group(3), ln) for ln in text.splitlines() if (m := ins.search(ln))]
    best = None
    for addr, op, ln in lines:
        if op.startswith("BRA"):
            t = tgt_re.search(ln)
            if t and int(t.group(1), 16) < addr:
                tgt = int(t.group(1), 16)
                body = [o for (a, o, _) in lines if tgt <= a <= addr]
                if any(o.startswith("HGMMA") for o in body) and (best is None or tgt < best[0] or
                                                                  (tgt == best[0] and addr < best[1])):
                    best = (tgt, addr)     # the first back edge to the loop head: a tile-end block
    if best is None:                       # laid out after it (persistent form) is not the fast path
        return collections.Counter(), 0, 0, 0
    body = [(a, o, ln) for (a, o, ln) in lines if best[0] <= a <= best[1]]
    skip = set()
    for a, o, ln in body:
        if o.startswith("BRA"):
            t = tgt_re.search(ln)
            if t and int(t.group(1), 16) > a:
                rng = [x for x in body if a < x[0] < int(t.group(1), 16)]
                if any(x[1].startswith("STG") for x in rng) and not any(x[1].startswith("HGMMA") for x in rng):
                    skip.update(x[0] for x in rng)
    fast = [(o, ln) for (a, o, ln) in body if a not in skip]
    dead = sum(1 for _, ln in fast if re.search(r"@!PT\s", ln))
    return collections.Counter(o for o, _ in fast), len(fast), dead, len(body)


DECODE_OPS = ("LOP3", "IMAD", "LEA", "SHF", "PRMT", "IADD3", "SHL")


def report(mg: int = 1, kg: int = 1, st: int = 4, out: str | None = None, arch: str = "sm_90a", maxnreg: int = 0,
           persistent: bool = False, aligned: bool = False) -> dict:
    """Assemble, disassemble, count the main loop (per weight: the loop covers `unroll` chunks of a
    warp's 16 rows x 256 k = 128 weights per thread each)."""
    ptx = gen(mg, kg, st, arch, maxnreg, persistent, aligned)
    unroll = st if st else 2
    cubin, log = gen_ptx.assemble(ptx, arch)
    s = gen_ptx.sass(cubin)
    hist, nloop, dead, nwhole = main_loop_stats(s)
    also = gen_ptx.loop_stats(s)[1]                  # aot_inspect.loop_stats: the largest backward-branch loop
    wpt = unroll * 128
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    dec = sum(v for o, v in hist.items() if o.split(".")[0] in DECODE_OPS)
    res = {"arch": arch, "mg": mg, "kg": kg, "st": st, "persistent": persistent, "aligned": aligned, "chunks_per_loop": unroll,
           "regs": int(regs.group(1)) if regs else None, "spill_stores": int(spill.group(1)) if spill else None,
           "loop_instr": nloop, "loop_instr_aot_inspect": also, "instr_per_weight": nloop / wpt,
           "never_executed_in_loop": dead, "loop_instr_with_out_of_line": nwhole, "instr_per_weight_executed": (nloop - dead) / wpt,
           "int_alu_per_weight": dec / wpt,
           "hgmma_per_weight": sum(v for o, v in hist.items() if o.startswith("HGMMA")) / wpt,
           "uniform_per_weight": sum(v for o, v in hist.items() if o.startswith("U")) / wpt,
           "loop_hist": dict(hist.most_common()),
           "ptxas_warnings": [ln for ln in log.splitlines() if "arning" in ln or "C7512" in ln or "Performance" in ln],
           "wgmma_serialized": "serialized" in log or "C7512" in log,
           "hgmma_register_a": bool(re.search(r"HGMMA\.64x8x16\.F32\.BF16\s+R\d+,\s*R\d+,\s*gdesc", s)),
           "hgmma_lines": sorted({re.sub(r"/\*[^*]*\*/|\s+", " ", ln).strip()[:110] for ln in s.splitlines()
                                  if "HGMMA" in ln})[:3]}
    if out:
        os.makedirs(out, exist_ok=True)
        tag = f"wgmma_bf16_{arch}_mg{mg}_kg{kg}_st{st}{'p' if persistent else ''}{'a' if aligned else ''}"
        open(os.path.join(out, f"{tag}.ptx"), "w").write(ptx)
        open(os.path.join(out, f"{tag}.cubin"), "wb").write(cubin)
        open(os.path.join(out, f"{tag}.sass"), "w").write(s)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mg", type=int, nargs="*", default=[1])
    ap.add_argument("--kg", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--st", type=int, nargs="*", default=[0, 4])
    ap.add_argument("--persistent", action="store_true", help="the persistent form (st >= 2)")
    ap.add_argument("--aligned", action="store_true", help="persistent form with one tile check per st chunks")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    for mg in a.mg:
        for kg in a.kg:
            for st in a.st:
                r = report(mg, kg, st, a.out, persistent=a.persistent or a.aligned, aligned=a.aligned)
                top = ", ".join(f"{k}:{v}" for k, v in list(r["loop_hist"].items())[:18])
                print(f"MG {mg} KG {kg} ST {st}{' persistent' if a.persistent or a.aligned else ''}{' aligned' if a.aligned else ''}: serialized {r['wgmma_serialized']} regs {r['regs']} spills {r['spill_stores']} "
                      f"loop {r['loop_instr']} -> {r['instr_per_weight']:.3f} thread-instr/weight (int ALU "
                      f"{r['int_alu_per_weight']:.3f}, HGMMA {r['hgmma_per_weight']:.3f}, uniform {r['uniform_per_weight']:.3f}); "
                      f"HGMMA register-A {r['hgmma_register_a']}\n    {top}\n    {r['hgmma_lines'][:1]}")
                for w in r["ptxas_warnings"]:
                    print("    ptxas:", w)


if __name__ == "__main__":
    main()
