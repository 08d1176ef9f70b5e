"""Compile the decode step's small Triton kernels for sm_90 without a GPU, with and without
programmatic dependent launch (moet.kernels.pdl), and print which griddepcontrol instructions
each one's PTX holds: under PDL both (wait, then launch_dependents) must be there, before any
other memory access; without, neither.

    python -m tests.kernels.aot_compile_small    (TRITON_INTERPRET must be unset)
Run by test_pdl.py in a subprocess; prints one line per kernel and setting.
"""
from __future__ import annotations

from moet.kernels import attention_triton as at
from moet.kernels import kv_write_triton as kv
from moet.kernels import norm_rope_triton as nr
from moet.kernels import router_triton as rt
from tests.kernels.aot_compile_moe import _compile

BF16, F32, I32, I64 = "*bf16", "*fp32", "*i32", "*i64"

GQA_TYPES = dict(q_ptr=BF16, k_ptr=BF16, v_ptr=BF16, ks_ptr=F32, vs_ptr=F32, bt_ptr=I32, lens_ptr=I32, acc_ptr=F32,
                 m_ptr=F32, l_ptr=F32, out_ptr=BF16, cnt_ptr=I32, scale="fp32")
GQA_CONST = dict(G=12, BLOCK_G=16, D=128, BLOCK_D=128, DV=128, BLOCK_DV=128, BLOCK_SIZE=16, MAX_SPLITS=32, WINDOW=0,
                 SCALE_KIND=0, GROUP_K=128, GROUP_V=128, BF16_DOT=True, INTERPRET=False, PAGES=4, OP_F16=False,
                 **at._merge_blocks(32, 128))

# (name, kernel, pointer / float types (others i32), constexprs) at GLM-4.5-Air's shapes
KERNELS = [
    ("rmsnorm", nr._rmsnorm_kernel,
     dict(x_ptr=BF16, x2_ptr=BF16, res_ptr=BF16, w_ptr=BF16, out_ptr=BF16, sum_ptr=BF16, eps="fp32"),
     dict(BLOCK=4096, HAS_RES=True, HAS_X2=True, OUT=1)),
    ("qk_norm_rope", nr._qk_norm_rope_kernel,
     dict(q_ptr=BF16, k_ptr=BF16, qw_ptr=BF16, kw_ptr=BF16, cos_ptr=BF16, sin_ptr=BF16, qo_ptr=BF16, ko_ptr=BF16,
          eps="fp32"),
     dict(D=128, RD=64, BLOCK=128, INTERLEAVE=False, HAS_NORM=True, OUT=1)),
    ("store_kv", kv._store_kv_kernel,
     dict(k_ptr=BF16, v_ptr=BF16, slot_ptr=I64, kc_ptr=BF16, vc_ptr=BF16, ks_ptr=F32, vs_ptr=F32),
     dict(CK=128, CHUNK_K=128, CV=128, CHUNK_V=128, BLOCK=128, KIND=0, OUT=1)),
    ("gqa_decode_split", at._gqa_decode_split_kernel, GQA_TYPES, dict(GQA_CONST, FUSED_MERGE=False)),
    ("gqa_decode_fused_merge", at._gqa_decode_split_kernel, GQA_TYPES, dict(GQA_CONST, FUSED_MERGE=True)),
    ("merge_splits", at._merge_splits_kernel,
     dict(acc_ptr=F32, m_ptr=F32, l_ptr=F32, lens_ptr=I32, out_ptr=BF16),
     dict(HQ=96, DV=128, BLOCK_DV=128, MAX_SPLITS=32, BLOCK_SIZE=16, **at._merge_blocks(32, 128))),
    ("router_gemv", rt._router_gemv_kernel, dict(x_ptr=BF16, w_ptr=F32, out_ptr=F32),
     dict(H=4096, E=128, BE=1, BK=4096, OUT_BF16=False)),
    ("router_topk", rt._router_kernel,
     dict(logits_ptr=F32, bias_ptr=F32, ids_ptr=I64, w_ptr=F32, scale="fp32"),
     dict(E=128, K=8, G=1, TOPK_GROUP=1, GP=1, GSP=128, KP=8, SIGMOID=True, NORM=True, HAS_BIAS=True,
          OUT_BF16=False, ACCURATE=True)),
]


def main() -> None:
    for name, fn, types, const in KERNELS:
        for pdl in (True, False):
            ptx = _compile(fn, types, {**const, "PDL": pdl}, num_warps=4, num_stages=2).asm["ptx"]
            body = ptx[ptx.index(".entry"):]
            wait, launch = body.find("griddepcontrol.wait"), body.find("griddepcontrol.launch_dependents")
            first_mem = min((i for i in (body.find("ld.global"), body.find("st.global")) if i >= 0), default=-1)
            order_ok = wait >= 0 and launch > wait and (first_mem < 0 or wait < first_mem)
            # the fused merge's hand-off: an acquire-release atomic, then L1-bypassing loads
            handoff = ("fence.acq_rel.gpu" in body and "atom.global.gpu.acq_rel.add" in body
                       and "ld.global.cg" in body)
            sync = ("acq-rel" if handoff else "-") if "fused_merge" in name else "n/a"
            print(name, "pdl" if pdl else "plain", "wait" if wait >= 0 else "-", "launch" if launch >= 0 else "-",
                  "wait-first" if order_ok else "-", sync)


if __name__ == "__main__":
    main()
