"""Decoding a checkpoint parameter (its on-disk tensors) to a float tensor, and the default
per-parameter weight_loader. Routed experts do not come through here (see model/experts.py):
they are re-encoded for the expert pools instead of being decoded.
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


def default_weight_loader(param: torch.nn.Parameter, fmt: str, parts: dict[str, torch.Tensor], where: str) -> None:
    value = decode(fmt, parts, param.dtype, where)
    if tuple(value.shape) != tuple(param.shape):
        raise CheckpointError(f"{where}: shape {list(value.shape)} does not match the {list(param.shape)} "
                              "that config.json implies")
    param.data.copy_(value)
