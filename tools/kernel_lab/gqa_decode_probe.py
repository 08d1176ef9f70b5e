"""What holds the paged GQA decode at batch 1 (32K context) to ~45% of the copy bandwidth:
the production kernel (attention_triton.paged_decode_gqa, its launch table) on caches that differ
only in where the bytes are, so no kernel change is needed to tell the suspects apart:

  base       [NB, 16, Hkv, D] pages (a head's 16 rows of 256 B at 1 KB strides), random block table
  ident      the same pages in table order (block i of a sequence = physical block i): DRAM locality
  hnd        [NB, Hkv, 16, D] storage seen through a permuted view (a head's page one 4 KB run)
  bs64       pages of 64 tokens (one block-table entry per 64-token tile instead of four)
  base_pdl   base with the small kernels under PDL (the engine's default since run 18; in the default list)
  s9 .. s21  deeper cp.async pipelines (launch keywords of paged_decode_gqa; same bits as base)
  t128, w8   128-token loop steps, 8 warps

(Run 19's second call also timed a per-page online-softmax variant of the kernel, since removed:
docs/perf.md, attention "Run 19"; runs 21b / 22 timed chains2_* variants, paged_decode_gqa(chains=2)
with two online-softmax chains per program, slower in every case and removed: attention "Run 22".)

Qwen3-30B-A3B heads (32 q / 4 kv, d 128), bf16 queries, bf16 and fp8 (per-tensor) caches, batch
1 / 8 / 32. Every variant's output is checked against base (same math: bit-identical expected
except bs64, whose split partition differs: relative error reported). Timing as attention_bench
(CUDA graph, do_bench with L2 flushed, median); GB/s = KV bytes read / time. Writes
$OUT-style JSON + a markdown table to --out.

    python tools/kernel_lab/gqa_decode_probe.py --out DIR [--ctx 32768] [--batches 1,8,32]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch


def time_ms(fn) -> float:
    from moet.bench.timing import graph_time_ms
    return graph_time_ms(fn)


def make_cache(fmt, nb: int, bs: int, hkv: int, d: int, hnd: bool, gen_seed: int):
    from moet.kernels.kv_cache import GQALayerKV, new_gqa_layer
    ref = new_gqa_layer(1, bs, hkv, d, d, fmt, device="cuda")          # for the dtype and scales
    dt = ref.k.dtype
    g = torch.Generator(device="cuda").manual_seed(gen_seed)

    def one():
        shape = (nb, hkv, bs, d) if hnd else (nb, bs, hkv, d)
        t = torch.empty(shape, dtype=dt, device="cuda")
        step = max(1, (1 << 26) // t[0].numel())
        for i in range(0, nb, step):
            t[i:i + step] = torch.randn(t[i:i + step].shape, device="cuda", generator=g).to(dt)
        return t.permute(0, 2, 1, 3) if hnd else t          # always seen as [NB, BS, Hkv, D]

    ks = vs = None
    if ref.k_scale is not None:      # per-tensor: one scale; per-block: one per (page, row, head, group)
        shape = ref.k_scale.shape if ref.k_scale.numel() == 1 else (nb, *ref.k_scale.shape[1:])
        ks = torch.full(shape, 0.05, dtype=ref.k_scale.dtype, device="cuda")
        vs = torch.full(shape, 0.05, dtype=ref.v_scale.dtype, device="cuda")
    return GQALayerKV(fmt, one(), one(), ks, vs)


# (name, rows of (query token, head) a program or None for the default, paged_prefill_gqa keywords);
# block_m = rows / next_pow2(G). Runs 25e / 28 (Qwen3 heads, bf16) timed more (docs/perf.md attention):
# 256 rows +11.5%, 128 keys +4%, 256 rows x 16 warps +32% (sm_90 AOT: 18 spills, 1 in the loop)
PREFILL_VARIANTS = [
    ("base", None, {}),          # the default (prefill_triton.prefill_launch): 256 rows x 64 keys, 16 / 8 warps
    ("256 rows", 256, {}),
    ("256 rows w16", 256, dict(num_warps=16)),
    ("256 rows w16 s2", 256, dict(num_warps=16, num_stages=2)),
    ("256 rows w16 n32", 256, dict(num_warps=16, block_n=32)),
    ("128 rows w16", 128, dict(num_warps=16)),
    ("512 rows w16", 512, dict(num_warps=16)),
    ("128 rows w8", 128, dict(num_warps=8, num_stages=3)),           # the default before run 28
]
# (name, q heads, kv heads, head dim): Qwen3-30B-A3B (G 8), GLM-4.5-Air (96 / 8: G 12, padded to 16)
PREFILL_HEADS = [("qwen3", 32, 4, 128), ("glm45", 96, 8, 128)]


def prefill(args) -> int:
    """paged_prefill_gqa on one causal prompt of args.prefill tokens for each of PREFILL_HEADS x
    bf16 / fp8 per-tensor / fp8 block-128 caches, bf16 queries: TFLOP/s = 4 * Hq * D * n (n + 1) / 2
    / time; 64 query rows checked against the reference, reruns compared bit for bit."""
    import triton

    from moet.kernels import prefill_triton as pt
    from moet.kernels.attention_reference import paged_decode_gqa as ref_decode
    from moet.kernels.kv_cache import KVFormat
    bs, n = 16, args.prefill
    os.makedirs(args.out, exist_ok=True)
    pages = -(-n // bs)
    recs = []
    fmts = [("bf16", KVFormat("auto", dtype=torch.bfloat16)), ("fp8", KVFormat("fp8_e4m3", "tensor")),
            ("fp8-block", KVFormat("fp8_e4m3", "block", group=128, dtype=torch.bfloat16))]
    for hname, hq, hkv, d in PREFILL_HEADS:
        scale = d ** -0.5
        block_g = triton.next_power_of_2(hq // hkv)
        for fname, fmt in fmts:
            if fname not in args.kv.split(","):
                continue
            cache = make_cache(fmt, pages, bs, hkv, d, False, gen_seed=77)
            table = torch.randperm(pages, device="cuda").view(1, pages).to(torch.int32)
            q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16)
            cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
            lens = torch.tensor([n], dtype=torch.int32, device="cuda")
            rows = torch.randperm(n, device="cuda")[:64].tolist()
            want = torch.cat([ref_decode(q[t:t + 1].float(), cache, table,
                                         torch.tensor([t + 1], dtype=torch.int32, device="cuda"), scale)
                              for t in rows]).float()
            flop = 4.0 * hq * d * n * (n + 1) / 2
            for name, nrows, kw in PREFILL_VARIANTS:
                kw = dict(kw, **({"block_m": max(1, nrows // block_g)} if nrows else {}))
                run = lambda: pt.paged_prefill_gqa(q, cache, table, cu, lens, scale, max_seqlen_q=n, **kw)
                try:
                    got = run()
                    torch.cuda.synchronize()
                    ms = time_ms(run)
                except Exception as exc:
                    print(f"prefill {n} {hname} {fname} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    recs.append(dict(heads=hname, kv=fname, variant=name, kwargs=kw, error=str(exc)[:500]))
                    continue
                err = float((got[rows].float() - want).norm() / want.norm())
                same = bool(torch.equal(run(), got))
                recs.append(dict(heads=hname, kv=fname, variant=name, kwargs=kw, tokens=n, ms=ms,
                                 tflops=flop / ms / 1e9, rel_err_vs_reference=err, rerun_identical=same))
                print(f"prefill {n} {hname} {fname} {name}: {ms:.3f} ms, {flop / ms / 1e9:.1f} TFLOP/s, "
                      f"relerr {err:.1e}, rerun identical {same}", flush=True)
            del cache
    with open(os.path.join(args.out, "gqa_prefill_probe.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, records=recs), f, indent=1)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--layouts", action="store_true", help="also the layout / table-order / page-size variants")
    ap.add_argument("--only", default="", help="comma-separated variant names to run (e.g. base,splits64: "
                                               "one kernel per variant under a profiler)")
    ap.add_argument("--kv", default="bf16,fp8", help="KV formats: bf16, fp8 (--prefill: also fp8-block)")
    ap.add_argument("--amortize", type=int, default=0,
                    help="also time one CUDA graph of N calls over N distinct caches (per-call time = total / N): "
                         "the graph launch's fixed cost, which a one-call graph pays per call and the engine's "
                         "decode-step graph pays once for all its layers, spread over N calls")
    ap.add_argument("--prefill", type=int, default=0,
                    help="only time paged_prefill_gqa on one causal prompt of this many tokens (PREFILL_VARIANTS)")
    args = ap.parse_args()
    if args.prefill:
        return prefill(args)
    os.makedirs(args.out, exist_ok=True)
    from moet.kernels import attention_triton, pdl
    from moet.kernels.kv_cache import KVFormat, gqa_bytes_per_token
    hq, hkv, d = 32, 4, 128
    scale = d ** -0.5
    fmts = [("bf16", KVFormat("auto", dtype=torch.bfloat16)), ("fp8", KVFormat("fp8_e4m3", "tensor"))]
    # (name, block size, HND storage, identity table, PDL, paged_decode_gqa keywords)
    variants = [("base", 16, False, False, False, {}), ("base_pdl", 16, False, False, True, {})]
    if args.layouts:                    # run 19's first call (layout, table order, page size, PDL)
        variants += [("ident", 16, False, True, False, {}), ("hnd", 16, True, False, False, {}),
                     ("bs64", 64, False, False, False, {})]
    variants += [
                # deeper K/V pipelines: Triton 3.6 gives the K and V loads of this loop only
                # ceil(num_stages / 2) buffers (the block-table load in front of them takes the other
                # stages; sm_90 TTGIR: 7 stages -> 3 K/V buffers), so the table's 7 stages keep only
                # two steps in flight. Same math, same bits expected (checked against base)
                ("s9", 16, False, False, False, dict(num_warps=4, num_stages=9)),
                ("s11", 16, False, False, False, dict(num_warps=4, num_stages=11)),
                ("s13", 16, False, False, False, dict(num_warps=4, num_stages=13)),
                ("s17", 16, False, False, False, dict(num_warps=4, num_stages=17)),
                ("s21", 16, False, False, False, dict(num_warps=4, num_stages=21)),
                # longer loop steps (more bytes and independent dots per step) and 8 warps
                ("t128 w4 s7", 16, False, False, False, dict(tile_tokens=128, num_warps=4, num_stages=7)),
                ("t64 w8 s11", 16, False, False, False, dict(num_warps=8, num_stages=11)),
                # more programs per sequence: 64 splits of 512 tokens (2 programs per SM at batch 1)
                ("splits64", 16, False, False, False, dict(split_tokens=256, max_splits=64)),
                # the transposed update (swap_ab: tokens as the MMAs' M, so sm_90 runs wgmma with K / V
                # read from shared memory; sm_90 AOT bf16: 16 HGMMA.64 a step instead of 32 HMMA + 28
                # LDSM, 581 instructions against 522); 8 warps = two warp groups over 128-token steps
                ("swap", 16, False, False, False, dict(swap_ab=True)),
                ("swap s3", 16, False, False, False, dict(swap_ab=True, num_warps=4, num_stages=3)),
                ("swap s5", 16, False, False, False, dict(swap_ab=True, num_warps=4, num_stages=5)),
                ("swap w8 s5", 16, False, False, False, dict(swap_ab=True, num_warps=8, num_stages=5)),
                ("swap t128 w8 s3", 16, False, False, False, dict(swap_ab=True, tile_tokens=128, num_warps=8,
                                                                   num_stages=3)),
                ("swap t128 w8 s5", 16, False, False, False, dict(swap_ab=True, tile_tokens=128, num_warps=8,
                                                                   num_stages=5)),
                ("swap splits64 s3", 16, False, False, False, dict(swap_ab=True, split_tokens=256, max_splits=64,
                                                                    num_warps=4, num_stages=3)),
                # fp8 caches read as int32 words, the dots split by byte slot (fp8_words; sm_90 AOT at 5
                # stages: 568 loop instructions against 785, the 64 LDS.U8 and ~110 moves gone); the
                # default for fp8 caches since run 25, so "bytes" is the byte tile it replaced
                ("bytes", 16, False, False, False, dict(fp8_words=False)),
                ("f8w", 16, False, False, False, dict(fp8_words=True)),
                ("f8w s3", 16, False, False, False, dict(fp8_words=True, num_warps=4, num_stages=3)),
                ("f8w s7", 16, False, False, False, dict(fp8_words=True, num_warps=4, num_stages=7)),
                ("f8w splits64", 16, False, False, False, dict(fp8_words=True, split_tokens=256, max_splits=64)),
                ("f8w t128 s3", 16, False, False, False, dict(fp8_words=True, tile_tokens=128, num_warps=4,
                                                              num_stages=3))]
    if args.only:
        keep = set(args.only.split(","))
        variants = [v for v in variants if v[0] in keep]
    fmts = [f for f in fmts if f[0] in args.kv.split(",")]
    recs, t0 = [], time.time()
    for batch in [int(x) for x in args.batches.split(",")]:
        for fname, fmt in fmts:
            q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
            lens = torch.full((batch,), args.ctx, dtype=torch.int32, device="cuda")
            base_out = None
            for name, bs, hnd, ident, use_pdl, kw in variants:
                pages = args.ctx // bs
                nb = batch * pages + 1
                cache = make_cache(fmt, nb, bs, hkv, d, hnd, gen_seed=1234)
                if ident:
                    table = torch.arange(batch * pages, device="cuda", dtype=torch.int32).view(batch, pages)
                else:
                    g = torch.Generator(device="cuda").manual_seed(99)
                    table = torch.randperm(nb - 1, device="cuda", generator=g)[:batch * pages].view(
                        batch, pages).to(torch.int32)
                out = torch.empty(batch, hq, d, device="cuda", dtype=q.dtype)
                pdl.set_small_kernel_pdl(use_pdl)
                try:
                    run = lambda: attention_triton.paged_decode_gqa(q, cache, table, lens, scale, out=out, **kw)
                    run()
                    torch.cuda.synchronize()
                    got = out.clone()
                    ms = time_ms(run)
                    ms_amortized = None
                    if args.amortize > 1:
                        others = [make_cache(fmt, nb, bs, hkv, d, hnd, gen_seed=1235 + j) for j in range(args.amortize - 1)]
                        outs = [torch.empty_like(out) for _ in others]
                        calls = [run] + [lambda c=c, o=o: attention_triton.paged_decode_gqa(q, c, table, lens, scale,
                                                                                           out=o, **kw)
                                         for c, o in zip(others, outs)]
                        ms_amortized = time_ms(lambda: [c() for c in calls]) / len(calls)
                        del others, outs, calls
                except Exception as exc:       # e.g. out of shared memory for this many stages
                    print(f"b{batch} {fname} {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    recs.append(dict(batch=batch, kv=fname, variant=name, kwargs=kw, error=str(exc)[:500]))
                    del cache, table
                    torch.cuda.empty_cache()
                    continue
                finally:
                    pdl.set_small_kernel_pdl(False)
                # each variant's random bytes sit elsewhere, so outputs differ between variants:
                # each is checked against the torch reference (batch 1: the float32 reference of a
                # 32K context is cheap there)
                from moet.kernels.attention_reference import paged_decode_gqa as ref_decode
                if batch == 1:
                    want = ref_decode(q.float(), cache, table, lens, scale).float()
                    err = float((got.float() - want).norm() / want.norm())
                else:
                    err = None
                rerun = run().clone()
                same = bool(torch.equal(rerun, got))
                if name == "base":
                    base_out = got
                bits_as_base = bool(torch.equal(got, base_out)) if (kw and base_out is not None) else None
                byt = gqa_bytes_per_token(hkv, d, d, fmt) * args.ctx * batch
                r = dict(batch=batch, kv=fname, variant=name, block_size=bs, hnd=hnd, identity_table=ident,
                         pdl=use_pdl, kwargs=kw, ms=ms, gbps=byt / ms / 1e6, rel_err_vs_reference=err, rerun_identical=same,
                         bits_as_base=bits_as_base, ms_amortized=ms_amortized,
                         gbps_amortized=byt / ms_amortized / 1e6 if ms_amortized else None)
                recs.append(r)
                print(f"[{time.time() - t0:5.0f}s] b{batch} {fname} {name}: {ms * 1e3:.1f} us, {r['gbps']:.0f} GB/s"
                      + (f" (graph of {args.amortize}: {ms_amortized * 1e3:.1f} us, {r['gbps_amortized']:.0f} GB/s per call)"
                         if ms_amortized else "")
                      + (f", relerr {err:.1e}" if err is not None else "") + f", rerun identical {same}" + ("" if bits_as_base is None else f", bits as base {bits_as_base}"), flush=True)
                del cache, table
                torch.cuda.empty_cache()
    with open(os.path.join(args.out, "gqa_decode_probe.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, ctx=args.ctx, records=recs), f,
                  indent=1)
    keys = sorted({(r["batch"], r["kv"]) for r in recs})
    lines = ["| variant | " + " | ".join(f"b{b} {k}" for b, k in keys) + " |",
             "|---|" + "---|" * len(keys)]
    for name, *_ in variants:
        row = {(r["batch"], r["kv"]): r.get("gbps", 0) for r in recs if r["variant"] == name}
        lines.append(f"| {name} | " + " | ".join(f"{row.get(k, 0):.0f}" for k in keys) + " |")
        if args.amortize > 1:
            row = {(r["batch"], r["kv"]): r.get("gbps_amortized") or 0 for r in recs if r["variant"] == name}
            lines.append(f"| {name}, graph of {args.amortize} | " + " | ".join(f"{row.get(k, 0):.0f}" for k in keys) + " |")
    md = "\n".join(lines)
    print(md)
    with open(os.path.join(args.out, "gqa_decode_probe.md"), "w") as f:
        f.write(md + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
