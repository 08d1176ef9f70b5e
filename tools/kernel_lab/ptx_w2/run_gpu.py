"""Device run for the PTX W2 lab: assemble, load through libcuda, check, time. One short call:

  cd <repo root>; PYTHONUNBUFFERED=1 python3 tools/kernel_lab/ptx_w2/run_gpu.py --out $OUT --budget-s 150 \
      2>&1 | tee $OUT/log.txt

First the wgmma kernel (run_wgmma.py: SASS stats, descriptor probe in child processes, checks incl.
fallback chunks, timing; --wg-configs, --only-wgmma / --skip-wgmma), then the mma.sync baseline below
(--configs, default 2x4,1x4,2x8). --cpu-dry: everything except the launches.

For each config (NT, W) and shape (DeepSeek-V3 per expert: N 4096 x K 7168 gate+up, N 7168 x K 2048
down; and 8 experts stacked: N 32768 x K 7168, N 57344 x K 2048) and T in 1, 4, 8:
  check: fresh random codes (all byte values), scale bytes 110..130, x ~ N(0, 1) quantized per token
         to e4m3 (the same bytes the reference uses), y pre-filled with NaN; relerr (max |y - ref| /
         max |ref|) against float64 (moet.kernels.reference.decode_w2 @ e4m3 x); a rerun must be
         bit-identical. Any failure raises (non-zero exit) after writing the JSON.
  time:  CUDA graph of `reps` launches rotating over enough weight sets to exceed the L2 (>= 160 MB),
         median of 5 replays; GB/s on code + scale bytes; a bf16 GEMV (torch.matmul) moving the same
         bytes measured the same way in the same run; % of it.
A watchdog (faulthandler) kills the process if the device hangs; --budget-s stops starting new
configs. JSON after every shape: $OUT/ptx_w2_results.json.
"""
from __future__ import annotations

import argparse
import ctypes
import faulthandler
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import gen_ptx  # noqa: E402
import layout as L  # noqa: E402
import emulate as E  # noqa: E402

RTOL = 2e-3   # pass/fail bound on max|y - ref| / max|ref|. Exact-product fp32 accumulation gives ~1e-6
              # (the CPU emulator: ~5e-8); a layout or fragment bug gives O(1). Values in 1e-5..2e-3 mean
              # the tensor core accumulates 32 fp8 products with reduced precision: record, do not hide.


class Cu:
    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")

    def chk(self, r, what):
        if r != 0:
            s = ctypes.c_char_p()
            self.lib.cuGetErrorString(r, ctypes.byref(s))
            raise RuntimeError(f"{what} failed: CUresult {r} {s.value.decode() if s.value else ''}")

    def load(self, cubin: bytes, name: str):
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        self._buf = ctypes.create_string_buffer(cubin)
        self.chk(self.lib.cuModuleLoadData(ctypes.byref(mod), self._buf), "cuModuleLoadData")
        self.chk(self.lib.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()), "cuModuleGetFunction")
        return fn


class Kernel:
    def __init__(self, cu: Cu, nt: int, warps: int, prefetch: bool = True):
        self.cu, self.nt, self.warps = cu, nt, warps
        ptx = gen_ptx.gen_ptx(nt, warps, prefetch)
        self.cubin, self.log = gen_ptx.assemble(ptx)
        self.fn = cu.load(self.cubin, gen_ptx.KERNEL)

    def __call__(self, codes, scales, xfm, xs, y, n, k, t):
        assert n % (8 * self.nt) == 0, (n, self.nt)
        args = [ctypes.c_uint64(v.data_ptr()) for v in (codes, scales, xfm, xs, y)] + \
               [ctypes.c_uint32(n), ctypes.c_uint32(k), ctypes.c_uint32(t)]
        arr = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self.cu.chk(self.cu.lib.cuLaunchKernel(self.fn, n // (8 * self.nt), 1, 1, 32 * self.warps, 1, 1, 0,
                                               stream, arr, None), "cuLaunchKernel")


class EmuKernel:
    """CPU stand-in with the kernel's signature (emulate.gemv), for --cpu-dry harness tests."""
    nt, warps = 1, 2

    def __call__(self, codes, scales, xfm, xs, y, n, k, t):
        y.copy_(torch.from_numpy(E.gemv(codes.numpy(), scales.numpy(), xfm.numpy(), xs.numpy(), n, k, t, self.warps)))


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def make_weights(n, k, gen, dev):
    codes = torch.randint(0, 256, (n, k // 4), dtype=torch.uint8, device=dev, generator=gen)
    scales = torch.randint(110, 131, (n, k // 32), dtype=torch.uint8, device=dev, generator=gen)
    return codes, scales


def make_x(t, k, gen, dev):
    x = torch.randn(t, k, device=dev, generator=gen)
    amax = x.abs().amax(dim=1)
    sc = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax)).float()
    q = (x / sc[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).contiguous(), sc.contiguous()


def reference(codes, scales, xb, xs):
    from moet.kernels.reference import decode_w2
    w = decode_w2(codes, scales).double()
    xv = xb.view(torch.float8_e4m3fn).double()
    return (xv @ w.T) * xs.double()[:, None]


def check(kern, n, k, t, gen, dev):
    codes, scales = make_weights(n, k, gen, dev)
    xb, xs = make_x(t, k, gen, dev)
    cf, sf, xf = L.to_fm8_codes_torch(codes), L.to_fm8_scales_torch(scales), L.to_xfm_torch(xb)
    y = torch.full((t, n), float("nan"), device=dev)
    kern(cf, sf, xf, xs, y, n, k, t)
    _sync(dev)
    ref = reference(codes, scales, xb, xs)
    nan = int(torch.isnan(y).sum())
    err = float((y.double() - ref).abs().max() / ref.abs().max())
    y2 = torch.full((t, n), float("nan"), device=dev)
    kern(cf, sf, xf, xs, y2, n, k, t)
    _sync(dev)
    same = bool(torch.equal(y.view(torch.int32), y2.view(torch.int32)))
    return {"relerr": err, "nan": nan, "bit_identical_rerun": same,
            "ok": nan == 0 and err < RTOL and same}


def graph_time(fn, reps):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(0)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / reps)
    return float(np.median(ts))


def time_shape(kern, n, k, t, gen, dev, reps=64):
    nbytes = n * k // 4 + n * k // 32
    sets = max(2, -(-160_000_000 // nbytes))
    ws = []
    for _ in range(sets):
        c, s = make_weights(n, k, gen, dev)
        ws.append((L.to_fm8_codes_torch(c), L.to_fm8_scales_torch(s)))
    xb, xs = make_x(t, k, gen, dev)
    xf = L.to_xfm_torch(xb)
    y = torch.empty((t, n), device=dev)
    us = graph_time(lambda i: kern(ws[i % sets][0], ws[i % sets][1], xf, xs, y, n, k, t), reps)
    # bf16 GEMV moving the same bytes: [T, K] x [K, N_eq], N_eq * K * 2 = nbytes
    n_eq = max(8, nbytes // (2 * k))
    bsets = max(2, -(-160_000_000 // (n_eq * k * 2)))
    bw = [torch.randn(n_eq, k, device=dev, generator=gen).to(torch.bfloat16) for _ in range(bsets)]
    xbf = torch.randn(t, k, device=dev, generator=gen).to(torch.bfloat16)
    yb = torch.empty((t, n_eq), device=dev, dtype=torch.bfloat16)
    us_b = graph_time(lambda i: torch.matmul(xbf, bw[i % bsets].T, out=yb), reps)
    gbs, gbs_b = nbytes / us / 1e3, n_eq * k * 2 / us_b / 1e3
    return {"us": us, "GBps": gbs, "bf16_eq_us": us_b, "bf16_eq_GBps": gbs_b, "pct_of_bf16": 100 * gbs / gbs_b,
            "weight_sets": sets, "bytes": nbytes}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=150)
    ap.add_argument("--configs", default="2x4,1x4,2x8", help="mma.sync baseline NTxW list")
    ap.add_argument("--wg-configs", default="1x1s4,1x2s4,1x1",
                    help="wgmma kernel configs MGxKG[sST]: row warpgroups x K-split warpgroups [cp.async ring stages]")
    ap.add_argument("--wg-share", type=float, default=0.65, help="fraction of the budget the wgmma part may start in")
    ap.add_argument("--only-wgmma", action="store_true", help="skip the mma.sync baseline")
    ap.add_argument("--skip-wgmma", action="store_true", help="only the mma.sync baseline")
    ap.add_argument("--tokens", default="1,4,8")
    ap.add_argument("--watchdog-s", type=float, default=0, help="default: budget + 120")
    ap.add_argument("--cpu-dry", action="store_true", help="no GPU: assemble + emulator checks, tiny shapes")
    a = ap.parse_args()
    if a.cpu_dry:
        import run_wgmma
        out = {}
        if not a.skip_wgmma:
            out["wgmma"] = run_wgmma.cpu_dry(tuple(a.wg_configs.split(",")))
        if not a.only_wgmma:
            out["mma_sync"] = cpu_dry()
        print("cpu-dry: all checks passed")
        return out
    t_start = time.time()
    faulthandler.dump_traceback_later(a.watchdog_s or a.budget_s + 120, exit=True)
    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cuda")
    torch.zeros(1, device=dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    cu = Cu()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "runs": []}
    path = os.path.join(a.out, "ptx_w2_results.json")
    failures = []
    if not a.skip_wgmma:
        import run_wgmma
        try:
            run_wgmma.run(res, path, a, t_start, gen, dev, cu, failures)
        except Exception as ex:        # keep the baseline alive; the failure is recorded and fails the run
            import traceback
            traceback.print_exc()
            failures.append({"wgmma": f"{type(ex).__name__}: {ex}"[:500]})
            res["wgmma_error"] = failures[-1]["wgmma"]
        json.dump(res, open(path, "w"), indent=1)
    shapes = [(4096, 7168), (7168, 2048), (32768, 7168), (57344, 2048)]
    toks = [int(v) for v in a.tokens.split(",")]
    for cfg in ([] if a.only_wgmma else a.configs.split(",")):
        nt, w = (int(v) for v in cfg.split("x"))
        if time.time() - t_start > a.budget_s:
            print(f"budget reached, skipping {cfg}")
            break
        kern = Kernel(cu, nt, w)
        print(f"== mma.sync NT {nt} W {w}: ptxas {kern.log.strip().splitlines()[-1] if kern.log.strip() else ''}")
        for n, k in shapes:
            for t in toks:
                if time.time() - t_start > a.budget_s:
                    break
                r = {"kernel": "mma_sync", "nt": nt, "warps": w, "N": n, "K": k, "T": t}
                r.update(check(kern, n, k, t, gen, dev))
                if not r["ok"]:
                    failures.append(r)
                    print("FAIL", r)
                else:
                    r.update(time_shape(kern, n, k, t, gen, dev))
                    print(f"mma.sync N {n:6d} K {k:5d} T {t}: relerr {r['relerr']:.2e} {r['us']:8.2f} us "
                          f"{r['GBps']:7.0f} GB/s  bf16-eq {r['bf16_eq_GBps']:7.0f} GB/s  {r['pct_of_bf16']:5.1f}%")
                res["runs"].append(r)
                json.dump(res, open(path, "w"), indent=1)
    res["failures"] = len(failures)
    res["failure_list"] = failures
    res["wall_s"] = round(time.time() - t_start, 1)
    json.dump(res, open(path, "w"), indent=1, default=str)
    faulthandler.cancel_dump_traceback_later()
    if failures:
        raise SystemExit(f"{len(failures)} check(s) FAILED; see {path}")
    print(f"all checks passed in {res['wall_s']} s;", path)


def cpu_dry() -> list[dict]:
    dev = torch.device("cpu")
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    out = []
    for n, k, t in ((16, 512, 1), (8, 768, 4), (16, 256, 8)):
        r = {"N": n, "K": k, "T": t}
        r.update(check(EmuKernel(), n, k, t, gen, dev))
        print("cpu-dry", r)
        out.append(r)
        if not r["ok"]:
            raise SystemExit(f"cpu-dry check FAILED: {r}")
    return out


if __name__ == "__main__":
    main()
