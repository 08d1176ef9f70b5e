"""Device run of the grouped wgmma MoE decode layer (gen_moe_wgmma.py, moe_wgmma.py). One call:

  cd <repo root>; PYTHONUNBUFFERED=1 python3 tools/kernel_lab/ptx_w2/run_moe_wgmma.py --out $OUT --budget-s 150 \
      2>&1 | tee $OUT/moe_log.txt

Shapes (H, I, E, top-k): DeepSeek-V3 (7168, 2048, 256, 8), GLM-4.5-Air (4096, 1408, 128, 8; down K
padded to 1536), Qwen3-30B-A3B (2048, 768, 128, 8); T = 1, 4, 8. Per (shape, T):
  check: a v1 W2Pool of the routing's distinct experts (random codes, scale bytes 114..126, plus
    one 0 byte in a gate/up and one 100 byte in a down matrix: fallback chunks), converted with
    moe_wgmma.convert_pool on the device; one routed expert not resident; token 1 shares an expert
    with token 0 (a run of 2); every workspace NaN-poisoned. vs float64 torch (moet's decode_w2)
    with e4m3 activations at the same two points: x bytes / scales exact, gu relerr, act bytes vs
    the reference's own quantization (mismatch share), y relerr with the kernel's act bytes, out
    (bf16) relerr, miss count exact, no NaN in out, bit-identical rerun, bit-identical with the
    experts in reversed slots.
  The first --cfgs entry is checked, and the same config with PDL toggled must give the same bits.
  time: a pool of all E experts (random kernel-layout bytes; for moet's Triton path an nb8 W2Pool),
    CUDA graphs of 8 calls each with its own random routing (weights never in L2), median via
    triton.testing.do_bench: (1) this layer, (2) moet.kernels.moe_dispatch.moe_experts (Triton, the
    table config), (3) a bf16 GEMV [1, H] x [H, N_eq] moving the mean distinct-expert bytes per call
    (rotating weight sets > L2); GB/s on the distinct experts' code + scale bytes, % of (3).
--cpu-dry: assemble + SASS report, then the check path on tiny shapes: the real launcher
(moe_wgmma.MoeWgmma) with libcuda replaced by emulate_moe.FakeCu (arguments bound to each kernel's
PTX parameter list, launches emulated), and the emulated layer (EmuLayer).
A failed check exits non-zero after writing $OUT/moe_wgmma_results.json; faulthandler watchdog at
budget + 120 s; --budget-s stops starting new shapes.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import emulate_moe as EM  # noqa: E402
import moe_wgmma as MW  # noqa: E402

SHAPES = {"deepseek": (7168, 2048, 256, 8), "glm": (4096, 1408, 128, 8), "qwen": (2048, 768, 128, 8)}
TOKENS = (1, 4, 8)
RTOL_GEMV = 2e-3           # gu / y vs float64 (the lab's wgmma bound; device relerr was 3-7e-4)
RTOL_OUT = 1e-2            # bf16 output
ACT_MISMATCH = 0.10        # share of act bytes != the reference's own e4m3 of its float64 act: the
                           # device's fp8 wgmma accumulates with fewer bits (gu relerr ~5e-4 of max), and
                           # an e4m3 step is 2^-3 relative, so a few % of bytes may round the other way;
                           # the y / out checks use the kernel's own act bytes (same activations)


# ----------------------------------------------------------------------------- torch helpers

def from_xq_t(xq):
    r, kk = xq.shape[0], xq.numel() // xq.shape[0]
    return xq.reshape(r, kk // 128, 4, 2, 4, 4).permute(0, 1, 4, 2, 3, 5).reshape(r, kk)


def quantize_t(v):
    """emulate.quantize_x semantics in torch (fp32): bytes uint8, scale fp32."""
    v = v.float()
    amax = v.abs().amax(dim=1)
    sc = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (v / sc[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), sc


def e4m3_t(b):
    return b.view(torch.float8_e4m3fn).double()


def relerr(a, r):
    a, r = a.double(), r.double()
    return float((a - r).abs().max() / r.abs().max().clamp(min=1e-300))


def routing(t, e, k, dev, gen):
    ids = torch.rand(t, e, device=dev, generator=gen).topk(k, dim=-1).indices
    w = torch.rand(t, k, device=dev, generator=gen)
    return ids.to(torch.int32), w / w.sum(-1, keepdim=True)


class EmuLayer:
    """CPU stand-in with MoeWgmma's call signature: emulate_moe.layer, writing the same workspace."""

    def __init__(self, kp):
        self.kp, self.kn = kp, kp.numpy()

    def __call__(self, hidden, ids, tw, table, miss, limit=None, ws=None):
        r = EM.layer(hidden.float().numpy(), ids.numpy(), tw.float().numpy(), table.numpy(), self.kn, limit)
        t = hidden.shape[0]
        ws["xq"].copy_(torch.from_numpy(r["xq"].reshape(t, -1)))
        ws["xs"].copy_(torch.from_numpy(r["xs"]))
        ok = torch.from_numpy(table.numpy()[ids.numpy().reshape(-1)] >= 0)
        ws["gu"][ok] = torch.from_numpy(r["gu"])[ok]
        ws["aq"].copy_(torch.from_numpy(r["aq"].reshape(r["aq"].shape[0], -1)))
        ws["as"].copy_(torch.from_numpy(r["as"]))
        ws["y"][ok] = torch.from_numpy(r["y"])[ok]
        ws["out"].copy_(r["out"])
        miss += r["miss"]
        return ws["out"]


# ----------------------------------------------------------------------------- check

def check(make_layer, h, i, e, k, t, dev, gen, limit=None, make_twin=None) -> dict:
    """make_twin: a second layer factory (the same config with PDL toggled) that must give the same bits."""
    from moet.kernels.pools import W2Pool
    from moet.kernels.reference import decode_w2
    ids, tw = routing(t, e, k, dev, gen)
    if t > 1:                                   # token 1 shares token 0's first expert: a run of 2
        if not (ids[1] == ids[0, 0]).any():
            ids[1, -1] = ids[0, 0]
    distinct = torch.unique(ids).tolist()
    miss_e = int(ids[t - 1, k - 1])             # one routed expert not resident
    if t > 1 and miss_e == int(ids[0, 0]):
        miss_e = int(ids[t - 1, 0])
    res_e = [x for x in distinct if x != miss_e]
    s = len(res_e)
    u8 = dict(dtype=torch.uint8, device=dev, generator=gen)
    pool = W2Pool(torch.randint(0, 256, (s, 2 * i, h // 4), **u8), torch.randint(114, 127, (s, 2 * i, h // 32), **u8),
                  torch.randint(0, 256, (s, h, i // 4), **u8), torch.randint(114, 127, (s, h, i // 32), **u8), "v1")
    pool.gate_up_scales[0, 5, 1] = 0           # fallback chunk (the quantizer's all-zero block)
    pool.down_scales[s - 1, 70 % h, 0] = 100   # fallback chunk (span > 12)
    kp = MW.convert_pool(pool)
    table = torch.full((e,), -1, dtype=torch.int32, device=dev)
    table[torch.tensor(res_e, device=dev, dtype=torch.long)] = torch.arange(s, dtype=torch.int32, device=dev)
    x = torch.randn(t, h, device=dev, generator=gen).to(torch.bfloat16)
    layer = make_layer(kp)
    ip = kp.Ip

    def run(layer_, table_):
        ws = MW.workspace(t, k, h, i, ip, dev, fill=float("nan"))
        miss = torch.zeros(1, dtype=torch.int32, device=dev)
        out = layer_(x, ids, tw, table_, miss, limit, ws=ws)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return out.clone(), ws, int(miss.item())

    out, ws, miss = run(layer, table)
    out2, _, _ = run(layer, table)
    # the same experts in reversed slots
    rev = torch.arange(s - 1, -1, -1, device=dev)
    kp_r = MW.KPool(*(getattr(kp, f)[rev].contiguous() for f in ("gu_codes", "gu_sw", "gu_aux", "dn_codes", "dn_sw",
                                                                  "dn_aux")), H=kp.H, I=kp.I, Ip=kp.Ip)
    table_r = torch.where(table >= 0, (s - 1) - table, table)
    out3, _, _ = run(make_layer(kp_r), table_r)
    twin_err = None
    try:
        out4 = run(make_twin(kp), table)[0] if make_twin is not None else out
    except Exception as ex:                      # e.g. cuLaunchKernelEx refused: recorded, fails the check
        twin_err, out4 = f"{type(ex).__name__}: {ex}"[:300], torch.full_like(out, float("nan"))
    # float64 reference with e4m3 activations at the same two points
    ids_f = ids.reshape(-1).long()
    slots = table[ids_f].long()
    ok = slots >= 0
    xb, xs = quantize_t(x.float())
    xv = e4m3_t(xb) * xs.double()[:, None]
    p = t * k
    gu_ref = torch.zeros(p, 2 * i, dtype=torch.float64, device=dev)
    y_ref = torch.zeros(p, h, dtype=torch.float64, device=dev)
    ab = from_xq_t(ws["aq"])[:, :i]
    av = e4m3_t(ab.contiguous()) * ws["as"].double()[:, None]
    for sl in torch.unique(slots[ok]).tolist():
        qs = torch.nonzero(slots == sl).flatten()
        wgu = decode_w2(pool.gate_up_codes[sl], pool.gate_up_scales[sl]).double()
        gu_ref[qs] = xv[qs // k] @ wgu.T
        del wgu
        wdn = decode_w2(pool.down_codes[sl], pool.down_scales[sl]).double()
        y_ref[qs] = av[qs] @ wdn.T
        del wdn
    g_, u_ = gu_ref[:, :i], gu_ref[:, i:]
    if limit is not None:
        g_, u_ = g_.clamp(max=limit), u_.clamp(-limit, limit)
    act_ref = g_ / (1 + torch.exp(-g_)) * u_
    sc = act_ref.abs().amax(1) / 448
    sc = torch.where(sc > 0, sc, torch.ones_like(sc))
    own = (act_ref / sc[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    w = torch.where(ok, tw.reshape(-1).double(), torch.zeros_like(tw.reshape(-1).double()))
    out_ref = (y_ref * w[:, None]).reshape(t, k, h).sum(1)
    rec = {"T": t, "pairs": p, "distinct": len(distinct), "resident": s,
           "fallback_chunks": int(sum(int((kp.gu_aux[j] == 0).all(-1).sum() + (kp.dn_aux[j] == 0).all(-1).sum())
                                      for j in range(s))),
           "x_bytes_exact": bool(torch.equal(from_xq_t(ws["xq"]), xb)) and bool(torch.equal(ws["xs"], xs)),
           "gu_relerr": relerr(ws["gu"][ok], gu_ref[ok]),
           "act_byte_mismatch": float((ab[ok] != own[ok]).double().mean()),
           "y_relerr": relerr(ws["y"][ok], y_ref[ok]),
           "out_relerr": relerr(out.float(), out_ref),
           "out_nan": int(torch.isnan(out.float()).sum()),
           "miss": [miss, int((~ok).sum())],
           "rerun_identical": bool(torch.equal(out.view(torch.int16), out2.view(torch.int16))),
           "slot_invariant": bool(torch.equal(out.view(torch.int16), out3.view(torch.int16))),
           "pdl_twin_identical": bool(torch.equal(out.view(torch.int16), out4.view(torch.int16))),
           "pdl_twin_error": twin_err}
    rec["ok"] = (rec["x_bytes_exact"] and rec["gu_relerr"] < RTOL_GEMV and rec["act_byte_mismatch"] < ACT_MISMATCH
                 and rec["y_relerr"] < RTOL_GEMV and rec["out_relerr"] < RTOL_OUT and rec["out_nan"] == 0
                 and rec["miss"][0] == rec["miss"][1] >= 1 and rec["rerun_identical"] and rec["slot_invariant"]
                 and rec["pdl_twin_identical"]
                 and rec["fallback_chunks"] >= 2)
    del pool, kp, kp_r
    return rec


# ----------------------------------------------------------------------------- timing

def graph_time_ms(fns, reps: int = 2) -> float:
    """moet's MoE tuner's timing (one CUDA graph of the calls, median ms per call)."""
    from moet.bench.moe_kernel_tune import graph_time_ms as timed
    return timed(fns, reps)


def random_kpool(e, h, i, dev, gen):
    """Random bytes are random codes in any layout; scales 114..126 (no fallback chunk) converted."""
    ip = MW.pad_k(i)
    u8 = dict(dtype=torch.uint8, device=dev, generator=gen)
    gsc = torch.randint(114, 127, (e, 2 * i, h // 32), **u8)
    dsc = torch.randint(114, 127, (e, h, ip // 32), **u8)
    import emulate_next as NX
    return MW.KPool(torch.randint(0, 256, (e, 2 * i // 16, h // 256, 2, 32, 16), **u8),
                    torch.stack([NX.to_sw8_torch(gsc[j]) for j in range(e)]),
                    torch.stack([NX.to_aux_torch(gsc[j]) for j in range(e)]),
                    torch.randint(0, 256, (e, h // 16, ip // 256, 2, 32, 16), **u8),
                    torch.stack([NX.to_sw8_torch(dsc[j]) for j in range(e)]),
                    torch.stack([NX.to_aux_torch(dsc[j]) for j in range(e)]), H=h, I=i, Ip=ip)


def time_shape(layers, kp, tri_pool, h, i, e, k, t, dev, gen, nsets=8, breakdown=False) -> dict:
    """layers: {cfg name: MoeWgmma}; the same routings, Triton and bf16 GEMV timed once.
    breakdown: also the first layer's launches 1..n for n = 1..4 (prefixes, same graphs of 8), so
    the layer's time splits into what each launch adds after the ones before it."""
    from moet.kernels.moe_dispatch import moe_experts
    x = torch.randn(t, h, device=dev, generator=gen).to(torch.bfloat16)
    table = torch.arange(e, dtype=torch.int32, device=dev)
    miss = torch.zeros(1, dtype=torch.int32, device=dev)
    sets = [routing(t, e, k, dev, gen) for _ in range(nsets)]
    distinct = sum(int(torch.unique(ids).numel()) for ids, _ in sets) / nsets
    ebytes = 3 * h * i * 9 // 32                  # codes + scales of one expert (moet's count)
    wss = [MW.workspace(t, k, h, i, kp.Ip, dev) for _ in range(nsets)]
    ms = {}
    for name, layer in layers.items():
        try:
            ms[name] = graph_time_ms([lambda ids=ids, w=w, ws=ws, layer=layer: layer(x, ids, w, table, miss, None, ws=ws)
                                      for (ids, w), ws in zip(sets, wss)])
        except Exception as ex:                  # one config failing (e.g. PDL in capture) keeps the others
            traceback.print_exc()
            ms[name] = ex
    prefix = {}
    if breakdown:
        name0, layer0 = next(iter(layers.items()))
        for n in (1, 2, 3, 4):
            prefix[n] = graph_time_ms([lambda ids=ids, w=w, ws=ws, n=n: layer0(x, ids, w, table, miss, None, ws=ws, stages=n)
                                       for (ids, w), ws in zip(sets, wss)])
        if not isinstance(ms.get(name0), Exception):
            prefix[5] = ms[name0]
    miss64 = torch.zeros(1, dtype=torch.int64, device=dev)
    sets_l = [(ids.long(), w) for ids, w in sets]
    ms_t = graph_time_ms([lambda ids=ids, w=w: moe_experts(x, ids, w, table, tri_pool, miss64) for ids, w in sets_l])
    nbytes = distinct * ebytes
    n_eq = max(8, int(nbytes // (2 * h)))
    bsets = max(2, -(-300_000_000 // (n_eq * h * 2)))
    bw = [torch.randn(n_eq, h, device=dev, generator=gen).to(torch.bfloat16) for _ in range(bsets)]
    xb = torch.randn(1, h, device=dev, generator=gen).to(torch.bfloat16)
    yb = torch.empty(1, n_eq, device=dev, dtype=torch.bfloat16)
    ms_b = graph_time_ms([lambda j=j: torch.matmul(xb, bw[j].T, out=yb) for j in range(bsets)] * max(1, 8 // bsets))
    gbs_b = n_eq * h * 2 / ms_b / 1e6
    del bw
    rec = {"distinct_experts": distinct, "bytes": nbytes,
           "wgmma": {name: ({"us": v * 1e3, "GBps": nbytes / v / 1e6, "pct": 100 * nbytes / v / 1e6 / gbs_b}
                            if not isinstance(v, Exception) else {"error": f"{type(v).__name__}: {v}"[:300]})
                     for name, v in ms.items()},
           "triton_us": ms_t * 1e3, "triton_GBps": nbytes / ms_t / 1e6,
           "bf16_gemv_us": ms_b * 1e3, "bf16_gemv_GBps": gbs_b}
    rec["triton_pct"] = 100 * rec["triton_GBps"] / gbs_b
    if prefix:
        names = ("quantize x", "gate/up", "SwiGLU + quantize", "down", "combine")
        rec["prefix_us"] = {f"1-{n} ({names[n - 1]})": v * 1e3 for n, v in prefix.items()}
    return rec


# ----------------------------------------------------------------------------- main

def cpu_dry(out_dir=None) -> dict:
    import gen_moe_wgmma as GM
    rep = GM.report(("1x1s4", "1x2s4"))
    for g in rep["gemv"]:
        print(f"cpu-dry SASS {GM.GEMV} {g['config']}: {g['instr_per_weight']:.3f} instr/weight, regs {g['regs']}, "
              f"spills {g['spill_stores']}, serialized {g['wgmma_serialized']}")
    dev = torch.device("cpu")
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    checks = []
    # the real launcher (moe_wgmma.MoeWgmma.__call__) with libcuda replaced by emulate_moe.FakeCu:
    # arguments bound by name to each kernel's PTX parameter list, launches emulated
    fake = lambda kp: MW.MoeWgmma(kp, "1x2s4", "1x1s4", cu=EM.FakeCu(), pdl=True)  # noqa: E731
    for (h, i, e, k, t, lim, mk) in ((256, 160, 12, 2, 1, None, fake), (256, 256, 8, 2, 3, 0.5, fake),
                                     (512, 256, 16, 4, 2, None, EmuLayer)):
        r = {"H": h, "I": i, "E": e, "k": k, "layer": "MoeWgmma+FakeCu" if mk is fake else "EmuLayer"}
        r.update(check(mk, h, i, e, k, t, dev, gen, lim,
                       make_twin=(lambda kp: MW.MoeWgmma(kp, "1x2s4", "1x1s4", cu=EM.FakeCu())) if mk is fake else None))
        print("cpu-dry check", json.dumps(r))
        checks.append(r)
    res = {"sass": rep, "checks": checks}
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        json.dump(res, open(os.path.join(out_dir, "moe_wgmma_cpu_dry.json"), "w"), indent=1, default=str)
    bad = [c for c in checks if not c["ok"]] + [g for g in rep["gemv"] if g["spill_stores"] or g["wgmma_serialized"]]
    if bad:
        raise SystemExit(f"cpu-dry FAILED: {bad}")
    print("cpu-dry: all checks passed")
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=150)
    ap.add_argument("--shapes", default="deepseek,glm,qwen")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--cfgs", default="1x2s4/1x1s4,1x2s4/1x1s4/pdl,1x1s4/1x1s4,1x1s4/1x1s4/pdl",
                    help="gemv configs gate_up/down[/pdl] (MGxKGsST; pdl = programmatic dependent launch); "
                         "the first is checked (and its PDL twin must give the same bits), all are timed")
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time the first config's launches 1..n (n = 1..4): what each launch adds")
    ap.add_argument("--cpu-dry", action="store_true")
    a = ap.parse_args()
    if a.cpu_dry:
        cpu_dry(a.out if a.out != "." else None)
        return
    t0 = time.time()
    faulthandler.dump_traceback_later(a.budget_s + 120, exit=True)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "moe_wgmma_results.json")
    dev = torch.device("cuda")
    torch.zeros(1, device=dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    import gen_moe_wgmma as GM
    cfgs = [tuple(c.split("/")) for c in a.cfgs.split(",")]
    uniq = tuple(dict.fromkeys(x for c in cfgs for x in c[:2]))
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "cfgs": cfgs,
           "sass": GM.report(uniq), "checks": [], "timing": [], "failures": []}
    for g in res["sass"]["gemv"]:
        print(f"SASS {g['config']}: {g['instr_per_weight']:.3f} instr/weight, regs {g['regs']}")
    cu = MW.Cu()

    def make_layer(kp, cfg=cfgs[0]):
        return MW.MoeWgmma(kp, cfg[0], cfg[1], cu=cu, pdl=len(cfg) > 2 and cfg[2] == "pdl")

    def make_twin(kp, cfg=cfgs[0]):                 # the first config with PDL toggled
        return MW.MoeWgmma(kp, cfg[0], cfg[1], cu=cu, pdl=not (len(cfg) > 2 and cfg[2] == "pdl"))

    def dump():
        res["wall_s"] = round(time.time() - t0, 1)
        json.dump(res, open(path, "w"), indent=1, default=str)

    for name in a.shapes.split(","):
        h, i, e, k = SHAPES[name]
        if time.time() - t0 > a.budget_s:
            print(f"budget reached: skipping {name}")
            res["skipped"] = res.get("skipped", []) + [name]
            continue
        try:
            for t in (int(v) for v in a.tokens.split(",")):
                r = {"shape": name, "H": h, "I": i, "E": e, "k": k}
                r.update(check(make_layer, h, i, e, k, t, dev, gen, limit=7.0 if t == 4 else None, make_twin=make_twin))
                print(f"[{time.time() - t0:5.0f}s] check {name} T {t}: {json.dumps(r)}")
                res["checks"].append(r)
                if not r["ok"]:
                    res["failures"].append(r)
                dump()
            if a.no_time:
                continue
            from moet.kernels.pools import W2Pool
            kp = random_kpool(e, h, i, dev, gen)
            u8 = dict(dtype=torch.uint8, device=dev, generator=gen)
            tri = W2Pool(torch.randint(0, 256, (e, 2 * i, h // 4), **u8), torch.randint(114, 127, (e, 2 * i, h // 32), **u8),
                         torch.randint(0, 256, (e, h, i // 4), **u8), torch.randint(114, 127, (e, h, i // 32), **u8), "nb8")
            layers = {"/".join(cfg): make_layer(kp, cfg) for cfg in cfgs}
            for t in (int(v) for v in a.tokens.split(",")):
                if time.time() - t0 > a.budget_s:
                    print(f"budget reached: skipping timing {name} T {t}")
                    continue
                r = {"shape": name, "T": t}
                r.update(time_shape(layers, kp, tri, h, i, e, k, t, dev, gen, breakdown=a.breakdown))
                if "prefix_us" in r:
                    print(f"[{time.time() - t0:5.0f}s] breakdown {name} T {t} ({'/'.join(cfgs[0])}): "
                          + ", ".join(f"{n}: {v:.1f} us" for n, v in r["prefix_us"].items()))
                wg = " | ".join(f"wgmma {c} {v['us']:.1f} us {v['GBps']:.0f} GB/s {v['pct']:.1f}%" if "us" in v
                                else f"wgmma {c} ERROR" for c, v in r["wgmma"].items())
                for c, v in r["wgmma"].items():
                    if "error" in v:
                        res["failures"].append({"shape": name, "T": t, "cfg": c, **v})
                print(f"[{time.time() - t0:5.0f}s] time {name} T {t}: {wg} | triton {r['triton_us']:.1f} us "
                      f"{r['triton_pct']:.1f}% | bf16 GEMV {r['bf16_gemv_GBps']:.0f} GB/s "
                      f"({r['distinct_experts']:.1f} experts)")
                res["timing"].append(r)
                dump()
            del kp, tri, layers
            torch.cuda.empty_cache()
        except Exception as ex:
            traceback.print_exc()
            res["failures"].append({"shape": name, "error": f"{type(ex).__name__}: {ex}"[:600]})
            dump()
    dump()
    faulthandler.cancel_dump_traceback_later()
    if res["failures"]:
        raise SystemExit(f"{len(res['failures'])} failure(s); see {path}")
    print(f"all checks passed in {res['wall_s']} s; {path}")


if __name__ == "__main__":
    main()
