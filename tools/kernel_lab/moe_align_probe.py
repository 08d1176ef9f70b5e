"""The one-program slot alignment (_prep_small_kernel) at 8 / 256 / 512 pairs (Qwen3-30B shape, W2,
T = 1 / 32 / 64) with its compare-chunk width and warps varied: run 12 measured 29 us at 256 pairs
and 404 us at 512 with QB 32 on 4 warps (spilled registers); moe_triton._align_launch now sizes the
chunk to <= 2,048 values on 8 warps from 256 pairs (the `None` row). Each row: the prep kernel's
device time, the layer's time, and (T = 64) the correctness check. Lab probe, one device call:
    PYTHONPATH=src python tools/kernel_lab/moe_align_probe.py     (writes $OUT/moe_align_probe.json)
"""
import json, os, torch
from moet.bench import moe_kernel_tune as tu
from moet.kernels import moe_triton as mt
from moet.kernels.launch_tables import device_name
from moet.kernels.moe_configs import lookup
from moet.kernels.reference import moe_experts_reference
dev = torch.device("cuda"); gen = torch.Generator(device=dev).manual_seed(0); name = device_name(dev)
h, i, e, k = tu.SHAPES["qwen"]; pool = tu.make_pool("w2", e, h, i, dev, gen); eb = tu.expert_bytes(pool)
rep = {}
for qb, w in ((None, None), (32, 4), (8, 8), (4, 8), (16, 8), (8, 16)):
    if qb: mt._align_launch = lambda pp, qb=qb, w=w: dict(QB=min(pp, qb), num_warps=w)
    for t in (1, 32, 64):
        cfg = mt.fit_token_tile(lookup("w2", h, i, t * k, name), t * k, e)
        bd = tu.kernel_breakdown(mt, pool, h, e, k, t, dev, gen, cfg)
        r = {"prep_us": bd.get("_prep_small_kernel"), "layer_us": tu.time_layer(mt, pool, h, e, k, t, dev, gen, cfg, eb)["us"]}
        if t == 64: r["ok"] = tu.check("w2", pool, h, e, k, t, 7.0, dev, gen, mt, moe_experts_reference, config=cfg)["ok"]
        rep[f"qb{qb}/w{w}/T{t}"] = r; print(f"qb{qb}/w{w}/T{t}", r, flush=True)
json.dump(rep, open(os.path.join(os.environ.get("OUT", "."), "moe_align_probe.json"), "w"), indent=1)
