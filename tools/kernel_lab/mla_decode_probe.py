"""The paged MLA decode's tile forms and launches on the GPU (issue 5's MLA rows: compute-bound at
DeepSeek-V3's 128 heads, ~142 TFLOP/s at batch 32 = ~18% of the bf16 MMA rate, run 23).

  base        the launcher's defaults (mla_decode_form; since run 25 = "hm eager n64" for bf16 and
              fp8-block caches)
  t32, t64    the transposed tile (tokens as the MMAs' M, so at 32 tokens a step the score dot is
              mma.sync and only P @ latent runs on wgmma), 8 warps, 2 stages; lazy = slack 8
  hm*         heads_m=True: the heads as M (FlashMLA's form; sm_90 AOT: 74 HGMMA a step, no HMMA),
              with the eager online softmax (slack 0: 230 registers, no spills) or lazy (spills)
  n16/n64     16 / 64 tokens a step; s3: 3 cp.async stages
(Run 25's first call named the then-default "base" = today's "t32 lazy" (bf16) / "t32 eager" (fp8-block),
and "base n64" = "t64 lazy" / "t64".)
(Run 25b also timed "g4": fp8_ds_mla read as one dot per scale group with the scales on the scores
and P instead of the tile; slower in every case, removed: docs/perf.md, attention "Run 25".)

DeepSeek-V3 absorbed heads (128 heads, latent 512 + rope 64), bf16 queries, pages of 16, bf16 and
fp8_ds_mla (fp8-block) caches of random values, a random block table. Batch 1 outputs are checked
against the torch reference (float32); every variant's rerun must be bit-identical. Timing: CUDA
graph, do_bench median. TFLOP/s = 2 * B * H * ctx * (2R + P) / time; GB/s = cache bytes read / time.

    python tools/kernel_lab/mla_decode_probe.py --out DIR [--ctx 32768] [--batches 1,8,32] [--only a,b]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

BS = 16
H, R, P = 128, 512, 64

VARIANTS = [
    ("base", {}),                                            # the launcher's default (mla_decode_form)
    ("t32 lazy", dict(heads_m=False, block_n=32, rescale_slack=8.0)),   # run 23's bf16 default
    ("t32 eager", dict(heads_m=False, block_n=32, rescale_slack=0.0)),  # run 23's fp8-block default
    ("t32 s3", dict(heads_m=False, block_n=32, num_stages=3)),
    ("t64", dict(heads_m=False, block_n=64)),
    ("t64 lazy", dict(heads_m=False, block_n=64, rescale_slack=8.0)),
    ("hm", dict(heads_m=True, block_n=32, rescale_slack=8.0)),
    ("hm eager", dict(heads_m=True, block_n=32, rescale_slack=0.0)),
    ("hm eager s3", dict(heads_m=True, block_n=32, rescale_slack=0.0, num_stages=3)),
    ("hm eager n16", dict(heads_m=True, rescale_slack=0.0, block_n=16)),
    ("hm eager n16 s4", dict(heads_m=True, rescale_slack=0.0, block_n=16, num_stages=4)),
    ("hm eager n64", dict(heads_m=True, rescale_slack=0.0, block_n=64)),
    ("hm n64", dict(heads_m=True, block_n=64, rescale_slack=8.0)),
    # more splits per sequence (the default form): at batch 1, 32 splits x 2 head blocks = 64
    # programs on 132 SMs
    ("splits64", dict(max_splits=64)),
    ("splits128", dict(max_splits=128)),
]


def time_ms(fn) -> float:
    from moet.bench.timing import graph_time_ms
    return graph_time_ms(fn)


def make_cache(fmt, nb: int, seed: int):
    """A cache of nb pages of random values, generated on the GPU in chunks."""
    from moet.kernels.kv_cache import new_mla_layer
    cache = new_mla_layer(nb, BS, R, P, fmt, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    step = 4096
    for i in range(0, nb, step):
        sl = slice(i, min(nb, i + step))
        lat = cache.latent[sl]
        lat.copy_(torch.randn(lat.shape, device="cuda", generator=g).to(lat.dtype))
        rope = cache.rope[sl]
        rope.copy_(torch.randn(rope.shape, device="cuda", generator=g).to(rope.dtype))
        if fmt.block_scaled:
            sc = cache.latent_scale[sl]
            sc.copy_(torch.rand(sc.shape, device="cuda", generator=g) * 0.02 + 0.005)
    return cache


PREFILL_VARIANTS = [
    ("prefill t32", {}),                                     # the launcher's default: transposed, 32 keys a step
    ("prefill hm n64", dict(heads_m=True)),
    ("prefill hm n32", dict(heads_m=True, block_n=32)),
    # GQA's prefill won 32% with 16 warps (run 28); the MLA tile at 16 warps is register-bound
    # (sm_90 AOT, bf16: 128 registers, 142 spilled ops, 106 in the loop; 32 keys: 60 / 37)
    ("prefill hm w16", dict(heads_m=True, num_warps=16)),
    ("prefill hm n32 w16", dict(heads_m=True, block_n=32, num_warps=16)),
]


def prefill(args, fmts, scale, t0) -> list[dict]:
    """paged_prefill_mla over one causal prompt of args.prefill tokens (no cached context):
    TFLOP/s of the absorbed form, 2 * H * (2R + P) per (query, key <= query) pair."""
    from moet.kernels import mla_prefill_triton as mp
    from moet.kernels.attention_reference import paged_decode_mla as ref_decode
    n = args.prefill
    pages = -(-n // BS)
    table = torch.randperm(pages, device="cuda").view(1, pages).to(torch.int32)
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    lens = torch.tensor([n], dtype=torch.int32, device="cuda")
    flop = 2.0 * H * (2 * R + P) * n * (n + 1) / 2
    recs = []
    for fname, fmt in fmts:
        cache = make_cache(fmt, pages, 4321)
        ql = torch.randn(n, H, R, device="cuda", dtype=torch.bfloat16)
        qr = torch.randn(n, H, P, device="cuda", dtype=torch.bfloat16)
        rows = torch.randperm(n, device="cuda")[:64]            # the reference on 64 query rows
        want = None
        for name, kw in PREFILL_VARIANTS:
            run = lambda: mp.paged_prefill_mla(ql, qr, cache, table, cu, lens, scale, max_seqlen_q=n, **kw)
            try:
                got = run()
                torch.cuda.synchronize()
                ms = time_ms(run)
            except Exception as exc:
                print(f"{fname} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                recs.append(dict(kv=fname, variant=name, kwargs=kw, error=str(exc)[:500]))
                continue
            if want is None:                # row t of the prompt = a decode over its first t + 1 keys
                want = torch.cat([ref_decode(ql[t:t + 1].float(), qr[t:t + 1].float(), cache, table,
                                             torch.tensor([t + 1], dtype=torch.int32, device="cuda"), scale)
                                  for t in rows.tolist()]).float()
            err = float((got[rows].float() - want).norm() / want.norm()) if want is not None else None
            same = bool(torch.equal(run(), got))
            r = dict(kv=fname, variant=name, kwargs=kw, tokens=n, ms=ms, tflops=flop / ms / 1e9,
                     rel_err_vs_reference=err, rerun_identical=same)
            recs.append(r)
            print(f"[{time.time() - t0:5.0f}s] prefill {n} {fname} {name}: {ms:.2f} ms, {r['tflops']:.1f} TFLOP/s"
                  + (f", relerr {err:.1e}" if err is not None else "") + f", rerun identical {same}", flush=True)
        del cache
        torch.cuda.empty_cache()
    return recs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--kv", default="bf16,fp8-block")
    ap.add_argument("--only", default="", help="comma-separated variant names")
    ap.add_argument("--prefill", type=int, default=0, help="also time paged_prefill_mla on one prompt of this "
                                                           "many tokens, PREFILL_VARIANTS")
    args = ap.parse_args()
    from moet.kernels import mla_decode_triton as md
    from moet.kernels.attention_reference import paged_decode_mla as ref_decode
    from moet.kernels.kv_cache import KVFormat, mla_bytes_per_token
    os.makedirs(args.out, exist_ok=True)
    fmts = [(n, f) for n, f in (("bf16", KVFormat("auto", dtype=torch.bfloat16)),
                                ("fp8-block", KVFormat("fp8_e4m3", "block", group=128, dtype=torch.bfloat16)))
            if n in args.kv.split(",")]
    variants = [v for v in VARIANTS if not args.only or v[0] in args.only.split(",")]
    scale = 1.0 / (R + P) ** 0.5
    recs, t0 = [], time.time()
    for batch in [int(x) for x in args.batches.split(",") if x]:
        pages = args.ctx // BS
        nb = batch * pages + 1
        lens = torch.full((batch,), args.ctx, dtype=torch.int32, device="cuda")
        g = torch.Generator(device="cuda").manual_seed(99)
        table = torch.randperm(nb - 1, device="cuda", generator=g)[:batch * pages].view(batch, pages).to(torch.int32)
        for fname, fmt in fmts:
            cache = make_cache(fmt, nb, 1234)
            ql = torch.randn(batch, H, R, device="cuda", dtype=torch.bfloat16)
            qr = torch.randn(batch, H, P, device="cuda", dtype=torch.bfloat16)
            want = ref_decode(ql.float(), qr.float(), cache, table, lens, scale).float() if batch == 1 else None
            byt = mla_bytes_per_token(R, P, fmt) * args.ctx * batch
            flop = 2.0 * batch * H * args.ctx * (2 * R + P)
            for name, kw in variants:
                out = torch.empty(batch, H, R, device="cuda", dtype=torch.bfloat16)
                split = dict(split_tokens=64)             # the engine's (attention_ops.DEFAULT_SPLIT_TOKENS)
                try:
                    run = lambda: md.paged_decode_mla(ql, qr, cache, table, lens, scale, out=out, **split, **kw)
                    run()
                    torch.cuda.synchronize()
                    got = out.clone()
                    ms = time_ms(run)
                except Exception as exc:         # e.g. out of shared memory
                    print(f"b{batch} {fname} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    recs.append(dict(batch=batch, kv=fname, variant=name, kwargs=kw, error=str(exc)[:500]))
                    continue
                err = float((got.float() - want).norm() / want.norm()) if want is not None else None
                same = bool(torch.equal(run().clone(), got))
                r = dict(batch=batch, kv=fname, variant=name, kwargs=kw, split=split, ms=ms, tflops=flop / ms / 1e9,
                         gbps=byt / ms / 1e6, rel_err_vs_reference=err, rerun_identical=same)
                recs.append(r)
                print(f"[{time.time() - t0:5.0f}s] b{batch} {fname} {name}: {ms * 1e3:.1f} us, {r['tflops']:.1f} TFLOP/s, "
                      f"{r['gbps']:.0f} GB/s" + (f", relerr {err:.1e}" if err is not None else "")
                      + f", rerun identical {same}", flush=True)
            del cache
            torch.cuda.empty_cache()
    if args.prefill:
        recs += prefill(args, fmts, scale, t0)
    with open(os.path.join(args.out, "mla_decode_probe.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, ctx=args.ctx,
                       date_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), records=recs), f, indent=1)
    keys = sorted({(r["batch"], r["kv"]) for r in recs if "batch" in r})
    lines = ["| variant | " + " | ".join(f"b{b} {k}" for b, k in keys) + " |", "|---|" + "---|" * len(keys)]
    for name, _ in variants:
        row = {(r["batch"], r["kv"]): r.get("tflops", 0) for r in recs if r["variant"] == name and "batch" in r}
        lines.append(f"| {name} | " + " | ".join(f"{row.get(k, 0):.1f}" for k in keys) + " |")
    table_md = "TFLOP/s\n" + "\n".join(lines)
    print(table_md)
    with open(os.path.join(args.out, "mla_decode_probe.md"), "w") as f:
        f.write(table_md + "\n")
    bad = [r for r in recs if "error" not in r and (not r["rerun_identical"]
                                                  or (r["rel_err_vs_reference"] or 0) > 2e-2)]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
