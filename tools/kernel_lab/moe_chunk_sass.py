"""sm_90 AOT build of the chunked MoE decode kernel (moe_chunked_decode._moe_chunk_kernel) without a
GPU: registers, shared memory, spills and the longest loop's instruction count for candidate
configs at the DeepSeek-V3 / Qwen3 shapes (row-tiled pools, PDL on, constant masks).

    env -u TRITON_INTERPRET PYTHONPATH=.:src python tools/kernel_lab/moe_chunk_sass.py
"""
from __future__ import annotations

import argparse

from moet.kernels import moe_chunked_decode as cd
from tests.kernels.aot_compile import _compile, sass_report

TYPES = dict(x_ptr="*bf16", gq_ptr="*i16", gs_ptr="*u8", gs2_ptr="*fp32", dq_ptr="*i16", ds_ptr="*u8",
             ds2_ptr="*fp32", sorted_ptr="*i32", bslot_ptr="*i32", act_ptr="*bf16", y_ptr="*fp32", s_x="i32",
             s_gq="i32", s_gs="i32", s_dq="i32", s_ds="i32", limit="fp32", P="i32")


def build(fmt, h, i, bm, bc, bkh, bnd, dn_stages, warps, stages, chains=1):
    upw = 8 if fmt == 0 else 4
    const = dict(H=h, I=i, TOPK=8, FMT=fmt, HAS_LIMIT=False, USE_ASM=2, BM=bm, BC=bc, BKH=bkh, BND=bnd,
                 DN_STAGES=dn_stages, TILED=True, CHAINS=chains, EVEN_K=(h // upw) % bkh == 0, EVEN_C=i % bc == 0,
                 EVEN_H=h % bnd == 0, PDL=True)
    return _compile(cd._moe_chunk_kernel, TYPES, const, dict(num_warps=warps, num_stages=stages),
                    div16=("s_x", "s_gq", "s_gs", "s_dq", "s_ds"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="*", default=None,
                    help="fmt,bm,bc,bkh,bnd,dn_stages,warps,stages,chains (fmt 0 = W2, 1 = FP4)")
    args = ap.parse_args()
    cfgs = [tuple(int(v) for v in c.split(",")) for c in args.configs] if args.configs else [
        (0, 8, 128, 32, 128, 3, 4, 4, 1), (0, 8, 128, 32, 128, 3, 8, 4, 1), (0, 8, 128, 64, 128, 3, 8, 3, 1),
        (0, 8, 64, 32, 128, 3, 4, 4, 1), (0, 8, 128, 32, 256, 3, 8, 4, 2), (0, 1, 128, 32, 128, 3, 4, 4, 1),
        (1, 8, 128, 32, 128, 3, 8, 4, 1), (1, 4, 128, 64, 128, 3, 4, 3, 2)]
    for fmt, bm, bc, bkh, bnd, dns, warps, stages, chains in cfgs:
        try:
            r = sass_report(build(fmt, 7168, 2048, bm, bc, bkh, bnd, dns, warps, stages, chains))
            print(f"{'w2' if fmt == 0 else 'fp4'} BM {bm} C {bc} BKH {bkh} BND {bnd} dn_st {dns} w {warps} st {stages} "
                  f"ch {chains}: regs {r['regs']} smem {r['smem']} spills {r['spill_ops']} loop {r['loop_instrs']} mmas {r['loop_mmas']}",
                  flush=True)
        except Exception as exc:
            print(fmt, bm, bc, bkh, bnd, dns, warps, stages, chains, "FAILED", str(exc)[:300], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
