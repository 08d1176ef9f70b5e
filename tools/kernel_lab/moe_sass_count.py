"""sm_90 SASS counts of moet's grouped MoE GEMM (moe_triton._moe_gemm_kernel) without a GPU: the
Triton AOT build of each tile, its registers, shared memory, spills and hot-loop instructions,
and a hash of the SASS (to show a refactor leaves a default path byte-identical: run it before
and after). Stop 24 used it for the two-chain, constant-mask and prefetch forms (docs/perf.md,
MoE "Stop 24").

    env -u TRITON_INTERPRET PYTHONPATH=.:src python tools/kernel_lab/moe_sass_count.py [--hist]
"""
from __future__ import annotations

import argparse
import hashlib

from moet.kernels import moe_triton as m
from tests.kernels.aot_compile import _compile, _cuobjdump, sass_report

# (label, FMT, GATE_UP, BM, BN, BKH, SPLIT_K, warps, stages, extra constexprs); DeepSeek-V3 shapes
# (gate/up N 2048 x K 7168, down N 7168 x K 2048), row-tiled pools (TILED), PDL on
TILES = [
    ("w2 gate/up T=1 table", m.FMT_W2, True, 1, 32, 32, 2, 2, 4, {}),
    ("w2 down T=1 table", m.FMT_W2, False, 1, 32, 32, 1, 2, 4, {}),
    ("fp4 gate/up T=1 table", m.FMT_FP4, True, 4, 32, 64, 1, 2, 4, {}),
    ("fp4 down T=1 table", m.FMT_FP4, False, 4, 16, 32, 1, 1, 4, {}),
    ("w2 gate/up prefill", m.FMT_W2, True, 64, 128, 32, 1, 8, 3, {}),
    # run 29's T = 1 table (pairs bucket 8): BM 8, gate/up unsplit BKH 64
    ("w2 gate/up T=1 run29", m.FMT_W2, True, 8, 32, 64, 1, 2, 4, {}),
    ("w2 down T=1 run29", m.FMT_W2, False, 8, 32, 32, 1, 2, 4, {}),
]
FORMS = [("masked", {}), ("even", dict(EVEN_K=True, EVEN_N=True)),
         ("even chains2", dict(EVEN_K=True, EVEN_N=True, CHAINS=2)),
         ("even xclamp", dict(EVEN_K=True, EVEN_N=True, X_CLAMP=True)),
         ("even xclamp c2", dict(EVEN_K=True, EVEN_N=True, X_CLAMP=True, CHAINS=2))]


def compile_tile(fmt, gate_up, bm, bn, bkh, split, warps, stages, extra):
    n, k = (2048, 7168) if gate_up else (7168, 2048)
    types = dict(x_ptr="*bf16", wq_ptr="*i16", sc_ptr="*u8", s2_ptr="*fp32", sorted_ptr="*i32", bslot_ptr="*i32",
                 out_ptr="*fp32" if (split > 1 or not gate_up or bm > 16) else "*bf16", s_x="i32",
                 s_wq_slot="i32", s_sc_slot="i32", limit="fp32", P="i32")
    const = dict(N=n, K=k, TOPK=8, GATE_UP=gate_up, FMT=fmt, SPLIT_K=split, HAS_LIMIT=gate_up, USE_ASM=2, BM=bm,
                 BN=bn, BKH=bkh, PDL=True, UNROLL=1, TILED=True, FUSED_FINISH=False, FUSED_COMBINE=False, CHAINS=1,
                 PREFETCH=0, EVEN_K=False, EVEN_N=False, X_CLAMP=False, PREFETCH_STEPS=0, KW2=False)
    const.update(extra)
    const = {name: v for name, v in const.items() if name in m._moe_gemm_kernel.arg_names}
    # every constexpr given (an omitted defaulted one would compile as a runtime argument) and the
    # JIT's divisibility of the integer strides, so the build is what a launch compiles
    return _compile(m._moe_gemm_kernel, types, const, dict(num_warps=warps, num_stages=stages),
                    div16=("s_x", "s_wq_slot", "s_sc_slot"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hist", action="store_true", help="also the loop's top instruction counts")
    args = ap.parse_args()
    for label, *tile, extra in TILES:
        for form, kw in FORMS:
            c = compile_tile(*tile, {**extra, **kw})
            r = sass_report(c)
            h = hashlib.sha1(_cuobjdump(c.asm["cubin"], "-sass").encode()).hexdigest()[:10]
            print(f"{label:24s} {form:13s} regs {r['regs']:3d} smem {r['smem']:6d} spills {r['spill_ops']:3d} "
                  f"loop {r['loop_instrs']:4d} mma {r['loop_mmas']:3d} sass {h}")
            if args.hist:
                print("    ", sorted(r["loop_hist"].items(), key=lambda kv: -kv[1])[:10])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
