"""Which dense linears keep a checkpoint's FP8 block-128 bytes (model/layers/linear.py
Fp8BlockLinear) instead of being decoded to the model dtype at load.

Automatic, no flag: on a CUDA device that has e4m3 (sm_89+: Ada, Hopper, Blackwell) with triton
installed, every dense Linear whose weight is stored as fp8_block is swapped for an
Fp8BlockLinear before loading (so the decoded bf16 copy never exists; the swap frees the bf16
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
from moet.model.layers.linear import Fp8BlockLinear, Linear

# "w8a8" is how DeepSeek-V3 was trained and how vLLM / SGLang serve FP8 checkpoints, and it
# feeds e4m3 straight to the FP8 tensor cores (2x bf16 in prefill); moet.bench.fp8_gemm_bench
# measures both modes at decode and prefill shapes.
DEFAULT_MODE = "w8a8"
KEEP_DECODED = ("kv_b_proj",)


def available(device: torch.device | str) -> bool:
    """Whether `device` can run the FP8 kernel."""
    device = torch.device(device)
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_linear_names(ckpt: Checkpoint) -> set[str]:
    """Canonical module names ('model.layers.0.self_attn.q_a_proj', ...) of the parameters the
    checkpoint stores as fp8_block (routed experts included; they match no Linear)."""
    names = set()
    for disk_name in ckpt.reader.tensors:
        if disk_name.endswith(wf.FP8_SCALE):
            primary = wf.primary_name(disk_name)
            names.add(ckpt.spec.canonical_name(primary)[: -len(".weight")])
    return names


def use_fp8_linears(model: nn.Module, names: set[str], *, mode: str = DEFAULT_MODE,
                    backend: str = "triton") -> int:
    """Replace each Linear named in `names` (but KEEP_DECODED) by an Fp8BlockLinear on the same
    device; returns how many were replaced. Call before loading the weights."""
    swapped = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear) or name not in names or name.endswith(KEEP_DECODED):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        out_features, in_features = module.weight.shape
        with torch.device(module.weight.device):
            new = Fp8BlockLinear(in_features, out_features, module.bias is not None, module.weight.dtype,
                                 mode=mode, backend=backend)
        setattr(parent, child, new)
        swapped += 1
    return swapped
