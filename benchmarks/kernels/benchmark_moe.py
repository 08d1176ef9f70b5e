"""The expert kernels timed: moet's Triton MoE layer (W2 and FP4 pools)
next to a bf16 MoE layer written the way transformers writes it and torch's grouped GEMM, on
the routed-expert shapes of real models, in one run on one GPU.

    python benchmarks/kernels/benchmark_moe.py [--budget-s 540] [--out DIR] [--models dsv3,glm45air,qwen3]
                                   [--decode 1,4,8,16,32] [--prefill 512,2048,8192] [--cpu-smoke]

Per model (pools built ON the device: random code bytes, scales in the range quantized weights
have, never zeros; every expert resident; freed before the next model):
1. correctness first: moe_experts_w2_triton / moe_experts_fp4_triton (moet.kernels, imported
   lazily: skipped with a message where absent) and both bf16 baselines against
   moe_experts_reference on fresh random inputs, in a slot table that is a permutation with
   1/8 of the experts not resident (miss counts must agree), the allocator poisoned with NaN
   before each call (the kernels allocate their outputs), reruns bit-identical. A failed check
   excludes that path from timing and is reported.
2. timing: decode T tokens (GB/s on the bytes of the distinct experts touched: codes + scales,
   or bf16 weights for the baselines; % of a bf16 GEMV W[32768, 7168] measured in the same
   run), prefill T tokens (TFLOP/s on the active pairs' 2*T*k*3*H*I; % of a dense bf16 GEMM
   [T, H] x [H, 3kI] of the same FLOPs measured in the same run). Each timed call uses the
   next of R random routings (rotating active expert sets, so weights never sit in L2) and
   do_bench flushes L2 between calls; capturable paths run as one CUDA graph of R calls
   ("graph" in the table), the others eagerly (their launch and host-sync costs are theirs).
Results: $OUT/moe_bench.json (rewritten as it goes) and moe_bench.md. A time guard stops
starting new measurements before --budget-s.
--cpu-smoke: tiny shapes, the references in place of the kernels, on CPU (tests the harness).
"""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil

import torch
import torch.nn.functional as F

from moet.bench.timing import Budget, bench_device, device_info, fail, log, out_dir, time_ms, write_json
from moet.kernels.pools import DensePool, FP4Pool, W2Pool
from moet.kernels.reference import moe_experts_reference

# name: (hidden H, moe intermediate I, routed experts E, top-k)
MODELS = {"dsv3": (7168, 2048, 256, 8), "glm45air": (4096, 1408, 128, 8), "qwen3": (2048, 768, 128, 8)}
MODEL_NAMES = {"dsv3": "DeepSeek-V3 / Kimi-K2", "glm45air": "GLM-4.5-Air", "qwen3": "Qwen3-30B-A3B"}
SMOKE_MODELS = {"smoke": (64, 32, 8, 2)}
ROTATIONS = 8


# ---------------------------------------------------------------- pools and inputs

def make_pools(h: int, i: int, e: int, device, gen) -> dict:
    """Random W2 and FP4 pools in the layouts the model's pools take for these shapes (row-tiled
    nb8t / nvfp4t or row-major nb8 / nvfp4) and a bf16 pool, e slots each."""
    from moet.quant.requantize import pool_layout
    u8 = dict(dtype=torch.uint8, device=device, generator=gen)
    w2_layout = {"layout": pool_layout("w2", h, i)} if "layout" in W2Pool.__slots__ else {}
    fp4_layout = {"layout": pool_layout("fp4", h, i)} if "layout" in FP4Pool.__slots__ else {}
    # UE8M0 bytes 118..124: 2^-9 .. 2^-3 per +-1/+-4 level, the range real expert weights land in
    w2 = W2Pool(torch.randint(0, 256, (e, 2 * i, h // 4), **u8), torch.randint(118, 125, (e, 2 * i, h // 32), **u8),
                torch.randint(0, 256, (e, h, i // 4), **u8), torch.randint(118, 125, (e, h, i // 32), **u8),
                **w2_layout)

    def e4m3_scales(*shape):   # bytes 0x28..0x47: normal e4m3 values 0.25 .. 3.75, never zero
        return torch.randint(0x28, 0x48, shape, **u8).view(torch.float8_e4m3fn)
    fp4 = FP4Pool(torch.randint(0, 256, (e, 2 * i, h // 2), **u8), e4m3_scales(e, 2 * i, h // 16),
                  (torch.rand(e, 2, device=device, generator=gen) + 0.5) * 2e-3,
                  torch.randint(0, 256, (e, h, i // 2), **u8), e4m3_scales(e, h, i // 16),
                  (torch.rand(e, device=device, generator=gen) + 0.5) * 2e-3, **fp4_layout)
    bf16 = dict(dtype=torch.bfloat16, device=device, generator=gen)     # no fp32 temporaries (DeepSeek-V3: 22 GB)
    dense = DensePool(torch.randn(e, 2 * i, h, **bf16).mul_(0.02), torch.randn(e, h, i, **bf16).mul_(0.02))
    return {"w2": w2, "fp4": fp4, "bf16": dense}


def expert_bytes(pool) -> int:
    """Bytes one expert occupies in `pool` (codes + scales; bf16 weights for DensePool)."""
    return sum(v[0].nbytes for v in (getattr(pool, f) for f in pool.__slots__) if isinstance(v, torch.Tensor))


def routing(t: int, e: int, k: int, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k: k distinct experts per token, router weights summing to 1 (as after renorm)."""
    ids = torch.rand(t, e, device=device, generator=gen).topk(k, dim=-1).indices
    w = torch.rand(t, k, device=device, generator=gen) + 0.1
    return ids, (w / w.sum(-1, keepdim=True)).float()


# ---------------------------------------------------------------- bf16 baselines

def moe_bf16_transformers_loop(hidden, topk_ids, topk_weights, slot_table, pool: DensePool, miss_counter, *,
                               act=None):
    """A bf16 MoE layer written as transformers' eager MoE blocks are: loop over the experts that
    got tokens (a host sync to find them), gather, gate/up -> SiLU*up -> down, index_add."""
    t, k = topk_ids.shape
    slots = slot_table.long()[topk_ids.long()]
    missed = slots < 0
    miss_counter += missed.sum().to(miss_counter.dtype)
    out = torch.zeros_like(hidden)
    for slot in torch.unique(slots[~missed]).tolist():
        tok, j = torch.where(slots == slot)
        gate, up = F.linear(hidden[tok], pool.gate_up[slot]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, pool.down[slot]) * topk_weights[tok, j, None].to(hidden.dtype)
        out.index_add_(0, tok, y)
    return out


def grouped_mm_available(device) -> tuple[bool, str]:
    if not hasattr(torch, "_grouped_mm"):
        return False, "torch has no _grouped_mm"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0):
        return False, "torch._grouped_mm needs sm_90+"
    return True, ""


def moe_bf16_grouped_mm(hidden, topk_ids, topk_weights, slot_table, pool: DensePool, miss_counter, *,
                        act=None):
    """torch's best bf16 path: pairs sorted by slot, two torch._grouped_mm calls over all slots
    (empty groups allowed), router weights, a fixed-order sum over k. No host sync."""
    t, k = topk_ids.shape
    s = pool.num_slots
    slots = slot_table.long()[topk_ids.long()].reshape(-1)
    missed = slots < 0
    miss_counter += missed.sum().to(miss_counter.dtype)
    key = torch.where(missed, s, slots)                      # misses sort last, outside every group
    order = torch.argsort(key, stable=True)
    # group ends without a host sync (bincount would read the max back): capturable in a graph
    groups = torch.arange(s, device=key.device)
    offs = torch.searchsorted(key[order], groups, right=True).to(torch.int32)
    x = hidden[order // k]
    gu = torch._grouped_mm(x, pool.gate_up.transpose(-2, -1), offs=offs)
    gate, up = gu.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, pool.down.transpose(-2, -1), offs=offs)
    y = torch.where((key[order] < s)[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device))
    pairs = torch.empty_like(y)
    pairs[order] = y
    pairs = pairs.reshape(t, k, -1) * topk_weights[:, :, None].to(y.dtype)
    out = pairs[:, 0]
    for j in range(1, k):
        out = out + pairs[:, j]
    return out


# ---------------------------------------------------------------- what runs

PREFERRED_MODULES = ("moe_triton",)   # where the expert kernels live now; older modules after it


def find_kernel(name: str):
    """moet.kernels.<module>.<name>: the package itself, then PREFERRED_MODULES, then any other
    moe* module; (None, why) if no module defines it or importing fails."""
    import moet.kernels as pkg
    if hasattr(pkg, name):
        return getattr(pkg, name), None
    errors = []
    others = sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if m.name.startswith("moe"))
    for mod in [m for m in PREFERRED_MODULES if m in others] + [m for m in others if m not in PREFERRED_MODULES]:
        try:
            m = importlib.import_module(f"moet.kernels.{mod}")
        except Exception as exc:  # triton missing, a kernel module mid-edit, ...
            errors.append(f"{mod}: {type(exc).__name__}: {exc}")
            continue
        if hasattr(m, name):
            return getattr(m, name), None
    return None, f"{name} not found in moet.kernels" + (f" ({'; '.join(errors)})" if errors else "")


def paths(smoke: bool, device) -> tuple[dict, dict]:
    """{label: (fn, pool key, graph-capturable)} and {label: why skipped}."""
    run, skipped = {}, {}
    if smoke:
        run["w2 (reference)"] = (moe_experts_reference, "w2", False)
        run["fp4 (reference)"] = (moe_experts_reference, "fp4", False)
    else:
        for fmt, fname in (("w2", "moe_experts_w2_triton"), ("fp4", "moe_experts_fp4_triton")):
            fn, why = find_kernel(fname)
            if fn is None:
                skipped[f"{fmt} triton"] = why
                log(f"  skip {fmt}: {why}")
            else:
                run[f"{fmt} triton"] = (fn, fmt, True)
    run["bf16 transformers loop"] = (moe_bf16_transformers_loop, "bf16", False)
    ok, why = grouped_mm_available(device)
    if ok:
        run["bf16 torch._grouped_mm"] = (moe_bf16_grouped_mm, "bf16", device.type == "cuda")
    else:
        skipped["bf16 torch._grouped_mm"] = why
    return run, skipped


# ---------------------------------------------------------------- correctness

def _poison_allocator(device, nbytes: int) -> None:
    """Fill freed allocator blocks with NaN so outputs a kernel allocates and fails to write
    show up (torch.empty reuses cached blocks)."""
    if device.type == "cuda":
        x = torch.full((nbytes // 2,), float("nan"), dtype=torch.bfloat16, device=device)
        del x


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def check(label, fn, pool, h, e, k, t, device, gen) -> dict:
    x = torch.randn(t, h, device=device, generator=gen).to(torch.bfloat16)
    ids, w = routing(t, e, k, device, gen)
    table = torch.randperm(e, device=device, generator=gen).to(torch.int32)     # expert -> some slot
    table[torch.randperm(e, device=device, generator=gen)[: max(1, e // 8)]] = -1
    m_ref = torch.zeros(1, dtype=torch.int64, device=device)
    m_out = torch.zeros(1, dtype=torch.int64, device=device)
    ref = moe_experts_reference(x, ids, w, table, pool, m_ref)
    try:
        _poison_allocator(device, 4 * t * k * h * 4)
        out = fn(x, ids, w, table, pool, m_out)
        _poison_allocator(device, 4 * t * k * h * 4)
        again = fn(x, ids, w, table, pool, torch.zeros_like(m_out))
    except Exception as exc:  # e.g. a torch build whose _grouped_mm rejects these operands
        msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        log(f"  check {label:24s} T={t:<5d} raised {msg} FAIL")
        return {"path": label, "T": t, "error": msg, "ok": False}
    rec = {"path": label, "T": t, "rel_err": _rel(out, ref), "finite": bool(torch.isfinite(out).all()),
           "misses": [int(m_out.item()), int(m_ref.item())], "rerun_identical": bool(torch.equal(out, again))}
    # bf16 outputs and (kernels) bf16 SwiGLU activations: ~1e-3 expected
    rec["ok"] = rec["finite"] and rec["rel_err"] < 2e-2 and rec["misses"][0] == rec["misses"][1] \
        and rec["rerun_identical"]
    log(f"  check {label:24s} T={t:<5d} rel err {rec['rel_err']:.2e} misses {rec['misses']} "
        f"rerun identical {rec['rerun_identical']} {'ok' if rec['ok'] else 'FAIL'}")
    return rec


# ---------------------------------------------------------------- timing

def graph_ms(fns, device) -> float:
    """One CUDA graph of len(fns) calls, replayed under do_bench (L2 flushed between replays):
    ms per call."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for f in fns:
            f()                                   # warm up (compiles, allocator) off the capture
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    torch.cuda.synchronize(device)
    return time_ms(g.replay, device) / len(fns)


def time_path(fn, pool, x, sets, table, miss, device, capturable: bool) -> tuple[float, str]:
    fns = [lambda ids=ids, w=w: fn(x, ids, w, table, pool, miss) for ids, w in sets]
    if capturable and device.type == "cuda":
        try:
            return graph_ms(fns, device), "graph"
        except Exception as exc:  # not capturable after all (a host sync): time it eagerly
            log(f"    (not capturable: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}; eager)")
            torch.cuda.synchronize(device)
    state = {"i": 0}

    def one():
        fns[state["i"] % len(fns)]()
        state["i"] += 1
    return time_ms(one, device), "eager"


def reference_bounds(device, tokens: list[int], h: int, i: int, k: int, gemv: tuple[int, int] = (32768, 7168)) -> dict:
    """bf16 GEMV bandwidth (W [32768, 7168]) and, per prefill T, a dense bf16 GEMM [T, H] x
    [H, 3kI] (the MoE layer's FLOPs at the same token count), timed like the paths."""
    out = {}
    n, kk = gemv
    ws = [torch.randn(n, kk, device=device, dtype=torch.bfloat16) for _ in range(2)]
    xv = torch.randn(1, kk, device=device, dtype=torch.bfloat16)
    fns = [lambda w=w: F.linear(xv, w) for w in ws]
    ms = graph_ms(fns, device) if device.type == "cuda" else time_ms(fns[0], device)
    out["gemv"] = {"what": f"bf16 GEMV x[1,{kk}] @ W[{n},{kk}]^T", "us": ms * 1e3, "GBps": 2 * n * kk / ms / 1e6}
    del ws
    for t in tokens:
        a = torch.randn(t, h, device=device, dtype=torch.bfloat16)
        b = torch.randn(3 * k * i, h, device=device, dtype=torch.bfloat16)
        ms = time_ms(lambda: F.linear(a, b), device)
        out[f"gemm_T{t}"] = {"what": f"bf16 GEMM [{t},{h}] @ [{3 * k * i},{h}]^T", "us": ms * 1e3,
                             "TFLOPs": 2 * t * h * 3 * k * i / ms / 1e9}
    return out


def run_model(name, dims, args, device, budget: Budget, result: dict, path, smoke: bool) -> None:
    h, i, e, k = dims
    gen = torch.Generator(device=device).manual_seed(0)
    rec = result["models"][name] = {"H": h, "I": i, "E": e, "k": k, "checks": [], "timing": []}
    log(f"{MODEL_NAMES.get(name, name)}: H {h}, I {i}, E {e}, top-{k}: building pools on {device}")
    pools = make_pools(h, i, e, device, gen)
    rec["expert_bytes"] = {f: expert_bytes(p) for f, p in pools.items()}
    run, rec["skipped"] = paths(smoke, device)
    decode, prefill = args.decode, args.prefill
    rec["bounds"] = bounds = reference_bounds(device, prefill, h, i, k, (256, 256) if smoke else (32768, 7168))
    log(f"  bound: bf16 GEMV {bounds['gemv']['GBps']:.0f} GB/s; " +
        ", ".join(f"T={t}: bf16 GEMM {bounds[f'gemm_T{t}']['TFLOPs']:.0f} TFLOP/s" for t in prefill))
    good = {}
    for label, (fn, fmt, cap) in run.items():
        checks = [check(label, fn, pools[fmt], h, e, k, t, device, gen) for t in (decode[0], decode[-1], prefill[0])]
        rec["checks"] += checks
        if all(c["ok"] for c in checks):
            good[label] = (fn, fmt, cap)
        else:
            fail(f"{name} {label}: correctness check failed, not timed")
    write_json(path, result)
    table = torch.arange(e, dtype=torch.int32, device=device)
    miss = torch.zeros(1, dtype=torch.int64, device=device)
    for t in decode + prefill:
        regime = "decode" if t in decode else "prefill"
        x = torch.randn(t, h, device=device, generator=gen).to(torch.bfloat16)
        sets = [routing(t, e, k, device, gen) for _ in range(ROTATIONS)]
        distinct = sum(int(torch.unique(ids).numel()) for ids, _ in sets) / len(sets)
        for label, (fn, fmt, cap) in good.items():
            if not budget.ok(20):
                log(f"budget: stopping before {name} {label} T={t} ({budget.elapsed():.0f} s used)")
                result["stopped_early"] = f"before {name} {label} T={t}"
                return
            ms, how = time_path(fn, pools[fmt], x, sets, table, miss, device, cap)
            row = {"path": label, "regime": regime, "T": t, "us": ms * 1e3, "timing": how,
                   "distinct_experts": distinct, "GBps": distinct * rec["expert_bytes"][fmt] / ms / 1e6,
                   "TFLOPs": 2 * t * k * 3 * h * i / ms / 1e9}
            row["pct_gemv_bw"] = 100 * row["GBps"] / bounds["gemv"]["GBps"]
            if regime == "prefill":
                row["pct_bf16_gemm"] = 100 * row["TFLOPs"] / bounds[f"gemm_T{t}"]["TFLOPs"]
            rec["timing"].append(row)
            perf = (f"{row['GBps']:8.0f} GB/s ({row['pct_gemv_bw']:5.1f}% of GEMV)" if regime == "decode"
                    else f"{row['TFLOPs']:7.1f} TFLOP/s ({row['pct_bf16_gemm']:5.1f}% of bf16 GEMM)")
            log(f"  {name} T={t:<5d} {label:24s} {ms * 1e3:10.1f} us {how:5s}  {perf}")
        write_json(path, result)
    del pools
    if device.type == "cuda":
        torch.cuda.empty_cache()


def markdown(result: dict) -> str:
    info = result["info"]
    lines = [f"MoE layer, {info.get('gpu', info['device'])}, {info['date_utc']} UTC, torch {info['torch']}, "
             f"triton {info.get('triton', '-')}; each call a fresh routing of {ROTATIONS} rotating sets, "
             "L2 flushed", ""]
    for name, rec in result["models"].items():
        b = rec.get("bounds", {})
        lines += [f"**{MODEL_NAMES.get(name, name)}** (H {rec['H']}, I {rec['I']}, E {rec['E']}, top-{rec['k']}); "
                  f"bf16 GEMV bound {b.get('gemv', {}).get('GBps', 0):.0f} GB/s; skipped: "
                  f"{'; '.join(f'{p}: {w}' for p, w in rec.get('skipped', {}).items()) or 'none'}", "",
                  "| T | path | us | timing | distinct experts | GB/s | % GEMV | TFLOP/s | % bf16 GEMM |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in rec["timing"]:
            pct = f"{r['pct_bf16_gemm']:.0f}%" if "pct_bf16_gemm" in r else "-"
            lines.append(f"| {r['T']} | {r['path']} | {r['us']:.1f} | {r['timing']} | {r['distinct_experts']:.0f} | "
                         f"{r['GBps']:.0f} | {r['pct_gemv_bw']:.0f}% | {r['TFLOPs']:.1f} | {pct} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-s", type=float, default=540.0, help="stop starting measurements after this many seconds")
    p.add_argument("--out", default=None, help="result folder (default $OUT, else ./bench_out)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--decode", default="1,4,8,16,32")
    p.add_argument("--prefill", default="512,2048,8192")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, the references as kernels, on CPU")
    args = p.parse_args(argv)
    budget = Budget(args.budget_s)
    smoke = args.cpu_smoke
    device = bench_device(smoke)
    if device is None:
        return 2
    if smoke:
        models, args.decode, args.prefill = SMOKE_MODELS, [1, 4], [16]
    else:
        models = {m: MODELS[m] for m in args.models.split(",")}
        args.decode = [int(t) for t in args.decode.split(",")]
        args.prefill = [int(t) for t in args.prefill.split(",")]
    out = out_dir(args.out)
    path = out / "moe_bench.json"
    result = {"info": device_info(device), "models": {}}
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    for name, dims in models.items():
        if not budget.ok(30):
            result["stopped_early"] = f"before {name}"
            break
        run_model(name, dims, args, device, budget, result, path, smoke)
    write_json(path, result)
    (out / "moe_bench.md").write_text(markdown(result))
    log(markdown(result))
    ok = all(c["ok"] for m in result["models"].values() for c in m["checks"])
    log(f"done in {budget.elapsed():.0f} s -> {path}; checks {'all ok' if ok else 'FAILED (see json)'}")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
