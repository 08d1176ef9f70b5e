"""Time named variants of the table's decode config at one shape, format and T, in one process, each
checked against the table config's output first (relerr; bit identity where the variant keeps the
sums' order). A variant is a ';'-separated list of field=value patches over the table config:
gu.FIELD / dn.FIELD patch the gate/up / down GemmConfig, a bare FIELD the MoEConfig
(e.g. "gu.SPLIT_K=2;fused_finish=1").

    python tools/kernel_lab/moe_config_probe.py --out DIR --shape deepseek --fmt w2 --tokens 1 \
        --variants "gu.SPLIT_K=2;fused_finish=1" "gu.SPLIT_K=2" ...
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace

import torch
from moe_probe_common import start


def patch(cfg, spec: str):
    gu, dn, top = {}, {}, {}
    for item in filter(None, spec.split(";")):
        key, val = item.split("=")
        v = int(val)
        if key.startswith("gu."):
            gu[key[3:]] = bool(v) if key.endswith("kwidth2") else v
        elif key.startswith("dn."):
            dn[key[3:]] = bool(v) if key.endswith("kwidth2") else v
        else:
            top[key] = bool(v) if key in ("pdl", "fused_finish", "fused_combine", "down_prefetch") else v
    return replace(cfg, gate_up=replace(cfg.gate_up, **gu), down=replace(cfg.down, **dn), **top)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="deepseek")
    ap.add_argument("--fmt", default="w2")
    ap.add_argument("--tokens", default="1")
    ap.add_argument("--variants", nargs="+", required=True)
    ap.add_argument("--masked-x", action="store_true", help="moe_triton.CLAMP_X_ROWS off (as moe_kernel_tune's)")
    args = ap.parse_args()
    from moet.bench.moe_kernel_tune import SHAPES, expert_bytes, make_pool, relerr, routing, time_layer
    from moet.kernels import moe_triton as mt
    from moet.kernels.launch_tables import device_name
    from moet.kernels.moe_configs import lookup
    mt.CLAMP_X_ROWS = not args.masked_x
    dev, t0, gemv, rep = start(args.out)
    rep["clamp_x_rows"] = mt.CLAMP_X_ROWS
    gen = torch.Generator(device=dev).manual_seed(0)
    h, i, e, k = SHAPES[args.shape]
    pool = make_pool(args.fmt, e, h, i, dev, gen)
    eb = expert_bytes(pool)
    table = torch.arange(e, dtype=torch.int32, device=dev)
    for t in [int(v) for v in args.tokens.split(",")]:
        base = mt.fit_token_tile(lookup(args.fmt, h, i, t * k, device_name(dev)), t * k, e)
        x = torch.randn(t, h, device=dev, generator=gen).bfloat16()
        ids, w = routing(t, e, k, dev, gen)
        miss = torch.zeros(1, dtype=torch.int64, device=dev)
        ref = mt.moe_experts_triton(x, ids, w, table, pool, miss, config=base)
        for spec in ["", *args.variants]:
            row = {"shape": args.shape, "fmt": args.fmt, "T": t, "variant": spec or "table"}
            try:
                c = patch(base, spec)
                row["cfg"] = c.to_json()
                out = mt.moe_experts_triton(x, ids, w, table, pool, miss, config=c)
                row["same_bits"] = bool(torch.equal(out, ref))
                row["relerr_vs_table"] = relerr(out, ref)
                row.update(time_layer(mt, pool, h, e, k, t, dev, gen, c, eb))
                row["pct_gemv"] = 100 * row["GBps"] / gemv
                print(f"[{time.time() - t0:4.0f}s] {args.shape} {args.fmt} T{t} {row['variant']}: {row['us']:.1f} us "
                      f"{row['GBps']:.0f} GB/s {row['pct_gemv']:.1f}% same_bits={row['same_bits']} "
                      f"relerr={row['relerr_vs_table']:.1e}", flush=True)
            except Exception as exc:      # e.g. out of shared memory, an invalid combination
                row["error"] = str(exc)[:300]
                print(f"[{time.time() - t0:4.0f}s] {args.shape} {args.fmt} T{t} {row['variant']}: {row['error']}",
                      flush=True)
            rep["rows"].append(row)
            with open(os.path.join(args.out, f"moe_config_probe_{args.shape}_{args.fmt}.json"), "w") as f:
                json.dump(rep, f, indent=1)
    print(f"done in {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
