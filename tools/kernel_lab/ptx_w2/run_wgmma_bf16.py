"""Device script of the bf16-activation wgmma kernel (gen_wgmma_bf16.py). One short call (< 3 min):

  cd <repo root>; PYTHONUNBUFFERED=1 python3 tools/kernel_lab/ptx_w2/run_wgmma_bf16.py --out $OUT \
      --budget-s 120 2>&1 | tee $OUT/bf16_log.txt

1. SASS of every config (assembly with the bundled ptxas; fails the run on wgmma serialization,
   spills or a missing register-A HGMMA).
2. Descriptor probe: one child process per gen_wgmma.DESC_VARIANTS entry (in order) on a tiny shape
   (N 128, K 1024, T 8); the first whose result matches the float64 reference is used (a wrong one
   may fault: it only kills its child).
3. Checks per (config, shape, T): DeepSeek-V3 N 4096 x K 7168, N 7168 x K 2048 and the 8-expert stacks
   N 32768 x K 7168, N 57344 x K 2048; T = 1, 4, 8; fresh random codes (all byte values), scale bytes
   110..130 plus one group at 0 and one at 1 (contract edges), x ~ N(0, 1) rounded to bf16 (not
   quantized), y NaN-poisoned; relerr = max|y - ref| / max|ref| vs float64 decode_w2 @ bf16 x (pass
   < RTOL; the emulator gives ~1e-7), no NaN, a bit-identical rerun.
4. Timing (CUDA graph of 64 launches rotating >= 160 MB of weight sets, median of 5 replays): every
   checked bf16 config, the e4m3 wgmma kernel (run_wgmma.WgKernel, configs --e4m3-configs, on e4m3 x)
   and a bf16 GEMV (torch.matmul) moving the same bytes, all in the same run; GB/s on code + scale bytes.
A faulthandler watchdog ends a hang (budget + 90 s); --budget-s stops starting new shapes. JSON after
every shape: $OUT/wgmma_bf16_results.json; a failed check exits non-zero after writing it.
--cpu-dry: everything except the launches (assembly + SASS, the probe's children and the check path
with the numpy emulator on tiny shapes).
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

import emulate_bf16 as EB  # noqa: E402
import gen_wgmma_bf16 as GB  # noqa: E402

RTOL = 2e-3      # pass bound (a layout / fragment bug gives O(1)); exact products + fp32 accumulation ~1e-6
PROBE_SHAPE = (128, 1024, 8)
SHAPES = [(4096, 7168), (7168, 2048), (32768, 7168), (57344, 2048)]
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def parse_config(cfg: str) -> tuple[int, int, int]:
    """'MGxKG', 'MGxKGsST' or 'MGxKGsSTp' (p: persistent) -> (mg, kg, st); st 0 = register prefetch."""
    head, _, st = cfg.rstrip("p").partition("s")
    mg, kg = (int(v) for v in head.split("x"))
    return mg, kg, int(st or 0)


def is_persistent(cfg: str) -> bool:
    return cfg.endswith("p")


class Bf16Kernel:
    """persistent: grid = min(N / (64 MG), SMs x resident CTAs per SM) CTAs looping over row-tile groups
    (x staged once per CTA); the 'aligned' build (one tile check per ST chunks) is used when
    (K / 256 / KG) % ST == 0, the general persistent build otherwise."""

    def __init__(self, cu, mg=1, kg=1, st=4, desc="lbo128_sbo256", persistent=False):
        self.cu, self.mg, self.kg, self.st, self.desc_name, self.persistent = cu, mg, kg, st, desc, persistent
        assert not persistent or st >= 2, "the persistent form needs a cp.async ring (st >= 2)"
        self.desc = GB.desc_template(*GB.DESC_VARIANTS[desc])
        self._fns, self._smem_set, self._occ = {}, {}, {}
        self.log = self._fn(False)[1]          # assemble the default build now (ptxas errors surface here)
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count if persistent else 0

    def _fn(self, aligned):
        if aligned not in self._fns:
            cubin, log = GB.gen_ptx.assemble(GB.gen(self.mg, self.kg, self.st, persistent=self.persistent, aligned=aligned))
            self._fns[aligned] = (self.cu.load(cubin, GB.KERNEL_P if self.persistent else GB.KERNEL), log)
        return self._fns[aligned]

    def grid(self, fn, n, smem):
        nr = n // (64 * self.mg)
        if not self.persistent:
            return nr
        key = (fn.value, smem)
        if key not in self._occ:
            occ = ctypes.c_int()
            self.cu.chk(self.cu.lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                ctypes.byref(occ), fn, ctypes.c_int(128 * self.mg * self.kg), ctypes.c_size_t(smem)), "cuOccupancy")
            self._occ[key] = max(1, occ.value)
        return min(nr, self.sms * self._occ[key])

    def build(self, k) -> str:
        if not self.persistent:
            return "plain"
        return "persistent-aligned" if ((k // 256) // self.kg) % self.st == 0 else "persistent"

    def __call__(self, cf, sw, xw, y, n, k, t):
        assert n % (64 * self.mg) == 0 and k % 256 == 0 and 1 <= t <= 8, (n, k, t)
        nch = k // 256
        aligned = False
        if self.persistent:
            assert nch % self.kg == 0, "persistent form: (K / 256) % KG must be 0"
            aligned = (nch // self.kg) % self.st == 0
        fn = self._fn(aligned)[0]
        smem = GB.smem_bytes(k, self.mg, self.kg, self.st, self.persistent)
        if smem > self._smem_set.get(aligned, 0):
            self.cu.chk(self.cu.lib.cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                       ctypes.c_int(smem)), "cuFuncSetAttribute")
            self._smem_set[aligned] = smem
        args = [ctypes.c_uint64(v.data_ptr()) for v in (cf, sw, xw, y)] + \
               [ctypes.c_uint32(n), ctypes.c_uint32(k), ctypes.c_uint32(t), ctypes.c_uint64(self.desc)]
        arr = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self.cu.chk(self.cu.lib.cuLaunchKernel(fn, self.grid(fn, n, smem), 1, 1, 128 * self.mg, self.kg, 1, smem,
                                               stream, arr, None), "cuLaunchKernel")


class EmuBf16Kernel:
    """CPU stand-in with Bf16Kernel's signature (emulate_bf16.gemv_wgmma_bf16 on the same bytes); LBO =
    the variant's first number (the PTX ISA reading: LBO is the K-direction core-matrix step)."""

    def __init__(self, kg=1, desc="lbo128_sbo256"):
        self.kg, self.mg, self.desc_name = kg, 1, desc
        self.lbo = GB.DESC_VARIANTS[desc][0]

    def __call__(self, cf, sw, xw, y, n, k, t):
        y.copy_(torch.from_numpy(EB.gemv_wgmma_bf16(cf.numpy(), sw.numpy(), xw.view(torch.int16).numpy().view(np.uint16),
                                                    n, k, t, self.kg, self.lbo)))


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def make_weights(n, k, gen, dev, edges: bool):
    """edges (checks): scale bytes 110..130 plus one group at 0 and one at 1; otherwise (timing) 114..126,
    the range in which the e4m3 kernel timed alongside takes no fallback chunk (run_wgmma.make_weights)."""
    codes = torch.randint(0, 256, (n, k // 4), dtype=torch.uint8, device=dev, generator=gen)
    lo, hi = (110, 131) if edges else (114, 127)
    scales = torch.randint(lo, hi, (n, k // 32), dtype=torch.uint8, device=dev, generator=gen)
    if edges:                                   # contract edges: byte 0 (+-1 -> +-0) and byte 1 (smallest exact)
        r = torch.randint(0, n, (2,), device=dev, generator=gen).tolist()
        grp = torch.randint(0, k // 32, (2,), device=dev, generator=gen).tolist()
        scales[r[0], grp[0]] = 0
        scales[r[1], grp[1]] = 1
    return codes, scales


def make_x(t, k, gen, dev):
    return torch.randn(t, k, device=dev, generator=gen).to(torch.bfloat16)


def convert(codes, scales):
    import emulate_next as NX
    return EB.to_fb16_codes_torch(codes), NX.to_sw8_torch(scales)


def reference(codes, scales, xbf):
    from moet.kernels.reference import decode_w2
    return xbf.double() @ decode_w2(codes, scales).double().T


def check(kern, n, k, t, gen, dev):
    codes, scales = make_weights(n, k, gen, dev, edges=True)
    xbf = make_x(t, k, gen, dev)
    cf, sw = convert(codes, scales)
    xw = EB.to_xw16_torch(xbf)
    y = torch.full((t, n), float("nan"), device=dev)
    kern(cf, sw, xw, y, n, k, t)
    _sync(dev)
    ref = reference(codes, scales, xbf)
    nan = int(torch.isnan(y).sum())
    err = float((y.double() - ref).abs().max() / ref.abs().max())
    y2 = torch.full((t, n), float("nan"), device=dev)
    kern(cf, sw, xw, y2, n, k, t)
    _sync(dev)
    same = bool(torch.equal(y.view(torch.int32), y2.view(torch.int32)))
    return {"relerr": err, "nan": nan, "bit_identical_rerun": same, "ok": nan == 0 and err < RTOL and same}


def cpu_time(fn, reps):
    """Stand-in for run_gpu.graph_time in the CPU mock run (wall clock, no graph)."""
    t0 = time.time()
    for i in range(reps):
        fn(i)
    return (time.time() - t0) * 1e6 / reps


def time_shape(kerns, e4m3_kerns, n, k, t, gen, dev, reps=64, timer=None, min_bytes=160_000_000):
    """The same random weights for every kernel (bf16 kernel: fb16 + sw8; e4m3 kernel: fa8i + sw8 + aux),
    one bf16-equivalent GEMV measurement."""
    import emulate_next as NX
    if timer is None:
        from run_gpu import graph_time as timer
    graph_time = timer
    nbytes = n * k // 4 + n * k // 32
    sets = max(2, -(-min_bytes // nbytes))
    raw = [make_weights(n, k, gen, dev, edges=False) for _ in range(sets)]
    wb = [convert(c, s) for c, s in raw]
    we = [(NX.to_fa8i_codes_torch(c), NX.to_sw8_torch(s), NX.to_aux_torch(s)) for c, s in raw] if e4m3_kerns else []
    assert all(int((w[2] == NX.FALLBACK).sum()) == 0 for w in we), "e4m3 timing weights must take no fallback chunk"
    del raw
    xbf = make_x(t, k, gen, dev)
    xw = EB.to_xw16_torch(xbf)
    y = torch.empty((t, n), device=dev)
    out = {}
    for name, kern in kerns.items():
        us = graph_time(lambda i: kern(*wb[i % sets], xw, y, n, k, t), reps)
        out[name] = {"us": us, "GBps": nbytes / us / 1e3}
    if e4m3_kerns:
        from run_gpu import make_x as make_x8
        xb8, xs8 = make_x8(t, k, gen, dev)
        xw8 = NX.to_xw8_torch(xb8)
        for name, kern in e4m3_kerns.items():
            us = graph_time(lambda i: kern(*we[i % sets], xw8, xs8, y, n, k, t), reps)
            out["e4m3_" + name] = {"us": us, "GBps": nbytes / us / 1e3}
    n_eq = max(8, nbytes // (2 * k))
    bsets = max(2, -(-min_bytes // (n_eq * k * 2)))
    bw = [torch.randn(n_eq, k, device=dev, generator=gen).to(torch.bfloat16) for _ in range(bsets)]
    yb = torch.empty((t, n_eq), device=dev, dtype=torch.bfloat16)
    us_b = graph_time(lambda i: torch.matmul(xbf, bw[i % bsets].T, out=yb), reps)
    gbs_b = n_eq * k * 2 / us_b / 1e3
    for r in out.values():
        r.update({"pct_of_bf16": 100 * r["GBps"] / gbs_b})
    del wb, we, bw
    return out, {"bf16_eq_us": us_b, "bf16_eq_GBps": gbs_b, "weight_sets": sets, "bytes": nbytes}


# ----------------------------------------------------------------------------- descriptor probe (children)

def probe_child(variant: str, cpu: bool) -> dict:
    n, k, t = PROBE_SHAPE
    if cpu:
        dev = torch.device("cpu")
        kern = EmuBf16Kernel(1, variant)
    else:
        faulthandler.dump_traceback_later(90, exit=True)
        from run_gpu import Cu
        dev = torch.device("cuda")
        torch.zeros(1, device=dev)
        kern = Bf16Kernel(Cu(), 1, 1, 4, variant)
    gen = torch.Generator(device=dev)
    gen.manual_seed(1)
    r = {"variant": variant, "N": n, "K": k, "T": t}
    try:
        r.update(check(kern, n, k, t, gen, dev))
    except Exception as ex:
        r.update({"ok": False, "error": f"{type(ex).__name__}: {ex}"[:400]})
    return r


def probe_variants(cpu: bool = False, timeout: float = 120):
    tried = []
    for name in GB.DESC_VARIANTS:
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


# ----------------------------------------------------------------------------- main

def sass_reports(configs, failures=None) -> list[dict]:
    out = []
    for cfg in configs:
        mg, kg, st = parse_config(cfg)
        r = GB.report(mg, kg, st, persistent=is_persistent(cfg), aligned=is_persistent(cfg))
        r["config"] = cfg
        r["ok"] = bool(r["hgmma_register_a"] and not r["wgmma_serialized"] and r["spill_stores"] == 0)
        print(f"bf16 SASS {cfg}: main loop {r['instr_per_weight']:.3f} instr/weight (int ALU {r['int_alu_per_weight']:.3f}, "
              f"HGMMA {r['hgmma_per_weight']:.3f}, uniform {r['uniform_per_weight']:.3f}), regs {r['regs']}, "
              f"spills {r['spill_stores']}, HGMMA register-A {r['hgmma_register_a']}, serialized {r['wgmma_serialized']}")
        if failures is not None and not r["ok"]:
            failures.append({"sass": cfg, "warnings": r["ptxas_warnings"]})
        out.append(r)
    return out


def cpu_dry(configs) -> list[dict]:
    out = [{"sass": r["config"], "instr_per_weight": r["instr_per_weight"], "regs": r["regs"], "ok": r["ok"]}
           for r in sass_reports(configs)]
    desc, tried = probe_variants(cpu=True)
    out.append({"probe": desc, "tried": [(x["variant"], x.get("ok")) for x in tried], "ok": desc == "lbo128_sbo256"})
    print("cpu-dry descriptor probe ->", desc)
    dev = torch.device("cpu")
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    for n, k, t, kg in ((64, 512, 1, 1), (128, 768, 4, 2), (64, 1024, 8, 2)):
        r = {"N": n, "K": k, "T": t, "kg": kg}
        r.update(check(EmuBf16Kernel(kg, desc or "lbo128_sbo256"), n, k, t, gen, dev))
        print("cpu-dry bf16 check", r)
        out.append(r)
    # the device run's shape loop (checks + timing bookkeeping) with the emulators and a wall-clock timer
    import run_wgmma
    res, fails = {"runs": [], "timing": []}, []
    run_shapes(res, None, {"1x1": EmuBf16Kernel(1, desc or "lbo128_sbo256"), "1x2": EmuBf16Kernel(2, desc or "lbo128_sbo256")},
               {"1x1": run_wgmma.EmuWgKernel(1, desc or "lbo128_sbo256")}, [(64, 512)], [1, 8], desc, gen, dev,
               time.time(), 1e9, False, fails, timer=cpu_time, min_bytes=1, reps=2)
    ok = not fails and len(res["timing"]) == 2 and all(set(x["kernels"]) == {"1x1", "1x2", "e4m3_1x1"} for x in res["timing"])
    out.append({"mock_run": [(x["N"], x["K"], x["T"], sorted(x["kernels"])) for x in res["timing"]], "failures": fails, "ok": ok})
    print("cpu-dry mock shape loop:", out[-1])
    bad = [r for r in out if not r["ok"]]
    if bad:
        raise SystemExit(f"cpu-dry bf16 check FAILED: {bad}")
    print("cpu-dry: all checks passed")
    return out


def run_shapes(res, path, kerns, e4m3, shapes, toks, desc, gen, dev, t_start, budget_s, no_time, failures,
               timer=None, min_bytes=160_000_000, reps=64):
    """Checks of every config at every (shape, T), then one timing of the configs that passed, the
    e4m3 kernels and the bf16 GEMV; the JSON is rewritten after every shape."""
    for n, k in shapes:
        for t in toks:
            if time.time() - t_start > budget_s:
                print(f"budget reached, skipping N {n} K {k} T {t}")
                res.setdefault("skipped", []).append([n, k, t])
                continue
            good = {}
            for cfg, kern in kerns.items():
                if n % (64 * kern.mg) or (getattr(kern, "persistent", False) and (k // 256) % kern.kg):
                    continue
                r = {"config": cfg, "desc": desc, "N": n, "K": k, "T": t}
                if hasattr(kern, "build"):
                    r["build"] = kern.build(k)
                try:
                    r.update(check(kern, n, k, t, gen, dev))
                except Exception as ex:
                    r.update({"ok": False, "error": f"{type(ex).__name__}: {ex}"[:300]})
                res["runs"].append(r)
                print(f"check bf16 {cfg} N {n:6d} K {k:5d} T {t}: relerr {r.get('relerr', float('nan')):.2e} "
                      f"nan {r.get('nan')} rerun-identical {r.get('bit_identical_rerun')} -> {'ok' if r['ok'] else 'FAIL'}")
                if r["ok"]:
                    good[cfg] = kern
                else:
                    failures.append(r)
            if good and not no_time:
                try:
                    tm, ref = time_shape(good, e4m3, n, k, t, gen, dev, reps=reps, timer=timer, min_bytes=min_bytes)
                except Exception as ex:          # a timing failure is recorded; the checks above stand
                    import traceback
                    traceback.print_exc()
                    failures.append({"timing": [n, k, t], "error": f"{type(ex).__name__}: {ex}"[:300]})
                else:
                    res["timing"].append({"N": n, "K": k, "T": t, **ref, "kernels": tm})
                    cells = "  ".join(f"{nm} {v['GBps']:5.0f} GB/s {v['pct_of_bf16']:3.0f}%" for nm, v in tm.items())
                    print(f"time N {n:6d} K {k:5d} T {t}: {cells}  | bf16-eq {ref['bf16_eq_GBps']:5.0f} GB/s")
            if path:
                json.dump(res, open(path, "w"), indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=120, help="no new shape is started after this")
    ap.add_argument("--configs", default="1x2s4,2x2s4,1x1s4p,1x2s4p,1x2s7p,2x2s4p,1x2",
                    help="bf16 kernel configs MGxKG[sST][p] (p: persistent, st >= 2)")
    ap.add_argument("--e4m3-configs", default="1x2s4,1x1s4", help="e4m3 wgmma kernel configs timed alongside ('' = none)")
    ap.add_argument("--tokens", default="1,4,8")
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--watchdog-s", type=float, default=0, help="default: budget + 90")
    ap.add_argument("--cpu-dry", action="store_true")
    ap.add_argument("--probe-variant", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.probe_variant:
        print("PROBE " + json.dumps(probe_child(a.probe_variant, a.cpu_dry)), flush=True)
        return
    configs = [c for c in a.configs.split(",") if c]
    if a.cpu_dry:
        return cpu_dry(configs)
    t_start = time.time()
    faulthandler.dump_traceback_later(a.watchdog_s or a.budget_s + 90, exit=True)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "wgmma_bf16_results.json")
    dev = torch.device("cuda")
    torch.zeros(1, device=dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    from run_gpu import Cu
    cu = Cu()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "rtol": RTOL, "runs": [], "timing": []}
    failures = []
    res["sass"] = sass_reports(configs, failures)
    desc, tried = probe_variants(cpu=False)
    res["desc_probe"], res["desc"] = tried, desc
    json.dump(res, open(path, "w"), indent=1)
    if desc is None:
        failures.append({"probe": "no descriptor variant matched"})
    else:
        kerns = {}
        for cfg in configs:
            mg, kg, st = parse_config(cfg)
            kerns[cfg] = Bf16Kernel(cu, mg, kg, st, desc, persistent=is_persistent(cfg))
        e4m3 = {}
        if a.e4m3_configs and not a.no_time:
            import run_wgmma
            for cfg in a.e4m3_configs.split(","):
                mg, kg, st = run_wgmma.parse_config(cfg)
                e4m3[cfg] = run_wgmma.WgKernel(cu, mg, kg, desc, st=st)
        toks = [int(v) for v in a.tokens.split(",")]
        run_shapes(res, path, kerns, e4m3, SHAPES, toks, desc, gen, dev, t_start, a.budget_s, a.no_time, failures)
    res["failures"], res["failure_list"] = len(failures), failures
    res["wall_s"] = round(time.time() - t_start, 1)
    json.dump(res, open(path, "w"), indent=1, default=str)
    faulthandler.cancel_dump_traceback_later()
    if failures:
        raise SystemExit(f"{len(failures)} check(s) FAILED; see {path}")
    print(f"all checks passed in {res['wall_s']} s;", path)


if __name__ == "__main__":
    main()
