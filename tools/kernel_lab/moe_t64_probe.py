"""Why the W2 MoE layer slows down 2.5x from T = 32 to T = 64 (GLM-4.5-Air, Qwen3-30B shapes; run 12:
278 -> 696 us on GLM, 110 -> 720 us on Qwen3): per-kernel device time at T = 32 and 64 with the
table's configs, then T = 64 with the sort-based torch alignment (the prefill path) instead of the
one-program _prep_small_kernel, checked against the reference. Lab probe, one device call:
    PYTHONPATH=src python tools/kernel_lab/moe_t64_probe.py --out $OUT
"""
import argparse
import json
import os

import torch

from moet.bench import moe_kernel_tune as tu
from moet.kernels import moe_triton as mt
from moet.kernels.launch_tables import device_name
from moet.kernels.moe_configs import lookup
from moet.kernels.reference import moe_experts_reference


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    name = device_name(dev)
    rep = {}
    for sname in ("glm", "qwen"):
        h, i, e, k = tu.SHAPES[sname]
        pool = tu.make_pool("w2", e, h, i, dev, gen)
        eb = tu.expert_bytes(pool)
        for t in (32, 64):
            cfg = mt.fit_token_tile(lookup("w2", h, i, t * k, name), t * k, e)
            key = f"{sname}/T{t}"
            rep[key] = {"cfg": cfg.to_json(), "time": tu.time_layer(mt, pool, h, e, k, t, dev, gen, cfg, eb),
                        "breakdown_us": tu.kernel_breakdown(mt, pool, h, e, k, t, dev, gen, cfg)}
            print(key, json.dumps(rep[key]), flush=True)
        cfg = mt.fit_token_tile(lookup("w2", h, i, 64 * k, name), 64 * k, e)
        saved = mt.SMALL_ALIGN_MAX_PAIRS
        mt.SMALL_ALIGN_MAX_PAIRS = 256                     # T = 64 (512 pairs) takes the sort path
        try:
            key = f"{sname}/T64/sort-align"
            rep[key] = {"cfg": cfg.to_json(),
                        "check": tu.check("w2", pool, h, e, k, 64, 7.0, dev, gen, mt, moe_experts_reference, config=cfg),
                        "time": tu.time_layer(mt, pool, h, e, k, 64, dev, gen, cfg, eb),
                        "breakdown_us": tu.kernel_breakdown(mt, pool, h, e, k, 64, dev, gen, cfg)}
            print(key, json.dumps(rep[key]), flush=True)
        except Exception as exc:
            rep[f"{sname}/T64/sort-align"] = {"error": repr(exc)[:1000]}
            print("sort-align", repr(exc)[:1000], flush=True)
        finally:
            mt.SMALL_ALIGN_MAX_PAIRS = saved
        with open(os.path.join(args.out, "moe_t64_probe.json"), "w") as f:
            json.dump(rep, f, indent=1)


if __name__ == "__main__":
    main()
