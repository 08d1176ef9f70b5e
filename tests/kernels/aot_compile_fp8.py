"""Compile the FP8 block-128 GEMM kernels (moet.kernels.fp8_gemm_triton) for sm_90 without a GPU
(Triton AOT, the ptxas shipped with triton): the interpreter accepts what the compiler may reject
(fp8 dot operands, tf32 dots, casts).

    python -m tests.kernels.aot_compile_fp8      (TRITON_INTERPRET must be unset)
Run by test_fp8_gemm_compiles.py in a subprocess; prints one line per kernel.
"""
from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moet.kernels import fp8_gemm_triton as fg

TARGET = GPUTarget("cuda", 90, 32)


def _compile(fn, types: dict, const: dict, **opts):
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs), target=TARGET,
                          options=opts)


def main() -> None:
    w = dict(w_ptr="*fp8e4nv", ws_ptr="*fp32", bias_ptr="*bf16")
    # (A_MODE, activations, scales, out, config): decode split-K (fp32 partials) and prefill tiles
    decode = dict(BLOCK_M=16, BLOCK_N=64, SPLIT=8, KB_PER_SPLIT=7), dict(num_warps=4, num_stages=4)
    prefill = dict(BLOCK_M=128, BLOCK_N=128, SPLIT=1, KB_PER_SPLIT=56), dict(num_warps=8, num_stages=3)
    cases = [(0, "*bf16", "*bf16", "*fp32", *decode), (2, "*bf16", "*bf16", "*fp32", *decode),
             (1, "*fp8e4nv", "*fp32", "*bf16", *prefill), (0, "*bf16", "*bf16", "*bf16", *prefill)]
    for a_mode, a, a_s, c, tile, opts in cases:
        const = dict(tile, A_MODE=a_mode, DOT_IEEE=False, HAS_BIAS=tile["SPLIT"] == 1, BLOCK_K=128, GROUP_M=8)
        k = _compile(fg._fp8_gemm_kernel, dict(w, a_ptr=a, as_ptr=a_s, c_ptr=c), const, **opts)
        print("fp8 gemm", f"A_MODE {a_mode}", tile, "cubin bytes", len(k.asm["cubin"]))
    k = _compile(fg._act_quant_kernel, dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32"), dict(ROWS=8, BLOCK_K=128))
    print("act quant", "cubin bytes", len(k.asm["cubin"]))
    k = _compile(fg._split_sum_kernel, dict(p_ptr="*fp32", bias_ptr="*bf16", c_ptr="*bf16"),
                 dict(SPLIT=8, HAS_BIAS=True, BLOCK=1024))
    print("split sum", "cubin bytes", len(k.asm["cubin"]))


if __name__ == "__main__":
    main()
