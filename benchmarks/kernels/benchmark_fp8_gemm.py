"""FP8 block-128 dense GEMM (moet.kernels.fp8_gemm_triton) on DeepSeek-V3's dense shapes.

    python benchmarks/kernels/benchmark_fp8_gemm.py [--budget-s 480] [--out DIR] [--tokens 1,16,128,2048,8192]
                                        [--modes w8a8,w8a16] [--sweep] [--cpu-smoke]

1. Correctness first, at every shape: the kernel (both modes) against the torch reference of the
   same math (fp32 upcast), fresh random weights (moet.formats.fp8_block.quantize of Gaussian
   rows of varied scale) and activations, split-K partials poisoned with NaN, rerun bit-identical;
   the w8a8 error against the exact product (w8a16 reference) is reported too. A failure stops
   the run before any timing.
2. Timing (triton do_bench: L2 flushed before every call, median) of CUDA-graph replays, as a
   served decode step runs them (the engine captures its decode steps), so host launch overhead
   is left out; at T <= 128 the eager time of each mode is recorded too ({mode}_eager_ms: our
   wrapper's Python and two launches cost tens of us, which a graph does not pay). Per shape and
   T, both modes next to torch's bf16 F.linear of the same shape in the same run, and
   torch._scaled_mm with block scales where this torch/cuBLAS has it (checked against the
   reference first; its activations are quantized before the timing, ours inside it).
   Small T: GB/s on the weight bytes (e4m3 + scales; bf16: 2 bytes/weight), with the bf16 GEMV
   bandwidth of W [32768, 7168] measured in the same run as the bound. Large T: TFLOP/s, with
   a bf16 8192^3 GEMM measured in the same run as the bound.
   --sweep also times a few launch configs per (shape, T) (the default among them) and writes
   the best to $OUT/fp8_gemm_configs.json (copy it to src/moet/kernels/ for pick_config to use).
Results: $OUT/fp8_gemm_bench.json (rewritten after every shape) and fp8_gemm_bench.md.
--cpu-smoke: tiny shapes through the references on CPU (tests the harness, times nothing real).
"""
from __future__ import annotations

import argparse
import os
from dataclasses import asdict

import torch
import torch.nn.functional as F

from moet.bench.timing import (Budget, bench_device, bf16_gemm_tflops, bf16_gemv_bandwidth, device_info, fail, graphed,
                               log, out_dir, time_ms, write_json)
from moet.formats import fp8_block
from moet.kernels.fp8_gemm_reference import act_quant_reference, fp8_block_gemm_reference

# DeepSeek-V3 dense stack (name: (N, K)); lm_head is bf16 in the checkpoint but the largest GEMV.
SHAPES = {
    "q_a 7168->1536": (1536, 7168),
    "q_b 1536->24576": (24576, 1536),
    "kv_a 7168->576": (576, 7168),
    "o 16384->7168": (7168, 16384),
    "mlp gate/up 7168->18432": (18432, 7168),
    "mlp down 18432->7168": (7168, 18432),
    "lm_head-ish 7168->129280": (129280, 7168),
}
SMOKE_SHAPES = {"tiny a": (200, 300), "tiny b": (64, 256)}
SMALL_T = 128          # T <= this: report GB/s (memory-bound); above: TFLOP/s


def _weights(n: int, k: int, device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, generator=g, device=device) * torch.rand(n, 1, generator=g, device=device).add(0.1)
    return fp8_block.quantize(w)


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _gemm(device, smoke: bool):
    if smoke:
        return lambda x, w, s, mode, config=None, partials=None: fp8_block_gemm_reference(x, w, s, mode=mode)
    from moet.kernels.fp8_gemm_triton import fp8_block_gemm_triton

    return lambda x, w, s, mode, config=None, partials=None: fp8_block_gemm_triton(
        x, w, s, mode=mode, config=config, partials=partials)


def _scaled_mm_fn(x, w, s):
    """torch._scaled_mm with DeepSeek block scales (1x128 activations, 128x128 weights), or
    (None, reason). Layout conventions differ between torch versions: try the known ones and
    keep the first that matches the reference."""
    if not hasattr(torch, "_scaled_mm"):
        return None, "torch has no _scaled_mm"
    xq, xs = act_quant_reference(x)
    want = fp8_block_gemm_reference(x, w, s, mode="w8a8")
    errors = []
    variants = {
        "scale_a MxK/128 (M-major), scale_b K/128xN/128": lambda: torch._scaled_mm(
            xq, w.t(), xs.t().contiguous().t(), s.t(), out_dtype=torch.bfloat16),
        "scale_a MxK/128, scale_b K/128xN/128 contiguous": lambda: torch._scaled_mm(
            xq, w.t(), xs.contiguous(), s.t().contiguous(), out_dtype=torch.bfloat16),
    }
    for name, fn in variants.items():
        try:
            err = _rel(fn(), want)
        except Exception as exc:  # torch raises RuntimeError / ValueError / NotImplementedError here
            errors.append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
            continue
        if err < 2e-2:
            return (lambda: torch._scaled_mm(xq, w.t(), *_scales(name, xs, s), out_dtype=torch.bfloat16)), name
        errors.append(f"{name}: wrong result (rel err {err:.3g})")
    return None, "; ".join(errors)


def _scales(name: str, xs, s):
    if name.startswith("scale_a MxK/128 (M-major)"):
        return xs.t().contiguous().t(), s.t()
    return xs.contiguous(), s.t().contiguous()


def check(shapes, modes, device, gemm, smoke: bool) -> list[dict]:
    """Correctness of every (shape, mode) at a few T before anything is timed."""
    rows = []
    ts = (1, 5) if smoke else (1, 16, 300)
    for i, (name, (n, k)) in enumerate(shapes.items()):
        w, s = _weights(n, k, device, 100 + i)
        for t in ts:
            g = torch.Generator(device=device).manual_seed(1000 * i + t)
            x = torch.randn(t, k, generator=g, device=device).to(torch.bfloat16)
            exact = fp8_block_gemm_reference(x.float(), w, s, mode="w8a16")
            for mode in modes:
                ref = fp8_block_gemm_reference(x, w, s, mode=mode)
                out = gemm(x, w, s, mode)
                again = gemm(x, w, s, mode)
                row = {"shape": name, "N": n, "K": k, "T": t, "mode": mode, "rel_err_vs_reference": _rel(out, ref),
                       "rel_err_vs_exact": _rel(out, exact), "bit_identical_rerun": bool(torch.equal(out, again)),
                       "finite": bool(torch.isfinite(out).all())}
                row["ok"] = row["rel_err_vs_reference"] < 1e-2 and row["bit_identical_rerun"] and row["finite"]
                log(f"  check {name:26s} T={t:<5d} {mode:5s} rel err {row['rel_err_vs_reference']:.2e} "
                    f"(vs exact {row['rel_err_vs_exact']:.2e}) rerun identical {row['bit_identical_rerun']}"
                    f" {'ok' if row['ok'] else 'FAIL'}")
                rows.append(row)
    return rows


def _time(fn, device, **kw) -> float:
    """ms of one call: a CUDA-graph replay on CUDA (time_ms of the eager call where capture
    fails, which is logged), time_ms on CPU."""
    if device.type != "cuda":
        return time_ms(fn, device, **kw)
    run, err = graphed(fn)
    if err is not None:
        log(f"    CUDA graph capture failed ({type(err).__name__}: {str(err)[:120]}); timed eagerly")
    return time_ms(run, device, **kw)


def _sweep_configs(t: int, n: int, k: int, mode: str, device):
    """A few candidates around the built-in default (each distinct one costs a compile)."""
    from dataclasses import replace

    from moet.kernels.fp8_gemm_triton import Fp8GemmConfig, pick_config
    base = pick_config(t, n, k, mode, device)
    if t <= 256:
        out = [base] + [replace(base, split=max(1, base.split * f // 2)) for f in (1, 4)]
        out += [replace(base, block_n=bn) for bn in (32, 128) if bn != base.block_n]
        out += [replace(base, num_stages=6), replace(base, num_warps=8)]
        if mode == "w8a8":                       # x quantized inside the GEMM or by a launch before it
            out.append(replace(base, inline_quant=not base.inline_quant))
        if t > 16:
            out += [replace(base, block_m=32 if base.block_m > 32 else 64), replace(base, split=1)]
        return list(dict.fromkeys(out))          # without repeats
    return [base] + [Fp8GemmConfig(bm, bn, 1, warps, stages, inline_quant=False)
                              for bm, bn, warps, stages in ((128, 128, 8, 4), (128, 128, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3),
                                                   (64, 128, 4, 4), (128, 64, 8, 4), (64, 64, 4, 4))]


def bench(shapes, tokens, modes, device, gemm, budget: Budget, smoke: bool, sweep: bool, result: dict, path) -> None:
    result["timing"] = rows = []
    for i, (name, (n, k)) in enumerate(shapes.items()):
        w, s = _weights(n, k, device, 200 + i)
        wb = fp8_block.dequantize(w, s).to(torch.bfloat16)
        fp8_bytes = w.numel() + 4 * s.numel()
        for t in tokens:
            if not budget.ok(30):
                log(f"budget: stopping before {name} T={t} ({budget.elapsed():.0f} s used)")
                result["stopped_early"] = f"before {name} T={t}"
                return
            x = torch.randn(t, k, device=device).to(torch.bfloat16)
            row = {"shape": name, "N": n, "K": k, "T": t, "flop": 2 * t * n * k}
            row["bf16_ms"] = _time(lambda: F.linear(x, wb), device)
            for mode in modes:
                row[f"{mode}_ms"] = _time(lambda: gemm(x, w, s, mode), device)
                if t <= SMALL_T:
                    row[f"{mode}_eager_ms"] = time_ms(lambda: gemm(x, w, s, mode), device)
            if device.type == "cuda":
                fn, how = _scaled_mm_fn(x, w, s)
                row["scaled_mm"] = how
                if fn is not None:
                    row["scaled_mm_ms"] = _time(fn, device)
                if sweep and not smoke and budget.ok(60):
                    for mode in modes:
                        best = None
                        for cfg in _sweep_configs(t, n, k, mode, device):
                            if not budget.ok(30):
                                break
                            try:
                                ms = _time(lambda: gemm(x, w, s, mode, config=cfg), device, warmup_ms=5, rep_ms=20)
                            except Exception as exc:  # a config the compiler rejects (shared memory)
                                log(f"    sweep {cfg}: {type(exc).__name__}")
                                continue
                            if best is None or ms < best[0]:
                                best = (ms, cfg)
                        if best:
                            row[f"{mode}_best_ms"], row[f"{mode}_best_config"] = best[0], repr(best[1])
                            # the default is a candidate: every swept T gets an entry
                            table = result.setdefault("config_table", {}).setdefault(
                                result["info"].get("gpu", "cpu"), {})
                            table.setdefault(f"{n}x{k}", {}).setdefault(mode, {})[str(t)] = asdict(best[1])
            for key in [kk for kk in row if kk.endswith("_ms") and not kk.endswith("_eager_ms")]:
                label = key[:-3]
                if t <= SMALL_T:
                    nbytes = 2 * n * k if label == "bf16" else fp8_bytes
                    row[f"{label}_GBps"] = nbytes / row[key] / 1e6
                row[f"{label}_TFLOPs"] = row["flop"] / row[key] / 1e9
            log(f"  {name:26s} T={t:<5d} bf16 {row['bf16_ms'] * 1e3:8.1f} us  " +
                "  ".join(f"{m} {row[m + '_ms'] * 1e3:8.1f} us" +
                          (f" (eager {row[m + '_eager_ms'] * 1e3:.1f})" if m + "_eager_ms" in row else "") for m in modes) +
                (f"  scaled_mm {row['scaled_mm_ms'] * 1e3:8.1f} us" if "scaled_mm_ms" in row else ""))
            rows.append(row)
        write_json(path, result)


def markdown(result: dict) -> str:
    ref_bw = result.get("bf16_gemv", {}).get("GBps")
    ref_tf = result.get("bf16_gemm", {}).get("TFLOPs")
    modes = result["modes"]
    info = result["info"]
    lines = [f"FP8 block-128 GEMM, {info.get('gpu', info['device'])}, {info['date_utc']} UTC, "
             f"torch {result['info']['torch']}, triton {result['info'].get('triton', '-')}",
             f"bf16 GEMV reference: {ref_bw and round(ref_bw)} GB/s ({result.get('bf16_gemv', {}).get('what')}); "
             f"bf16 GEMM reference: {ref_tf and round(ref_tf)} TFLOP/s ({result.get('bf16_gemm', {}).get('what')})", "",
             "Times are CUDA-graph replays; 'eager' is the same call launched from Python.", "",
             "| shape | T | bf16 us | " + " | ".join(f"{m} us | {m} GB/s or TFLOP/s (% of bound) | {m} eager us"
                                                   for m in modes) + " | scaled_mm us |",
             "|---|---|---|" + "---|---|---|" * len(modes) + "---|"]
    for r in result.get("timing", []):
        cells = []
        for m in modes:
            if r["T"] <= SMALL_T and ref_bw:
                perf = f"{r[m + '_GBps']:.0f} GB/s ({100 * r[m + '_GBps'] / ref_bw:.0f}%)"
            elif ref_tf:
                perf = f"{r[m + '_TFLOPs']:.0f} TF ({100 * r[m + '_TFLOPs'] / ref_tf:.0f}%)"
            else:
                perf = "-"
            eager = f"{r[m + '_eager_ms'] * 1e3:.1f}" if m + "_eager_ms" in r else "-"
            cells.append(f"{r[m + '_ms'] * 1e3:.1f} | {perf} | {eager}")
        sm = f"{r['scaled_mm_ms'] * 1e3:.1f}" if "scaled_mm_ms" in r else "-"
        lines.append(f"| {r['shape']} | {r['T']} | {r['bf16_ms'] * 1e3:.1f} | " + " | ".join(cells) + f" | {sm} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-s", type=float, default=480.0, help="stop timing after this many seconds")
    p.add_argument("--out", default=None, help="result folder (default $OUT, else ./bench_out)")
    p.add_argument("--tokens", default="1,16,128,2048,8192")
    p.add_argument("--modes", default="w8a8,w8a16")
    p.add_argument("--shapes", default=None, help="comma-separated substrings of shape names to keep")
    p.add_argument("--sweep", action="store_true", help="also time a few launch configs per (shape, T)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes through the torch reference on CPU")
    args = p.parse_args(argv)
    budget = Budget(args.budget_s)
    smoke = args.cpu_smoke
    device = bench_device(smoke)
    if device is None:
        return 2
    shapes = SMOKE_SHAPES if smoke else SHAPES
    if args.shapes:
        keep = args.shapes.split(",")
        shapes = {k: v for k, v in shapes.items() if any(s in k for s in keep)}
    tokens = [int(t) for t in args.tokens.split(",")] if not smoke else [1, 4]
    modes = args.modes.split(",")
    out = out_dir(args.out)
    path = out / "fp8_gemm_bench.json"
    result = {"info": device_info(device), "modes": modes, "tokens": tokens, "shapes": shapes}
    log(f"fp8_gemm_bench on {result['info'].get('gpu', 'cpu')}: correctness first")
    gemm = _gemm(device, smoke)
    result["check"] = check(shapes, modes, device, gemm, smoke)
    write_json(path, result)
    if not all(r["ok"] for r in result["check"]):
        fail("correctness check failed; nothing timed (see fp8_gemm_bench.json)")
        return 1
    if device.type == "cuda":
        result["bf16_gemv"] = bf16_gemv_bandwidth(device)
        result["bf16_gemm"] = bf16_gemm_tflops(device)
        log(f"bound: {result['bf16_gemv']['GBps']:.0f} GB/s bf16 GEMV, "
            f"{result['bf16_gemm']['TFLOPs']:.0f} TFLOP/s bf16 GEMM")
    bench(shapes, tokens, modes, device, gemm, budget, smoke, args.sweep, result, path)
    write_json(path, result)
    if "config_table" in result:      # copy to src/moet/kernels/fp8_gemm_configs.json to use it
        write_json(out / "fp8_gemm_configs.json", result["config_table"])
    (out / "fp8_gemm_bench.md").write_text(markdown(result))
    log(markdown(result))
    log(f"done in {budget.elapsed():.0f} s -> {path}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
