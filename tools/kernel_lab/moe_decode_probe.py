"""What the x stall of the decode GEMMs costs (Nsight Compute, run 20: at T = 1 the top stall of both
grouped GEMMs is a long-scoreboard wait on the step's activation slices, which Triton loads straight
into the MMA registers when a token tile has BM < 4 rows, and stages through shared memory with
cp.async from BM 4 on -- sm_90 SASS of the AOT build). Variants of the table's decode config:

  BM 1 / 4 / 8      token tile (at T = 1 every tile holds one pair: the extra rows are masked, the
                    m16n8k16 MMA count is the same for BM <= 8)
  unroll 1 / 2      GemmConfig.unroll of gate/up and down (the K loop body twice: one step's x loads
                    in flight during the other's dots)

Each variant: the layer's output compared with the table config's (bit-identical expected), the
layer timed as moe_kernel_tune does (CUDA graph of 8 routings, L2 never warm), GB/s on the bytes
of the distinct experts touched, % of a bf16 GEMV timed in the same run. JSON + markdown to --out.

    python tools/kernel_lab/moe_decode_probe.py --out DIR [--shapes deepseek,glm,qwen] [--tokens 1,8]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from dataclasses import replace

import torch
from moe_probe_common import start


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="deepseek,glm,qwen")
    ap.add_argument("--formats", default="w2,fp4")
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--bms", default="1,4,8")
    ap.add_argument("--unrolls", default="1,2")
    args = ap.parse_args()
    from moet.bench.moe_kernel_tune import SHAPES, expert_bytes, make_pool, routing, time_layer
    from moet.kernels import moe_triton as mt
    from moet.kernels.launch_tables import device_name
    from moet.kernels.moe_configs import lookup
    dev, t0, gemv, rep = start(args.out)
    lines = ["| shape | fmt | T | BM | unroll gu/dn | us | GB/s | % GEMV | same bits as table |", "|---" * 9 + "|"]
    gen = torch.Generator(device=dev).manual_seed(0)
    for sname in args.shapes.split(","):
        h, i, e, k = SHAPES[sname]
        for fmt in args.formats.split(","):
            pool = make_pool(fmt, e, h, i, dev, gen)
            eb = expert_bytes(pool)
            table = torch.arange(e, dtype=torch.int32, device=dev)
            for t in [int(x) for x in args.tokens.split(",")]:
                base = mt.fit_token_tile(lookup(fmt, h, i, t * k, device_name(dev)), t * k, e)
                x = torch.randn(t, h, device=dev, generator=gen).bfloat16()
                ids, w = routing(t, e, k, dev, gen)
                miss = torch.zeros(1, dtype=torch.int64, device=dev)
                ref = mt.moe_experts_triton(x, ids, w, table, pool, miss, config=base)
                for bm, ug, ud in itertools.product([int(v) for v in args.bms.split(",")],
                                                    [int(v) for v in args.unrolls.split(",")],
                                                    [int(v) for v in args.unrolls.split(",")]):
                    c = replace(base, BM=bm, gate_up=replace(base.gate_up, unroll=ug),
                                down=replace(base.down, unroll=ud))
                    row = {"shape": sname, "fmt": fmt, "T": t, "cfg": c.to_json()}
                    try:
                        out = mt.moe_experts_triton(x, ids, w, table, pool, miss, config=c)
                        row["same_bits"] = bool(torch.equal(out, ref))
                        row["relerr_vs_table"] = float((out.double() - ref.double()).norm() / ref.double().norm())
                        row.update(time_layer(mt, pool, h, e, k, t, dev, gen, c, eb))
                        row["pct_gemv"] = 100 * row["GBps"] / gemv
                    except Exception as exc:      # e.g. out of shared memory
                        row["error"] = str(exc)[:300]
                    rep["rows"].append(row)
                    if "us" in row:
                        lines.append(f"| {sname} | {fmt} | {t} | {bm} | {ug}/{ud} | {row['us']:.1f} | {row['GBps']:.0f} | "
                                     f"{row['pct_gemv']:.1f}% | {row['same_bits']} |")
                        print(f"[{time.time() - t0:4.0f}s] {sname} {fmt} T{t} BM{bm} unroll {ug}/{ud}: {row['us']:.1f} us "
                              f"{row['GBps']:.0f} GB/s {row['pct_gemv']:.1f}% same_bits={row['same_bits']}", flush=True)
                    else:
                        print(f"[{time.time() - t0:4.0f}s] {sname} {fmt} T{t} BM{bm} unroll {ug}/{ud}: {row['error']}",
                              flush=True)
                    with open(os.path.join(args.out, "moe_decode_probe.json"), "w") as f:
                        json.dump(rep, f, indent=1)
            del pool
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "moe_decode_probe.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"done in {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
