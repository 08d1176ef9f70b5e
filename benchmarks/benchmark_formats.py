"""Conversion speed of checkpoint expert formats -> W2, and the scale-rule quality study.

    python benchmarks/benchmark_formats.py [--device cpu|cuda] [--json OUT] [--repeats N]

Speed is "MB/s of checkpoint converted": bytes of the native expert tensors (codes + scales)
consumed per second by w2.from_<format>, on one DeepSeek-V3 routed-expert matrix shape
([2048, 7168] gate/up, [7168, 2048] down). On a GPU it is also held to the copy bandwidth
measured in the same run (the conversion reads the native bytes and writes 2.25 bits/weight;
the floor is that traffic over the copy bandwidth). Quality: relRMS and mean signed bias of
W2 against the source on Gaussian and Laplace weights (and on NVFP4-quantized Gaussian, the
real input of the pipeline), for each scale rule.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from moet.formats import fp8_block, mxfp4, nvfp4, w2

SHAPES = {"dsv3_gate_up": (2048, 7168), "dsv3_down": (7168, 2048)}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time(fn, device: str, repeats: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    t = _time(lambda: y.copy_(x), device, 20)
    return 2 * x.numel() / t


def _on_cpu(fmt, t, q8, s8, b4, s4, wb) -> w2.W2Tensor:
    if fmt == "nvfp4":
        return w2.from_nvfp4(t.weight.cpu(), t.weight_scale.cpu(), t.weight_scale_2.cpu())
    if fmt == "fp8_block":
        return w2.from_fp8_block(q8.cpu(), s8.cpu())
    if fmt == "mxfp4":
        return w2.from_mxfp4(b4.cpu(), s4.cpu())
    return w2.quantize(wb.cpu())


def speed(device: str, repeats: int) -> list[dict]:
    rows = []
    g = torch.Generator(device=device).manual_seed(0)
    for shape_name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=g, device=device) * 0.02
        t = nvfp4.quantize(w)
        q8, s8 = fp8_block.quantize(w)
        b4, s4 = mxfp4.quantize(w)
        wb = w.bfloat16()
        cases = {
            "nvfp4": (lambda: w2.from_nvfp4(t.weight, t.weight_scale, t.weight_scale_2),
                      t.weight.numel() + t.weight_scale.numel() + 4),
            "fp8_block": (lambda: w2.from_fp8_block(q8, s8), q8.numel() + 4 * s8.numel()),
            "mxfp4": (lambda: w2.from_mxfp4(b4, s4), b4.numel() + s4.numel()),
            "bf16": (lambda: w2.quantize(wb), 2 * wb.numel()),
        }
        for fmt, (fn, native_bytes) in cases.items():
            if device != "cpu":   # the device result must equal the CPU result bit for bit
                a, b = fn(), _on_cpu(fmt, t, q8, s8, b4, s4, wb)
                assert torch.equal(a.codes.cpu(), b.codes) and torch.equal(a.scales.cpu(), b.scales), fmt
            sec = _time(fn, device, repeats)
            out_bytes = n * k // 4 + n * k // 32
            rows.append(dict(device=device, shape=shape_name, n=n, k=k, source=fmt, seconds=sec,
                             native_bytes=native_bytes, mb_per_s=native_bytes / sec / 1e6,
                             weights_per_s=n * k / sec, traffic_bytes=native_bytes + out_bytes))
    return rows


def quality() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    n, k = 1024, 4096
    gauss = torch.randn(n, k, generator=g, dtype=torch.float64)
    u = torch.rand(n, k, generator=g, dtype=torch.float64) - 0.5
    laplace = -torch.sign(u) * torch.log1p(-2 * u.abs())
    t = nvfp4.quantize(gauss.float())
    gauss_nvfp4 = nvfp4.dequantize(t.weight, t.weight_scale, t.weight_scale_2, dtype=torch.float64)
    rows = []
    for dist, w in (("gaussian", gauss), ("laplace", laplace), ("gaussian->nvfp4", gauss_nvfp4)):
        for rule in w2.SCALE_RULES:
            q = w2.dequantize(w2.quantize(w, scale_rule=rule), dtype=torch.float64)
            err = q - w
            rel = (err.norm() / w.norm()).item()
            # bias in units of the tensor RMS; "gain" = least-squares scale of q onto w
            rows.append(dict(distribution=dist, scale_rule=rule, rel_rms=rel,
                             bias_over_rms=(err.mean() / w.pow(2).mean().sqrt()).item(),
                             gain=((q * w).sum() / (q * q).sum()).item()))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-quality", action="store_true")
    args = ap.parse_args(argv)
    bw = copy_bandwidth(args.device)
    rows = speed(args.device, args.repeats)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU ({torch.get_num_threads()} threads)"
    print(f"# W2 conversion speed on {name}, torch {torch.__version__}"
          + (f", copy bandwidth {bw / 1e9:.0f} GB/s" if bw else ""))
    print(f"{'shape':<14} {'source':<10} {'ms':>9} {'MB/s in':>10} {'Gweights/s':>11}" + ("  % of copy floor" if bw else ""))
    for r in rows:
        extra = ""
        if bw:
            r["pct_of_copy_floor"] = 100 * (r["traffic_bytes"] / bw) / r["seconds"]
            extra = f"  {r['pct_of_copy_floor']:.1f}%"
        print(f"{r['shape']:<14} {r['source']:<10} {r['seconds'] * 1e3:>9.2f} {r['mb_per_s']:>10.1f} "
              f"{r['weights_per_s'] / 1e9:>11.3f}{extra}")
    q = [] if args.skip_quality else quality()
    if q:
        print("\n# W2 error by scale rule (1024 x 4096, float64 source)")
        print(f"{'distribution':<16} {'rule':<10} {'relRMS':>8} {'bias/RMS':>10} {'gain':>7}")
        for r in q:
            print(f"{r['distribution']:<16} {r['scale_rule']:<10} {r['rel_rms']:>8.4f} {r['bias_over_rms']:>+10.2e} {r['gain']:>7.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "copy_bandwidth": bw, "speed": rows, "quality": q}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
