"""Compile the Triton grouped MoE kernels (moet.kernels.moe_gemm, moe_align_triton) for sm_90 without a GPU
(Triton AOT, the ptxas shipped with triton), the GPU path included (inline-asm decoders, bf16
dots), which the interpreter cannot run.

    python -m tests.kernels.aot_compile_moe [--quick]    (TRITON_INTERPRET must be unset)
Run by test_moe_triton.py in a subprocess; prints one line per kernel.
"""
from __future__ import annotations

import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moet.kernels import moe_align_triton
from moet.kernels import moe_gemm as g
from moet.kernels import moe_triton as m

TARGET = GPUTarget("cuda", 90, 32)


def _compile(fn, types: dict, const: dict, num_warps: int = 4, num_stages: int = 3):
    for flag in ("FUSED_FINISH", "FUSED_COMBINE", "ZERO_OUT"):   # the separate launches unless asked
        if flag in fn.arg_names:
            const = {flag: False, **const}
    if "UNROLL" in fn.arg_names:                                  # a defaulted constexpr: AOT needs it given
        const = {"UNROLL": 1, **const}
    if "TILED" in fn.arg_names:                                   # (likewise: the row-major nb8 pool unless asked)
        const = {"TILED": False, **const}
    if "CHAINS" in fn.arg_names:                                  # (likewise: one MMA chain a step)
        const = {"CHAINS": 1, **const}
    if "PREFETCH" in fn.arg_names:                                # (likewise: no L2 prefetch, all its steps)
        const = {"PREFETCH": 0, "PREFETCH_STEPS": 0, **const}
    if "KW2" in fn.arg_names:                                     # (likewise: the scale loads' kWidth 4 form)
        const = {"KW2": False, **const}
    for flag in ("EVEN_K", "EVEN_N", "X_CLAMP"):                  # (likewise: masked K steps and rows, x
                                                                  # rows masked)
        if flag in fn.arg_names:
            const = {flag: False, **const}
    for flag in ("SWAP_AB", "F8_WORDS"):                          # (the GQA decode's, likewise)
        if flag in fn.arg_names:
            const = {flag: False, **const}
    if "PF_STEPS" in fn.arg_names:                                # (the GQA decode's L2 prefetch: none)
        const = {"PF_STEPS": 0, "KV_BYTES": 2, **const}
    if "LONG_SPLITS" in fn.arg_names:                             # (its plain partition, one-chunk merge)
        const = {"LONG_SPLITS": 0, **const}
    if "SKIP_EMPTY" in fn.arg_names:
        const = {"SKIP_EMPTY": False, **const}
    if "NCHUNK" in fn.arg_names:
        const = {"NCHUNK": 1, **const}
    for flag in ("HAS_BIAS", "HAS_ALPHA", "HAS_SINKS"):           # gpt-oss's biases, activation, sinks: off
        if flag in fn.arg_names:                                  # unless asked
            const = {flag: False, **const}
    types = {"bias_ptr": "*bf16", "alpha": "fp32", "sinks_ptr": "*fp32", **types}
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
    opts = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs), target=TARGET,
                          options=opts)


def main(quick: bool = False) -> None:
    # DeepSeek-V3 routed experts: H 7168, I 2048, top-8; decode (BM 16) and prefill (BM 64) tiles
    for fmt, name in ((m.FMT_W2, "w2"), (m.FMT_FP4, "fp4")):
        for gate_up in (True, False):
            # (BM, BN, BKH, SPLIT_K, warps, stages, PDL): decode tiles of 16 and 1 pairs, prefill
            # (the last: BM 4 with the K loop unrolled twice, the T = 1 form of run 21)
            configs = ((16, 64, 32, 1, 4, 4, False, 1), (1, 32, 32, 2, 2, 4, True, 1), (64, 128, 16, 1, 8, 3, False, 1),
                       (4, 32, 32, 2, 2, 4, True, 2))
            for bm, bn, bkh, split, warps, stages, pdl, unroll in (configs[:1] + configs[-1:]) if quick else configs:
                n, k = (2048, 7168) if gate_up else (7168, 2048)
                types = dict(x_ptr="*bf16", wq_ptr="*i16", sc_ptr="*u8", s2_ptr="*fp32", sorted_ptr="*i32",
                             bslot_ptr="*i32", out_ptr="*bf16" if gate_up and split == 1 else "*fp32",
                             s_x="i32", s_wq_slot="i32", s_sc_slot="i32", limit="fp32", P="i32")
                const = dict(N=n, K=k, TOPK=8, GATE_UP=gate_up, FMT=fmt, SPLIT_K=split, HAS_LIMIT=gate_up,
                             USE_ASM=2, BM=bm, BN=bn, BKH=bkh, PDL=pdl, UNROLL=unroll)   # sm_90: asm_level 2
                c = _compile(g._moe_gemm_kernel, types, const, warps, stages)
                # FP4 at asm_level 2 converts its e4m3 scales with the hardware instruction
                cvt = " e4m3-cvt" if "cvt.rn.f16x2.e4m3x2" in c.asm["ptx"] else ""
                print("gemm", name, "gate_up" if gate_up else "down", bm, bn, bkh, split, unroll,
                      "cubin bytes", str(len(c.asm["cubin"])) + cvt)
    # the decoders' MMA K packing (GemmConfig.kwidth2): the table's DeepSeek-V3 T = 1 tiles, both forms
    for fmt, name in ((m.FMT_W2, "w2"), (m.FMT_FP4, "fp4")):
        for gate_up in (True, False):
            n, k = (2048, 7168) if gate_up else (7168, 2048)
            types = dict(x_ptr="*bf16", wq_ptr="*i16", sc_ptr="*u8", s2_ptr="*fp32", sorted_ptr="*i32",
                         bslot_ptr="*i32", out_ptr="*bf16" if gate_up else "*fp32", s_x="i32", s_wq_slot="i32",
                         s_sc_slot="i32", limit="fp32", P="i32")
            widths = []
            for kw2 in (False, True):
                const = dict(N=n, K=k, TOPK=8, GATE_UP=gate_up, FMT=fmt, SPLIT_K=1, HAS_LIMIT=gate_up, USE_ASM=2,
                             BM=8, BN=32 if gate_up else 64, BKH=64 if gate_up else 32, PDL=True, TILED=True,
                             KW2=kw2)
                ttgir = _compile(g._moe_gemm_kernel, types, const, 2, 4).asm["ttgir"]
                widths.append("/".join(sorted(set(re.findall(r"kWidth = (\d+)", ttgir)))))
            print("kwidth", name, "gate_up" if gate_up else "down", *widths)
    # row-tiled pools (nb8t, nvfp4t): the tiled addressing, whole-tile and half-tile K steps (the
    # interpreter accepts what the compiler may not)
    for fmt, name in ((m.FMT_W2, "w2"), (m.FMT_FP4, "fp4")):
        for gate_up, bkh in ((True, 32), (False, 64), (False, 16)):
            n, k = (2048, 7168) if gate_up else (7168, 2048)
            types = dict(x_ptr="*bf16", wq_ptr="*i16", sc_ptr="*u8", s2_ptr="*fp32", sorted_ptr="*i32",
                         bslot_ptr="*i32", out_ptr="*fp32", s_x="i32", s_wq_slot="i32", s_sc_slot="i32",
                         limit="fp32", P="i32")
            const = dict(N=n, K=k, TOPK=8, GATE_UP=gate_up, FMT=fmt, SPLIT_K=2, HAS_LIMIT=gate_up, USE_ASM=2, BM=1,
                         BN=32, BKH=bkh, PDL=True, UNROLL=1, TILED=True)
            c = _compile(g._moe_gemm_kernel, types, const, 2, 4)
            print("gemm-tiled", name, "gate_up" if gate_up else "down", bkh, "cubin bytes", len(c.asm["cubin"]))
        # and a prefill tile (BM 64, BN 128, the SwiGLU epilogue writing act)
        types = dict(x_ptr="*bf16", wq_ptr="*i16", sc_ptr="*u8", s2_ptr="*fp32", sorted_ptr="*i32", bslot_ptr="*i32",
                     out_ptr="*bf16", s_x="i32", s_wq_slot="i32", s_sc_slot="i32", limit="fp32", P="i32")
        const = dict(N=2048, K=7168, TOPK=8, GATE_UP=True, FMT=fmt, SPLIT_K=1, HAS_LIMIT=True, USE_ASM=2, BM=64,
                     BN=128, BKH=32, PDL=False, UNROLL=1, TILED=True)
        c = _compile(g._moe_gemm_kernel, types, const, 8, 3)
        print("gemm-tiled", name, "prefill gate_up 32", "cubin bytes", len(c.asm["cubin"]))
        # two MMA chains a step (GemmConfig.chains 2) on the tiled decode tile of the table at T = 1:
        # gate/up with its gate and up dots alternating, down with even / odd slots apart; both
        # compile with the inline-asm decoders
        types = dict(types, out_ptr="*fp32")
        const = dict(const, SPLIT_K=2, BM=1, BN=32, PDL=True, CHAINS=2)
        c = _compile(g._moe_gemm_kernel, types, const, 2, 4)
        print("gemm-chains2", name, "gate_up", "cubin bytes", len(c.asm["cubin"]))
        const = dict(const, N=7168, K=2048, GATE_UP=False, HAS_LIMIT=False, SPLIT_K=1)
        c = _compile(g._moe_gemm_kernel, types, const, 2, 4)
        print("gemm-chains2", name, "down", "cubin bytes", len(c.asm["cubin"]))
        # tiles that divide the GEMM (EVEN_K / EVEN_N: constant masks), what the launcher picks at
        # these shapes: gate/up split in two and down, the table's T = 1 tiles
        for gu, n_, k_, split in ((True, 2048, 7168, 2), (False, 7168, 2048, 1)):
            even = dict(const, N=n_, K=k_, GATE_UP=gu, HAS_LIMIT=gu, SPLIT_K=split, CHAINS=1, EVEN_K=True,
                        EVEN_N=True)
            c = _compile(g._moe_gemm_kernel, types, even, 2, 4)
            print("gemm-even", name, "gate_up" if gu else "down", "cubin bytes", len(c.asm["cubin"]))
        # the down GEMM with its L2 prefetch before the PDL wait (MoEConfig.down_prefetch)
        const = dict(const, CHAINS=1, PREFETCH=8, PREFETCH_STEPS=2)
        ptx = _compile(g._moe_gemm_kernel, types, const, 2, 4).asm["ptx"]
        ok = 0 < ptx.find("prefetch.global.L2") < ptx.find("griddepcontrol.wait")
        print("gemm-prefetch", name, "before-wait" if ok else "missing")
    # the split gate/up with the SwiGLU finish in its last program per (tile, row block)
    for fmt, name in ((m.FMT_W2, "w2"), (m.FMT_FP4, "fp4")):
        types = dict(x_ptr="*bf16", wq_ptr="*i16", sc_ptr="*u8", s2_ptr="*fp32", sorted_ptr="*i32",
                     bslot_ptr="*i32", out_ptr="*fp32", act_ptr="*bf16", cnt_ptr="*i32",
                     s_x="i32", s_wq_slot="i32", s_sc_slot="i32", limit="fp32", P="i32")
        const = dict(N=2048, K=7168, TOPK=8, GATE_UP=True, FMT=fmt, SPLIT_K=2, HAS_LIMIT=True, USE_ASM=True,
                     BM=1, BN=32, BKH=32, PDL=True, FUSED_FINISH=True)
        ptx = _compile(g._moe_gemm_kernel, types, const, 2, 4).asm["ptx"]
        ok = "fence.acq_rel.gpu" in ptx and "atom.global.gpu.acq_rel.add" in ptx and "ld.global.cg" in ptx
        print("gemm-fused-finish", name, "handoff" if ok else "no-handoff")
        # the down GEMM with the top-k combine in its last program per (token, row block)
        types = dict(x_ptr="*bf16", wq_ptr="*i16", sc_ptr="*u8", s2_ptr="*fp32", sorted_ptr="*i32",
                     bslot_ptr="*i32", out_ptr="*fp32", act_ptr="*bf16", cnt_ptr="*i32", ids_ptr="*i64",
                     table_ptr="*i32", tw_ptr="*fp32", s_x="i32", s_wq_slot="i32", s_sc_slot="i32", limit="fp32",
                     P="i32")
        const = dict(N=7168, K=2048, TOPK=8, GATE_UP=False, FMT=fmt, SPLIT_K=1, HAS_LIMIT=False, USE_ASM=True,
                     BM=2, BN=32, BKH=32, PDL=True, FUSED_COMBINE=True)
        ptx = _compile(g._moe_gemm_kernel, types, const, 2, 4).asm["ptx"]
        ok = "fence.acq_rel.gpu" in ptx and "atom.global.gpu.acq_rel.add" in ptx and "ld.global.cg" in ptx
        print("gemm-fused-combine", name, "handoff" if ok else "no-handoff")
    c = _compile(moe_align_triton._prep_small_kernel,
                 dict(ids_ptr="*i64", table_ptr="*i32", sorted_ptr="*i32", bslot_ptr="*i32", nblk_ptr="*i32",
                      miss_ptr="*i64", P="i32", NB="i32", x_ptr="*bf16", xp_ptr="*bf16", s_x="i32"),
                 dict(H=7168, UPW=8, BH=2048, BM=16, PP=256, QB=32, FILL=1024, PDL=True))
    print("align", "cubin bytes", len(c.asm["cubin"]))
    c = _compile(g._swiglu_finish_kernel, dict(ws_ptr="*fp32", act_ptr="*bf16", ids_ptr="*i64", table_ptr="*i32",
                                               limit="fp32", P="i32"),
                 dict(I=2048, UPW=8, SPLIT_K=2, HAS_LIMIT=True, BI=1024, PDL=True))
    print("swiglu", "cubin bytes", len(c.asm["cubin"]))
    # gpt-oss: gate/up biases by expert id and the alpha activation, in the one-split epilogue, the
    # fused finish and the finish kernel (gpt-oss-120b: H 2880, I 2880, top-4)
    gu = dict(x_ptr="*bf16", wq_ptr="*i16", sc_ptr="*u8", s2_ptr="*fp32", sorted_ptr="*i32", bslot_ptr="*i32",
              act_ptr="*bf16", cnt_ptr="*i32", ids_ptr="*i64", table_ptr="*i32", tw_ptr="*fp32", s_x="i32",
              s_wq_slot="i32", s_sc_slot="i32", limit="fp32", P="i32")
    oss = dict(N=2880, K=2880, TOPK=4, GATE_UP=True, SPLIT_K=1, HAS_LIMIT=True, USE_ASM=2, BM=1, BN=32, BKH=32,
               PDL=True, HAS_BIAS=True, HAS_ALPHA=True)
    built = [_compile(g._moe_gemm_kernel, dict(gu, out_ptr="*bf16"), dict(oss, FMT=fmt), 2, 4)
             for fmt in (m.FMT_W2, m.FMT_FP4)]
    built.append(_compile(g._moe_gemm_kernel, dict(gu, out_ptr="*fp32"),
                          dict(oss, FMT=m.FMT_W2, SPLIT_K=2, FUSED_FINISH=True), 2, 4))
    built.append(_compile(g._swiglu_finish_kernel, dict(ws_ptr="*fp32", act_ptr="*bf16", ids_ptr="*i64",
                                                        table_ptr="*i32", limit="fp32", P="i32"),
                          dict(I=2880, UPW=8, SPLIT_K=2, HAS_LIMIT=True, BI=1024, PDL=True, HAS_BIAS=True,
                               HAS_ALPHA=True)))
    print("gpt-oss", *(len(c.asm["cubin"]) > 0 for c in built))
    c = _compile(g._combine_kernel, dict(ws_ptr="*fp32", ids_ptr="*i64", table_ptr="*i32", tw_ptr="*fp32",
                                         out_ptr="*bf16", P="i32"), dict(H=7168, TOPK=8, SPLIT_K=2, BH=1024, PDL=False))
    print("combine", "cubin bytes", len(c.asm["cubin"]))


if __name__ == "__main__":
    import sys
    main(quick="--quick" in sys.argv)
