"""Device diagnostic: the routers' decode GEMV (router_triton.router_logits: the sigmoid routers' fp32
form, the softmax routers' bf16 one)
in launch variants, against torch's cast + cuBLAS, as the engine runs it: one CUDA graph of
L layers' GEMVs (distinct weights: 45 x 2 MB fp32 exceeds the 50 MB L2, so each read comes from
HBM; the bf16 softmax shapes fit it, 23 MB, so theirs are upper bounds).
Checks every variant against a float64 reference first.

    PYTHONPATH=src python tools/kernel_lab/router_bench.py [--layers 45] [--tokens 1]
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from moet.kernels.router_triton import router_logits

# (experts, hidden, weight and logit dtype): the sigmoid routers' fp32 form, the softmax routers' bf16 one
SHAPES = {"glm": (128, 4096, torch.float32), "deepseek": (256, 7168, torch.float32),
          "qwen-h2048": (128, 2048, torch.float32), "qwen3-softmax": (128, 2048, torch.bfloat16),
          "mixtral-softmax": (8, 4096, torch.bfloat16)}
VARIANTS = [(1, 1024, 4), (1, 2048, 4), (1, 4096, 4), (1, 4096, 8), (1, 2048, 8), (2, 1024, 4), (2, 2048, 8),
            (4, 1024, 8), (1, 512, 2), (1, 1024, 2)]


def graph_us(fn, reps: int = 20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()                                         # compile / warm outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / reps)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--layers", type=int, default=45)
    ap.add_argument("--tokens", default="1,2")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rep = {"device": torch.cuda.get_device_name(dev), "results": {}}
    for name, (e, h, dt) in SHAPES.items():
        ws = [(torch.randn(e, h, device=dev) * 0.02).to(dt) for _ in range(args.layers)]
        nbytes = e * h * ws[0].element_size()
        for t in map(int, args.tokens.split(",")):
            x = torch.randn(t, h, device=dev).bfloat16()
            ref = (x.double() @ ws[0].double().t())
            mb = args.layers * nbytes / 1e6
            row = {}
            if dt == torch.float32:
                us = graph_us(lambda: [F.linear(x.float(), w) for w in ws]) / args.layers
                row["torch cast + cublas"] = {"us": us, "GBps": nbytes / us / 1e3}
            else:
                us = graph_us(lambda: [F.linear(x, w) for w in ws]) / args.layers
                row["torch cublas bf16"] = {"us": us, "GBps": nbytes / us / 1e3}
            tol = 1e-6 if dt == torch.float32 else 2 ** -8
            for be, bk, nw in VARIANTS:
                out = router_logits(x, ws[0], dt, rows_per_program=be, block_k=bk, num_warps=nw)
                err = float((out.double() - ref).norm() / ref.norm())
                again = router_logits(x, ws[0], dt, rows_per_program=be, block_k=bk, num_warps=nw)
                if err > tol or not torch.equal(out, again):
                    row[f"BE{be} BK{bk} w{nw}"] = {"error": f"relerr {err:.2e}, rerun equal {torch.equal(out, again)}"}
                    continue
                us = graph_us(lambda: [router_logits(x, w, dt, rows_per_program=be, block_k=bk, num_warps=nw)
                                       for w in ws]) / args.layers
                row[f"BE{be} BK{bk} w{nw}"] = {"us": us, "GBps": nbytes / us / 1e3, "relerr": err}
            rep["results"][f"{name} E{e} H{h} T{t} ({mb:.0f} MB over {args.layers} layers)"] = row
            print(f"{name} E{e} H{h} T{t}: " + ", ".join(
                f"{k} {v['us']:.2f} us" if "us" in v else f"{k} {v['error']}" for k, v in row.items()), flush=True)
    with open(os.path.join(args.out, "router_bench.json"), "w") as f:
        json.dump(rep, f, indent=1)


if __name__ == "__main__":
    main()
