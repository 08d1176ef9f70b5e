"""SwiGLU of the dense MLP / shared experts in one kernel: act = silu(g) * u, reading the fused
gate_up GEMV output [T, 2I] (g = [:, :I], u = [:, I:]) directly. In eager torch this is three
kernels at decode (chunk is a view; silu; mul), each a launch of its own inside a CUDA graph.

Same roundings as torch's F.silu(g) * u on the model dtype: silu in fp32 as torch's CUDA kernel
computes it, x / (1 + expf(-x)) (libdevice's expf, IEEE division), rounded to the model dtype;
then the product in fp32 rounded to the model dtype (a bf16 x bf16 product is exact in fp32, so
that is torch's bf16 mul). Roundings to bf16 are on the bits (kv_write_triton._bf16_rne) so the
interpreter twin in the CPU tests computes what the GPU does; under TRITON_INTERPRET=1 exp is
numpy's (no libdevice), which can differ from expf in the last fp32 bit.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from moet.kernels.kv_write_triton import _bf16_rne
from moet.kernels.norm_rope_triton import _round
from moet.kernels.router_triton import _exp


@triton.jit
def _swiglu_kernel(gu_ptr, out_ptr, I, s_gu, s_out, BLOCK: tl.constexpr, OUT_BF16: tl.constexpr,
                   ACCURATE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gu_ptr + t * s_gu + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * s_gu + I + cols, mask=m, other=0.0).to(tl.float32)
    e = _exp(-g, ACCURATE)
    a = _round(tl.math.div_rn(g, 1.0 + e), OUT_BF16, dtype)
    y = a * u
    if OUT_BF16:
        tl.store(out_ptr + t * s_out + cols, _bf16_rne(y), mask=m)
    else:
        tl.store(out_ptr + t * s_out + cols, y.to(dtype), mask=m)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (the fused gate/up output; unit last stride) -> silu(g) * u [..., I]."""
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"swiglu: last dim {two_i} is not even")
    i = two_i // 2
    x = gate_up.reshape(-1, two_i)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((*gate_up.shape[:-1], i), dtype=gate_up.dtype, device=gate_up.device)
    o2 = out.view(-1, i)
    block = min(1024, triton.next_power_of_2(max(i, 16)))
    if x.shape[0] and i:
        _swiglu_kernel[(x.shape[0], triton.cdiv(i, block))](
            x, o2, i, x.stride(0), o2.stride(0), BLOCK=block, OUT_BF16=gate_up.dtype == torch.bfloat16,
            ACCURATE=gate_up.is_cuda and os.environ.get("TRITON_INTERPRET") != "1", num_warps=4)
    return out
