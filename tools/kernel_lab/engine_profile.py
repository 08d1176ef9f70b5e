"""Device diagnostic: where does one single-stream decode step of the engine spend its time?
cProfile of the host side (eng.step with a device sync) and torch.profiler's CUDA kernel table,
on a random-weight model of a real shape (engine_bench.random_model).

    PYTHONPATH=src python tools/kernel_lab/engine_profile.py --out $OUT [--model qwen3_30b] [--batch 1]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time
from types import SimpleNamespace

import torch

from moet.bench import engine_bench as eb
from moet.sampling_params import SamplingParams


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--model", default="qwen3_30b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--small-kernel-pdl", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    name, cfg = eb.MODELS[args.model] if cuda else ("smoke", eb.SMOKE)
    model = eb.random_model(cfg, dev)
    ns = SimpleNamespace(streams=f"1,4,8,{args.batch}", prefill=512, gpu_memory_utilization=0.85, kv_cache_memory_gb=4.0,
                         enforce_eager=False, async_scheduling=args.async_scheduling,
                         small_kernel_pdl=args.small_kernel_pdl)
    eng = eb.make_engine(model, cfg, dev, ns, 2048)
    sp = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    for i, p in enumerate(eb.prompts(args.batch, 128, cfg["vocab_size"], 2)):
        eng.add_request(f"r{i}", p, sp)
    for _ in range(5):
        eng.step()
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    sync()
    report = io.StringIO()

    # 1. plain timing of step() and of the runner's forward alone (graph replay)
    t = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
        sync()
    step_ms = (time.perf_counter() - t) / args.steps * 1e3
    fwd = eng.runner.forward
    times = []

    def timed_forward(*a, **k):
        sync()
        t0 = time.perf_counter()
        out = fwd(*a, **k)
        sync()
        times.append(time.perf_counter() - t0)
        return out
    eng.runner.forward = timed_forward
    for _ in range(args.steps):
        eng.step()
    eng.runner.forward = fwd
    fwd_ms = sum(times) / len(times) * 1e3
    print(f"{name} batch {args.batch}: step {step_ms:.2f} ms, runner.forward {fwd_ms:.2f} ms "
          f"(graphs {sorted(eng.runner.graphs)}, error {eng.runner.graph_error})", file=report)

    # 2. host side
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(args.steps):
        eng.step()
        sync()
    pr.disable()
    pstats.Stats(pr, stream=report).sort_stats("cumulative").print_stats(40)
    pstats.Stats(pr, stream=report).sort_stats("tottime").print_stats(25)

    # 3. device side
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(10):
            eng.step()
            if not args.async_scheduling:            # async: one sync at the end (a sync a step
                sync()                               # would drain the pipeline it measures)
        sync()
    key = "cuda_time_total" if cuda else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=45, max_name_column_width=70), file=report)
    if cuda:
        trace = os.path.join(args.out, f"engine_trace_{args.model}_b{args.batch}.json")
        prof.export_chrome_trace(trace)
        print(gpu_timeline(trace, 10), file=report)
    text = report.getvalue()
    print(text[:6000])
    with open(os.path.join(args.out, f"engine_profile_{args.model}_b{args.batch}.txt"), "w") as f:
        f.write(text)


def gpu_timeline(trace_path: str, steps: int, gap_us: float = 15.0) -> str:
    """From a chrome trace of `steps` engine steps: kernel time per step on every stream merged
    (the GPU busy), the idle left in the span, the idle gaps longer than gap_us (with the kernels
    on both sides), and the kernel time per stream. The profiler inflates host times, not kernel
    times: busy per step is the number to hold against the unprofiled step time."""
    import collections
    import json
    ev = json.load(open(trace_path))["traceEvents"]
    k = sorted((e for e in ev if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not k:
        return "no kernels in the trace"
    busy, gaps, cur_s, cur_e, last = 0.0, [], k[0]["ts"], k[0]["ts"] + k[0]["dur"], k[0]
    for e in k[1:]:
        if e["ts"] > cur_e:
            busy += cur_e - cur_s
            if e["ts"] - cur_e > gap_us:
                gaps.append((e["ts"] - cur_e, last["name"][:40], e["name"][:40]))
            cur_s = e["ts"]
        if e["ts"] + e["dur"] > cur_e:
            cur_e, last = e["ts"] + e["dur"], e
    busy += cur_e - cur_s
    span = cur_e - k[0]["ts"]
    per_stream = collections.Counter()
    for e in k:
        per_stream[e["tid"]] += e["dur"]
    out = [f"GPU timeline over {steps} steps: span {span / steps / 1e3:.3f} ms a step, busy (any stream) "
           f"{busy / steps / 1e3:.3f} ms, idle {(span - busy) / steps / 1e3:.3f} ms; "
           f"{len(gaps)} gaps > {gap_us:.0f} us ({sum(g for g, _, _ in gaps) / steps / 1e3:.3f} ms a step)"]
    for g, a, b in sorted(gaps, reverse=True)[:5]:
        out.append(f"  gap {g:8.1f} us after {a} before {b}")
    main_tid = per_stream.most_common(1)[0][0]
    side = sum(v for t, v in per_stream.items() if t != main_tid)
    out.append(f"  kernel time a step: main stream {per_stream[main_tid] / steps / 1e3:.3f} ms, the other "
               f"{len(per_stream) - 1} streams {side / steps / 1e3:.3f} ms")
    return "\n".join(out)


if __name__ == "__main__":
    main()
