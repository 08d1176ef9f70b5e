"""Where a decode MoE layer's time goes, launch by launch: the layer's launches captured as a CUDA
graph of 8 routings (as moe_kernel_tune times it: weights never in L2), once whole and once cut
after each of its launches (prep; + gate/up; + down; + combine where there is one). What a launch
adds to the prefix before it is its share of the layer under PDL, tail and ramp included.

The cut is made by wrapping moe_triton's kernel objects: a wrapped launch past the cut is not
issued. Only the timing graph is cut; the outputs of the whole layer are checked against the
table config's own (bit-identical) so the wrapping is known to launch the real kernels.

The same prefixes with the config's PDL off: what the overlap of each launch with the one before
it buys.

    python tools/kernel_lab/moe_layer_prefix.py --out DIR [--shapes deepseek,qwen] [--formats w2,fp4] [--tokens 1,8]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace

import torch
from moe_probe_common import start


class _Cut:
    """A kernel object whose launches past `keep` (a predicate on the launch index) are skipped."""

    def __init__(self, kernel, name: str, log: list):
        self.kernel, self.name, self.log = kernel, name, log
        self.keep = lambda name, i: True

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*a, **kw):
            i = sum(1 for n in self.log if n == self.name)
            self.log.append(self.name)
            if self.keep(self.name, i):
                return launch(*a, **kw)
        return run


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="deepseek,qwen")
    ap.add_argument("--formats", default="w2,fp4")
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--masked-x", action="store_true", help="moe_triton.CLAMP_X_ROWS off (as moe_kernel_tune's)")
    args = ap.parse_args()
    from moet.bench.moe_kernel_tune import SHAPES, expert_bytes, graph_time_ms, make_pool, routing
    from moet.kernels import moe_triton as mt
    from moet.kernels.launch_tables import device_name
    from moet.kernels.moe_configs import lookup
    mt.CLAMP_X_ROWS = not args.masked_x
    dev, t0, gemv, rep = start(args.out)
    rep["clamp_x_rows"] = mt.CLAMP_X_ROWS
    names = ["_prep_small_kernel", "_moe_gemm_kernel", "_swiglu_finish_kernel", "_combine_kernel"]
    log: list = []
    cuts = {n: _Cut(getattr(mt, n), n, log) for n in names}
    for n, c in cuts.items():
        setattr(mt, n, c)
    lines = ["| shape | fmt | T | launches | prefix us (cumulative) | whole layer us | % GEMV | prefix without PDL |",
             "|---" * 8 + "|"]
    gen = torch.Generator(device=dev).manual_seed(0)
    try:
        for sname in args.shapes.split(","):
            h, i, e, k = SHAPES[sname]
            for fmt in args.formats.split(","):
                pool = make_pool(fmt, e, h, i, dev, gen)
                eb = expert_bytes(pool)
                table = torch.arange(e, dtype=torch.int32, device=dev)
                for t in [int(x) for x in args.tokens.split(",")]:
                    cfg = mt.fit_token_tile(lookup(fmt, h, i, t * k, device_name(dev)), t * k, e)
                    x = torch.randn(t, h, device=dev, generator=gen).bfloat16()
                    miss = torch.zeros(1, dtype=torch.int64, device=dev)
                    sets = [routing(t, e, k, dev, gen) for _ in range(8)]
                    distinct = sum(int(torch.unique(ids).numel()) for ids, _ in sets) / len(sets)
                    # the sequence of launches of one layer call, by name
                    log.clear()
                    ref = mt.moe_experts_triton(x, *sets[0], table, pool, miss, config=cfg)
                    seq = list(log)
                    prefix, prefix_nopdl = [], []
                    for cut, c_ in [(c, cfg) for c in range(1, len(seq) + 1)] + \
                            [(c, replace(cfg, pdl=False, down_prefetch=False)) for c in range(1, len(seq) + 1)]:
                        fns = [lambda ids=ids, w=w, c_=c_: mt.moe_experts_triton(x, ids, w, table, pool, miss,
                                                                                 config=c_) for ids, w in sets]
                        allowed = {}
                        for j, n in enumerate(seq[:cut]):
                            allowed.setdefault(n, set()).add(seq[:j + 1].count(n) - 1)

                        def keep(n, idx, allowed=allowed):
                            # idx counts this name's launches since log.clear(): fold it into one layer call
                            calls = seq.count(n)
                            return (idx % calls) in allowed.get(n, set())
                        for c in cuts.values():
                            c.keep = keep
                        log.clear()
                        (prefix if c_ is cfg else prefix_nopdl).append(graph_time_ms(fns) * 1e3)
                    for c in cuts.values():
                        c.keep = lambda n, idx: True
                    log.clear()
                    out = mt.moe_experts_triton(x, *sets[0], table, pool, miss, config=cfg)
                    same = bool(torch.equal(out, ref))
                    whole = prefix[-1]
                    gbps = distinct * eb / (whole * 1e-6) / 1e9
                    row = {"shape": sname, "fmt": fmt, "T": t, "cfg": cfg.to_json(), "launches": seq,
                           "prefix_us": prefix, "whole_us": whole, "GBps": gbps, "pct_gemv": 100 * gbps / gemv,
                           "prefix_nopdl_us": prefix_nopdl, "same_bits_after_unwrap": same, "distinct_experts": distinct, "expert_bytes": eb}
                    rep["rows"].append(row)
                    short = [n.strip("_").replace("_kernel", "") for n in seq]
                    lines.append(f"| {sname} | {fmt} | {t} | {' + '.join(short)} | "
                                 f"{' / '.join(f'{v:.1f}' for v in prefix)} | {whole:.1f} | {row['pct_gemv']:.1f}% | "
                                 f"{' / '.join(f'{v:.1f}' for v in prefix_nopdl)} |")
                    print(f"[{time.time() - t0:4.0f}s] {lines[-1]} same_bits={same}", flush=True)
                    with open(os.path.join(args.out, "moe_layer_prefix.json"), "w") as f:
                        json.dump(rep, f, indent=1)
                del pool
                torch.cuda.empty_cache()
    finally:
        for n, c in cuts.items():
            setattr(mt, n, c.kernel)
    with open(os.path.join(args.out, "moe_layer_prefix.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"done in {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
