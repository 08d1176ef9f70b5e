"""Which dense linears keep a checkpoint's quantized bytes instead of being decoded to the model
dtype at load (model/layers/linear.py): FP8 block-128 weights as e4m3 + block scales
(Fp8BlockLinear), NVFP4 weights as e2m1 codes + e4m3 block-16 scales + scale_2 (Nvfp4Linear).

Automatic, no flag: on a CUDA device that can run the format's kernel (FP8: e4m3, sm_89+; NVFP4:
bf16 dots, sm_80+) with triton installed, every dense Linear whose weight is stored in that
format is swapped before loading (so the decoded bf16 copy never exists; the swap frees the bf16
tensor the model was built with, and the allocator reuses it for the expert pools). Elsewhere
(CPU, older GPUs) the weights are decoded as before.
Kept decoded even then: MLA's kv_b_proj, which absorbed attention reads as a float matrix.
"""
from __future__ import annotations

import importlib.util

import torch
from torch import nn

from moet.checkpoint import Checkpoint
from moet.checkpoint import weight_format as wf
from moet.model.layers.linear import Fp8BlockLinear, Linear, Nvfp4Linear

# "w8a8" is how DeepSeek-V3 was trained and how vLLM / SGLang serve FP8 checkpoints, and it
# feeds e4m3 straight to the FP8 tensor cores (2x bf16 in prefill); moet.bench.fp8_gemm_bench
# measures both modes at decode and prefill shapes.
DEFAULT_MODE = "w8a8"
KEEP_DECODED = wf.KEEP_DECODED
FORMATS = wf.KEPT_DENSE_FORMATS
_MIN_CAPABILITY = {"fp8_block": (8, 9), "nvfp4": (8, 0)}
_SCALE_SUFFIX = {"fp8_block": wf.FP8_SCALE, "nvfp4": wf.NVFP4_SCALE_2}


def available(fmt: str, device: torch.device | str) -> bool:
    """Whether `device` can run the kernel of dense weights stored as `fmt` (False for other formats)."""
    device = torch.device(device)
    if fmt not in FORMATS or device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.get_device_capability(device) >= _MIN_CAPABILITY[fmt]


def kept_linear_names(ckpt: Checkpoint, fmt: str) -> set[str]:
    """Canonical module names ('model.layers.0.self_attn.q_a_proj', ...) of the parameters the
    checkpoint stores as `fmt` (routed experts included; they match no Linear)."""
    names = set()
    for disk_name in ckpt.reader.tensors:
        if disk_name.endswith(_SCALE_SUFFIX[fmt]):
            primary = wf.primary_name(disk_name)
            names.add(ckpt.spec.canonical_name(primary)[: -len(".weight")])
    return names


def use_kept_linears(model: nn.Module, names: set[str], fmt: str, *, mode: str = DEFAULT_MODE,
                     backend: str = "triton") -> int:
    """Replace each Linear named in `names` (but KEEP_DECODED) by the `fmt` Linear on the same
    device (mode: FP8's activation mode); returns how many were replaced. Call before loading."""
    if fmt not in FORMATS:
        raise ValueError(f"kept dense format {fmt!r}; expected one of {FORMATS}")
    swapped = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear) or name not in names or name.endswith(KEEP_DECODED):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        out_features, in_features = module.weight.shape
        with torch.device(module.weight.device):
            if fmt == "fp8_block":
                new = Fp8BlockLinear(in_features, out_features, module.bias is not None, module.weight.dtype,
                                     mode=mode, backend=backend)
            else:
                new = Nvfp4Linear(in_features, out_features, module.bias is not None, module.weight.dtype,
                                  backend=backend)
        setattr(parent, child, new)
        swapped += 1
    return swapped
