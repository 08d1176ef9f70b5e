"""Where the paged GQA decode's batch-1 time goes, from inside the kernels.

Runs 19-32 explained batch 1 (32K, Qwen3-30B-A3B heads: 29 us graphed, 54% of the copy) as the step
chain of one 4-warp program per SM. Taken over all contexts, that model doesn't fit: with the grid
fixed at 32 splits (128 programs), run 26's batch-1 times at 32K (16 loop steps a program, 29.2
us) and 128K (64 steps, 84.7 us) fit T = a + n s with s = 1.16 us a step (32 KB a program: 3.6 TB/s
over 128 programs, 85% of the copy) and a = 10.7 us that every call pays whatever its length. This
probe measures both terms directly:

  curve    the production paged_decode_gqa at batch 1 with the grid held at 32 splits and n loop
           steps a program (ctx = 2048 n, split_tokens = 64 n; n = 16 is the default launch at 32K),
           graph of 4 calls over 4 distinct caches: the per-call time T(n) and its linear fit.
  splits   the production kernel at 32K and 128K with max_splits 8 .. 64 (256-token minimum splits):
           whether fewer, longer programs pay the fixed part less.
  stamps   the same split kernel and merge kernel with per-program timestamps (lab copies that call
           attention_triton's own tile and merge functions, checked bit-identical to the production
           kernels): %globaltimer (ns, common to all SMs) at each program's entry and end, %clock64 at
           entry, after the page loop and at the end (that SM's cycles), and %smid. One CUDA graph of 4
           layers (split + merge each, distinct caches), replayed after an L2 flush. Per layer: the
           split kernel's start skew, the spread of per-program loop times, the end skew (which
           program finishes last, and why), the gap to the merge, the merge's span, the gap to
           the next layer.

    python tools/kernel_lab/gqa_timeline_probe.py --out DIR [--steps 1,2,4,8,16,32,64] [--kv bf16,fp8]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import triton
import triton.language as tl
import triton.testing as tt

from moet.kernels.attention_triton import (_gqa_decode_tile, _gqa_f8w_split, _merge_blocks, _merge_head, _pow2,
                                           _split_pages, _split_window)

HQ, HKV, D = 32, 4, 128            # Qwen3-30B-A3B heads
SPLITS = 32


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _clock():
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _smid():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _stamped_split_kernel(
        q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, acc_ptr, m_ptr, l_ptr, st_ptr,
        s_qb, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_btb, scale, pages_min,
        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        MAX_SPLITS: tl.constexpr, SCALE_KIND: tl.constexpr, PAGES: tl.constexpr, OP_F16: tl.constexpr,
        F8_WORDS: tl.constexpr):
    """attention_triton._gqa_decode_split_kernel's bf16-cache and fp8-words paths (no window, no
    fused merge, per-tensor scales only), with stamps [gt entry, gt end, clk entry, clk after loop,
    clk end, smid] at st_ptr + 8 * program."""
    g0 = _globaltimer()
    c0 = _clock()
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    pid = (b * tl.num_programs(1) + h) * tl.num_programs(2) + sp
    n = tl.load(lens_ptr + b)
    n_pages, pps, used = _split_pages(n, pages_min, MAX_SPLITS, BLOCK_SIZE)
    c1 = c0
    if sp < used:
        g = tl.arange(0, BLOCK_G)
        qh = h * G + g
        qk_scale = scale
        if SCALE_KIND == 1:
            qk_scale = scale * tl.load(ks_ptr)
        lo_tok, first, last = _split_window(n, sp, pps, n_pages, 0, BLOCK_SIZE)
        row = (b * (tl.num_programs(1) * G) + qh) * tl.num_programs(2) + sp
        if F8_WORDS:
            _gqa_f8w_split(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, acc_ptr, m_ptr, l_ptr, b, h, sp, n, first, last,
                           lo_tok, row, g, qh, s_qb, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh,
                           0, 0, 0, 0, 0, 0, s_btb, qk_scale, G, BLOCK_G, D, D, BLOCK_SIZE, PAGES, SCALE_KIND, False)
            c1 = _clock()
        else:
            d = tl.arange(0, D)
            q = tl.load(q_ptr + b * s_qb + qh[:, None] * s_qh + d[None, :], mask=g[:, None] < G,
                        other=0.0).to(tl.bfloat16)
            acc = tl.zeros([BLOCK_G, D], tl.float32)
            m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_G], tl.float32)
            for page in range(first, last, PAGES):
                m_i, l_i, acc = _gqa_decode_tile(
                    q, m_i, l_i, acc, page, last, n, lo_tok, b, h, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, d, d,
                    s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, 0, 0, 0, 0, 0, 0, s_btb, qk_scale,
                    D, D, BLOCK_SIZE, PAGES, SCALE_KIND, D, D, True, OP_F16, False)
            c1 = _clock()
            gmask = g < G
            tl.store(m_ptr + row, m_i, mask=gmask)
            tl.store(l_ptr + row, l_i, mask=gmask)
            tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=gmask[:, None])
    c2 = _clock()
    g1 = _globaltimer()
    st = st_ptr + 8 * pid
    tl.store(st, g0)
    tl.store(st + 1, g1)
    tl.store(st + 2, c0)
    tl.store(st + 3, c1)
    tl.store(st + 4, c2)
    tl.store(st + 5, _smid().to(tl.int64))


@triton.jit
def _stamped_merge_kernel(acc_ptr, m_ptr, l_ptr, lens_ptr, out_ptr, st_ptr, s_ob, s_oh, num_splits, pages_min,
                          HQ: tl.constexpr, DV: tl.constexpr, MAX_SPLITS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          BLOCK_S: tl.constexpr, DV_TILE: tl.constexpr):
    """attention_triton._merge_splits_kernel with stamps [gt entry, gt end, smid] at st_ptr + 4 * program."""
    g0 = _globaltimer()
    b = tl.program_id(0)
    h = tl.program_id(1)
    _, _, used = _split_pages(tl.load(lens_ptr + b), pages_min, MAX_SPLITS, BLOCK_SIZE)
    _merge_head(acc_ptr, m_ptr, l_ptr, out_ptr + b * s_ob + h * s_oh, (b * HQ + h) * num_splits, used,
                num_splits, DV, DV, BLOCK_S, DV_TILE)
    g1 = _globaltimer()
    st = st_ptr + 4 * (b * tl.num_programs(1) + h)
    tl.store(st, g0)
    tl.store(st + 1, g1)
    tl.store(st + 2, _smid().to(tl.int64))


@triton.jit
def _stamped_old_merge_kernel(acc_ptr, m_ptr, l_ptr, lens_ptr, out_ptr, st_ptr, s_ob, s_oh, num_splits, pages_min,
                              HQ: tl.constexpr, DV: tl.constexpr, MAX_SPLITS: tl.constexpr,
                              BLOCK_SIZE: tl.constexpr, BLOCK_S: tl.constexpr, DV_TILE: tl.constexpr):
    """The merge before stop 30 (its loads masked by the splits used, so they wait for the length),
    stamped like _stamped_merge_kernel: the A/B of the lens-independent loads."""
    g0 = _globaltimer()
    b = tl.program_id(0)
    h = tl.program_id(1)
    _, _, used = _split_pages(tl.load(lens_ptr + b), pages_min, MAX_SPLITS, BLOCK_SIZE)
    row0 = (b * HQ + h) * num_splits
    s = tl.arange(0, BLOCK_S)
    smask = s < used
    m = tl.load(m_ptr + row0 + s, mask=smask, other=float("-inf"))
    l = tl.load(l_ptr + row0 + s, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(smask, tl.exp(m - m_safe), 0.0)
    l_sum = tl.sum(w * l, 0)
    pos = l_sum > 0
    den = tl.where(pos, l_sum, 1.0)
    cols = tl.arange(0, DV_TILE)
    a = tl.load(acc_ptr + (row0 + s)[:, None] * DV + cols[None, :], mask=smask[:, None], other=0.0)
    out = tl.where(pos, tl.sum(w[:, None] * a, 0) / den, 0.0)
    tl.store(out_ptr + b * s_ob + h * s_oh + cols, out.to(out_ptr.dtype.element_ty))
    g1 = _globaltimer()
    st = st_ptr + 4 * (b * tl.num_programs(1) + h)
    tl.store(st, g0)
    tl.store(st + 1, g1)
    tl.store(st + 2, _smid().to(tl.int64))


def make_cache(fmt, nb: int, seed: int):
    from moet.kernels.kv_cache import GQALayerKV, new_gqa_layer
    ref = new_gqa_layer(1, 16, HKV, D, D, fmt, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def one():
        t = torch.empty(nb, 16, HKV, D, dtype=ref.k.dtype, device="cuda")
        step = max(1, (1 << 26) // t[0].numel())
        for i in range(0, nb, step):
            t[i:i + step] = torch.randn(t[i:i + step].shape, device="cuda", generator=gen).to(ref.k.dtype)
        return t

    ks = vs = None
    if ref.k_scale is not None:
        ks = torch.full_like(ref.k_scale, 0.05)
        vs = torch.full_like(ref.v_scale, 0.05)
    return GQALayerKV(fmt, one(), one(), ks, vs)


class Layer:
    """One attention layer's inputs at batch 1: a cache of ctx tokens behind a random block table."""

    def __init__(self, fmt, ctx: int, seed: int, batch: int = 1):
        pages = ctx // 16
        self.cache = make_cache(fmt, batch * pages + 1, seed)
        gen = torch.Generator(device="cuda").manual_seed(seed + 7)
        self.table = torch.randperm(batch * pages, device="cuda", generator=gen).view(batch, pages).to(torch.int32)
        self.lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        self.q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        self.out = torch.empty(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
        self.out_lab = torch.empty_like(self.out)
        self.split_stamps = torch.zeros(HKV * SPLITS, 8, dtype=torch.int64, device="cuda")
        self.merge_stamps = torch.zeros(HQ, 4, dtype=torch.int64, device="cuda")
        self.acc = torch.empty(1, HQ, SPLITS, D, dtype=torch.float32, device="cuda")
        self.m = torch.empty(1, HQ, SPLITS, dtype=torch.float32, device="cuda")
        self.l = torch.empty_like(self.m)

    def production(self, split_tokens: int | None, max_splits: int = SPLITS, **kw):
        from moet.kernels.attention_triton import paged_decode_gqa
        return paged_decode_gqa(self.q, self.cache, self.table, self.lens, D ** -0.5, split_tokens=split_tokens,
                                max_splits=max_splits or None, out=self.out, **kw)     # 0: the default

    def stamped(self, split_tokens: int, old_merge: bool = False):
        from moet.kernels.attention_triton import gqa_decode_launch, gqa_fp8_words_applies
        c = self.cache
        launch = gqa_decode_launch(self.q, c)
        f8w = gqa_fp8_words_applies(self.q, c)
        kst, vst = c.k.stride()[:3], c.v.stride()[:3]
        if f8w:
            kst, vst = tuple(x // 4 for x in kst), tuple(x // 4 for x in vst)
        kind = 1 if c.fmt.is_fp8 else 0
        ks = c.k_scale if c.k_scale is not None else self.m
        vs = c.v_scale if c.v_scale is not None else self.m
        pages_min = -(-split_tokens // 16)
        _stamped_split_kernel[(1, HKV, SPLITS)](
            self.q, c.k, c.v, ks, vs, self.table, self.lens, self.acc, self.m, self.l, self.split_stamps,
            self.q.stride(0), self.q.stride(1), *kst, *vst, self.table.stride(0), D ** -0.5, pages_min,
            G=HQ // HKV, BLOCK_G=_pow2(HQ // HKV), D=D, BLOCK_SIZE=16, MAX_SPLITS=SPLITS, SCALE_KIND=kind,
            PAGES=4, OP_F16=c.fmt.is_fp8, F8_WORDS=f8w, num_warps=launch.num_warps, num_stages=launch.num_stages)
        merge = _stamped_old_merge_kernel if old_merge else _stamped_merge_kernel
        merge[(1, HQ)](self.acc, self.m, self.l, self.lens, self.out_lab, self.merge_stamps,
                                       self.out_lab.stride(0), self.out_lab.stride(1), SPLITS, pages_min,
                                       HQ=HQ, DV=D, MAX_SPLITS=SPLITS, BLOCK_SIZE=16, **_merge_blocks(SPLITS, D))
        return self.out_lab


def graph_of(fns):
    """fns captured in one CUDA graph -> its replay."""
    from moet.bench.timing import graphed
    run, err = graphed(lambda: [f() for f in fns])
    if err is not None:
        raise err
    return run


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def analyse(layers) -> dict:
    """Per layer, ns relative to the first split program's entry of layer 0."""
    t_ref = None
    out = []
    for L in layers:
        s = L.split_stamps.cpu().tolist()
        mg = L.merge_stamps.cpu().tolist()
        if t_ref is None:
            t_ref = min(r[0] for r in s)
        starts = [r[0] - t_ref for r in s]
        ends = [r[1] - t_ref for r in s]
        loop_cyc = [r[3] - r[2] for r in s]
        tot_cyc = [r[4] - r[2] for r in s]
        tot_ns = [r[1] - r[0] for r in s]
        # cycles per ns from the programs (long ones: the coarse timer matters least there)
        ratio = statistics.median([c / t for c, t in zip(tot_cyc, tot_ns) if t > 2000]) if max(tot_ns) > 2000 else None
        last = max(range(len(s)), key=lambda i: ends[i])
        out.append(dict(
            split_first_start=min(starts), split_last_start=max(starts), split_first_end=min(ends),
            split_median_end=statistics.median(ends), split_last_end=max(ends),
            program_ns=dict(min=min(tot_ns), p10=pct(tot_ns, 10), median=statistics.median(tot_ns),
                            p90=pct(tot_ns, 90), max=max(tot_ns)),
            loop_cycles=dict(min=min(loop_cyc), median=statistics.median(loop_cyc), max=max(loop_cyc)),
            epilogue_cycles_median=statistics.median([r[4] - r[3] for r in s]),
            cycles_per_ns=ratio, last_program=dict(index=last, smid=s[last][5], start=starts[last],
                                                   ns=tot_ns[last]),
            distinct_sms=len({r[5] for r in s}),
            merge_first_start=min(r[0] - t_ref for r in mg), merge_last_start=max(r[0] - t_ref for r in mg),
            merge_last_end=max(r[1] - t_ref for r in mg),
            merge_program_ns_median=statistics.median([r[1] - r[0] for r in mg])))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", default="1,2,4,8,16,32,64")
    ap.add_argument("--stamp-steps", default="1,16,64")
    ap.add_argument("--kv", default="bf16,fp8")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--splits", default="8,16,24,32,48,64", help="the splits sweep's max_splits ('' = none)")
    ap.add_argument("--splits-ctx", default="32768,131072")
    ap.add_argument("--skip-curve", action="store_true", help="no curve / stamps / splits sweep")
    ap.add_argument("--merge-ab", default="1,16", help="steps at which the stamped graph runs the old and the new "
                                                       "merge ('' = none)")
    ap.add_argument("--pdl", default="1:2048,1:8192,1:32768,1:131072,8:32768,32:32768",
                    help="batch:ctx cases of the PDL / prefetch sweep ('' = none)")
    ap.add_argument("--prefetch", default="0,1,2,4", help="prefetch_steps under PDL in the sweep ('d': the default)")
    ap.add_argument("--pdl-splits", default="32", help="max_splits of the PDL sweep (each with every --prefetch; 0: the "
                                                       "default cap with long_splits 64)")
    ap.add_argument("--no-pdl-off", action="store_true", help="the PDL sweep without its PDL-off variant")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from moet.bench.timing import graph_time_ms
    from moet.kernels.attention_reference import paged_decode_gqa as ref_decode
    from moet.kernels.kv_cache import KVFormat, gqa_bytes_per_token
    fmts = {"bf16": KVFormat("auto", dtype=torch.bfloat16), "fp8": KVFormat("fp8_e4m3", "tensor")}
    recs, t0 = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    date_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), curve=[], stamps=[]), time.time()
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    recs["merge_ab"], recs["pdl"] = [], []
    for kv in args.kv.split(","):
        fmt = fmts[kv]
        for n in [int(x) for x in args.merge_ab.split(",") if x]:
            ctx, split_tokens = 2048 * n, 64 * n
            layers = [Layer(fmt, ctx, 3000 + 10 * j) for j in range(args.layers)]
            row = dict(kv=kv, steps=n, ctx=ctx)
            outs = {}
            for name, old in (("new", False), ("old", True), ("new2", False), ("old2", True)):
                run = graph_of([lambda L=L, old=old: L.stamped(split_tokens, old_merge=old) for L in layers])
                row[f"us_{name}"] = float(tt.do_bench(run, warmup=10, rep=60, return_mode="median")) / len(layers) * 1e3
                merge_ns = []
                for _ in range(5):
                    flush.zero_()
                    run()
                    torch.cuda.synchronize()
                    a = analyse(layers)
                    merge_ns += [x["merge_program_ns_median"] for x in a[1:]]
                    merge_ns += [x["merge_last_end"] - x["merge_first_start"] for x in a[1:]]
                row[f"merge_program_and_span_ns_{name}"] = merge_ns
                outs[name] = layers[0].out_lab.clone()
            row["old_new_bits_equal"] = bool(torch.equal(outs["new"], outs["old"]))
            recs["merge_ab"].append(row)
            print(f"[{time.time() - t0:4.0f}s] merge A/B {kv} n={n}: " + ", ".join(
                f"{k} {row[f'us_{k}']:.2f} us" for k in ("new", "old", "new2", "old2"))
                + f"; merge program ns new {statistics.median(row['merge_program_and_span_ns_new'][0::2])} old "
                f"{statistics.median(row['merge_program_and_span_ns_old'][0::2])}; bits equal {row['old_new_bits_equal']}",
                flush=True)
            del layers
            torch.cuda.empty_cache()
        for case in [c for c in args.pdl.split(",") if c]:
            from moet.kernels import pdl
            batch, ctx = (int(x) for x in case.split(":"))
            layers = [Layer(fmt, ctx, 4000 + 10 * j, batch) for j in range(args.layers)]
            byt = gqa_bytes_per_token(HKV, D, D, fmt) * ctx * batch
            pfs = [None if x == "d" else int(x) for x in args.prefetch.split(",")]
            splits = [int(x) for x in args.pdl_splits.split(",")]
            variants = [] if args.no_pdl_off else [("pdl off", False, 0, splits[0])]
            variants += [(f"pdl pf{'d' if p is None else p}" + (f" s{sp}" if len(splits) > 1 else ""), True, p, sp)
                         for sp in splits for p in pfs]
            base, row = None, dict(kv=kv, batch=batch, ctx=ctx, us={}, bits_equal={}, relerr_vs_first={})
            for rep in (1, 2):                   # each variant twice, interleaved
                for name, on, pf, sp in variants:
                    pdl.set_small_kernel_pdl(on)
                    try:
                        # sp 0: the default split cap with the long partition at 64 (paged_decode_gqa(long_splits))
                        extra = dict(long_splits=64) if sp == 0 else {}
                        run = graph_of([lambda L=L, pf=pf, sp=sp, extra=extra: L.production(None, sp, prefetch_steps=pf,
                                                                                          **extra)
                                        for L in layers])
                        us = float(tt.do_bench(run, warmup=10, rep=60, return_mode="median")) / len(layers) * 1e3
                        run()
                        torch.cuda.synchronize()
                    finally:
                        pdl.set_small_kernel_pdl(False)
                    got = layers[-1].out.clone()
                    base = got if base is None else base
                    row["us"].setdefault(name, []).append(us)
                    row["bits_equal"][name] = bool(torch.equal(got, base)) and row["bits_equal"].get(name, True)
                    row["relerr_vs_first"][name] = float((got.float() - base.float()).norm() / base.float().norm())
                    del run
            recs["pdl"].append(row)
            print(f"[{time.time() - t0:4.0f}s] pdl {kv} b{batch} ctx={ctx}: " + ", ".join(
                f"{k} {min(v):.1f} us ({byt / min(v) / 1e3:.0f} GB/s)" for k, v in row["us"].items())
                + f"; bits equal {all(row['bits_equal'].values())}, max relerr vs the first "
                f"{max(row['relerr_vs_first'].values()):.1e}", flush=True)
            del layers
            torch.cuda.empty_cache()
        if args.skip_curve:
            continue
        for n in [int(x) for x in args.steps.split(",")]:
            ctx, split_tokens = 2048 * n, 64 * n
            layers = [Layer(fmt, ctx, 1000 + 10 * j) for j in range(args.layers)]
            byt = gqa_bytes_per_token(HKV, D, D, fmt) * ctx
            prod = graph_of([lambda L=L: L.production(split_tokens) for L in layers])
            lab = graph_of([lambda L=L: L.stamped(split_tokens) for L in layers])
            ms_prod = float(tt.do_bench(prod, warmup=10, rep=60, return_mode="median")) / len(layers)
            ms_lab = float(tt.do_bench(lab, warmup=10, rep=60, return_mode="median")) / len(layers)
            ms_one = graph_time_ms(lambda: layers[0].production(split_tokens))
            L = layers[0]
            prod()
            lab()
            torch.cuda.synchronize()
            same = bool(torch.equal(L.out, L.out_lab))
            err = None
            if n in (1, 16):
                want = ref_decode(L.q.float(), L.cache, L.table, L.lens, D ** -0.5).float()
                err = float((L.out.float() - want).norm() / want.norm())
            rec = dict(kv=kv, steps=n, ctx=ctx, us_per_call_graph=ms_prod * 1e3, us_stamped_per_call=ms_lab * 1e3,
                       us_one_call_graph=ms_one * 1e3, gbps=byt / ms_prod / 1e6, lab_bits_equal=same, relerr=err)
            recs["curve"].append(rec)
            print(f"[{time.time() - t0:4.0f}s] {kv} n={n} ctx={ctx}: {ms_prod * 1e3:.1f} us/call (graph of "
                  f"{len(layers)}), {rec['gbps']:.0f} GB/s; stamped {ms_lab * 1e3:.1f}; one-call graph "
                  f"{ms_one * 1e3:.1f}; lab bits equal {same}" + (f", relerr {err:.1e}" if err is not None else ""),
                  flush=True)
            if str(n) in args.stamp_steps.split(","):
                per = []
                for _ in range(5):
                    flush.zero_()
                    lab()
                    torch.cuda.synchronize()
                    per.append(analyse(layers))
                recs["stamps"].append(dict(kv=kv, steps=n, ctx=ctx, replays=per))
                a = per[-1]
                for j, x in enumerate(a):
                    print(f"   layer {j}: split starts {x['split_first_start']}..{x['split_last_start']} ns, ends "
                          f"{x['split_first_end']}/{x['split_median_end']:.0f}/{x['split_last_end']} (first/median/last), "
                          f"program ns {x['program_ns']}, loop cyc {x['loop_cycles']}, epi cyc "
                          f"{x['epilogue_cycles_median']}, cyc/ns {x['cycles_per_ns']}, last {x['last_program']}, "
                          f"SMs {x['distinct_sms']}; merge {x['merge_first_start']}..{x['merge_last_start']} -> "
                          f"{x['merge_last_end']} (program {x['merge_program_ns_median']} ns)", flush=True)
            del layers, prod, lab
            torch.cuda.empty_cache()
        recs.setdefault("splits", [])
        for ctx in [int(x) for x in args.splits_ctx.split(",") if args.splits]:
            layers = [Layer(fmt, ctx, 2000 + 10 * j) for j in range(args.layers)]
            byt = gqa_bytes_per_token(HKV, D, D, fmt) * ctx
            for ms_ in [int(x) for x in args.splits.split(",")]:
                run = graph_of([lambda L=L: L.production(256, ms_) for L in layers])
                ms = float(tt.do_bench(run, warmup=10, rep=60, return_mode="median")) / len(layers)
                recs["splits"].append(dict(kv=kv, ctx=ctx, max_splits=ms_, us_per_call_graph=ms * 1e3,
                                           gbps=byt / ms / 1e6))
                print(f"[{time.time() - t0:4.0f}s] {kv} ctx={ctx} max_splits={ms_}: {ms * 1e3:.1f} us/call, "
                      f"{byt / ms / 1e6:.0f} GB/s", flush=True)
                del run
            del layers
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "gqa_timeline_probe.json"), "w") as f:
        json.dump(recs, f, indent=1)
    for kv in args.kv.split(","):
        pts = [(r["steps"], r["us_per_call_graph"]) for r in recs["curve"] if r["kv"] == kv]
        if len(pts) >= 2:
            xs, ys = zip(*pts)
            mx, my = statistics.mean(xs), statistics.mean(ys)
            s = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x in xs)
            print(f"{kv}: T(n) ~ {my - s * mx:.2f} us + {s:.3f} us x n (least squares over n = {list(xs)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
