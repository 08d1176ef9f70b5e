"""One shape of the grouped MoE layer, run a few times eagerly with fresh routings: a target for
Nsight Compute (`ncu -k regex:_moe_gemm_kernel ...`), which profiles the launches themselves.

    python tools/kernel_lab/moe_decode_once.py [--shape deepseek] [--fmt w2] [--tokens 1] [--calls 4]
"""
from __future__ import annotations

import argparse

import torch

SHAPES = {"deepseek": (7168, 2048, 256), "glm": (4096, 1408, 128), "qwen": (2048, 768, 128)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="deepseek", choices=sorted(SHAPES))
    ap.add_argument("--fmt", default="w2", choices=["w2", "fp4"])
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--calls", type=int, default=4)
    args = ap.parse_args()
    from moet.bench.moe_kernel_tune import make_pool, routing
    from moet.kernels import moe_triton as mt
    h, i, e = SHAPES[args.shape]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    pool = make_pool(args.fmt, e, h, i, dev, gen)
    x = torch.randn(args.tokens, h, device=dev, generator=gen).bfloat16()
    table = torch.arange(e, dtype=torch.int32, device=dev)
    miss = torch.zeros(1, dtype=torch.int64, device=dev)
    for _ in range(args.calls):
        ids, w = routing(args.tokens, e, 8, dev, gen)
        out = mt.moe_experts_triton(x, ids, w, table, pool, miss)
    torch.cuda.synchronize()
    print(f"{args.shape} {args.fmt} T={args.tokens}: |out| {float(out.float().norm()):.3f}, misses {int(miss)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
