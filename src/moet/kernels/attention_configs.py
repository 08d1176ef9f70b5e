"""Launch configurations of the Triton GQA paged decode (attention_triton.paged_decode_gqa), read
from a table in the repository (attention_configs.json beside this file) keyed by device name, KV
format and shape, and by batch size; written by hand from `attention_bench --quick` runs (each
entry's "source" says what was measured, docs/kernels.md how the table was chosen), as
moe_configs.json is for the MoE kernels. Devices, shapes or query dtypes the table lacks get
DEFAULT_GQA_DECODE: Triton's 4 warps and 3 stages, what every GPU ran before the table, and small
enough in shared memory (bf16, d 128, 64-token steps: 39 KB) for any GPU Triton supports.

What an entry may vary, and by what:
  num_warps sets the dots' and reductions' layouts, so it may change the last bits of a row: one
    value per (device, format, shape), never per batch -- a sequence's output must not depend on
    what else was scheduled in the same step (kernels/attention_ops.py).
  num_stages is only the depth of Triton's cp.async pipeline of the page loop (same math in the
    same order: bit-identical, which attention_bench checks on the GPU), so it may follow the
    batch size: deep pipelines win where each SM holds one program (batch 1 at 32K: 4 kv heads
    x 32 splits = 128 programs on 132 SMs), Triton's 3 where many programs per SM hide latency.

Table layout:
  {"version": 1,
   "devices": {"NVIDIA H200": {"gqa_decode": {"bf16 D128 T64": {"num_warps": 4,
                                                                 "num_stages": {"1": 7, "32": 3}}}}}}
Shape key (gqa_shape_key): the KV storage ("bf16", "fp16", "fp32", "fp8" per-tensor scales,
"fp8-block", "nvfp4"), the head dim and the tokens per loop step -- the shared memory of one pipeline stage
grows with both (sm_90 AOT, bf16 d 128, 64-token steps: 39 / 72 / 105 KB at 3 / 5 / 7 stages), so
an entry is never applied to a shape it was not measured at. Entries apply to bf16 queries (the
served tensor-core path); fp32 queries (the exactness tests) take DEFAULT_GQA_DECODE.
A lookup for batch B takes the largest measured batch <= B (the smallest when B is below them
all): between two measured points the smaller batch's depth, because a deeper pipeline than
needed cost little where it was measured (H200 bf16 batch 32: 7 stages a little under 3) while a
shallow one at few programs per SM cost a lot (batch 1: 3 stages far under 7).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from moet.kernels.launch_tables import read_table

TABLE_PATH = Path(__file__).with_name("attention_configs.json")


@dataclass(frozen=True, slots=True)
class GQALaunch:
    num_warps: int = 4
    num_stages: int = 3


DEFAULT_GQA_DECODE = GQALaunch(4, 3)


def gqa_shape_key(fmt, kv_dtype: torch.dtype, d: int, dv: int, step_tokens: int) -> str:
    """'bf16 D128 T64': KV storage, head dim (and value dim where it differs), tokens per step."""
    if fmt.is_nvfp4:
        kv = "nvfp4"
    elif fmt.block_scaled:
        kv = "fp8-block"
    elif fmt.is_fp8:
        kv = "fp8"
    else:
        kv = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(kv_dtype, str(kv_dtype))
    return f"{kv} D{d}" + (f" DV{dv}" if dv != d else "") + f" T{step_tokens}"


def load_table(path: str = str(TABLE_PATH)) -> dict:
    return read_table(path)


def lookup_gqa_decode(device_name: str, shape_key: str, batch: int, table: dict | None = None) -> GQALaunch:
    """The table's launch for this device, shape and batch size, else DEFAULT_GQA_DECODE."""
    table = load_table() if table is None else table
    entry = table.get("devices", {}).get(device_name, {}).get("gqa_decode", {}).get(shape_key)
    if not entry:
        return DEFAULT_GQA_DECODE
    stages = entry.get("num_stages", DEFAULT_GQA_DECODE.num_stages)
    if isinstance(stages, dict):
        sizes = sorted(int(b) for b in stages)
        pick = max((b for b in sizes if b <= batch), default=sizes[0])
        stages = stages[str(pick)]
    return GQALaunch(int(entry.get("num_warps", DEFAULT_GQA_DECODE.num_warps)), int(stages))
