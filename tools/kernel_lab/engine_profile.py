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
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    name, cfg = eb.MODELS[args.model] if cuda else ("smoke", eb.SMOKE)
    model = eb.random_model(cfg, dev)
    ns = SimpleNamespace(streams=f"1,4,8,{args.batch}", prefill=512, gpu_memory_utilization=0.85, kv_cache_memory_gb=4.0,
                         enforce_eager=False)
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
            sync()
    key = "cuda_time_total" if cuda else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=45, max_name_column_width=70), file=report)
    if cuda:
        prof.export_chrome_trace(os.path.join(args.out, f"engine_trace_{args.model}_b{args.batch}.json"))
    text = report.getvalue()
    print(text[:6000])
    with open(os.path.join(args.out, f"engine_profile_{args.model}_b{args.batch}.txt"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
