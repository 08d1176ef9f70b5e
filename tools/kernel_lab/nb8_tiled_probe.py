"""Does the row-tiled pool layout (W2 nb8t, FP4 nvfp4t) speed up moet's MoE layer? (docs/perf.md, "Run 26": in the
e4m3 lab GEMV, a layout with each 64-row x 256-weight tile contiguous plus >= 8 KB a loop step
lifted the T = 1 gate/up stack +14%; moet's nb8 decode step reads 64 B per row, as that lab's
row-major form did.)

Per shape and T: the table config and wider K steps (gate/up / down BKH 64, BN 64) on the nb8 pool
and on its nb8t copy (moet.formats.w2.tile_rows: the same bytes, permuted). Each nb8t output is
compared with the nb8 output of the same config (bit-identical expected: the same math in the same
order); each config's output with the table config's (relerr: wider K steps sum in another order).
Timing as moe_kernel_tune (CUDA graph of 8 routings, GB/s on the distinct experts' bytes).

    python tools/kernel_lab/nb8_tiled_probe.py --out DIR [--shapes deepseek,qwen] [--tokens 1,8] [--formats w2,fp4]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace

import torch
from moe_probe_common import start


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="deepseek,qwen")
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--formats", default="w2", help="w2 (nb8 vs nb8t) and / or fp4 (nvfp4 vs nvfp4t)")
    ap.add_argument("--budget-s", type=float, default=200)
    args = ap.parse_args()
    from moet.bench.moe_kernel_tune import SHAPES, expert_bytes, make_pool, routing, time_layer
    from moet.kernels import moe_triton as mt
    from moet.kernels.launch_tables import device_name
    from moet.kernels.moe_configs import lookup
    from moet.kernels.pools import row_major, row_tiled
    dev, t0, gemv, rep = start(args.out)
    gen = torch.Generator(device=dev).manual_seed(0)

    def row_major_and_tiled(fmt, e, h, i):
        pool = make_pool(fmt, e, h, i, dev, gen)     # the model's layout for these shapes (random bytes)
        pool = row_major(pool) if pool.layout in ("nb8t", "nvfp4t") else pool
        return pool, row_tiled(pool)

    for sname, fmt in [(s_, f_) for s_ in args.shapes.split(",") for f_ in args.formats.split(",")]:
        h, i, e, k = SHAPES[sname]
        pool, tiled = row_major_and_tiled(fmt, e, h, i)
        eb = expert_bytes(pool)
        table = torch.arange(e, dtype=torch.int32, device=dev)
        for t in [int(x) for x in args.tokens.split(",")]:
            base = mt.fit_token_tile(lookup(fmt, h, i, t * k, device_name(dev)), t * k, e)
            variants = {"table": base,
                        "gu BKH 64": replace(base, gate_up=replace(base.gate_up, BKH=64)),
                        "dn BKH 64": replace(base, down=replace(base.down, BKH=64)),
                        "gu+dn BKH 64": replace(base, gate_up=replace(base.gate_up, BKH=64),
                                                down=replace(base.down, BKH=64)),
                        "gu BN 64 BKH 64 w4": replace(base, gate_up=replace(base.gate_up, BN=64, BKH=64, num_warps=4))}
            x = torch.randn(t, h, device=dev, generator=gen).bfloat16()
            ids, wts = routing(t, e, k, dev, gen)
            ref = None
            for vname, cfg in variants.items():
                if time.time() - t0 > args.budget_s:
                    print("budget: stop", flush=True)
                    break
                outs = {}
                for lname, p in ((pool.layout, pool), (tiled.layout, tiled)):
                    miss = torch.zeros(1, dtype=torch.int64, device=dev)
                    try:
                        outs[lname] = mt.moe_experts_triton(x, ids, wts, table, p, miss, config=cfg)
                        rec = time_layer(mt, p, h, e, k, t, dev, gen, cfg, eb)
                    except Exception as exc:                      # out of resources etc.: recorded
                        print(f"{sname} T {t} {vname} {lname}: {exc!r}"[:300], flush=True)
                        rep["rows"].append(dict(shape=sname, fmt=fmt, t=t, variant=vname, layout=lname,
                                                error=repr(exc)[:300]))
                        continue
                    rec.update(shape=sname, fmt=fmt, t=t, variant=vname, layout=lname, config=repr(cfg),
                               pct_of_gemv=100 * rec["GBps"] / gemv)
                    if ref is None:
                        ref = outs[lname]
                    rec["relerr_vs_table"] = float((outs[lname].double() - ref.double()).norm() / ref.double().norm())
                    if lname == tiled.layout and pool.layout in outs:
                        rec["same_bits_as_row_major"] = bool(torch.equal(outs[pool.layout], outs[lname]))
                    rep["rows"].append(rec)
                    print(f"[{time.time() - t0:4.0f}s] {sname} {fmt} T {t} {vname:20s} {lname:6s}: {rec['us']:7.1f} us "
                          f"{rec['GBps']:6.0f} GB/s {rec['pct_of_gemv']:5.1f}% of the GEMV"
                          + (f"  same bits: {rec['same_bits_as_row_major']}" if "same_bits_as_row_major" in rec else "")
                          + f"  relerr vs table {rec['relerr_vs_table']:.1e}", flush=True)
                json.dump(rep, open(os.path.join(args.out, "nb8_tiled_probe.json"), "w"), indent=1)
        del pool, tiled
    json.dump(rep, open(os.path.join(args.out, "nb8_tiled_probe.json"), "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
