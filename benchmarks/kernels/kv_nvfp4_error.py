"""How much an nvfp4 KV cache moves attention outputs, on random data (CPU, float64 math):
the numbers behind the nvfp4 choices in docs/kv-cache.md.

    python benchmarks/kernels/kv_nvfp4_error.py [--seeds 4] [--tokens 1024]

1. MLA (absorbed, DeepSeek-V3's R 512 / P 64 and softmax scale): the latent in nvfp4 (e2m1, e4m3
   scale per 16, scale_2 = 1) with the rope part in bf16, fp8 e4m3 (per-layer scale 1) or nvfp4;
   relative error (Frobenius norm over all heads and queries) of the latent-space output against
   the exact (float64, unquantized) cache and against the bf16 cache, next to a bf16 and an
   fp8_ds_mla cache. Latents are
   RMSNorm-like (unit RMS, some channels larger), rope keys unit normal, queries normal.
2. GQA (Qwen3-30B-A3B heads: 32 q / 4 kv x 128): K and V in nvfp4 against bf16 and fp8-block.
3. The per-layer scale_2: quantize -> dequantize relative error of normal data of RMS sigma with
   scale_2 = 1 (no calibration) and scale_2 = amax / (6 * 448) (modelopt's calibrated rule), over
   sigma from 1e-4 to 1e2: where scale_2 = 1 stops being enough (block scales subnormal in e4m3).
Prints markdown tables.
"""
from __future__ import annotations

import argparse

import torch

from moet.formats import nvfp4
from moet.formats.fp8 import to_e4m3


def nvfp4_rt(x: torch.Tensor, s2: float = 1.0) -> torch.Tensor:
    t = torch.tensor(s2, dtype=torch.float32)
    q, s = nvfp4.quantize_blocks(x.float(), t)
    return nvfp4.dequantize_blocks(q, s, t, torch.float64)


def bf16_rt(x):
    return x.to(torch.bfloat16).double()


def fp8_tensor_rt(x):
    return to_e4m3(x.float()).double()


def fp8_block_rt(x, group=128):
    xg = x.double().unflatten(-1, (x.shape[-1] // group, group))
    s = (xg.abs().amax(-1, keepdim=True) / 448).float().double()
    return (to_e4m3((xg / s).float()).double() * s).flatten(-2)


def attend(q, k, v, scale):
    """q [T, H, D], k [N, D], v [N, Dv] (MQA) -> [T, H, Dv], float64, no mask (decode rows)."""
    s = torch.einsum("thd,nd->thn", q, k) * scale
    return torch.einsum("thn,nv->thv", torch.softmax(s, -1), v)


def rel(a, b):
    return float((a - b).norm() / b.norm())


def mla_errors(seeds: int, n: int) -> dict[str, tuple[float, float]]:
    r, p, h, t = 512, 64, 16, 8
    scale = 192 ** -0.5
    rows = {"bf16 cache (latent and rope bf16)": [], "fp8_ds_mla (latent fp8 block-128, rope bf16)": [],
            "nvfp4 latent + bf16 rope": [], "nvfp4 latent + fp8 rope": [], "nvfp4 latent + nvfp4 rope": []}
    for seed in range(seeds):
        g = torch.Generator().manual_seed(seed)
        lat = torch.randn(n, r, generator=g, dtype=torch.float64)
        lat = lat * (1 + 3 * (torch.rand(r, generator=g, dtype=torch.float64) < 0.02))   # a few larger channels
        rope = torch.randn(n, p, generator=g, dtype=torch.float64)
        ql = torch.randn(t, h, r, generator=g, dtype=torch.float64)
        qr = torch.randn(t, h, p, generator=g, dtype=torch.float64) * 2
        q = torch.cat([ql, qr], -1)

        def out(lat_q, rope_q):
            return attend(q, torch.cat([lat_q, rope_q], -1), lat_q, scale)

        exact = out(lat, rope)
        bf = out(bf16_rt(lat), bf16_rt(rope))
        lat4 = nvfp4_rt(lat)
        for name, o in (("bf16 cache (latent and rope bf16)", bf),
                        ("fp8_ds_mla (latent fp8 block-128, rope bf16)", out(fp8_block_rt(lat), bf16_rt(rope))),
                        ("nvfp4 latent + bf16 rope", out(lat4, bf16_rt(rope))),
                        ("nvfp4 latent + fp8 rope", out(lat4, fp8_tensor_rt(rope))),
                        ("nvfp4 latent + nvfp4 rope", out(lat4, nvfp4_rt(rope)))):
            rows[name].append((rel(o, exact), rel(o, bf)))
    return {k: tuple(sum(x) / len(x) for x in zip(*v)) for k, v in rows.items()}


def gqa_errors(seeds: int, n: int) -> dict[str, tuple[float, float]]:
    hq, hkv, d, t = 32, 4, 128, 4
    rows = {"bf16": [], "fp8 block-128": [], "nvfp4": []}
    for seed in range(seeds):
        g = torch.Generator().manual_seed(100 + seed)
        k = torch.randn(n, hkv, d, generator=g, dtype=torch.float64)
        v = torch.randn(n, hkv, d, generator=g, dtype=torch.float64)
        q = torch.randn(t, hq, d, generator=g, dtype=torch.float64) * 2

        def out(kq, vq):
            return torch.cat([attend(q[:, i * 8:(i + 1) * 8], kq[:, i], vq[:, i], d ** -0.5) for i in range(hkv)], 1)

        exact = out(k, v)
        bf = out(bf16_rt(k), bf16_rt(v))
        for name, o in (("bf16", bf), ("fp8 block-128", out(fp8_block_rt(k), fp8_block_rt(v))),
                        ("nvfp4", out(nvfp4_rt(k), nvfp4_rt(v)))):
            rows[name].append((rel(o, exact), rel(o, bf)))
    return {k: tuple(sum(x) / len(x) for x in zip(*v)) for k, v in rows.items()}


def scale2_errors() -> list[tuple[float, float, float]]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4096, 512, generator=g, dtype=torch.float64)
    out = []
    for sigma in (1e-4, 1e-3, 1e-2, 3e-2, 1e-1, 1.0, 1e1, 1e2):
        xs = x * sigma
        calibrated = float(xs.abs().max()) / (6 * 448)
        out.append((sigma, rel(nvfp4_rt(xs, 1.0), xs), rel(nvfp4_rt(xs, calibrated), xs)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024)
    a = ap.parse_args()
    print(f"MLA R 512 / P 64, {a.tokens} keys, mean of {a.seeds} seeds: output error vs the exact cache")
    print("| cache | vs exact | vs bf16 cache |\n|---|---|---|")
    for k, (e, b) in mla_errors(a.seeds, a.tokens).items():
        print(f"| {k} | {e:.4f} | {b:.4f} |")
    print(f"\nGQA 32 / 4 x 128, {a.tokens} keys: output error vs the exact cache")
    print("| cache | vs exact | vs bf16 cache |\n|---|---|---|")
    for k, (e, b) in gqa_errors(a.seeds, a.tokens).items():
        print(f"| {k} | {e:.4f} | {b:.4f} |")
    print("\nnvfp4 quantize -> dequantize of N(0, sigma^2) data, relative error")
    print("| sigma | scale_2 = 1 | scale_2 = amax / 2688 |\n|---|---|---|")
    for sigma, e1, ec in scale2_errors():
        print(f"| {sigma:g} | {e1:.4f} | {ec:.4f} |")


if __name__ == "__main__":
    main()
