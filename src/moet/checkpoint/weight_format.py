"""Which number format a checkpoint stores its weights in, and how a linear weight's companion
tensors are named on disk.

Detected from config.json's `quantization_config` or modelopt's hf_quant_config.json:
  "float"      BF16 / FP16 / FP32 as is
  "fp8_block"  DeepSeek style: `X.weight` e4m3 [N, K] + `X.weight_scale_inv` fp32 [ceil(N/128), ceil(K/128)]
  "nvfp4"      modelopt: `X.weight` uint8 [N, K/2] + `X.weight_scale` e4m3 [N, K/16] + `X.weight_scale_2` fp32 []
  "mxfp4"      gpt-oss style: `X_blocks` uint8 [..., N, K/32, 16] + `X_scales` uint8 e8m0 [..., N, K/32]
A quantized checkpoint may keep some tensors in float (norms, router, lm_head, modules listed in
its exclude list); a tensor's own format is therefore decided per tensor from its dtype and the
companions present on disk (`tensor_format`), the checkpoint format only says what to expect.
"""
from __future__ import annotations

import re

from moet.errors import CheckpointError

FORMATS = ("float", "fp8_block", "nvfp4", "mxfp4")

# Companion suffixes, replacing ".weight" (or appended for mxfp4 parameter names).
FP8_SCALE = ".weight_scale_inv"
NVFP4_SCALE, NVFP4_SCALE_2, NVFP4_INPUT_SCALE = ".weight_scale", ".weight_scale_2", ".input_scale"
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
# Activation / KV calibration scalars some exporters add; weight-only inference ignores them.
IGNORED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale", ".q_scale", ".activation_scale")
# Dense weights a GPU keeps in their stored format (model/kept_dense.py), and the modules that
# are decoded even then (MLA's kv_b_proj: the absorbed attention reads it as a float matrix).
KEPT_DENSE_FORMATS = ("fp8_block", "nvfp4")
KEEP_DECODED = ("kv_b_proj",)
# Tensors some checkpoints carry that no computation needs (matched against canonical names).
IGNORED_NAMES = (re.compile(r"rotary_emb\.inv_freq$"),)


def detect(config: dict, hf_quant_config: dict | None, where: str) -> str:
    qc = config.get("quantization_config")
    if not qc and hf_quant_config:
        qc = {"quant_method": "modelopt", **(hf_quant_config.get("quantization") or {})}
    if not qc:
        return "float"
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is not None and list(block) != [128, 128]:
            raise CheckpointError(f"{where}: FP8 weight_block_size {block} is not supported (only [128, 128])")
        if block is None:
            raise CheckpointError(f"{where}: per-tensor FP8 (no weight_block_size) is not supported; "
                                  "supported quantizations: fp8 block-128, modelopt NVFP4, mxfp4")
        return "fp8_block"
    if method == "modelopt":
        algo = str(qc.get("quant_algo", "")).upper()
        if algo == "NVFP4":
            return "nvfp4"
        raise CheckpointError(f"{where}: modelopt quant_algo {algo or '(none)'} is not supported (only NVFP4)")
    if method == "mxfp4":
        return "mxfp4"
    raise CheckpointError(f"{where}: quantization {method or '(unnamed)'} is not supported; "
                          "supported: none (BF16/FP16), fp8 block-128, modelopt NVFP4, mxfp4")


def companions(param: str, fmt: str) -> dict[str, str]:
    """On-disk names of the tensors that make up parameter `param` (e.g. '...q_proj.weight')
    in format `fmt`, keyed by role."""
    if fmt == "float":
        return {"weight": param}
    if fmt == "fp8_block":
        return {"weight": param, "weight_scale_inv": param[: -len(".weight")] + FP8_SCALE}
    if fmt == "nvfp4":
        stem = param[: -len(".weight")]
        return {"weight": param, "weight_scale": stem + NVFP4_SCALE, "weight_scale_2": stem + NVFP4_SCALE_2}
    if fmt == "mxfp4":
        return {"blocks": param + MXFP4_BLOCKS, "scales": param + MXFP4_SCALES}
    raise ValueError(fmt)


def tensor_format(param: str, present) -> str:
    """The format parameter `param` is stored in, judged by which companion names exist in
    `present` (a container of on-disk names)."""
    if param + MXFP4_BLOCKS in present:
        return "mxfp4"
    if param.endswith(".weight"):
        stem = param[: -len(".weight")]
        if stem + FP8_SCALE in present:
            return "fp8_block"
        if stem + NVFP4_SCALE in present:
            return "nvfp4"
    return "float"


def logical_shape(fmt: str, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The decoded shape of a parameter in format `fmt`, from its on-disk tensors' header shapes
    (keyed by role, as `companions` names them)."""
    if fmt == "nvfp4":
        *lead, half = shapes["weight"]
        return (*lead, half * 2)
    if fmt == "mxfp4":
        *lead, groups, _ = shapes["blocks"]
        return (*lead, groups * 32)
    return tuple(shapes["weight"])


def primary_name(disk_name: str) -> str | None:
    """The parameter a companion tensor belongs to, or None if `disk_name` is itself a primary
    tensor. Ignored calibration scalars map to ''."""
    for suf in IGNORED_SUFFIXES:
        if disk_name.endswith(suf):
            return ""
    if disk_name.endswith(FP8_SCALE):
        return disk_name[: -len(FP8_SCALE)] + ".weight"
    if disk_name.endswith(NVFP4_SCALE_2):
        return disk_name[: -len(NVFP4_SCALE_2)] + ".weight"
    if disk_name.endswith(NVFP4_SCALE):
        return disk_name[: -len(NVFP4_SCALE)] + ".weight"
    if disk_name.endswith(MXFP4_SCALES):
        return disk_name[: -len(MXFP4_SCALES)] + MXFP4_BLOCKS
    return None
