"""Hand-offs between the programs of one launch (GPU-wide counters), shared by the kernels whose
programs pass work to each other: the grouped MoE's fused SwiGLU finish and fused top-k combine
(moe_gemm) and the fused split merge of the paged decode (attention_triton, fused_merge).

Memory ordering: a producer's stores, then fence.acq_rel.gpu in every thread, a CTA barrier and
the atomic (signal); a consumer's acquire atomic (or the producer-side atomic's result), the fence
and a barrier (acquired), then loads that bypass L1 (.cg: other SMs wrote the data during this
launch). Under the interpreter programs run one after another: the fences compile to nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

COUNTERS = 1 << 16                   # ints in each counter buffer
_buffers: dict[tuple[str, torch.device], torch.Tensor] = {}


def device_counters(user: str, device: torch.device) -> torch.Tensor:
    """int32 [COUNTERS], one buffer per (kernel family, device), zero between launches: each
    launch's last programs re-zero the counters they used, so consecutive layers and CUDA-graph
    replays need no memset. Made on the first call, which CUDA-graph warm-up runs before capture."""
    buf = _buffers.get((user, device))
    if buf is None:
        buf = _buffers[(user, device)] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return buf


@triton.jit
def gpu_fence(USE_ASM: tl.constexpr):
    """fence.acq_rel.gpu in every thread (the interpreter runs one program at a time: nothing to order)."""
    if USE_ASM:
        tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def signal(ptr, USE_ASM: tl.constexpr):
    """This program's stores before it, visible GPU-wide, then ptr += 1; returns the old value."""
    gpu_fence(USE_ASM)
    tl.debug_barrier()
    return tl.atomic_add(ptr, 1, sem="acq_rel")


@triton.jit
def acquired(USE_ASM: tl.constexpr):
    """After an atomic that observed the producers' signals: their stores visible to every thread."""
    gpu_fence(USE_ASM)
    tl.debug_barrier()

