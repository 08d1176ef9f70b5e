"""Dense linear layers.

Checkpoint precision is kept where the device allows: BF16 weights load as is. On a GPU, FP8
block-128 weights (sm_89+) stay e4m3 + block scales in an `Fp8BlockLinear` (moet.kernels.
fp8_gemm_triton: half the bytes of bf16 per decode step) and NVFP4 weights (sm_80+) stay codes +
scales in an `Nvfp4Linear` (moet.kernels.nvfp4_gemm_triton: 0.28x); model/kept_dense.py decides
which Linears are swapped before loading. On CPU both are decoded once at load (moet.quant.decode).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moet.errors import CheckpointError
from moet.formats._checks import require_finite
from moet.kernels.fp8_gemm_reference import MODES as FP8_MODES

FP8_BLOCK = 128


def _onednn_packing() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        # CPU, bf16: the weight in oneDNN's blocked layout, made once (pack_for_cpu). F.linear on a
        # bf16 CPU weight runs the same oneDNN matmul but re-lays the plain weight out at every
        # call, which is most of a small decode GEMV's time; packed, the results are the same bits.
        self.cpu_packed: torch.Tensor | None = None

    def pack_for_cpu(self) -> bool:
        """Pack a bf16 CPU weight for oneDNN (see cpu_packed), where this torch has the ops and the
        packed matmul gives F.linear's bits on a probe input. -> packed?"""
        w = self.weight
        if w.dtype != torch.bfloat16 or w.is_cuda or not _onednn_packing():
            return False
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1)
            x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)
            if not torch.equal(torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], ""),
                               F.linear(x, w, self.bias)):
                return False
        except RuntimeError:
            return False
        self.cpu_packed = packed
        self.forward = self._forward_packed      # this instance only: other Linears keep F.linear
        return True

    def _forward_packed(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.bfloat16 and not x.is_cuda:
            return torch.ops.mkldnn._linear_pointwise(x, self.cpu_packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def fuse_linears(linears: list[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One stacked weight (and bias) for Linears that read the same input, so one GEMV replaces
    several (decode steps are launch-bound). Each Linear's parameters become views into the
    stacked tensors: nothing is stored twice, named_parameters() is unchanged, and in-place
    writes through either name land in both. Call after loading, on the final device (a later
    .to() would split the views). None when any is not a plain Linear (e.g. Fp8BlockLinear)."""
    if any(type(m) is not Linear for m in linears) or len({m.bias is None for m in linears}) != 1:
        return None
    w = torch.cat([m.weight.data for m in linears])
    b = torch.cat([m.bias.data for m in linears]) if linears[0].bias is not None else None
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = w[row:row + n]
        if b is not None:
            m.bias.data = b[row:row + n]
        row += n
    return w, b


class Fp8BlockLinear(nn.Module):
    """y = x @ W^T (+ bias) with W kept as the checkpoint stores it: weight e4m3 [N, K] and
    weight_scale_inv fp32 [ceil(N/128), ceil(K/128)] (a buffer, loaded with the weight).
    mode: "w8a8" (activations quantized per token per 128-group, as DeepSeek-V3 runs) or
    "w8a16" (activations as they are); see moet.kernels.fp8_gemm_reference for the numerics.
    backend: "triton" (the GPU kernel; on CPU only under TRITON_INTERPRET, for tests) or
    "reference" (the torch reference of the same math)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, *,
                 mode: str = "w8a8", backend: str = "triton"):
        super().__init__()
        if mode not in FP8_MODES or backend not in ("triton", "reference"):
            raise ValueError(f"Fp8BlockLinear mode {mode!r} / backend {backend!r}")
        self.mode, self.backend = mode, backend
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn),
                                   requires_grad=False)
        self.weight.weight_loader = self._load
        nb, kb = -(-out_features // FP8_BLOCK), -(-in_features // FP8_BLOCK)
        self.register_buffer("weight_scale_inv", torch.empty(nb, kb, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    def _load(self, param: nn.Parameter, fmt: str, parts: dict[str, torch.Tensor], where: str) -> None:
        """The loader's weight_loader hook: copy the e4m3 bytes and the scales as they are."""
        if fmt != "fp8_block":
            raise CheckpointError(f"{where}: stored as {fmt}, but this layer was set up for FP8 block-128 "
                                  "(the checkpoint mixes formats for one parameter?)")
        w, s = parts["weight"], parts["weight_scale_inv"]
        if w.dtype != torch.float8_e4m3fn or tuple(w.shape) != tuple(param.shape) \
                or s.dtype != torch.float32 or tuple(s.shape) != tuple(self.weight_scale_inv.shape):
            raise CheckpointError(f"{where}: FP8 weight {w.dtype} {list(w.shape)} / scales {s.dtype} "
                                  f"{list(s.shape)} do not match e4m3 {list(param.shape)} / float32 "
                                  f"{list(self.weight_scale_inv.shape)}")
        require_finite(s, f"{where} weight_scale_inv")
        param.data.copy_(w)
        self.weight_scale_inv.copy_(s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "triton":
            from moet.kernels.fp8_gemm_triton import fp8_block_gemm_triton as gemm
        else:
            from moet.kernels.fp8_gemm_reference import fp8_block_gemm_reference as gemm
        return gemm(x, self.weight, self.weight_scale_inv, mode=self.mode, bias=self.bias)


class Nvfp4Linear(nn.Module):
    """y = x @ W^T (+ bias) with W kept as modelopt's NVFP4 stores it: weight uint8 [N, K/2] (two
    e2m1 codes a byte), weight_scale e4m3 [N, K/16] and weight_scale_2 fp32 [] (buffers, loaded
    with the weight); the numerics in moet.kernels.nvfp4_gemm_reference (W4A16: the checkpoint's
    input_scale is not used). backend: "triton" (the GPU kernel; on CPU only under
    TRITON_INTERPRET, for tests) or "reference" (the torch reference of the same math)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, *,
                 backend: str = "triton"):
        super().__init__()
        if backend not in ("triton", "reference") or in_features % 16:
            raise ValueError(f"Nvfp4Linear backend {backend!r} / in_features {in_features} (a multiple of 16)")
        self.backend = backend
        self.weight = nn.Parameter(torch.empty(out_features, in_features // 2, dtype=torch.uint8), requires_grad=False)
        self.weight.weight_loader = self._load
        self.weight.logical_shape = (out_features, in_features)      # what the loader checks the checkpoint against
        self.register_buffer("weight_scale", torch.empty(out_features, in_features // 16, dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale_2", torch.empty((), dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    def _load(self, param: nn.Parameter, fmt: str, parts: dict[str, torch.Tensor], where: str) -> None:
        """The loader's weight_loader hook: copy codes and scales as they are."""
        if fmt != "nvfp4":
            raise CheckpointError(f"{where}: stored as {fmt}, but this layer was set up for NVFP4 "
                                  "(the checkpoint mixes formats for one parameter?)")
        w, s, s2 = parts["weight"], parts["weight_scale"], parts["weight_scale_2"]
        if w.dtype != torch.uint8 or tuple(w.shape) != tuple(param.shape) or s.dtype != torch.float8_e4m3fn \
                or tuple(s.shape) != tuple(self.weight_scale.shape) or s2.numel() != 1:
            raise CheckpointError(f"{where}: NVFP4 weight {w.dtype} {list(w.shape)} / scales {s.dtype} "
                                  f"{list(s.shape)} / scale_2 {list(s2.shape)} do not match uint8 "
                                  f"{list(param.shape)} / e4m3 {list(self.weight_scale.shape)} / one float32")
        require_finite(s.float(), f"{where} weight_scale")
        require_finite(s2.float(), f"{where} weight_scale_2")
        param.data.copy_(w)
        self.weight_scale.copy_(s)
        self.weight_scale_2.copy_(s2.reshape(()).float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "triton":
            from moet.kernels.nvfp4_gemm_triton import nvfp4_gemm_triton as gemm
        else:
            from moet.kernels.nvfp4_gemm_reference import nvfp4_gemm_reference as gemm
        return gemm(x, self.weight, self.weight_scale, self.weight_scale_2, bias=self.bias)


class MLP(nn.Module):
    """SwiGLU MLP (dense layers and shared experts): down(silu(gate(x)) * up(x)); with swiglu_limit
    (DeepSeek-V4) gate clamped from above and up to +-limit first, as the routed experts."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, swiglu_limit: float | None = None):
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.gate_proj = Linear(hidden, intermediate, False, dtype)
        self.up_proj = Linear(hidden, intermediate, False, dtype)
        self.down_proj = Linear(intermediate, hidden, False, dtype)
        self.gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None     # fuse_gate_up()

    def fuse_gate_up(self) -> bool:
        """gate and up as one GEMV (fuse_linears). -> fused?"""
        if self.gate_up is None:
            self.gate_up = fuse_linears([self.gate_proj, self.up_proj])
        return self.gate_up is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu_limit is not None:
            lim = self.swiglu_limit
            g, u = self.gate_proj(x).clamp(max=lim), self.up_proj(x).clamp(-lim, lim)
            return self.down_proj(F.silu(g) * u)
        if self.gate_up is not None:
            gu = F.linear(x, *self.gate_up)
            if gu.is_cuda:          # silu and the product in one kernel (torch's roundings)
                from moet.kernels.swiglu_triton import swiglu
                return self.down_proj(swiglu(gu))
            g, u = gu.chunk(2, dim=-1)
            return self.down_proj(F.silu(g) * u)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
