"""Compile the paged attention kernels for sm_90 without a GPU (Triton AOT, ptxas shipped with
triton). The interpreter runs kernels as numpy and accepts things the compiler rejects (types
of loop-carried values, dot shapes, fp8 casts); this catches those on a CPU machine.

    python -m tests.kernels.aot_compile      (TRITON_INTERPRET must be unset)
Run by test_attention_triton_compiles.py in a subprocess; prints one line per kernel.
"""
from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moet.kernels import attention_triton as at
from moet.kernels import kv_write_triton as kw
from moet.kernels import mla_prefill_triton as mp
from moet.kernels import prefill_triton as pt

TARGET = GPUTarget("cuda", 90, 32)


def _compile(fn, types: dict, const: dict, options: dict | None = None):
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in fn.arg_names}
    # pointers 16-byte aligned, as the JIT specialises them at run time
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs), target=TARGET,
                          options=options)


def main() -> None:
    i64 = {n: "i64" for n in ("s_kb", "s_vb", "ss_kb", "ss_vb", "s_lb", "s_rb", "ss_b")}
    for kv, kind in (("*bf16", 0), ("*fp8e4nv", 1), ("*fp8e4nv", 2)):
        # GLM-4.5-like: 96 q heads / 8 kv heads, head_dim 128, pages of 16, sliding window on the bf16 one
        const = dict(G=12, BLOCK_G=16, D=128, BLOCK_D=128, DV=128, BLOCK_DV=128, BLOCK_SIZE=16,
                     MAX_SPLITS=32, WINDOW=0 if kind else 4096, SCALE_KIND=kind,
                     GROUP_K=128, GROUP_V=128, BF16_DOT=True, INTERPRET=False, PAGES=4, OP_F16=bool(kind))
        types = dict(i64, q_ptr="*bf16", k_ptr=kv, v_ptr=kv, ks_ptr="*fp32", vs_ptr="*fp32", bt_ptr="*i32",
                     lens_ptr="*i32", acc_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", scale="fp32")
        c = _compile(at._gqa_decode_split_kernel, types, const)
        print("gqa split", kv, "scale kind", kind, "cubin bytes", len(c.asm["cubin"]))
        # the prefill/extend kernel, same model: 8 query tokens x 16 (12 used) heads = 128 rows per program
        const = dict(G=12, BLOCK_G=16, BLOCK_M=pt.PREFILL_ROWS // 16, D=128, BLOCK_D=128, DV=128, BLOCK_DV=128,
                     BLOCK_SIZE=16, BLOCK_N=pt.PREFILL_BLOCK_N, WINDOW=0 if kind else 4096, SCALE_KIND=kind,
                     GROUP_K=128, GROUP_V=128, INTERPRET=False, BF16_DOT=True)
        types = dict(i64, q_ptr="*bf16", k_ptr=kv, v_ptr=kv, ks_ptr="*fp32", vs_ptr="*fp32", bt_ptr="*i32",
                     cu_ptr="*i32", lens_ptr="*i32", out_ptr="*bf16", scale="fp32")
        c = _compile(pt._gqa_prefill_kernel, types, const, dict(num_warps=pt.PREFILL_NUM_WARPS))
        print("gqa prefill", kv, "scale kind", kind, "cubin bytes", len(c.asm["cubin"]))
        # DeepSeek-V3: R 512, P 64, MLA_BLOCK_H heads per program
        lat = "*bf16" if kind == 0 else "*fp8e4nv"
        rope = "*fp8e4nv" if kind == 1 else "*bf16"
        const = dict(H=128, BLOCK_H=at.MLA_BLOCK_H, R=512, BLOCK_R=512, P=64, BLOCK_P=64, BLOCK_N=at.MLA_BLOCK_N,
                     BLOCK_SIZE=16, MAX_SPLITS=32, SCALE_KIND=kind, GROUP=128, NG=4, BF16_DOT=True, INTERPRET=False)
        types = dict(i64, ql_ptr="*bf16", qr_ptr="*bf16", lat_ptr=lat, rope_ptr=rope, ls_ptr="*fp32",
                     bt_ptr="*i32", lens_ptr="*i32", acc_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", scale="fp32")
        # the launch options paged_decode_mla uses (warps, stages: shared memory and registers)
        c = _compile(at._mla_decode_split_kernel, types, const,
                     dict(num_warps=at.MLA_NUM_WARPS, num_stages=at.MLA_NUM_STAGES))
        # the H200's 227 KB of shared memory per block: over it the launch fails on the GPU only
        assert c.metadata.shared <= 227 * 1024, f"mla decode needs {c.metadata.shared} B of shared memory"
        print("mla split", lat, "scale kind", kind, "cubin bytes", len(c.asm["cubin"]), "smem", c.metadata.shared)
        # MLA prefill/extend, same shapes: 64 heads x 1 query token per program, the decode's launch
        const = dict(H=128, BLOCK_H=at.MLA_BLOCK_H, BLOCK_M=1, R=512, BLOCK_R=512, P=64, BLOCK_P=64,
                     BLOCK_N=at.MLA_BLOCK_N, BLOCK_SIZE=16, SCALE_KIND=kind, GROUP=128, NG=4, INTERPRET=False,
                     BF16_DOT=True)
        types = dict(i64, ql_ptr="*bf16", qr_ptr="*bf16", lat_ptr=lat, rope_ptr=rope, ls_ptr="*fp32",
                     bt_ptr="*i32", cu_ptr="*i32", lens_ptr="*i32", out_ptr="*bf16", scale="fp32")
        c = _compile(mp._mla_prefill_kernel, types, const,
                     dict(num_warps=at.MLA_NUM_WARPS, num_stages=at.MLA_NUM_STAGES))
        assert c.metadata.shared <= 227 * 1024, f"mla prefill needs {c.metadata.shared} B of shared memory"
        print("mla prefill", lat, "scale kind", kind, "cubin bytes", len(c.asm["cubin"]))
        # KV write of one part (a GQA head row of 128 / the MLA latent of 512), bf16 source
        dst = "*bf16" if kind == 0 else "*fp8e4nv"
        const = dict(C=128, CHUNK=128, BLOCK=128, KIND=kind, OUT=1 if kind == 0 else 0)
        types = dict(src_ptr="*bf16", slot_ptr="*i64", dst_ptr=dst, scale_ptr="*fp32", s_dst_slot="i64",
                     s_sc_slot="i64")
        c = _compile(kw._store_rows_kernel, types, const)
        print("kv write", dst, "scale kind", kind, "cubin bytes", len(c.asm["cubin"]))
    c = _compile(at._merge_splits_kernel, dict(acc_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", lens_ptr="*i32",
                                               out_ptr="*bf16"),
                 dict(HQ=96, DV=128, BLOCK_DV=128, MAX_SPLITS=32, BLOCK_SIZE=16))
    print("merge", "cubin bytes", len(c.asm["cubin"]))


if __name__ == "__main__":
    main()
