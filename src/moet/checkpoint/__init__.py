"""Checkpoint directories: config -> ModelSpec, lazy tensor reader, weight format, identity.

    ckpt = open_checkpoint("/models/DeepSeek-V3")
    ckpt.spec.layer_kinds, ckpt.weight_format, ckpt.reader.get("model.norm.weight")

This package knows files and names, not numbers (decoding lives in moet.formats).
"""
from __future__ import annotations

from dataclasses import dataclass

from moet.checkpoint import weight_format as _wf
from moet.checkpoint.reader import CheckpointReader, TensorInfo
from moet.checkpoint.spec import FAMILIES, ModelSpec, check_against_weights, spec_from_config


@dataclass
class Checkpoint:
    path: str
    reader: CheckpointReader
    spec: ModelSpec
    weight_format: str  # "float" | "fp8_block" | "nvfp4" | "mxfp4"


def open_checkpoint(path: str) -> Checkpoint:
    reader = CheckpointReader.open(path)
    where = f"{reader.path}/config.json"
    spec = spec_from_config(reader.config, where)
    check_against_weights(spec, reader.tensors, where)
    fmt = _wf.detect(reader.config, reader.hf_quant_config, where)
    return Checkpoint(reader.path, reader, spec, fmt)


__all__ = ["Checkpoint", "CheckpointReader", "ModelSpec", "TensorInfo", "FAMILIES", "open_checkpoint",
           "spec_from_config"]
