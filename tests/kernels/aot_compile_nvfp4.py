"""Compile the nvfp4 KV paths of the attention kernels for sm_90 without a GPU (Triton AOT, the
ptxas shipped with triton): the interpreter accepts what the compiler may reject (the nibble join
and reshapes of attention_triton._nvfp4_tile, the e2m1 bit tricks, the write's e4m3 rounding).

    python -m tests.kernels.aot_compile_nvfp4      (TRITON_INTERPRET must be unset)
Run by test_kv_nvfp4_compiles.py in a subprocess; prints one line per kernel with its shared
memory and spill count. Shapes: Qwen3-30B-A3B's GQA (8 q heads a kv head, d 128) and DeepSeek-V3's
MLA (128 heads, R 512, P 64), pages of 16, bf16 queries, the launchers' default forms.
"""
from __future__ import annotations

from moet.kernels import attention_triton as at
from moet.kernels import kv_write_triton as kw
from moet.kernels import mla_decode_triton as md
from moet.kernels import mla_prefill_triton as mp
from moet.kernels import prefill_triton as pt
from tests.kernels.aot_compile import GQA_DIV16, _compile, sass_report

NVFP4 = at._SCALE_NVFP4
SMEM = 227 * 1024


def _report(name: str, c) -> None:
    r = sass_report(c)
    assert c.metadata.shared <= SMEM, (name, c.metadata.shared)
    print(name, "smem", c.metadata.shared, "regs", r["regs"], "spill ops", r["spill_ops"])


def main() -> None:
    i64 = {n: "i64" for n in ("s_kb", "s_vb", "ss_kb", "ss_vb", "s_lb", "s_rb", "ss_b")}
    gqa_types = dict(i64, q_ptr="*bf16", k_ptr="*u8", v_ptr="*u8", ks_ptr="*fp8e4nv", vs_ptr="*fp8e4nv",
                     bt_ptr="*i32", lens_ptr="*i32", acc_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32",
                     s2_ptr="*fp32", scale="fp32")
    const = dict(G=8, BLOCK_G=16, D=128, BLOCK_D=128, DV=128, BLOCK_DV=128, BLOCK_SIZE=16, MAX_SPLITS=32, WINDOW=0,
                 SCALE_KIND=NVFP4, GROUP_K=128, GROUP_V=128, BF16_DOT=True, INTERPRET=False, PAGES=4, OP_F16=False,
                 **at._merge_blocks(32, 128))
    _report("gqa split nvfp4", _compile(at._gqa_decode_split_kernel, gqa_types, const, div16=GQA_DIV16))
    _report("gqa split nvfp4 swap_ab", _compile(at._gqa_decode_split_kernel, gqa_types, dict(const, SWAP_AB=True),
                                                div16=GQA_DIV16))
    rows, warps, stages = pt.prefill_launch(True, 128)
    pconst = dict(G=8, BLOCK_G=8, BLOCK_M=rows // 8, D=128, BLOCK_D=128, DV=128, BLOCK_DV=128, BLOCK_SIZE=16,
                  BLOCK_N=pt.PREFILL_BLOCK_N, WINDOW=0, SCALE_KIND=NVFP4, GROUP_K=128, GROUP_V=128, INTERPRET=False,
                  BF16_DOT=True)
    ptypes = dict(gqa_types, cu_ptr="*i32", out_ptr="*bf16")
    _report("gqa prefill nvfp4", _compile(pt._gqa_prefill_kernel, ptypes, pconst,
                                          dict(num_warps=warps, **({"num_stages": stages} if stages else {}))))
    mtypes = dict(i64, ql_ptr="*bf16", qr_ptr="*bf16", lat_ptr="*u8", rope_ptr="*fp8e4nv", ls_ptr="*fp8e4nv",
                  bt_ptr="*i32", lens_ptr="*i32", acc_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", s2_ptr="*fp32",
                  scale="fp32")
    mconst = dict(H=128, BLOCK_H=md.MLA_BLOCK_H, R=512, BLOCK_R=512, P=64, BLOCK_P=64, BLOCK_N=md.MLA_HM_BLOCK_N,
                  BLOCK_SIZE=16, MAX_SPLITS=32, SCALE_KIND=NVFP4, GROUP=128, NG=4, BF16_DOT=True, INTERPRET=False,
                  HEADS_M=True, SLACK=0.0)
    launch = dict(num_warps=md.MLA_NUM_WARPS, num_stages=md.MLA_NUM_STAGES)
    div = ("s_qlb", "s_qlh", "s_qrb", "s_qrh", "s_lb", "s_lt", "s_btb", "pages_min")
    _report("mla split nvfp4 heads-M", _compile(md._mla_decode_split_kernel, mtypes, mconst, launch, div16=div))
    _report("mla split nvfp4 transposed", _compile(md._mla_decode_split_kernel, mtypes,
                                                   dict(mconst, HEADS_M=False, BLOCK_N=md.MLA_BLOCK_N), launch))
    mp_types = dict(mtypes, cu_ptr="*i32", out_ptr="*bf16")
    mp_const = {k: v for k, v in mconst.items() if k != "MAX_SPLITS"}
    _report("mla prefill nvfp4 heads-M", _compile(mp._mla_prefill_kernel, mp_types, dict(mp_const, BLOCK_M=1),
                                                  launch))
    wtypes = dict(k_ptr="*bf16", v_ptr="*bf16", slot_ptr="*i64", kc_ptr="*u8", vc_ptr="*u8", ks_ptr="*fp8e4nv",
                  vs_ptr="*fp8e4nv", s2_ptr="*fp32")
    c = _compile(kw._store_nvfp4_kernel, wtypes, dict(CK=128, CV=128, BLOCK_B=8, PARTS=2))
    print("kv write nvfp4 gqa cubin bytes", len(c.asm["cubin"]))
    c = _compile(kw._store_nvfp4_kernel, wtypes, dict(CK=512, CV=512, BLOCK_B=32, PARTS=1))
    print("kv write nvfp4 mla cubin bytes", len(c.asm["cubin"]))


if __name__ == "__main__":
    main()
