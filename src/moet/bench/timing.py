"""What the kernel benchmarks share: a wall-clock budget that stops a run before the machine is
taken away, one timing function (Triton's do_bench on a GPU: L2 flushed before every call,
median of the event-timed calls; perf_counter on CPU), the bf16 GEMV / GEMM references every
result is held to in the same run, and where results go ($OUT on the GPU box)."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch


class Budget:
    """Wall-clock budget: `left()` seconds remain; `ok(need)` says whether `need` more fit."""

    def __init__(self, seconds: float):
        self.start, self.seconds = time.monotonic(), seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def ok(self, need: float = 0.0) -> bool:
        return self.left() > need


def log(msg: str) -> None:
    print(msg, flush=True)


def time_ms(fn, device: torch.device, *, warmup_ms: int = 20, rep_ms: int = 80) -> float:
    """Median ms of one call of fn. CUDA: triton.testing.do_bench, which zeroes a 256 MB buffer
    before every call, so weights come from HBM, not L2 (fn's own launch overhead included)."""
    if device.type == "cuda":
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graphed(fn):
    """fn captured in a CUDA graph (warmed once on a side stream first, as capture requires) ->
    (graph.replay, None); where capture fails, (fn, the exception): time it eagerly and say so.
    Timing the replay leaves out Python's launch overhead, which a served step does not pay."""
    fn()
    try:
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay, None
    except Exception as exc:               # noqa: BLE001 -- the caller reports it
        return fn, exc


def graph_time_ms(fn, *, warmup_ms: int = 10, rep_ms: int = 40) -> float:
    """Median ms of one replay of fn captured in a CUDA graph (graphed; a capture failure is
    raised, not timed eagerly), under triton.testing.do_bench (L2 flushed before every run): the
    kernel-lab probes' timer."""
    import triton.testing
    run, err = graphed(fn)
    if err is not None:
        raise err
    return float(triton.testing.do_bench(run, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def bf16_gemv_bandwidth(device: torch.device, n: int = 32768, k: int = 7168) -> dict:
    """A bf16 GEMV (one token, W [n, k]) as the memory reference: GB/s counted on W's bytes."""
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    ms = time_ms(lambda: torch.nn.functional.linear(x, w), device)
    return {"what": f"bf16 GEMV x[1,{k}] @ W[{n},{k}]^T (torch F.linear)", "ms": ms, "GBps": 2 * n * k / ms / 1e6}


def bf16_gemm_tflops(device: torch.device, m: int = 8192, n: int = 8192, k: int = 8192) -> dict:
    """A bf16 GEMM as the compute reference (TFLOP/s)."""
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    ms = time_ms(lambda: torch.nn.functional.linear(a, b), device)
    return {"what": f"bf16 GEMM [{m},{k}] @ [{n},{k}]^T (torch F.linear)", "ms": ms, "TFLOPs": 2 * m * n * k / ms / 1e9}


def device_info(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "device": str(device),
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        try:
            import triton
            info["triton"] = triton.__version__
        except ImportError:
            pass
    return info


def out_dir(arg: str | None) -> Path:
    """--out, else $OUT (the GPU box's result folder), else ./bench_out."""
    path = Path(arg or os.environ.get("OUT") or "bench_out")
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)


def fail(msg: str) -> None:
    print(f"FAILED: {msg}", file=sys.stderr, flush=True)


def bench_device(cpu_smoke: bool) -> torch.device | None:
    """The device a GPU bench runs on: CPU for --cpu-smoke, else CUDA; None (after saying which
    flag helps) when there is no CUDA device."""
    if not cpu_smoke and not torch.cuda.is_available():
        fail("no CUDA device; use --cpu-smoke to exercise the harness on CPU")
        return None
    return torch.device("cpu" if cpu_smoke else "cuda")
