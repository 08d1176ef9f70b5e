"""Lab: W2 decoded to fp8 e4m3 (four weights a 32-bit register) instead of bf16 (two), x split
into two e4m3 halves (hi + lo, ~bf16 precision), one m16n8k32 MMA pair per 32-weight scale group
and the group's UE8M0 scale applied to the fp32 partial (exact: a power of two).

Why: the bf16 decoder spends one LOP3 + one IMAD per two weights (nb8) and the T = 1 gate/up is
bound by its instruction stream (docs/perf.md, Stop 27). Four e4m3 weights of one register need
their sign at bits 7/15/23/31 and their "x4" bit at 4/12/20/28 (bytes 0x20 | big << 4 | neg << 7 =
+-1/8, +-1/2): one word of 16 weights gives its four registers with rotations by 0, 2, 4, 6 and a
LOP3 each (the residues {7 - t, 4 - t} mod 8 of t = 0, 2, 4, 6 tile 0..7): 7 instructions for 16
weights instead of 19.

Layout "f8w" (lab only): row n, block b of 128 weights (scale groups 4b .. 4b + 3) = 8 int32 words;
word j, byte y holds, for group q, in-group weight 4j + y: neg at bit (8y + 7 - 2q) mod 32 and big at
(8y + 4 - 2q) mod 32. Scales: the natural [N, K/32] bytes read as int32 words (4 groups a word).

    PYTHONPATH=.:src python tools/kernel_lab/w2_fp8_lab.py --check     # CPU interpreter, small
    PYTHONPATH=.:src python tools/kernel_lab/w2_fp8_lab.py --sass      # sm_90 AOT counts, CPU
    PYTHONPATH=.:src python tools/kernel_lab/w2_fp8_lab.py --gpu OUT   # H200: check + time (never run:
                                                                       # the AOT counts ruled it out)
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

ROT = (0, 2, 4, 6)


def _asm() -> str:
    lines = ["{", ".reg .b32 t;"]
    for q, t in enumerate(ROT):
        if t == 0:
            lines.append(f"lop3.b32 ${q}, $4, 0x90909090, 0x20202020, 0xEA;")
        else:
            lines.append(f"shf.l.wrap.b32 t, $4, $4, {t};")
            lines.append(f"lop3.b32 ${q}, t, 0x90909090, 0x20202020, 0xEA;")
    lines.append("}")
    return "\n".join(lines)


F8W_ASM = tl.constexpr(_asm())


# ----------------------------------------------------------------------------- layout (torch)

def to_f8w(neg: torch.Tensor, big: torch.Tensor) -> torch.Tensor:
    """neg, big bool [N, K] (K % 128 == 0) -> int32 words [N, K/128, 8]."""
    n, k = neg.shape
    nb = neg.reshape(n, k // 128, 4, 8, 4).to(torch.int64)     # [n, b, q, j, y]
    bb = big.reshape(n, k // 128, 4, 8, 4).to(torch.int64)
    w = torch.zeros(n, k // 128, 8, dtype=torch.int64, device=neg.device)
    for q in range(4):
        for y in range(4):
            pn = (8 * y + 7 - 2 * q) % 32
            pb = (8 * y + 4 - 2 * q) % 32
            w |= nb[:, :, q, :, y] << pn
            w |= bb[:, :, q, :, y] << pb
    return (w - ((w >> 31) << 32)).to(torch.int32)           # two's complement int32


def split_x(x: torch.Tensor):
    """x [T, K] -> (x_hi, x_lo) e4m3 [T, K] and the per-token power of two a: x * a ~ hi + lo."""
    amax = x.float().abs().amax(dim=1).clamp_min(1e-30)
    a = torch.exp2(torch.floor(torch.log2(448.0 / amax)))
    xs = x.float() * a[:, None]
    hi = xs.to(torch.float8_e4m3fn)
    lo = (xs - hi.float()).to(torch.float8_e4m3fn)
    return hi, lo, a


# ----------------------------------------------------------------------------- kernel

@triton.jit
def _decode(wd, USE_ASM: tl.constexpr):
    """wd int32 [BN, 32] (word j at elements 4j..4j+3) -> e4m3 tiles of groups q = 0..3."""
    if USE_ASM:
        o0, o1, o2, o3 = tl.inline_asm_elementwise(F8W_ASM, "=r,=r,=r,=r,r,r,r,r", [wd],
                                                   dtype=(tl.float8e4nv,) * 4, is_pure=True, pack=4)
    else:
        u = wd.to(tl.uint32, bitcast=True)
        y = (tl.arange(0, 32) % 4)[None, :].to(tl.uint32)
        r1 = (u << 2) | (u >> 30)
        r2 = (u << 4) | (u >> 28)
        r3 = (u << 6) | (u >> 26)
        o0 = ((((u >> (8 * y)) & 0x90) | 0x20).to(tl.uint8)).to(tl.float8e4nv, bitcast=True)
        o1 = ((((r1 >> (8 * y)) & 0x90) | 0x20).to(tl.uint8)).to(tl.float8e4nv, bitcast=True)
        o2 = ((((r2 >> (8 * y)) & 0x90) | 0x20).to(tl.uint8)).to(tl.float8e4nv, bitcast=True)
        o3 = ((((r3 >> (8 * y)) & 0x90) | 0x20).to(tl.uint8)).to(tl.float8e4nv, bitcast=True)
    return o0, o1, o2, o3


@triton.jit
def _group(acc, o, xh_ptr, xl_ptr, m, mmask, k0, sw, q: tl.constexpr, K: tl.constexpr, USE_ASM: tl.constexpr):
    kk = tl.arange(0, 32)
    xh = tl.load(xh_ptr + m[:, None] * K + k0 + 32 * q + kk[None, :], mask=mmask[:, None], other=0.0)
    xl = tl.load(xl_ptr + m[:, None] * K + k0 + 32 * q + kk[None, :], mask=mmask[:, None], other=0.0)
    if USE_ASM:
        p = tl.dot(o, tl.trans(xh))
        p = tl.dot(o, tl.trans(xl), p)
    else:
        p = tl.dot(o.to(tl.float32), tl.trans(xh.to(tl.float32)), input_precision="ieee")
        p = tl.dot(o.to(tl.float32), tl.trans(xl.to(tl.float32)), p, input_precision="ieee")
    s = (((sw >> (8 * q)) & 255) << 23).to(tl.float32, bitcast=True)
    return acc + p * s[:, None]


@triton.jit
def f8w_gemv_kernel(wq_ptr, sc_ptr, xh_ptr, xl_ptr, out_ptr, N, T, K: tl.constexpr, BN: tl.constexpr,
                    BM: tl.constexpr, R: tl.constexpr, USE_ASM: tl.constexpr):
    """out [E, T, N] fp32 = (W_e @ (x_hi + x_lo)^T)^T / 8 per expert e = program_id(1)."""
    pid = tl.program_id(0)
    e = tl.program_id(1)
    KB: tl.constexpr = K // 128
    rows = pid * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    mmask = m < T
    jj = tl.arange(0, 8)
    r64 = rows.to(tl.int64)
    wbase = wq_ptr + e.to(tl.int64) * N * KB * 8 + r64[:, None] * (KB * 8) + jj[None, :]
    sbase = sc_ptr + e.to(tl.int64) * N * KB + r64 * KB
    acc = tl.zeros((BN, BM), tl.float32)
    for b0 in range(0, KB, R):
        for r in tl.static_range(R):
            b = b0 + r
            words = tl.load(wbase + b * 8)
            wd = tl.reshape(tl.broadcast_to(words[:, :, None], (BN, 8, 4)), (BN, 32))
            o0, o1, o2, o3 = _decode(wd, USE_ASM)
            sw = tl.load(sbase + b)
            acc = _group(acc, o0, xh_ptr, xl_ptr, m, mmask, b * 128, sw, 0, K, USE_ASM)
            acc = _group(acc, o1, xh_ptr, xl_ptr, m, mmask, b * 128, sw, 1, K, USE_ASM)
            acc = _group(acc, o2, xh_ptr, xl_ptr, m, mmask, b * 128, sw, 2, K, USE_ASM)
            acc = _group(acc, o3, xh_ptr, xl_ptr, m, mmask, b * 128, sw, 3, K, USE_ASM)
    out = out_ptr + e.to(tl.int64) * T * N + m[None, :] * N + rows[:, None]
    tl.store(out, acc, mask=mmask[None, :])


def run(words, scales_i32, xh, xl, a, n, k, e, t, *, bn=32, bm=16, r=1, warps=2, stages=3, use_asm=True):
    out = torch.empty(e, t, n, dtype=torch.float32, device=words.device)
    f8w_gemv_kernel[(n // bn, e)](words, scales_i32, xh, xl, out, n, t, K=k, BN=bn, BM=bm, R=r, USE_ASM=use_asm,
                                  num_warps=warps, num_stages=stages)
    return out * (8.0 / a)[None, :, None]


def make(e, n, k, t, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    neg = torch.randint(0, 2, (e, n, k), generator=g, dtype=torch.bool)
    big = torch.randint(0, 2, (e, n, k), generator=g, dtype=torch.bool)
    s = torch.randint(110, 125, (e, n, k // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    x = torch.randn(t, k, generator=g).to(torch.bfloat16)
    w64 = ((1 - 2 * neg.double()) * (1 + 3 * big.double())
           * torch.exp2(s.double() - 127).repeat_interleave(32, dim=-1))
    ref = torch.einsum("enk,tk->etn", w64, x.double())
    words = torch.stack([to_f8w(neg[i], big[i]) for i in range(e)]).contiguous()
    sc = s.contiguous().view(torch.int32)                    # [E, N, K/128] words of 4 scales
    xh, xl, a = split_x(x)
    return (words.to(device), sc.to(device), xh.to(device), xl.to(device), a.to(device)), ref, w64, x


def relerr(out, ref):
    return float((out.double().cpu() - ref).norm() / ref.norm())


def check_cpu():
    e, n, k, t = 2, 32, 256, 3
    args, ref, _, _ = make(e, n, k, t, "cpu")
    out = run(*args, n, k, e, t, bn=32, bm=16, use_asm=False)
    err = relerr(out, ref)
    print(f"interpreter relerr {err:.3e}")
    assert err < 5e-3, err
    return 0


def sass():
    sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "..")]
    from tests.kernels.aot_compile import _compile, sass_report
    for bn, bm, r, warps, stages in [(64, 8, 1, 4, 3), (64, 8, 2, 4, 3), (64, 8, 4, 4, 3), (64, 16, 4, 4, 3),
                                     (128, 8, 2, 8, 3), (128, 8, 2, 4, 3)]:
        try:
            c = _compile(f8w_gemv_kernel, dict(wq_ptr="*i32", sc_ptr="*i32", xh_ptr="*fp8e4nv", xl_ptr="*fp8e4nv",
                                               out_ptr="*fp32", N="i32", T="i32"),
                         dict(K=7168, BN=bn, BM=bm, R=r, USE_ASM=True), dict(num_warps=warps, num_stages=stages))
        except Exception as ex:  # noqa: BLE001 (a lab: report and go on)
            print(f"BN {bn} BM {bm} R {r} w {warps}: compile failed: {str(ex)[:300]}")
            continue
        rep = sass_report(c)
        weights = bn * 128 * r / (32 * warps)
        print(f"BN {bn:3d} BM {bm:2d} R {r} warps {warps} stages {stages}: regs {rep['regs']} smem {rep['smem']} "
              f"spills {rep['spill_ops']} loop {rep['loop_instrs']} mma {rep['loop_mmas']} "
              f"-> {rep['loop_instrs'] / weights:.2f} instr/weight")
        hist = sorted(rep["loop_hist"].items(), key=lambda kv: -kv[1])[:12]
        print("    ", hist)
        ttgir = c.asm["ttgir"]
        print("     kWidth", sorted(set(__import__("re").findall(r"kWidth = \d+", ttgir))),
              "local_alloc", ttgir.count("local_alloc"))
    return 0


def gpu(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    dev = torch.device("cuda")
    rep = {"device": torch.cuda.get_device_name(dev), "rows": []}
    from moet.bench.moe_kernel_tune import bf16_gemv_gbps, graph_time_ms
    gemv = bf16_gemv_gbps(dev)
    rep["bf16_gemv_GBps"] = gemv
    print(f"bf16 GEMV {gemv:.0f} GB/s", flush=True)
    # DeepSeek-V3 gate/up at T = 1: 8 experts x 4096 rows (gate + up) x K 7168; down: 8 x 7168 x 2048
    for label, n, k in [("gate/up", 4096, 7168), ("down", 7168, 2048)]:
        e, t = 8, 1
        args, ref, _, _ = make(e, n, k, t, "cpu", seed=1)
        args = tuple(a.to(dev) for a in args)
        # the experts' bytes many times over, so every timed call reads from HBM (no L2 reuse)
        copies = 8
        pool = [tuple(a.clone() for a in args) for _ in range(copies)]
        nbytes = e * n * k * 2.25 / 8
        for bn, bm, r, warps, stages in [(32, 16, 1, 2, 3), (32, 16, 2, 2, 3), (32, 16, 1, 2, 4), (64, 16, 1, 4, 3),
                                         (32, 8, 1, 2, 3), (16, 16, 2, 1, 4), (64, 16, 2, 4, 3)]:
            try:
                out = run(*args, n, k, e, t, bn=bn, bm=bm, r=r, warps=warps, stages=stages)
                torch.cuda.synchronize()
            except Exception as ex:  # noqa: BLE001
                print(f"{label} {bn} {bm} {r} {warps} {stages}: failed {str(ex)[:200]}", flush=True)
                continue
            err = relerr(out, ref)
            again = run(*args, n, k, e, t, bn=bn, bm=bm, r=r, warps=warps, stages=stages)
            same = bool(torch.equal(out, again))

            def call(i, bn=bn, bm=bm, r=r, warps=warps, stages=stages):
                w, s, xh, xl, a = pool[i]
                o = torch.empty(e, t, n, dtype=torch.float32, device=dev)
                f8w_gemv_kernel[(n // bn, e)](w, s, xh, xl, o, n, t, K=k, BN=bn, BM=bm, R=r, USE_ASM=True,
                                              num_warps=warps, num_stages=stages)
            # a graph of the copies in turn (each copy's bytes once), median ms per call
            us = graph_time_ms([lambda i=i: call(i) for i in range(copies)]) * 1e3
            row = dict(part=label, BN=bn, BM=bm, R=r, warps=warps, stages=stages, relerr=err, bit_identical=same,
                       us=us, GBps=nbytes / us / 1e3, pct_gemv=100 * nbytes / us / 1e3 / gemv)
            rep["rows"].append(row)
            print(json.dumps(row), flush=True)
    with open(os.path.join(out_dir, "w2_fp8_lab.json"), "w") as f:
        json.dump(rep, f, indent=1)
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--sass", action="store_true")
    ap.add_argument("--gpu", default=None)
    a = ap.parse_args()
    if a.check:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        raise SystemExit(check_cpu())
    if a.sass:
        raise SystemExit(sass())
    raise SystemExit(gpu(a.gpu or os.environ.get("OUT", "/tmp/out")))
