"""Device part for the wgmma kernel (gen_wgmma.py), driven by run_gpu.py (same ctypes loader, checks
and CUDA-graph timing). Standalone only for the descriptor probe child:

  python3 tools/kernel_lab/ptx_w2/run_wgmma.py --probe-variant lbo128_sbo256 [--cpu-dry]

Descriptor probe: the B descriptor's LBO / SBO reading is the easy thing to get wrong, so before any
real shape the parent runs one child process per variant (gen_wgmma.DESC_VARIANTS, in order) on a
tiny shape (N 128, K 1024, T 8, with fallback chunks) and keeps the first whose result matches the
float64 reference; a wrong variant may read outside the staged tile and fault, which only kills its
child (timeout 120 s; the child also has its own watchdog). The chosen variant and every tried
variant's result go into the JSON.
Checks per (config, shape, T): fresh random codes, scale bytes 114..126 (every chunk on the fast
path) plus two (row, group) bytes forced so that their (64-row tile, chunk) takes the fallback (one
scale byte 0 = the quantizer's all-zero block, one 100 = a chunk spanning > 12), y NaN-poisoned,
relerr vs float64 (same e4m3 x), a bit-identical rerun. Timing uses scale bytes 114..126 only (no
fallback chunk), N / 64 CTAs, the bf16 GEMV of equal bytes measured in the same run.
"""
from __future__ import annotations

import argparse
import ctypes
import faulthandler
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import emulate_next as NX  # noqa: E402
import gen_wgmma as GW  # noqa: E402

RTOL = 2e-3
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
PROBE_SHAPE = (128, 1024, 8)


def parse_config(cfg: str) -> tuple[int, int, int]:
    """'MGxKG' or 'MGxKGsST' -> (mg, kg, st): row warpgroups, K-split warpgroups, cp.async ring stages
    (0 = register prefetch one chunk ahead)."""
    head, _, st = cfg.partition("s")
    mg, kg = (int(v) for v in head.split("x"))
    return mg, kg, int(st or 0)


class WgKernel:
    def __init__(self, cu, mg: int = 1, kg: int = 1, desc: str = "lbo128_sbo256", fallback: bool = True, st: int = 0):
        self.cu, self.mg, self.kg, self.st, self.desc_name = cu, mg, kg, st, desc
        self.desc = GW.desc_template(*GW.DESC_VARIANTS[desc])
        self.cubin, self.log = GW.gen_ptx.assemble(GW.gen_wgmma(mg, kg, fallback, st=st))
        self.fn = cu.load(self.cubin, GW.KERNEL)
        self._smem_set = 0

    def __call__(self, cf, sw, aux, xw, xs, y, n, k, t):
        assert n % (64 * self.mg) == 0 and k % 256 == 0 and 1 <= t <= 8, (n, k, t)
        smem = GW.smem_bytes(k, self.mg, self.kg, self.st)
        if smem > self._smem_set:
            self.cu.chk(self.cu.lib.cuFuncSetAttribute(self.fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                       ctypes.c_int(smem)), "cuFuncSetAttribute")
            self._smem_set = smem
        args = [ctypes.c_uint64(v.data_ptr()) for v in (cf, sw, aux, xw, xs, y)] + \
               [ctypes.c_uint32(n), ctypes.c_uint32(k), ctypes.c_uint32(t), ctypes.c_uint64(self.desc)]
        arr = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self.cu.chk(self.cu.lib.cuLaunchKernel(self.fn, n // (64 * self.mg), 1, 1, 128 * self.mg, self.kg, 1, smem,
                                               stream, arr, None), "cuLaunchKernel")


class EmuWgKernel:
    """CPU stand-in with WgKernel's signature (emulate_next.gemv_wgmma on the same bytes); kstep = the
    K-direction core-matrix step the variant would give if LBO is the K step (the PTX ISA reading)."""

    def __init__(self, kg: int = 1, desc: str = "lbo128_sbo256"):
        self.kg, self.desc_name, self.mg = kg, desc, 1
        self.kstep = GW.DESC_VARIANTS[desc][0]

    def __call__(self, cf, sw, aux, xw, xs, y, n, k, t):
        y.copy_(torch.from_numpy(NX.gemv_wgmma(cf.numpy(), sw.numpy(), aux.numpy(), xw.numpy(), xs.numpy(),
                                               n, k, t, self.kg, self.kstep)))


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def make_weights(n, k, gen, dev, force_fallback: bool):
    codes = torch.randint(0, 256, (n, k // 4), dtype=torch.uint8, device=dev, generator=gen)
    scales = torch.randint(114, 127, (n, k // 32), dtype=torch.uint8, device=dev, generator=gen)
    if force_fallback:
        r = torch.randint(0, n, (2,), device=dev, generator=gen).tolist()
        grp = torch.randint(0, k // 32, (2,), device=dev, generator=gen).tolist()
        scales[r[0], grp[0]] = 0          # all-zero block
        scales[r[1], grp[1]] = 100        # span > 12 inside its chunk
    return codes, scales


def convert(codes, scales):
    return NX.to_fa8i_codes_torch(codes), NX.to_sw8_torch(scales), NX.to_aux_torch(scales)


def check(kern, n, k, t, gen, dev):
    from run_gpu import make_x, reference
    codes, scales = make_weights(n, k, gen, dev, force_fallback=True)
    xb, xs = make_x(t, k, gen, dev)
    cf, sw, aux = convert(codes, scales)
    xw = NX.to_xw8_torch(xb)
    nfb = int((aux == NX.FALLBACK).all(dim=-1).sum())
    y = torch.full((t, n), float("nan"), device=dev)
    kern(cf, sw, aux, xw, xs, y, n, k, t)
    _sync(dev)
    ref = reference(codes, scales, xb, xs)
    nan = int(torch.isnan(y).sum())
    err = float((y.double() - ref).abs().max() / ref.abs().max())
    y2 = torch.full((t, n), float("nan"), device=dev)
    kern(cf, sw, aux, xw, xs, y2, n, k, t)
    _sync(dev)
    same = bool(torch.equal(y.view(torch.int32), y2.view(torch.int32)))
    return {"relerr": err, "nan": nan, "bit_identical_rerun": same, "fallback_chunks": nfb,
            "chunks": (n // 64) * (k // 256), "ok": nan == 0 and err < RTOL and same and nfb >= 1}


def time_shape(kerns, n, k, t, gen, dev, reps=64):
    """kerns: {name: WgKernel}; the same weight sets for all, one bf16-equivalent measurement."""
    from run_gpu import graph_time, make_x
    nbytes = n * k // 4 + n * k // 32
    sets = max(2, -(-160_000_000 // nbytes))
    ws = [convert(*make_weights(n, k, gen, dev, force_fallback=False)) for _ in range(sets)]
    assert all(int((w[2] == NX.FALLBACK).sum()) == 0 for w in ws)
    xb, xs = make_x(t, k, gen, dev)
    xw = NX.to_xw8_torch(xb)
    y = torch.empty((t, n), device=dev)
    out = {}
    for name, kern in kerns.items():
        us = graph_time(lambda i: kern(*ws[i % sets], xw, xs, y, n, k, t), reps)
        out[name] = {"us": us, "GBps": nbytes / us / 1e3}
    n_eq = max(8, nbytes // (2 * k))
    bsets = max(2, -(-160_000_000 // (n_eq * k * 2)))
    bw = [torch.randn(n_eq, k, device=dev, generator=gen).to(torch.bfloat16) for _ in range(bsets)]
    xbf = torch.randn(t, k, device=dev, generator=gen).to(torch.bfloat16)
    yb = torch.empty((t, n_eq), device=dev, dtype=torch.bfloat16)
    us_b = graph_time(lambda i: torch.matmul(xbf, bw[i % bsets].T, out=yb), reps)
    gbs_b = n_eq * k * 2 / us_b / 1e3
    for r in out.values():
        r.update({"bf16_eq_us": us_b, "bf16_eq_GBps": gbs_b, "pct_of_bf16": 100 * r["GBps"] / gbs_b,
                  "weight_sets": sets, "bytes": nbytes})
    del ws, bw
    return out


# ----------------------------------------------------------------------------- descriptor probe

def probe_child(variant: str, cpu: bool) -> dict:
    n, k, t = PROBE_SHAPE
    if cpu:
        dev = torch.device("cpu")
        kern = EmuWgKernel(1, variant)
    else:
        faulthandler.dump_traceback_later(90, exit=True)
        from run_gpu import Cu
        dev = torch.device("cuda")
        torch.zeros(1, device=dev)
        kern = WgKernel(Cu(), 1, 1, variant)
    gen = torch.Generator(device=dev)
    gen.manual_seed(1)
    r = {"variant": variant, "N": n, "K": k, "T": t}
    try:
        r.update(check(kern, n, k, t, gen, dev))
    except Exception as ex:          # an out-of-range read in the emulator / a device fault
        r.update({"ok": False, "error": f"{type(ex).__name__}: {ex}"[:400]})
    return r


def probe_variants(cpu: bool = False, timeout: float = 120) -> tuple[str | None, list[dict]]:
    tried = []
    for name in GW.DESC_VARIANTS:
        t0 = time.time()
        cmd = [sys.executable, os.path.abspath(__file__), "--probe-variant", name] + (["--cpu-dry"] if cpu else [])
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("PROBE ")]
            r = json.loads(line[-1][6:]) if line else {"variant": name, "ok": False,
                                                       "error": f"rc {p.returncode}: {p.stderr[-600:]}"}
        except subprocess.TimeoutExpired:
            r = {"variant": name, "ok": False, "error": f"timeout {timeout}s"}
        r["wall_s"] = round(time.time() - t0, 1)
        print("descriptor probe:", json.dumps(r))
        tried.append(r)
        if r.get("ok"):
            return name, tried
    return None, tried


# ----------------------------------------------------------------------------- the device section of run_gpu

def run(res, path, a, t_start, gen, dev, cu, failures):
    """Called by run_gpu.main: SASS stats, descriptor probe, checks and timing of the wgmma configs."""
    res["wgmma_sass"] = []
    for cfg in a.wg_configs.split(","):
        mg, kg, st = parse_config(cfg)
        r = GW.report(mg, kg, True, st=st)
        r["config"] = cfg
        res["wgmma_sass"].append(r)
        print(f"wgmma SASS {cfg}: fast path {r['instr_per_weight']:.3f} instr/weight, regs {r['regs']}, "
              f"QGMMA register-A {r['qgmma_register_a']}, serialized {r['wgmma_serialized']}")
    desc, tried = probe_variants(cpu=False)
    res["wgmma_desc_probe"] = tried
    res["wgmma_desc"] = desc
    json.dump(res, open(path, "w"), indent=1)
    if desc is None:
        failures.append({"wgmma": "no descriptor variant matched", "tried": tried})
        print("FAIL: no wgmma descriptor variant matched; skipping the wgmma kernel")
        return
    kerns = {}
    for cfg in a.wg_configs.split(","):
        mg, kg, st = parse_config(cfg)
        kerns[cfg] = WgKernel(cu, mg, kg, desc, st=st)
    shapes = [(4096, 7168), (7168, 2048), (32768, 7168), (57344, 2048)]
    toks = [int(v) for v in a.tokens.split(",")]
    res.setdefault("wgmma_runs", [])
    for n, k in shapes:
        for t in toks:
            if time.time() - t_start > a.budget_s * a.wg_share:
                print(f"wgmma budget share reached, skipping N {n} K {k} T {t}")
                continue
            good = {}
            for cfg, kern in kerns.items():
                if n % (64 * kern.mg):
                    continue
                r = {"kernel": "wgmma", "config": cfg, "desc": desc, "N": n, "K": k, "T": t}
                r.update(check(kern, n, k, t, gen, dev))
                if not r["ok"]:
                    failures.append(r)
                    print("FAIL", r)
                else:
                    good[cfg] = kern
                res["wgmma_runs"].append(r)
            if good:
                tm = time_shape(good, n, k, t, gen, dev)
                for r in res["wgmma_runs"]:
                    if (r["N"], r["K"], r["T"]) == (n, k, t) and r["config"] in tm:
                        r.update(tm[r["config"]])
                        print(f"wgmma {r['config']} N {n:6d} K {k:5d} T {t}: relerr {r['relerr']:.2e} "
                              f"(fallback chunks {r['fallback_chunks']}) {r['us']:8.2f} us {r['GBps']:7.0f} GB/s  "
                              f"bf16-eq {r['bf16_eq_GBps']:7.0f} GB/s  {r['pct_of_bf16']:5.1f}%")
            json.dump(res, open(path, "w"), indent=1)


def cpu_dry(configs=("1x1", "1x2s4")) -> list[dict]:
    """Everything except the launch: assemble + SASS stats of each config, the descriptor probe through
    child processes (emulator), and the check path on tiny shapes with the emulator."""
    out = []
    for cfg in configs:
        mg, kg, st = parse_config(cfg)
        r = GW.report(mg, kg, True, st=st)
        print(f"cpu-dry wgmma SASS {cfg}: fast path {r['instr_per_weight']:.3f} instr/weight, regs {r['regs']}, "
              f"QGMMA-regA {r['qgmma_register_a']}, serialized {r['wgmma_serialized']}")
        out.append({"sass": cfg, "instr_per_weight": r["instr_per_weight"], "regs": r["regs"],
                    "ok": r["qgmma_register_a"] and not r["f2fp_or_hmma_in_loop"] and r["spill_stores"] == 0
                    and not r["wgmma_serialized"]})
    desc, tried = probe_variants(cpu=True)
    out.append({"probe": desc, "tried": [(x["variant"], x.get("ok")) for x in tried], "ok": desc is not None})
    print("cpu-dry descriptor probe ->", desc)
    dev = torch.device("cpu")
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    for n, k, t, kg in ((64, 512, 1, 1), (128, 768, 4, 2), (64, 1024, 8, 2)):
        r = {"N": n, "K": k, "T": t, "kg": kg}
        r.update(check(EmuWgKernel(kg, desc or "lbo128_sbo256"), n, k, t, gen, dev))
        print("cpu-dry wgmma", r)
        out.append(r)
    bad = [r for r in out if not r["ok"]]
    if bad:
        raise SystemExit(f"cpu-dry wgmma check FAILED: {bad}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--probe-variant", required=True)
    ap.add_argument("--cpu-dry", action="store_true")
    a = ap.parse_args()
    r = probe_child(a.probe_variant, a.cpu_dry)
    print("PROBE " + json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
