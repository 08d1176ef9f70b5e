"""Which tensor-core instruction does each fp8 MMA form become on a given arch? (CPU, ptxas only)

  python3 tools/kernel_lab/ptx_w2/probe_wgmma.py

Assembles two one-instruction kernels and prints their MMA SASS lines:
  mma.sync m16n8k32 e4m3 (what gen_ptx.py emits)  -> sm_90a: F2FP.F16.E4M3.UNPACK_B + HMMA.16816 (emulated)
                                                    sm_89 / sm_120: QMMA.16832 (native)
  wgmma m64n8k32 e4m3 with A in registers           -> sm_90a: QGMMA.64x8x32 with a register A operand
The second is the native fp8 path on Hopper and the form the H200 kernel should take
(README.md, "Next step").
"""
from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_ptx  # noqa: E402

MMA_SYNC = """.version 8.7
.target {arch}
.address_size 64
.visible .entry k(.param .u64 p)
{{
  .reg .b32 a<4>, b<2>; .reg .f32 d<4>; .reg .b64 pp;
  ld.param.u64 pp, [p];
  ld.global.v4.u32 {{a0,a1,a2,a3}}, [pp];
  ld.global.v2.u32 {{b0,b1}}, [pp+16];
  mov.f32 d0, 0f00000000; mov.f32 d1, 0f00000000; mov.f32 d2, 0f00000000; mov.f32 d3, 0f00000000;
  mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {{d0,d1,d2,d3}}, {{a0,a1,a2,a3}}, {{b0,b1}}, {{d0,d1,d2,d3}};
  st.global.v4.f32 [pp], {{d0,d1,d2,d3}};
  ret;
}}
"""

WGMMA_REG_A = """.version 8.7
.target sm_90a
.address_size 64
.visible .entry k(.param .u64 p, .param .u64 q)
{
  .reg .b32 a<4>; .reg .f32 d<4>; .reg .b64 desc, pp;
  ld.param.u64 pp, [p];
  ld.global.v4.u32 {a0,a1,a2,a3}, [pp];
  ld.param.u64 desc, [q];
  mov.f32 d0, 0f00000000; mov.f32 d1, 0f00000000; mov.f32 d2, 0f00000000; mov.f32 d3, 0f00000000;
  wgmma.fence.sync.aligned;
  wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {d0,d1,d2,d3}, {a0,a1,a2,a3}, desc, 1, 1, 1;
  wgmma.commit_group.sync.aligned;
  wgmma.wait_group.sync.aligned 0;
  st.global.v4.f32 [pp], {d0,d1,d2,d3};
  ret;
}
"""


def mma_lines(ptx: str, arch: str) -> list[str]:
    cubin, _ = gen_ptx.assemble(ptx, arch)
    out = []
    for ln in gen_ptx.sass(cubin).splitlines():
        m = re.search(r"\*/\s+(.*?);", ln)
        if m and re.search(r"MMA|GMMA|F2FP|WARPGROUP", m.group(1)):
            out.append(m.group(1).strip())
    return out


def main():
    for arch in ("sm_90a", "sm_89", "sm_120"):
        print(f"mma.sync m16n8k32 e4m3 on {arch}:")
        for ln in mma_lines(MMA_SYNC.format(arch=arch), arch):
            print("   ", ln)
    print("wgmma m64n8k32 e4m3, A in registers, on sm_90a:")
    for ln in mma_lines(WGMMA_REG_A, "sm_90a"):
        print("   ", ln)


if __name__ == "__main__":
    main()
