"""Emit PTX for the wgmma (register-A, e4m3) W2 decode GEMV on sm_90a and assemble it with the triton
wheel's ptxas (README "wgmma kernel"). Layouts and per-lane arithmetic: emulate_next.py (the numpy
emulation of exactly this kernel; tests/kernels/test_ptx_w2_lab.py).

  python3 tools/kernel_lab/ptx_w2/gen_wgmma.py [--mg 1 2] [--kg 1 2] [--out DIR]

Kernel `w2_gemv_wgmma(codes, scales, aux, x, x_scale, y, N, K, T, desc)` (pointers global u64):
  codes   uint8 fa8i [N/16, K/256, 2, 32, 16]   lane's 2 x 16 B per chunk = its A words for 8 wgmmas
  scales  uint8 sw8  [N/16, K/256, 32, 4]        lane word: byte 2b + h = s(row g + 8h, group 8c + 4b + t)
  aux     uint8 ref  [N/64, K/256, 64]           byte 16w + 2g + h = ref(row 16w + g + 8h) (>= 1); all 0 =
                                                 the (64-row tile, chunk) takes the exact fallback
  x       uint8 xw8  [K/32, 2, 8, 16]            e4m3 activations in the smem order wgmma B reads
                                                 (K permuted like the codes; tokens >= T zero)
  x_scale f32 [T];  y f32 [T, N];  desc u64: the B descriptor template (LBO / SBO / swizzle bits,
                                                 start address 0; the kernel adds the smem address)
Grid (N / (64 MG)), block (128 MG, KG), dynamic shared 8 K bytes (the whole permuted x tile, staged
once per CTA; >= 48 KB needs the MAX_DYNAMIC_SHARED_SIZE attribute). Warpgroup wg: mg = wg % MG owns
64 rows (wgmma M; warp w = rows 16w..16w+15), kg = wg / MG a contiguous range of the K/256 chunks
(split-K inside the CTA, partials summed in kg order through shared memory: deterministic).
Per thread and chunk (128 weights): 2 LDG.128 codes + 1 LDG.32 scales + 1 LDG.U16 aux, one chunk
ahead (ping-pong register sets); fast path: 2 PRMT + 2 IMAD (base LUT per row), 4 PRMT + 4 IMAD
(LUT word per row and group: LUT - 8 ref + 8 s, bytes replicated), 8 x (5 int + 4 PRMT) decode into
32 A registers (double buffered), wgmma.fence, 8 wgmma m64n8k32 chained in D (first scale-d = 0),
commit; wait_group 1; 4 FFMA acc += D(c-1) * 2^(ref - 127). Flagged chunk (aux 0): the same fast
path with LUT 0 (D = 0, f = 0), then after the FFMA an out-of-line block: per block b, group slot t'
and MMA m, a plain-LUT decode on lanes t == t' (LUT 0 = +0 bytes elsewhere), mma.sync m16n8k32 with
B read from the staged x tile, chained over m from 0, then 4 FFMA by the group's 2^(s - 127) (s from
lane 4g + t' by shfl).
"""
from __future__ import annotations

import argparse
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_ptx  # noqa: E402
from layout import LUT  # noqa: E402

KERNEL = "w2_gemv_wgmma"
WG_ROWS = 64


def desc_template(lbo: int, sbo: int, swizzle: int = 0) -> int:
    """wgmma shared-memory matrix descriptor without the start address: bits 16-29 LBO >> 4,
    32-45 SBO >> 4, 49-51 base offset 0, 62-63 swizzle mode (0 = none)."""
    assert lbo % 16 == 0 and sbo % 16 == 0
    return ((lbo >> 4) & 0x3FFF) << 16 | ((sbo >> 4) & 0x3FFF) << 32 | (swizzle & 3) << 62


# Plausible readings of the no-swizzle K-major descriptor for our B tile (per wgmma 2 core matrices
# of 8 tokens x 16 B along K, 128 B apart; N = 8 has one core matrix along N). The device script tries
# them on a tiny shape and keeps the first that matches the reference.
DESC_VARIANTS = {
    "lbo128_sbo256": (128, 256),     # PTX ISA reading: LBO = K-direction step, SBO = M/N step
    "lbo256_sbo128": (256, 128),     # swapped reading
    "lbo128_sbo128": (128, 128),     # either reading (SBO unused when N = 8)
}


RING_STAGE = 5120   # bytes per warpgroup per chunk in the cp.async ring: 128 x 32 B codes, 128 x 4 scales, 128 x 4 aux


def unroll_of(pf: int = 1, st: int = 0) -> int:
    import math
    n = st if st else pf + 1
    return n * 2 // math.gcd(n, 2)


def gen_wgmma(mg: int = 1, kg: int = 1, fallback: bool = True, arch: str = "sm_90a", pf: int = 1, st: int = 0,
              maxnreg: int = 0, moe: bool = False) -> str:
    """pf: (st = 0) how many chunks ahead the code / scale / aux loads run, in pf + 1 register sets.
    st >= 3: instead a ring of st shared-memory stages per warpgroup filled with cp.async (each thread
    copies and later reads back only its own 40 bytes per chunk: no barriers), st - 1 chunks ahead,
    one register set; more bytes in flight per SM without registers.
    fallback: emit the exact fallback for flagged chunks (always, for real use; False only to compare
    the SASS of the fast path).
    moe: the grouped (MoE) form `moe_gemv_wgmma` (gen_moe_wgmma.py docstring): grid (N / (64 MG), P);
    program (r, p) serves the run of <= 8 pairs of expert ids[p] that pair p starts (others exit),
    weights at slot slot_table[ids[p]] of the pools, B column n = x row member_n / xdiv; the same
    per-warpgroup code otherwise."""
    assert pf >= 1 and (st == 0 or st >= 2)
    nls = 1 if st else pf + 1          # load register sets
    unroll = unroll_of(pf, st)
    L: list[str] = []
    FBL: list[str] = []               # out-of-line fallback blocks, emitted after the main loop
    cur = [L]

    def e(line):
        cur[0].append(line)
    nthr = 128 * mg * kg
    e("// generated by tools/kernel_lab/ptx_w2/gen_wgmma.py -- edit the generator")
    e(f"// MG={mg} KG={kg} FALLBACK={int(fallback)} PF={pf} ST={st}")
    e(".version 8.7")
    e(f".target {arch}")
    e(".address_size 64")
    e(".extern .shared .align 1024 .b8 xsm[];")
    e("")
    if moe:
        e(".visible .entry moe_gemv_wgmma(")
        e("    .param .u64 p_codes, .param .u64 p_scales, .param .u64 p_aux, .param .u64 p_x, .param .u64 p_xs,")
        e("    .param .u64 p_y, .param .u32 p_n, .param .u32 p_k, .param .u32 p_np, .param .u64 p_desc,")
        e("    .param .u64 p_ids, .param .u64 p_table, .param .u64 p_miss, .param .u32 p_xdiv)")
    else:
        e(f".visible .entry {KERNEL}(")
        e("    .param .u64 p_codes, .param .u64 p_scales, .param .u64 p_aux, .param .u64 p_x, .param .u64 p_xs,")
        e("    .param .u64 p_y, .param .u32 p_n, .param .u32 p_k, .param .u32 p_t, .param .u64 p_desc)")
    e(f".reqntid {128 * mg}, {kg}, 1")
    if maxnreg:
        e(f".maxnreg {maxnreg}")
    e("{")
    e("    .reg .pred pv, pf, pl, pe, pt;")
    e("    .reg .b32 tid, wg, wt, warp, lane, gq, tq, mgi, kgi, blk, tile, t16, n, k, tt, nch, per, c0, c1, c;")
    e("    .reg .b32 tmp, tmp2, xa, dlo, dhi, dl, lo, hi, s16, h2, h18, rg, rg8, bg, bg8, fb, fb8, lut, sx, sel;")
    e("    .reg .b32 lg<2>, lh<2>;")
    e("    .reg .b64 pc, ps, pa, px, pxs, py, off, a64, cp, sp, ap, dsc, dtm, dbs;")
    e("    .reg .f32 acc<4>, f<4>, v, xsv, fx;")
    e("    .reg .b32 rb, rs, ra, fa<4>, fb0, fb1, fi, ftp, fbb, fxa, fw, fsh;")
    e("    .reg .pred pb, pm, pm3;")
    e("    .reg .b32 fm;")
    e("    .reg .f32 fe<4>, fz;")
    for q in range(nls):
        e(f"    .reg .b32 cw{q}_<8>, sw{q}, aw{q};")
    if moe:
        e("    .reg .b32 pr, ex, gs, np, xdiv, slot, mk0, mk1, iv, cs, c2, c3, xm, xm2, xm3, pos, srcsz;")
        e("    .reg .b64 msk, bef, aft, one, pids, ptab, pmiss, pxr;")
        e("    .reg .pred pq;")
    for p in range(2):
        e(f"    .reg .b32 A{p}_<32>;")
        e(f"    .reg .f32 D{p}_<4>;")
    e("")
    e("    ld.param.u64 pc, [p_codes]; ld.param.u64 ps, [p_scales]; ld.param.u64 pa, [p_aux];")
    e("    ld.param.u64 px, [p_x]; ld.param.u64 pxs, [p_xs]; ld.param.u64 py, [p_y]; ld.param.u64 dtm, [p_desc];")
    if moe:
        e("    ld.param.u32 n, [p_n]; ld.param.u32 k, [p_k]; ld.param.u32 np, [p_np]; ld.param.u32 xdiv, [p_xdiv];")
        e("    ld.param.u64 pids, [p_ids]; ld.param.u64 ptab, [p_table]; ld.param.u64 pmiss, [p_miss];")
        e("    cvta.to.global.u64 pids, pids; cvta.to.global.u64 ptab, ptab;")
    else:
        e("    ld.param.u32 n, [p_n]; ld.param.u32 k, [p_k]; ld.param.u32 tt, [p_t];")
    e("    cvta.to.global.u64 pc, pc; cvta.to.global.u64 ps, ps; cvta.to.global.u64 pa, pa;")
    e("    cvta.to.global.u64 px, px; cvta.to.global.u64 pxs, pxs; cvta.to.global.u64 py, py;")
    # block (128 MG, KG): the K-split index is %tid.y, so everything the wgmma descriptor depends on
    # is provably warp-uniform (ptxas keeps it in uniform registers: no R2UR per wgmma)
    e("    mov.u32 wg, %tid.x; mov.u32 kgi, %tid.y; shr.u32 mgi, wg, 7; and.b32 wt, wg, 127; shr.u32 warp, wt, 5;")
    e(f"    mad.lo.u32 tid, kgi, {128 * mg}, wg;            // linear thread id")
    e("    and.b32 lane, wg, 31; shr.u32 gq, lane, 2; and.b32 tq, lane, 3;")
    e("    mov.u32 blk, %ctaid.x;")
    e(f"    mad.lo.u32 tile, blk, {mg}, mgi;              // 64-row tile")
    e("    mad.lo.u32 t16, tile, 4, warp;               // 16-row warp tile")
    e("    shr.u32 nch, k, 8;")
    if moe:
        moe_prologue(e, nthr)
    if kg == 1:
        e("    mov.u32 c0, 0; mov.u32 c1, nch;")
    else:
        e(f"    add.u32 per, nch, {kg - 1}; div.u32 per, per, {kg};")
        e("    mul.lo.u32 c0, kgi, per; add.u32 c1, c0, per; min.u32 c1, c1, nch; min.u32 c0, c0, nch;")
    e("    mov.f32 acc0, 0f00000000; mov.f32 acc1, 0f00000000; mov.f32 acc2, 0f00000000; mov.f32 acc3, 0f00000000;")
    for p in range(2):
        e(f"    mov.f32 f{2*p}, 0f00000000; mov.f32 f{2*p+1}, 0f00000000;")
        for q in range(4):
            e(f"    mov.f32 D{p}_{q}, 0f00000000;")
    # per-thread pointers at chunk c0
    e("    mad.lo.u32 tmp, t16, nch, c0;")
    e("    mul.wide.u32 off, tmp, 1024; add.u64 cp, pc, off; mul.wide.u32 off, lane, 16; add.u64 cp, cp, off;")
    e("    mul.wide.u32 off, tmp, 128; add.u64 sp, ps, off; mul.wide.u32 off, lane, 4; add.u64 sp, sp, off;")
    e("    mad.lo.u32 tmp, tile, nch, c0; mul.wide.u32 off, tmp, 64; add.u64 ap, pa, off;")
    if st:
        e("    shl.b32 tmp, warp, 4; shr.u32 tmp2, gq, 1; mad.lo.u32 tmp, tmp2, 4, tmp; cvt.u64.u32 off, tmp; add.u64 ap, ap, off;")
        # this thread's ring slots: xsm + 8 K + wg * st * RING_STAGE (+ slot * RING_STAGE)
        e("    mov.u32 xa, xsm; shl.b32 tmp, k, 3; add.u32 tmp, tmp, xa;")
        e(f"    mad.lo.u32 tmp2, kgi, {mg}, mgi; mad.lo.u32 tmp, tmp2, {st * RING_STAGE}, tmp;")
        e("    mad.lo.u32 rb, wt, 16, tmp;")
        e("    add.u32 rs, tmp, 4096; mad.lo.u32 rs, wt, 4, rs;")
        e("    add.u32 ra, tmp, 4608; mad.lo.u32 ra, wt, 4, ra;")
    else:
        e("    shl.b32 tmp, warp, 4; mad.lo.u32 tmp, gq, 2, tmp; cvt.u64.u32 off, tmp; add.u64 ap, ap, off;")
    e("    setp.lt.u32 pl, c0, c1;")

    def issue(slot, pred):
        o = slot * RING_STAGE
        e(f"    @{pred} cp.async.cg.shared.global [rb+{o}], [cp], 16;")
        e(f"    @{pred} cp.async.cg.shared.global [rb+{o + 2048}], [cp+512], 16;")
        e(f"    @{pred} cp.async.ca.shared.global [rs+{o}], [sp], 4;")
        e(f"    @{pred} cp.async.ca.shared.global [ra+{o}], [ap], 4;")
        e("    cp.async.commit_group;")

    def fetch(slot):
        o = slot * RING_STAGE
        e(f"    ld.shared.v4.u32 {{cw0_0, cw0_1, cw0_2, cw0_3}}, [rb+{o}];")
        e(f"    ld.shared.v4.u32 {{cw0_4, cw0_5, cw0_6, cw0_7}}, [rb+{o + 2048}];")
        e(f"    ld.shared.u32 sw0, [rs+{o}];")
        e(f"    ld.shared.u16 aw0, [tmp2+{o}];")

    def loads(p, pred):
        pp = f"@{pred} " if pred else ""
        e(f"    {pp}ld.global.nc.v4.u32 {{cw{p}_0, cw{p}_1, cw{p}_2, cw{p}_3}}, [cp];")
        e(f"    {pp}ld.global.nc.v4.u32 {{cw{p}_4, cw{p}_5, cw{p}_6, cw{p}_7}}, [cp+512];")
        e(f"    {pp}ld.global.nc.u32 sw{p}, [sp];")
        e(f"    {pp}ld.global.nc.u16 aw{p}, [ap];")

    def advance():
        e("    add.u64 cp, cp, 1024; add.u64 sp, sp, 128; add.u64 ap, ap, 64;")

    for q in range(st - 1 if st else pf):     # the first chunks' loads go out before the x staging
        if q:
            e(f"    add.u32 tmp, c0, {q}; setp.lt.u32 pv, tmp, c1;")
        if st:
            issue(q, "pl" if q == 0 else "pv")
        else:
            loads(q, "pl" if q == 0 else "pv")
        advance()
    # stage the whole permuted x (8 K bytes) into shared memory, all threads of the CTA
    if moe:   # PDL: everything above reads only inputs (ids, table, weights); x is the previous kernel's
        e("    griddepcontrol.wait;")
    e("    mov.u32 xa, xsm;")
    e("    shr.u32 tmp2, k, 1;                            // 16-byte units")
    e("    mov.u32 tmp, tid;")
    e("STAGE:")
    e("    setp.lt.u32 pe, tmp, tmp2;")
    e("    @!pe bra STAGED;")
    # cp.async: every piece in flight at once (a load -> store loop would wait one L2 round trip per
    # 16 B piece per thread); the wait below also completes the ring prologue's groups
    if moe:
        e("    shr.u32 sel, tmp, 3; mul.wide.u32 off, sel, 16; add.u64 a64, pxr, off;   // piece (j h, column tid & 7)")
    else:
        e("    mul.wide.u32 off, tmp, 16; add.u64 a64, px, off;")
    e("    shl.b32 sel, tmp, 4; add.u32 sel, sel, xa;")
    if moe:
        e("    cp.async.cg.shared.global [sel], [a64], 16, srcsz;   // src-size 0: zero column")
    else:
        e("    cp.async.cg.shared.global [sel], [a64], 16;")
    e(f"    add.u32 tmp, tmp, {nthr};")
    e("    bra.uni STAGE;")
    e("STAGED:")
    e("    cp.async.wait_all;")
    e("    fence.proxy.async.shared::cta;")
    e("    bar.sync 0;")
    # descriptor: template | ((xsm + c * 2048 + j * 256) >> 4), one u64 add per wgmma below
    e("    mov.b64 {dlo, dhi}, dtm;")
    e("    shl.b32 tmp, c0, 11; add.u32 tmp, tmp, xa; shr.u32 tmp, tmp, 4; and.b32 tmp, tmp, 0x3FFF;")
    e("    or.b32 dlo, dlo, tmp; mov.b64 dbs, {dlo, dhi};")
    e(f"    mov.b32 lut, {LUT:#010x}; mov.f32 fz, 0f00000000;")
    e("    mov.u32 c, c0;")
    e("    @!pl bra DONE;")

    def decode_word(w, la, lb, dst):
        e(f"    and.b32 lo, {w}, 0x33333333; and.b32 hi, {w}, 0xCCCCCCCC;")
        e("    shr.u32 s16, lo, 16; shr.u32 h2, hi, 2; shr.u32 h18, hi, 18;")
        e(f"    prmt.b32 {dst[0]}, {la}, 0, lo; prmt.b32 {dst[1]}, {lb}, 0, h2;")
        e(f"    prmt.b32 {dst[2]}, {la}, 0, s16; prmt.b32 {dst[3]}, {lb}, 0, h18;")

    def wgmma(p, regs, j, first):
        e(f"    add.s64 dsc, dbs, {16 * j};")
        e(f"    wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {{D{p}_0, D{p}_1, D{p}_2, D{p}_3}}, "
          f"{{{regs[0]}, {regs[1]}, {regs[2]}, {regs[3]}}}, dsc, {0 if first else 1}, 1, 1;")

    def body(p, ls, tag):
        A = [f"A{p}_{i}" for i in range(32)]
        # fast path, always (no branch before the wgmmas: a branch there costs ptxas ~40 registers):
        # LUT words with the scale folded in; a flagged chunk (aux 0) gets LUT 0 -> D = 0 and f = 0, and
        # its exact contribution comes from the fallback block after the FFMA below
        if fallback:
            e(f"    setp.eq.u32 pf, aw{ls}, 0;")
        e(f"    prmt.b32 rg, aw{ls}, 0, 0x0000; prmt.b32 rg8, aw{ls}, 0, 0x1111;")
        e(f"    mad.lo.u32 bg, rg, -8, {LUT:#010x}; mad.lo.u32 bg8, rg8, -8, {LUT:#010x};")
        for b in range(2):
            e(f"    prmt.b32 lg{b}, sw{ls}, 0, {0x1111 * (2 * b):#06x}; mad.lo.u32 lg{b}, lg{b}, 8, bg;")
            e(f"    prmt.b32 lh{b}, sw{ls}, 0, {0x1111 * (2 * b + 1):#06x}; mad.lo.u32 lh{b}, lh{b}, 8, bg8;")
            if fallback:
                e(f"    selp.b32 lg{b}, 0, lg{b}, pf; selp.b32 lh{b}, 0, lh{b}, pf;")
        for b in range(2):
            for m in range(4):
                decode_word(f"cw{ls}_{4*b+m}", f"lg{b}", f"lh{b}", A[16 * b + 4 * m: 16 * b + 4 * m + 4])
        e(f"    and.b32 fb, aw{ls}, 0xFF; shl.b32 fb, fb, 23; mov.b32 f{2*p}, fb;")
        e(f"    and.b32 fb8, aw{ls}, 0xFF00; shl.b32 fb8, fb8, 15; mov.b32 f{2*p+1}, fb8;")
        e("    wgmma.fence.sync.aligned;")
        for b in range(2):
            for m in range(4):
                wgmma(p, A[16 * b + 4 * m: 16 * b + 4 * m + 4], 4 * b + m, b == 0 and m == 0)
        e("    wgmma.commit_group.sync.aligned;")

    def late_fallback(p, ls, tag):
        e(f"    @pf bra.uni FB{tag};")
        e(f"JOIN{tag}:")
        cur[0] = FBL
        fallback_block(p, ls, tag)
        cur[0] = L

    def fallback_block(p, ls, tag):
        """Out of line (after the main loop, so the loop body is the fast path alone). Synchronous
        mma.sync m16n8k32 per warp (its 16 rows x 8 tokens: the same D layout as its slice of the
        wgmma), B fragments read from the staged x tile; a runtime loop over (block b, group slot t')
        keeps it small: lanes t == t' decode with the plain LUT, the others with LUT 0 (+0 bytes), 4
        chained MMAs from 0, then 4 FFMA by the group's 2^(s - 127) (s from lane 4g + t' by shfl)."""
        e(f"FB{tag}:")
        e("    and.b32 sel, lane, 0x1C;")
        e("    shl.b32 sx, c, 11; add.u32 sx, sx, xa; mad.lo.u32 sx, gq, 16, sx; mad.lo.u32 sx, tq, 4, sx;")
        e("    mov.u32 fi, 0;")
        e(f"FBL{tag}:")
        # fi = 16 b + 4 t' + m: one decode + one MMA per trip keeps the register footprint small
        e("    and.b32 fm, fi, 3; shr.u32 ftp, fi, 2; and.b32 ftp, ftp, 3; shr.u32 fbb, fi, 4;")
        e(f"    setp.eq.u32 pt, tq, ftp; selp.b32 lg0, {LUT:#010x}, 0, pt;")
        e("    setp.ne.u32 pb, fbb, 0; setp.eq.u32 pm, fm, 0; setp.eq.u32 pm3, fm, 3;")
        e(f"    selp.b32 fw, cw{ls}_4, cw{ls}_0, pb; selp.b32 fa0, cw{ls}_5, cw{ls}_1, pb;")
        e(f"    selp.b32 fa1, cw{ls}_6, cw{ls}_2, pb; selp.b32 fa2, cw{ls}_7, cw{ls}_3, pb;")
        e("    and.b32 fa3, fm, 1; setp.ne.u32 pt, fa3, 0; selp.b32 fw, fa0, fw, pt; selp.b32 fa2, fa2, fa1, pt;")
        e("    setp.gt.u32 pt, fm, 1; selp.b32 fw, fa2, fw, pt;")
        decode_word("fw", "lg0", "lg0", ["fa0", "fa1", "fa2", "fa3"])
        e("    shl.b32 fxa, fbb, 10; add.u32 fxa, fxa, sx; shl.b32 fsh, fm, 8; add.u32 fxa, fxa, fsh;  // wgmma j = 4 b + m")
        e("    ld.shared.u32 fb0, [fxa]; ld.shared.u32 fb1, [fxa+128];")
        for q in range(4):
            e(f"    selp.f32 fe{q}, 0f00000000, fe{q}, pm;")
        e("    mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {fe0, fe1, fe2, fe3}, "
          "{fa0, fa1, fa2, fa3}, {fb0, fb1}, {fe0, fe1, fe2, fe3};")
        e(f"    add.u32 tmp, sel, ftp; shfl.sync.idx.b32 fb, sw{ls}, tmp, 0x1f, 0xffffffff;")
        e("    shl.b32 fsh, fbb, 4; shr.u32 fb, fb, fsh; shr.u32 fb8, fb, 8;")
        e("    and.b32 fb, fb, 0xFF; shl.b32 fb, fb, 23; and.b32 fb8, fb8, 0xFF; shl.b32 fb8, fb8, 23;")
        e("    mov.b32 fx, fb; @pm3 fma.rn.f32 acc0, fe0, fx, acc0; @pm3 fma.rn.f32 acc1, fe1, fx, acc1;")
        e("    mov.b32 fx, fb8; @pm3 fma.rn.f32 acc2, fe2, fx, acc2; @pm3 fma.rn.f32 acc3, fe3, fx, acc3;")
        e(f"    add.u32 fi, fi, 1; setp.lt.u32 pt, fi, 32; @pt bra.uni FBL{tag};")
        e(f"    bra.uni JOIN{tag};")

    def ffma(p):
        e(f"    fma.rn.f32 acc0, D{p}_0, f{2*p}, acc0; fma.rn.f32 acc1, D{p}_1, f{2*p}, acc1;")
        e(f"    fma.rn.f32 acc2, D{p}_2, f{2*p+1}, acc2; fma.rn.f32 acc3, D{p}_3, f{2*p+1}, acc3;")

    e("LOOP:")
    for u in range(unroll):
        p, ls = u % 2, u % nls
        if st:
            e(f"    add.u32 tmp, c, {st - 1}; setp.lt.u32 pv, tmp, c1;")
            issue((u + st - 1) % st, "pv")
            advance()
            e(f"    cp.async.wait_group {st - 1};")
            e("    and.b32 tmp2, gq, 1; mad.lo.u32 tmp2, tmp2, 2, ra;")
            fetch(u % st)
        else:
            e(f"    add.u32 tmp, c, {pf}; setp.lt.u32 pv, tmp, c1;")
            loads((u + pf) % nls, "pv")
            advance()
        body(p, ls, u)
        e("    wgmma.wait_group.sync.aligned 1;")
        ffma(1 - p)                                     # chunk c - 1 (zeros before the first)
        if fallback:
            late_fallback(p, ls, u)                     # flagged chunk c: its exact contribution
        e("    add.u32 c, c, 1; add.s64 dbs, dbs, 128; setp.lt.u32 pe, c, c1;")
        if u < unroll - 1:
            e(f"    @!pe bra TAIL{p};")
        else:
            e("    @pe bra LOOP;")
    e(f"TAIL{(unroll - 1) % 2}:")
    e("    wgmma.wait_group.sync.aligned 0;")
    ffma((unroll - 1) % 2)
    e("    bra.uni DONE;")
    e(f"TAIL{unroll % 2}:")
    e("    wgmma.wait_group.sync.aligned 0;")
    ffma(unroll % 2)
    e("    bra.uni DONE;")
    L.extend(FBL)
    e("DONE:")
    e("    wgmma.wait_group.sync.aligned 0;")
    if moe:   # PDL: let the next kernel launch (it waits for this grid's completion before reading y)
        e("    griddepcontrol.launch_dependents;")
    # epilogue: rows 64 tile + 16 warp + g (+8), tokens 2t, 2t+1
    e("    mad.lo.u32 tmp2, tile, 64, gq; shl.b32 tmp, warp, 4; add.u32 tmp2, tmp2, tmp;   // row g")
    if kg > 1:
        e("    bar.sync 0;                                   // x tile no longer read: reuse for partials")
        e(f"    mad.lo.u32 tmp, kgi, {mg}, mgi; mad.lo.u32 tmp, tmp, 128, wt; shl.b32 tmp, tmp, 4; add.u32 tmp, tmp, xa;")
        e("    st.shared.v4.f32 [tmp], {acc0, acc1, acc2, acc3};")
        e("    bar.sync 0;")
        e("    setp.ne.u32 pe, kgi, 0;")
        e("    @pe bra END;")
        for q in range(4):
            e(f"    mov.f32 acc{q}, 0f00000000;")
        for kk in range(kg):
            e(f"    mad.lo.u32 tmp, mgi, 128, wt; add.u32 tmp, tmp, {kk * mg * 128}; shl.b32 tmp, tmp, 4; add.u32 tmp, tmp, xa;")
            e("    ld.shared.v4.f32 {v, xsv, fx, f0}, [tmp];")
            e("    add.rn.f32 acc0, acc0, v; add.rn.f32 acc1, acc1, xsv; add.rn.f32 acc2, acc2, fx; add.rn.f32 acc3, acc3, f0;")
    for q in range(4):
        e(f"    shl.b32 tmp, tq, 1; add.u32 tmp, tmp, {q % 2}; setp.lt.u32 pt, tmp, {'gs' if moe else 'tt'};   // token")
        e(f"    @!pt bra SKIP{q};")
        if moe:            # column 2t (+1) -> its pair; x row = pair / xdiv; y row = pair
            e(f"    mov.u32 sx, {'xm2' if q % 2 == 0 else 'xm3'}; div.u32 tmp, sx, xdiv;")
        e("    mul.wide.u32 off, tmp, 4; add.u64 a64, pxs, off; ld.global.f32 xsv, [a64];")
        e(f"    mul.rn.f32 v, acc{q}, xsv;")
        if moe:
            e("    mov.u32 tmp, sx;")
        e(f"    add.u32 sel, tmp2, {8 * (q // 2)}; mad.lo.u32 sel, tmp, n, sel;")
        e("    mul.wide.u32 off, sel, 4; add.u64 a64, py, off; st.global.f32 [a64], v;")
        e(f"SKIP{q}:")
    e("END:")
    e("    ret;")
    e("}")
    return "\n".join(L) + "\n"


def moe_prologue(e, nthr: int):
    """Grouped form: which run of pairs this program serves (warp ballots over ids[0..P-1], P <= 64),
    early exit, miss count, slot offsets of the three pools, the x row of this thread's staging
    column (tid & 7) and of its two output columns (2t, 2t + 1)."""
    e("    mov.u32 pr, %ctaid.y;")
    e("    mul.wide.u32 off, pr, 4; add.u64 a64, pids, off; ld.global.nc.u32 ex, [a64];")
    for h, reg in ((0, "mk0"), (1, "mk1")):
        e(f"    add.u32 tmp, lane, {32 * h}; mov.u32 iv, -1; setp.lt.u32 pq, tmp, np;")
        e("    mul.wide.u32 off, tmp, 4; add.u64 a64, pids, off; @pq ld.global.nc.u32 iv, [a64];")
        e(f"    setp.eq.u32 pq, iv, ex; vote.sync.ballot.b32 {reg}, pq, 0xffffffff;")
    e("    mov.b64 msk, {mk0, mk1};")
    e("    mov.b64 one, 1; shl.b64 bef, one, pr; sub.s64 bef, bef, 1; and.b64 bef, bef, msk;")
    e("    popc.b64 tmp, bef; and.b32 tmp, tmp, 7; setp.ne.u32 pq, tmp, 0;")
    e("    @pq bra END;                                    // not the start of a run of 8: exit")
    e("    shr.b64 aft, msk, pr; popc.b64 gs, aft; min.u32 gs, gs, 8;")
    e("    and.b32 cs, tid, 7; shl.b32 c2, tq, 1; add.u32 c3, c2, 1; mov.u32 xm, pr; mov.u32 xm2, pr; mov.u32 xm3, pr;")
    for i in range(8):
        e("    brev.b64 bef, aft; clz.b64 pos, bef; add.u32 pos, pos, pr;")
        e(f"    setp.eq.u32 pq, cs, {i}; @pq mov.u32 xm, pos; setp.eq.u32 pq, c2, {i}; @pq mov.u32 xm2, pos;")
        e(f"    setp.eq.u32 pq, c3, {i}; @pq mov.u32 xm3, pos;")
        if i < 7:
            e("    sub.s64 bef, aft, 1; and.b64 aft, aft, bef;")
    e("    mul.wide.u32 off, ex, 4; add.u64 a64, ptab, off; ld.global.nc.u32 slot, [a64];")
    e("    setp.lt.s32 pq, slot, 0;")
    e("    @!pq bra RESIDENT;")
    e("    setp.eq.u64 pq, pmiss, 0; @pq bra END;")
    e("    mov.u32 tmp, %ctaid.x; or.b32 tmp, tmp, tid; setp.ne.u32 pq, tmp, 0; @pq bra END;")
    e("    griddepcontrol.wait;")
    e("    cvta.to.global.u64 pmiss, pmiss; red.global.add.u32 [pmiss], gs;   // the only atomic")
    e("    bra.uni END;")
    e("RESIDENT:")
    # slot offsets: codes N K / 4, scales N K / 32, aux N K / 256 bytes per slot
    e("    mul.lo.u32 tmp, n, k; shr.u32 tmp, tmp, 2; mul.wide.u32 off, slot, tmp; add.u64 pc, pc, off;")
    e("    shr.u32 tmp, tmp, 3; mul.wide.u32 off, slot, tmp; add.u64 ps, ps, off;")
    e("    shr.u32 tmp, tmp, 3; mul.wide.u32 off, slot, tmp; add.u64 pa, pa, off;")
    # staging source: column cs = tid & 7 is this thread's for every piece (nthr % 8 == 0)
    assert nthr % 8 == 0
    e("    setp.lt.u32 pq, cs, gs; selp.b32 srcsz, 16, 0, pq; selp.b32 tmp, xm, 0, pq; div.u32 tmp, tmp, xdiv;")
    e("    mul.wide.u32 off, tmp, k; add.u64 pxr, px, off;")


def main_loop_stats(text: str):
    """Opcode histogram of the main loop's fast path. Main loop: of the backward branches whose body
    holds a QGMMA, the one with the lowest target (the loop head). ptxas lays the fallback blocks out
    inside that range (it inverts the branch), so the instructions skipped by a forward branch whose
    skipped range holds the fallback's HMMA / F2FP and no QGMMA are taken out: what is left is what every
    unflagged chunk executes. Returns (fast-path histogram, its length, whole-loop length)."""
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
                if any(o.startswith("QGMMA") for o in body) and (best is None or tgt < best[0] or
                                                                  (tgt == best[0] and addr > best[1])):
                    best = (tgt, addr)
    if best is None:
        return collections.Counter(), 0, 0
    lo, hi = best
    body = [(a, o, ln) for (a, o, ln) in lines if lo <= a <= hi]
    skip = set()
    for a, o, ln in body:
        if o.startswith("BRA"):
            t = tgt_re.search(ln)
            if t and int(t.group(1), 16) > a:
                rng = [x for x in body if a < x[0] < int(t.group(1), 16)]
                if any(x[1].startswith(("HMMA", "F2FP")) for x in rng) and \
                        not any(x[1].startswith("QGMMA") for x in rng):
                    skip.update(x[0] for x in rng)
    fast = [o for (a, o, _) in body if a not in skip]
    return collections.Counter(fast), len(fast), len(body)


def smem_bytes(k: int, mg: int = 1, kg: int = 1, st: int = 0) -> int:
    return 8 * k + mg * kg * st * RING_STAGE


def report(mg: int = 1, kg: int = 1, fallback: bool = True, out: str | None = None, arch: str = "sm_90a",
           pf: int = 1, st: int = 0, maxnreg: int = 0) -> dict:
    """Assemble, disassemble and count the main loop. The loop of the build without the fallback is
    exactly the fast path (what every chunk runs unless flagged); the full build's loop also holds
    the two out-of-path fallback blocks, reported separately."""
    ptx = gen_wgmma(mg, kg, fallback, arch, pf, st, maxnreg)
    unroll = unroll_of(pf, st)
    cubin, log = gen_ptx.assemble(ptx, arch)
    s = gen_ptx.sass(cubin)
    hist, nloop, nwhole = main_loop_stats(s)
    weights_per_thread = unroll * 16 * 256 // 32  # loop = `unroll` chunks of a warp's 16 rows x 256 k, per thread
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    res = {"arch": arch, "mg": mg, "kg": kg, "pf": pf, "st": st, "fallback": fallback, "chunks_per_loop": unroll,
           "regs": int(regs.group(1)) if regs else None, "spill_stores": int(spill.group(1)) if spill else None,
           "loop_instr": nloop, "loop_instr_with_fallback_blocks": nwhole, "instr_per_weight": nloop / weights_per_thread, "loop_hist": dict(hist.most_common()),
           "ptxas_warnings": [ln for ln in log.splitlines() if "arning" in ln or "C7512" in ln or "Performance" in ln],
           "wgmma_serialized": "serialized" in log,
           "qgmma_register_a": bool(re.search(r"QGMMA\.64x8x32\S*\s+R\d+,\s*gdesc", s) or
                                    re.search(r"QGMMA\.64x8x32[^\n]*R\d+,\s*gdesc", s)),
           "f2fp_or_hmma_in_loop": any(o.startswith(("F2FP", "HMMA")) for o in hist)}
    if out:
        os.makedirs(out, exist_ok=True)
        tag = f"wgmma_{arch}_mg{mg}_kg{kg}_pf{pf}_st{st}_fb{int(fallback)}"
        open(os.path.join(out, f"{tag}.ptx"), "w").write(ptx)
        open(os.path.join(out, f"{tag}.cubin"), "wb").write(cubin)
        open(os.path.join(out, f"{tag}.sass"), "w").write(s)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mg", type=int, nargs="*", default=[1])
    ap.add_argument("--kg", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--pf", type=int, nargs="*", default=[1])
    ap.add_argument("--st", type=int, nargs="*", default=[0, 4])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    for mg, kg, pf, st in [(m, k_, p, s_) for m in a.mg for k_ in a.kg for p in a.pf for s_ in a.st]:
            for fb in (False, True):
                r = report(mg, kg, fb, a.out, pf=pf, st=st)
                top = ", ".join(f"{k}:{v}" for k, v in list(r["loop_hist"].items())[:18])
                print(f"MG {mg} KG {kg} PF {pf} ST {st} fallback {int(fb)}: serialized {r['wgmma_serialized']} regs {r['regs']} spills {r['spill_stores']} "
                      f"loop {r['loop_instr']} -> {r['instr_per_weight']:.3f} thread-instr/weight; "
                      f"QGMMA register-A {r['qgmma_register_a']}; F2FP/HMMA {r['f2fp_or_hmma_in_loop']}\n    {top}")
                for w in r["ptxas_warnings"]:
                    print("    ptxas:", w)


if __name__ == "__main__":
    main()
