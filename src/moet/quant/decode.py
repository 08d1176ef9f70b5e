"""Decoding a checkpoint parameter (its on-disk tensors, in one checkpoint weight format) to its
float values. The model's loader decodes dense weights with it; routed experts are re-encoded
for the expert pools instead (quant/requantize.py), which decodes with it only where the target
format cannot take the checkpoint's bytes as they are.
"""
from __future__ import annotations

import torch

from moet.errors import CheckpointError
from moet.formats import fp8_block, mxfp4, nvfp4


def decode(fmt: str, parts: dict[str, torch.Tensor], dtype: torch.dtype, name: str) -> torch.Tensor:
    """On-disk tensors of one parameter -> its values in `dtype`.
    fp8_block / nvfp4 / mxfp4 decode through float64 (exact) and round once to `dtype`.
    Memory: an NVFP4 dense weight becomes dtype-sized (bf16: 4x its on-disk bytes)."""
    if fmt == "float":
        return parts["weight"].to(dtype)
    if fmt == "fp8_block":
        return fp8_block.dequantize(parts["weight"], parts["weight_scale_inv"], dtype=torch.float64, name=name).to(dtype)
    if fmt == "nvfp4":
        return nvfp4.dequantize(parts["weight"], parts["weight_scale"], parts["weight_scale_2"],
                                dtype=torch.float64, name=name).to(dtype)
    if fmt == "mxfp4":
        return mxfp4.dequantize(parts["blocks"], parts["scales"], dtype=torch.float64, name=name).to(dtype)
    raise CheckpointError(f"{name}: unknown weight format {fmt}")

