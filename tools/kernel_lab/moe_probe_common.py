"""The start every MoE kernel-lab probe shares: the output folder, the device, a bf16 GEMV timed in
the same run (the bandwidth every GB/s is held to) and the report header."""
from __future__ import annotations

import os
import time

import torch


def start(out: str) -> tuple[torch.device, float, float, dict]:
    """(device, start time, bf16 GEMV GB/s, report dict with "rows": [])."""
    from moet.bench.moe_kernel_tune import bf16_gemv_gbps
    os.makedirs(out, exist_ok=True)
    dev = torch.device("cuda")
    t0 = time.time()
    gemv = bf16_gemv_gbps(dev)
    rep = {"device": torch.cuda.get_device_name(dev), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "bf16_gemv_GBps": gemv, "rows": []}
    print(f"[{time.time() - t0:4.0f}s] bf16 GEMV {gemv:.0f} GB/s", flush=True)
    return dev, t0, gemv, rep
