"""Check, time and tune the Triton grouped MoE kernels (moet.kernels.moe_triton) on a GPU, and
write the launch-config table (moet/kernels/moe_configs.json format).

One script, one device call: for every shape x format
  1. correctness against moe_experts_reference on fresh random inputs, every buffer the
     kernels write poisoned with NaN first, misses in the slot table (counted and zero),
     bit-identical reruns, and the same experts in permuted slots give the same bits;
  2. timing inside CUDA graphs of R calls, each call a different random routing, so weights
     never sit in L2 (do_bench also flushes L2 between replays): achieved GB/s on the bytes
     of the distinct experts touched, and % of a bf16 GEMV measured in the same run; prefill:
     TFLOP/s and % of a bf16 GEMM of the same token count measured in the same run;
  3. tuning: candidate configs per (shape, format, T bucket), the best written to the table.
A time guard stops starting new work after --budget-s; JSON is rewritten after every step.

    PYTHONUNBUFFERED=1 python benchmarks/kernels/tune_moe.py --out $OUT --budget-s 280 \
        [--tune deepseek:1,deepseek:8192,...] [--model-check CHECKPOINT_DIR] [--write-table]
The table it writes ($OUT/moe_configs.json, and with --write-table merged into the repo's
src/moet/kernels/moe_configs.json) holds the tuned points; lookups take the nearest bucket.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback
from dataclasses import replace

import torch

SHAPES = {"deepseek": (7168, 2048, 256, 8), "glm": (4096, 1408, 128, 8), "qwen": (2048, 768, 128, 8)}
DECODE_T = (1, 4, 8, 16, 32)
PREFILL_T = (512, 2048, 8192)


def merge_table(new: dict, path: str) -> None:
    """Add (or replace) the tuned buckets of `new` in the table at `path`, buckets sorted."""
    old = json.loads(open(path).read()) if os.path.exists(path) else {"version": 1, "devices": {}}
    for dev, shapes in new["devices"].items():
        for key, buckets in shapes.items():
            merged = {**old["devices"].setdefault(dev, {}).get(key, {}), **buckets}
            old["devices"][dev][key] = dict(sorted(merged.items(), key=lambda kv: int(kv[0])))
    with open(path, "w") as f:
        json.dump(old, f, indent=1)


def make_pool(fmt: str, e: int, h: int, i: int, dev, gen, row_major: bool = False):
    """Random bytes in the layout the model's pools take for these shapes (moet.quant.requantize.
    pool_layout: so the table is tuned on what it serves), or its row-major twin (`row_major`,
    for A/B runs): random nb8 / nb8t codes with scales as quantized weights have them; random
    e2m1 bytes with normal e4m3 block scales."""
    from moet.kernels.pools import FP4Pool, W2Pool
    from moet.kernels.pools import row_major as untiled
    from moet.quant.requantize import pool_layout
    u8 = dict(dtype=torch.uint8, device=dev, generator=gen)
    if fmt == "w2":
        pool = W2Pool(torch.randint(0, 256, (e, 2 * i, h // 4), **u8),
                      torch.randint(115, 126, (e, 2 * i, h // 32), **u8),
                      torch.randint(0, 256, (e, h, i // 4), **u8), torch.randint(115, 126, (e, h, i // 32), **u8),
                      layout=pool_layout("w2", h, i))
    else:
        # e4m3 scale bytes 0x28..0x47 (0.25 .. 3.75, normals), scale_2 ~ 1e-2
        def sc(*s):
            return torch.randint(0x28, 0x48, s, **u8).view(torch.float8_e4m3fn)
        pool = FP4Pool(torch.randint(0, 256, (e, 2 * i, h // 2), **u8), sc(e, 2 * i, h // 16),
                       (torch.rand(e, 2, device=dev, generator=gen) + 0.5) * 1e-2,
                       torch.randint(0, 256, (e, h, i // 2), **u8), sc(e, h, i // 16),
                       (torch.rand(e, device=dev, generator=gen) + 0.5) * 1e-2, layout=pool_layout("fp4", h, i))
    return untiled(pool) if row_major and pool.layout in ("nb8t", "nvfp4t") else pool


def expert_bytes(pool) -> int:
    from moet.kernels.pools import pool_nbytes
    return pool_nbytes(pool) // pool.num_slots


def routing(t: int, e: int, k: int, dev, gen):
    ids = torch.rand(t, e, device=dev, generator=gen).topk(k, dim=-1).indices
    w = torch.rand(t, k, device=dev, generator=gen)
    return ids, w / w.sum(-1, keepdim=True)


def graph_time_ms(fns, reps: int = 2) -> float:
    """fns: callables, one per call in the graph; median ms per call."""
    import triton
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns[:2]:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    torch.cuda.synchronize()
    best = min(triton.testing.do_bench(g.replay, warmup=20, rep=120, return_mode="median") for _ in range(reps))
    return best / len(fns)


def bf16_gemv_gbps(dev) -> float:
    n, k = 32768, 7168
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(3)]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    outs = [torch.empty(1, n, device=dev, dtype=torch.bfloat16) for _ in range(3)]
    fns = [lambda i=i: torch.matmul(x, ws[i].t(), out=outs[i]) for i in range(3)] * 2
    ms = graph_time_ms(fns)
    return n * k * 2 / ms / 1e6


def bf16_gemm_tflops(dev, t: int, n: int, k: int) -> float:
    a = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    out = torch.empty(t, n, device=dev, dtype=torch.bfloat16)
    ms = graph_time_ms([lambda: torch.matmul(a, b.t(), out=out)] * 4)
    return 2 * t * n * k / ms / 1e9


def relerr(a: torch.Tensor, r: torch.Tensor) -> float:
    return float((a.double() - r.double()).norm() / r.double().norm())


def check(fmt, pool, h, e, k, t, limit, dev, gen, mt, ref_fn, config=None) -> dict:
    """One correctness record: poisoned workspaces, misses, reruns, slot permutation (config:
    the launch configuration to check, default the table's)."""
    from moet.kernels.reference import ExpertActivation
    orig = mt._workspace

    def poisoned(shape, dtype, device):
        x = torch.empty(shape, dtype=dtype, device=device)
        return x.fill_(float("nan")) if dtype.is_floating_point else x.fill_(-7)
    mt._workspace = poisoned
    try:
        x = torch.randn(t, h, device=dev, generator=gen).bfloat16()
        ids, w = routing(t, e, k, dev, gen)
        table = torch.arange(e, dtype=torch.int32, device=dev)
        table[torch.randperm(e, device=dev, generator=gen)[: e // 8]] = -1          # 1/8 not resident
        m_ref = torch.zeros(1, dtype=torch.int64, device=dev)
        m_tri = torch.zeros(1, dtype=torch.int64, device=dev)
        ref = ref_fn(x, ids, w, table, pool, m_ref, act=ExpertActivation(limit=limit))
        out = mt.moe_experts_triton(x, ids, w, table, pool, m_tri, act=ExpertActivation(limit=limit), config=config)
        out2 = mt.moe_experts_triton(x, ids, w, table, pool, torch.zeros_like(m_tri), act=ExpertActivation(limit=limit),
                                     config=config)
        rec = {"T": t, "relerr": relerr(out, ref), "finite": bool(torch.isfinite(out).all()),
               "misses": [int(m_tri.item()), int(m_ref.item())], "rerun_identical": bool(torch.equal(out, out2))}
        if t <= 64:     # the same experts in other slots: same bits
            perm = torch.randperm(e, device=dev, generator=gen)
            ppool = type(pool)(*[getattr(pool, f)[perm] if isinstance(getattr(pool, f), torch.Tensor)
                                 else getattr(pool, f) for f in pool.__slots__])
            inv = torch.empty_like(perm)
            inv[perm] = torch.arange(e, device=dev)
            ptable = torch.where(table >= 0, inv[table.clamp(min=0).long()].to(torch.int32), table)
            out3 = mt.moe_experts_triton(x, ids, w, ptable, ppool, torch.zeros_like(m_tri), act=ExpertActivation(limit=limit),
                                         config=config)
            rec["slot_invariant"] = bool(torch.equal(out, out3))
        rec["ok"] = (rec["relerr"] < 1e-2 and rec["finite"] and rec["misses"][0] == rec["misses"][1]
                     and rec["rerun_identical"] and rec.get("slot_invariant", True))
        return rec
    finally:
        mt._workspace = orig


def time_layer(mt, pool, h, e, k, t, dev, gen, config, ebytes, nsets: int = 8) -> dict:
    x = torch.randn(t, h, device=dev, generator=gen).bfloat16()
    table = torch.arange(e, dtype=torch.int32, device=dev)
    miss = torch.zeros(1, dtype=torch.int64, device=dev)
    sets = [routing(t, e, k, dev, gen) for _ in range(nsets)]
    distinct = sum(int(torch.unique(ids).numel()) for ids, _ in sets) / nsets
    fns = [lambda ids=ids, w=w: mt.moe_experts_triton(x, ids, w, table, pool, miss, config=config) for ids, w in sets]
    ms = graph_time_ms(fns)
    rec = {"us": ms * 1e3, "GBps": distinct * ebytes / ms / 1e6, "distinct_experts": distinct}
    return rec


def kernel_breakdown(mt, pool, h, e, k, t, dev, gen, config, nsets: int = 8) -> dict:
    """Device time per kernel (us per layer call) from a profiled replay of the timing graph."""
    from torch.profiler import ProfilerActivity, profile
    x = torch.randn(t, h, device=dev, generator=gen).bfloat16()
    table = torch.arange(e, dtype=torch.int32, device=dev)
    miss = torch.zeros(1, dtype=torch.int64, device=dev)
    sets = [routing(t, e, k, dev, gen) for _ in range(nsets)]
    for ids, w in sets[:2]:
        mt.moe_experts_triton(x, ids, w, table, pool, miss, config=config)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for ids, w in sets:
            mt.moe_experts_triton(x, ids, w, table, pool, miss, config=config)
    reps = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        dt = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if dt and "Memcpy" not in ev.key and "Memset" not in ev.key:
            out[ev.key[:60]] = out.get(ev.key[:60], 0.0) + dt / (reps * nsets)
    return out


def model_check(path: str, dev) -> dict:
    """The wiring end to end: a checkpoint loaded on the GPU with expert_format w2 / fp4 runs its
    MoE layers through the Triton kernels (counted); logits against the same model with the
    dispatch forced to the torch reference (same pools)."""
    from moet.checkpoint import open_checkpoint
    from moet.kernels import moe_dispatch, moe_triton
    from moet.model import load_model
    res = {}
    ids = torch.arange(3, 35, device=dev) * 37 % 8000
    for fmt in ("w2", "fp4"):
        model = load_model(open_checkpoint(path), expert_format=fmt, dtype=torch.bfloat16, device=dev)
        calls = [0]
        orig = moe_triton.moe_experts_triton

        def counted(*a, **kw):
            calls[0] += 1
            return orig(*a, **kw)
        moe_triton.moe_experts_triton = counted
        try:
            with torch.no_grad():
                for t in (32, 1):                       # prefill-sized and decode-sized calls
                    out = model.forward(ids[:t], 0, model.new_cache(64, dev)).float()
                    saved = moe_dispatch.uses_triton
                    moe_dispatch.uses_triton = lambda pool: False
                    try:
                        ref = model.forward(ids[:t], 0, model.new_cache(64, dev)).float()
                    finally:
                        moe_dispatch.uses_triton = saved
                    res[f"{fmt}/T{t}"] = {"logits_relerr": relerr(out, ref), "triton_calls": calls[0],
                                          "argmax_agree": float((out.argmax(-1) == ref.argmax(-1)).float().mean())}
        finally:
            moe_triton.moe_experts_triton = orig
        del model
    return res


def candidates(regime: str, fmt: str):
    from moet.kernels.moe_configs import GemmConfig, MoEConfig
    if regime == "decode":
        # few pairs per expert: small token tiles (BM 1 at T = 1 has no padded token rows, so no
        # shared-memory x tiles and half the MMAs) and low-register configs for occupancy
        # (SASS counts from the sm_90 AOT build)
        # and enough programs: at T = 1 a DeepSeek-V3 gate/up with BN 64 is only 32 x 8 programs of
        # two warps (one warp per scheduler), so split-K and narrow row blocks are in the list
        # BKH 64 (a whole nb8t tile row a step, two units of 256 weights: faster for DeepSeek-V3's
        # T = 8 gate/up on the row-tiled pool)
        gu = [GemmConfig(32, 32, 2, 2, 4), GemmConfig(32, 32, 1, 2, 4), GemmConfig(64, 16, 1, 2, 6),
              GemmConfig(32, 16, 2, 2, 6), GemmConfig(32, 32, 4, 2, 4), GemmConfig(64, 32, 2, 2, 4),
              GemmConfig(64, 32, 1, 4, 4), GemmConfig(16, 32, 2, 1, 4), GemmConfig(32, 64, 2, 2, 4),
              GemmConfig(32, 64, 1, 2, 4),
              # gate and up dots alternating (chains 2; sm_90 AOT at the T = 1 tile: 114 registers
              # against 96, so 8 programs an SM instead of 10: for the sweep to decide)
              GemmConfig(32, 32, 2, 2, 4, chains=2), GemmConfig(32, 64, 1, 2, 4, chains=2),
              # deeper rings at the T = 1 tile (sm_90 AOT: 6 stages 96 registers, 23 KB; 8: 104, 32 KB)
              GemmConfig(32, 32, 2, 2, 6), GemmConfig(32, 32, 2, 2, 8)]
        dn = [GemmConfig(32, 32, 1, 2, 4), GemmConfig(64, 16, 1, 2, 6), GemmConfig(32, 16, 1, 2, 6),
              GemmConfig(64, 32, 1, 2, 4), GemmConfig(32, 32, 2, 2, 4), GemmConfig(128, 32, 1, 4, 4),
              GemmConfig(16, 32, 1, 1, 4), GemmConfig(32, 64, 1, 2, 4), GemmConfig(32, 32, 1, 2, 6),
              GemmConfig(32, 32, 1, 2, 8),
              # even / odd slots in two accumulators (chains 2: the down's 16 HMMAs a step are one
              # dependent chain in the sm_90 SASS otherwise)
              GemmConfig(32, 32, 1, 2, 4, chains=2), GemmConfig(16, 32, 1, 1, 4, chains=2)]
        base = MoEConfig(16, gu[0], dn[0])
        return base, gu, dn
    # prefill: tensor-core tiles; the weights are decoded once per (tile, K step) for BM tokens, so
    # wider token tiles and deeper pipelines are in the list too (with only the first four per
    # side, the best, BM 64, stayed well short of the GEMM at T = 8192)
    base = MoEConfig(64, GemmConfig(64, 16, 1, 8, 3), GemmConfig(128, 16, 1, 8, 3))
    # BKH 64: BKH 32 won over 16 (twice the K per register-A wgmma, half the
    # warp-group waits), so the next doubling is in the list (sm_90 AOT at BM 64: FP4 fits 3 stages
    # without spills; W2 gate/up needs 2 stages and spills a little, W2 down fits 2 stages), and a
    # BN-256 down (half the x-tile reads per weight; its gate/up twin spills)
    gu = [GemmConfig(64, 16, 1, 8, 3), GemmConfig(64, 16, 1, 4, 3), GemmConfig(64, 32, 1, 8, 3),
          GemmConfig(128, 16, 1, 8, 3), GemmConfig(128, 32, 1, 8, 3), GemmConfig(64, 16, 1, 4, 4),
          GemmConfig(128, 16, 1, 8, 4), GemmConfig(128, 64, 1, 8, 3), GemmConfig(128, 64, 1, 8, 2),
          GemmConfig(64, 64, 1, 4, 3), GemmConfig(128, 32, 1, 8, 3, chains=2)]
    dn = [GemmConfig(128, 16, 1, 8, 3), GemmConfig(64, 16, 1, 4, 3), GemmConfig(128, 32, 1, 8, 3),
          GemmConfig(64, 32, 1, 4, 3), GemmConfig(128, 16, 1, 8, 4), GemmConfig(64, 16, 1, 8, 3),
          GemmConfig(128, 64, 1, 8, 3), GemmConfig(128, 64, 1, 8, 2), GemmConfig(256, 32, 1, 8, 2)]
    return base, gu, dn


def decode_tile_sizes(pairs: int, experts: int) -> list[int]:
    """Token-tile sizes worth timing at decode: up to ~4x the mean pairs per expert, and at least
    up to 8: BM >= 4 tiles stage x through shared memory (cp.async) where BM 1-2 tiles load it
    into registers at each K step, and the m16n8k16 MMA count is the same up to BM 8 (DeepSeek-V3
    W2 at T = 8, ~1 pair per expert: BM 8 beat BM 1 on the H200)."""
    cap = max(8, 1 << max(0, math.ceil(math.log2(max(1.0, 4 * pairs / experts)))))
    return [b for b in (1, 2, 4, 8, 16) if b <= cap]


def decode_whole_configs():
    """Whole decode configs the greedy sweeps cannot reach one field at a time. The token tile is
    chosen first, with the base row tiles; from BM 4 on x is staged through shared memory with the
    codes, which is what lets a K step of 64 units pay off (BM 1-2 load x into registers each step).
    The FP4 winner at T = 1 and 8 on the row-tiled pools was BM 4 + gate/up BKH 64 without a split
    (clearly faster for DeepSeek-V3 at T = 1), while W2's sweep at T = 1 kept BM 1 (a tie with BM 4
    on the base tiles) and so would never time that pair."""
    from moet.kernels.moe_configs import GemmConfig, MoEConfig
    gu = GemmConfig(32, 64, 1, 2, 4)
    gi = GemmConfig(32, 64, 1, 2, 4, chains=2)
    return [MoEConfig(4, gu, GemmConfig(16, 32, 1, 1, 4)), MoEConfig(4, gu, GemmConfig(32, 32, 1, 2, 4)),
            MoEConfig(8, gu, GemmConfig(32, 32, 1, 2, 4)), MoEConfig(4, gu, GemmConfig(64, 32, 1, 2, 4)),
            MoEConfig(4, GemmConfig(32, 64, 2, 2, 4), GemmConfig(16, 32, 1, 1, 4)),
            MoEConfig(4, gi, GemmConfig(16, 32, 1, 1, 4)), MoEConfig(4, gi, GemmConfig(32, 32, 1, 2, 4)),
            MoEConfig(4, gi, GemmConfig(16, 32, 1, 1, 4, chains=2))]


def prefill_whole_configs(fmt: str):
    """Whole prefill configs the greedy sweeps cannot reach one field at a time: W2 at BM 128 needs
    two cp.async stages (three run out of shared memory: x tiles of 128 rows x 8 slots),
    or a BN-64 gate/up, which fits three (sm_90 AOT: BN 128 needs 233,472 bytes, 1 KB over
    the H200's 232,448 a block; BN 64 215-217 KB, no spills; the BN-128 down 215 KB)."""
    from moet.kernels.moe_configs import GemmConfig, MoEConfig
    if fmt != "w2":    # FP4 at BM 128 (the sweep's winner) with the down K step doubled (its gate/up twin spills)
        g = GemmConfig(128, 32, 1, 8, 3)
        return [MoEConfig(128, g, GemmConfig(128, 64, 1, 8, 2)), MoEConfig(128, g, GemmConfig(128, 64, 1, 8, 3))]
    two = GemmConfig(128, 32, 1, 8, 2)
    return [MoEConfig(128, two, two), MoEConfig(128, two, GemmConfig(128, 32, 1, 8, 3)),
            MoEConfig(128, GemmConfig(128, 16, 1, 8, 2), two),
            MoEConfig(128, GemmConfig(64, 32, 1, 4, 3), GemmConfig(128, 32, 1, 8, 3)),
            MoEConfig(128, GemmConfig(64, 32, 1, 8, 3), GemmConfig(128, 32, 1, 8, 3))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=280.0)
    ap.add_argument("--shapes", default="deepseek,glm,qwen")
    ap.add_argument("--formats", default="w2,fp4")
    ap.add_argument("--tune", default="deepseek:1,deepseek:8192,glm:1,qwen:1",
                    help="shape:T points to tune (the rest run the table/default config)")
    ap.add_argument("--tokens", default=",".join(map(str, DECODE_T + PREFILL_T)))
    ap.add_argument("--row-major", action="store_true",
                    help="time row-major pools (nb8, nvfp4) where the model's would be row-tiled: A/B runs; "
                         "not with --write-table (the table serves the model's layout)")
    ap.add_argument("--masked-tiles", action="store_true",
                    help="keep the K / row masks on tiles that divide their GEMM (moe_triton.UNMASK_EVEN_TILES "
                         "off): A/B runs; not with --write-table")
    ap.add_argument("--masked-x", action="store_true",
                    help="keep the pair mask on the x loads of such tiles (moe_triton.CLAMP_X_ROWS off): A/B runs; "
                         "not with --write-table")
    ap.add_argument("--model-check", default="", help="checkpoint dir: run its MoE layers through the kernels")
    ap.add_argument("--write-table", action="store_true",
                    help="also merge the tuned entries into the repo's table (moet/kernels/moe_configs.json)")
    args = ap.parse_args()
    if args.row_major and args.write_table:
        ap.error("--row-major times pools the model does not serve; leave out --write-table")
    if (args.masked_tiles or args.masked_x) and args.write_table:
        ap.error("--masked-tiles / --masked-x time kernels the model does not run; leave out --write-table")
    t0 = time.time()
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    from moet.kernels import moe_triton as mt
    from moet.kernels.moe_configs import SMALL_ALIGN_MAX_PAIRS, TABLE_PATH, MoEConfig, lookup, shape_key
    from moet.kernels.reference import moe_experts_reference
    mt.UNMASK_EVEN_TILES = not args.masked_tiles
    mt.CLAMP_X_ROWS = not args.masked_x
    import triton
    name = torch.cuda.get_device_name(dev)
    rep = {"device": name, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "triton": triton.__version__, "checks": {}, "timings": {}, "tuning": {}}
    table = {"version": 1, "devices": {name: {}}}
    os.makedirs(args.out, exist_ok=True)

    def dump():
        with open(os.path.join(args.out, "moe_kernel_tune.json"), "w") as f:
            json.dump(rep, f, indent=1)
        with open(os.path.join(args.out, "moe_configs.json"), "w") as f:
            json.dump(table, f, indent=1)

    def left() -> float:
        return args.budget_s - (time.time() - t0)

    if args.model_check:
        try:
            rep["model_check"] = model_check(args.model_check, dev)
        except Exception as exc:
            traceback.print_exc()
            rep["model_check"] = {"error": repr(exc)[:2000]}
        print(f"[{time.time() - t0:5.0f}s] model check: {rep['model_check']}", flush=True)
    rep["bf16_gemv_GBps"] = bf16_gemv_gbps(dev)
    print(f"[{time.time() - t0:5.0f}s] bf16 GEMV N32768 K7168: {rep['bf16_gemv_GBps']:.0f} GB/s", flush=True)
    gen = torch.Generator(device=dev).manual_seed(0)
    tune = {(p.split(":")[0], int(p.split(":")[1])) for p in args.tune.split(",") if p}
    tokens = [int(x) for x in args.tokens.split(",")]
    for sname in args.shapes.split(","):
        h, i, e, k = SHAPES[sname]
        if 8192 in tokens:
            rep.setdefault("bf16_gemm_TFLOPs", {})[sname] = {
                "gate_up": bf16_gemm_tflops(dev, 8192, 2 * i, h), "down": bf16_gemm_tflops(dev, 8192, h, i)}
            print(f"[{time.time() - t0:5.0f}s] bf16 GEMM T8192 {sname}: {rep['bf16_gemm_TFLOPs'][sname]}", flush=True)
        for fmt in args.formats.split(","):
            if left() < 0:
                print(f"time guard: skipping {sname}/{fmt}", flush=True)
                continue
            pool = make_pool(fmt, e, h, i, dev, gen, row_major=args.row_major)
            eb = expert_bytes(pool)
            key = f"{sname}/{fmt}"
            try:
                for t in (1, 8, 600):
                    rec = check(fmt, pool, h, e, k, t, 7.0 if t == 8 else None, dev, gen, mt, moe_experts_reference)
                    rep["checks"][f"{key}/T{t}"] = rec
                    print(f"[{time.time() - t0:5.0f}s] check {key} T{t}: {rec}", flush=True)
            except Exception as exc:
                traceback.print_exc()
                rep["checks"][f"{key}/error"] = repr(exc)[:2000]
                dump()
                continue
            dump()
            entries = table["devices"][name].setdefault(shape_key(fmt, h, i), {})
            for t in tokens:
                if left() < 0:
                    print(f"time guard: skipping {key} T{t}", flush=True)
                    break
                p = t * k
                regime = "decode" if p <= SMALL_ALIGN_MAX_PAIRS else "prefill"
                cfg = lookup(fmt, h, i, p, name)
                try:
                    if (sname, t) in tune:
                        base, gus, dns = candidates(regime, fmt)
                        best, best_us, tried = base, float("inf"), []

                        def sweep(make, options):
                            """Greedy: time make(best, o) for each option, keep the fastest."""
                            nonlocal best, best_us
                            for o in options:
                                c = make(best, o)
                                if (c == best and best_us < float("inf")) or left() < 0:
                                    continue
                                try:
                                    r = time_layer(mt, pool, h, e, k, t, dev, gen, c, eb)
                                except Exception as exc:     # e.g. out of shared memory: skip it
                                    print(f"    {key} T{t} {c.to_json()} failed: {str(exc)[:200]}", flush=True)
                                    tried.append({"cfg": c.to_json(), "us": float("inf"), "error": str(exc)[:500]})
                                    continue
                                tried.append({"cfg": c.to_json(), **r})
                                if r["us"] < best_us:
                                    best, best_us = c, r["us"]
                                print(f"    {key} T{t} {c.to_json()} {r['us']:.1f} us {r['GBps']:.0f} GB/s", flush=True)

                        if regime == "decode":       # token tile first: it decides occupancy
                            sweep(lambda b, bm: replace(b, BM=bm), decode_tile_sizes(p, e))
                        sweep(lambda b, gu: replace(b, gate_up=gu), gus)
                        sweep(lambda b, dn: replace(b, down=dn), dns)
                        if regime == "prefill":          # larger token tiles
                            bm0 = best.BM
                            sweep(lambda b, bm: replace(b, BM=bm), (16, 32, 128))
                            if best.BM != bm0:           # the row tiles were chosen for the old BM
                                sweep(lambda b, gu: replace(b, gate_up=gu), gus)
                                sweep(lambda b, dn: replace(b, down=dn), dns)
                            sweep(lambda b, c: c, prefill_whole_configs(fmt))
                        else:                            # the K loop unrolled (GemmConfig.unroll)
                            sweep(lambda b, u: replace(b, gate_up=replace(b.gate_up, unroll=u)), (2,))
                            sweep(lambda b, u: replace(b, down=replace(b.down, unroll=u)), (2,))
                            sweep(lambda b, c: c, [c for c in decode_whole_configs() if c.BM <= max(
                                decode_tile_sizes(p, e))])
                        rep["tuning"][f"{key}/T{t}"] = tried
                        def try_flag(flag: str, label: str, report: str | None = None, **with_too):
                            """The best config with one launch option on (and the options it needs,
                            with_too); kept when correct and >= 2% faster; reported under `report`
                            (default: the flag's name)."""
                            try_config(replace(best, **{flag: True}, **with_too), label, report or flag)

                        def try_config(c: MoEConfig, label: str, report: str):
                            """c (the best config with one change) kept when correct and >= 2% faster."""
                            nonlocal best, best_us
                            try:
                                on = time_layer(mt, pool, h, e, k, t, dev, gen, c, eb)
                                chk = check(fmt, pool, h, e, k, t, 7.0, dev, gen, mt, moe_experts_reference, config=c)
                            except Exception as exc:
                                traceback.print_exc()
                                on, chk = {"us": float("inf"), "error": repr(exc)[:1000]}, {}
                            rep.setdefault(report, {})[f"{key}/T{t}"] = {"off_us": best_us, "on": on, "check": chk}
                            print(f"    {key} T{t} {label}: off {best_us:.1f} us, on {on}, check {chk}", flush=True)
                            if chk.get("ok") and on["us"] < 0.98 * best_us:      # clearly faster: keep it
                                best, best_us = c, on["us"]

                        if regime == "decode" and left() > 0:
                            try_flag("pdl", "PDL")                     # launches overlapping the kernel before
                        if best.gate_up.SPLIT_K > 1 and left() > 0:
                            try_flag("fused_finish", "fused finish")   # the split gate/up's SwiGLU finish fused
                        if regime == "decode" and left() > 0:
                            try_flag("fused_combine", "fused combine")  # the top-k combine in the down GEMM
                        if regime == "decode" and left() > 0:
                            # the down weights prefetched into L2 before its PDL wait (needs PDL)
                            try_flag("down_prefetch", "down prefetch", pdl=True)
                        if regime == "decode" and left() > 0:
                            # only each down program's first K step (the whole slab competes with
                            # gate/up's reads for L2; a little faster at T = 1 on the H200)
                            try_flag("down_prefetch", "down prefetch, first step", "down_prefetch_first_step", pdl=True,
                                     down_prefetch_steps=1)
                        for part in ("gate_up", "down"):
                            # the scale bytes behind a branch: the MMAs' K packed by 2 (GemmConfig.kwidth2;
                            # faster on some GEMMs, much slower on others: tried per GEMM)
                            if regime == "decode" and left() > 0:
                                try_config(replace(best, **{part: replace(getattr(best, part), kwidth2=True)}),
                                           f"{part} kWidth 2", f"{part}_kwidth2")
                        cfg = best
                        entries[str(p)] = best.to_json()
                        if t == 1:
                            rep.setdefault("breakdown_us", {})[key] = bd = kernel_breakdown(
                                mt, pool, h, e, k, t, dev, gen, cfg)
                            print(f"    breakdown {key} T1 (us per call): {bd}", flush=True)
                    r = time_layer(mt, pool, h, e, k, t, dev, gen, cfg, eb)
                    r["cfg"] = cfg.to_json()
                    r["pct_bf16_gemv"] = 100 * r["GBps"] / rep["bf16_gemv_GBps"]
                    if regime == "prefill":
                        flops = 2 * p * 3 * h * i
                        r["TFLOPs"] = flops / (r["us"] * 1e-6) / 1e12
                        gemm = rep.get("bf16_gemm_TFLOPs", {}).get(sname)
                        if gemm:
                            r["pct_bf16_gemm"] = 100 * r["TFLOPs"] / min(gemm.values())
                    rep["timings"][f"{key}/T{t}"] = r
                    print(f"[{time.time() - t0:5.0f}s] {key} T{t}: {r['us']:.1f} us, {r['GBps']:.0f} GB/s "
                          f"({r['pct_bf16_gemv']:.1f}% of bf16 GEMV)"
                          + (f", {r['TFLOPs']:.0f} TFLOP/s ({r.get('pct_bf16_gemm', 0):.1f}% of bf16 GEMM)"
                             if "TFLOPs" in r else ""), flush=True)
                except Exception as exc:
                    traceback.print_exc()
                    rep["timings"][f"{key}/T{t}"] = {"error": repr(exc)[:2000]}
                dump()
            del pool
            torch.cuda.empty_cache()
    dump()
    if args.write_table:
        merge_table(table, str(TABLE_PATH))
        print(f"merged the tuned entries into {TABLE_PATH}", flush=True)
    print(f"done in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
