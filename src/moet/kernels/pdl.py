"""Programmatic dependent launch (PDL, sm_90+) for the decode step's small Triton kernels.

A decode step at batch 1 is ~900 kernels, most of them a few microseconds long (norms, rotary,
the KV store, attention decode and its split merge, the router's GEMV and top-k): between two
dependent kernels the GPU drains the first, then launches and ramps up the second (under a
microsecond each, but over ~900 kernels a few percent of a GLM-4.5-Air step on the H200 is such
idle time; docs/kernels.md, PDL). Under PDL a kernel launched with
`launch_pdl` may start as soon as every program of the kernel before it has called
`gdc_launch_dependents`; it then blocks in `gdc_wait` until that kernel has finished and its
writes are visible. `pdl_enter` does both first thing, so a kernel never touches memory before its
predecessor is complete (and, transitively, everything before that): the same results, the launch
and ramp-up overlapped. The grouped MoE kernels take their PDL from their launch table
(MoEConfig.pdl); these small kernels from EngineConfig.kernels.small_kernel_pdl, set once per process
by the model runner (a launch option, like the Triton cache: not per engine) through
pdl_flag.py, which needs no Triton.
"""
from __future__ import annotations

import triton
import triton.language as tl

# the switch and the launch keywords live in pdl_flag (no Triton there: the CPU-only runtime sets it)
from moet.kernels.pdl_flag import pdl_launch, set_small_kernel_pdl, small_kernel_pdl  # noqa: F401


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait until the kernel before has finished and its writes are visible, then let the next
    kernel start launching, so its launch and setup overlap this kernel's work."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """An L2 prefetch of each pointer's line (prefetch.global.L2: a hint; no register written,
    nothing waits for it). Kernels issue it before their PDL wait, so their DRAM reads overlap the
    kernels before them. It cannot return stale data, even for bytes a running kernel still writes:
    L2 is where every SM's writes meet and a prefetch fills no L1 line and no register. Every
    pointer must be inside an allocation (clamp, do not mask: there is no mask)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\nmov.u32 $0, 0;", "=r,l", [ptrs.to(tl.int64, bitcast=True)],
                              dtype=tl.int32, is_pure=False, pack=1)
