"""The repository's JSON launch tables (moe_configs.json, attention_configs.json beside this file):
`{"version": 1, "devices": {device name: {...}}}`. A missing file reads as an empty table, so a
checkout without one runs every kernel on its defaults. device_name: the key the tables use."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=8)
def read_table(path: str) -> dict:
    p = Path(path)
    if not p.exists():
        return {"version": 1, "devices": {}}
    return json.loads(p.read_text())


@lru_cache(maxsize=None)
def device_shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one CUDA block may opt into (H100 / H200: 227 KiB, A100: 163 KiB,
    sm_86 / sm_89: 99 KiB); 0 for other devices."""
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block))


@lru_cache(maxsize=None)
def device_capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability ((9, 0) on an H100 / H200); (0, 0) for other devices."""
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else (0, 0)


@lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """A CUDA device's multiprocessors (132 on an H200); 0 for other devices."""
    return int(torch.cuda.get_device_properties(device).multi_processor_count) if device.type == "cuda" else 0


@lru_cache(maxsize=None)
def device_name(device: torch.device) -> str:
    """torch's name of a CUDA device ("NVIDIA H200"), else the device type ("cpu")."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
