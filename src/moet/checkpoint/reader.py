"""Lazy, tensor-by-tensor access to a Hugging Face checkpoint directory.

What is read eagerly: config.json, generation_config.json, the shard index and every shard's
safetensors *header* (names, dtypes, shapes, offsets: a few KB per shard). Tensor data is read
only by `get(name)`, one tensor at a time through safetensors' safe_open. At most one shard
stays open (mmapped) at a time: a mapped page counts in the process' RSS once touched, so
keeping every shard open would grow RSS to the checkpoint's size while loading.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field

import torch

from moet.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# safetensors header dtype strings -> torch dtypes (only the ones checkpoints we read use).
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U8": torch.uint8, "I8": torch.int8,
    "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
}
if hasattr(torch, "float8_e8m0fnu"):
    ST_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu


# DeepSeek's own checkpoints (DeepSeek-V4) store a quantized weight's scales as `X.scale`: beside an
# e4m3 `X.weight` [N, K] they are FP8 block-128 scales [N/128, K/128] (UE8M0 or float32); beside an
# int8 `X.weight` [N, K/2] of packed e2m1 pairs (low nibble first) they are UE8M0 exponents
# [N, K/32], i.e. MXFP4. The reader presents them under the names of the formats moet reads
# (checkpoint/weight_format.py): X.weight_scale_inv (float32), or X.weight_blocks [N, K/32, 16] +
# X.weight_scales; the values are the same, only the names and views change.
DS_SCALE = ".scale"


def _e8m0_to_f32(t: torch.Tensor) -> torch.Tensor:
    """UE8M0 exponent bytes -> 2**(byte - 127) in float32 (exact; 255, NaN, stays NaN)."""
    b = t.view(torch.uint8).to(torch.int32)
    out = torch.ldexp(torch.ones_like(b, dtype=torch.float32), b - 127)
    return torch.where(b == 255, torch.full_like(out, float("nan")), out)


def _deepseek_scale_aliases(tensors: dict[str, "TensorInfo"]) -> dict[str, tuple["TensorInfo", str]]:
    """{presented name: (stored name, view)} for DeepSeek-style `.scale` weights; rewrites
    `tensors` to list the presented names in place of the stored ones."""
    aliases: dict[str, tuple[TensorInfo, str]] = {}
    for name in [n for n in tensors if n.endswith(DS_SCALE)]:
        stem = name[: -len(DS_SCALE)]
        weight = tensors.get(stem + ".weight")
        if weight is None:
            continue                               # a parameter called scale (a norm's), not a weight's
        scale = tensors[name]
        if weight.dtype == "F8_E4M3":
            presented = stem + ".weight_scale_inv"
            aliases[presented] = (scale, "f32")
            tensors[presented] = TensorInfo(presented, scale.file, "F32", scale.shape, 4 * math.prod(scale.shape))
        elif weight.dtype in ("I8", "U8") and len(weight.shape) == 2 and weight.shape[1] % 16 == 0:
            n, half = weight.shape
            blocks, scales = stem + ".weight_blocks", stem + ".weight_scales"
            aliases[blocks], aliases[scales] = (weight, "blocks"), (scale, "u8")
            tensors[blocks] = TensorInfo(blocks, weight.file, "U8", (n, half // 16, 16), weight.nbytes)
            tensors[scales] = TensorInfo(scales, scale.file, "U8", scale.shape, scale.nbytes)
            del tensors[stem + ".weight"]
        else:
            continue
        del tensors[name]
    return aliases


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    file: str                 # shard file name, relative to the checkpoint directory
    dtype: str                # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    nbytes: int


def read_header(path: str) -> tuple[dict[str, dict], int]:
    """A safetensors file's JSON header (without reading any tensor data) and the byte offset
    where its data section starts (tensor data_offsets are relative to it)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 * 2**20:
                raise CheckpointError(f"{path}: not a safetensors file (header length {n} is implausible)")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read safetensors header ({exc})") from exc
    header.pop("__metadata__", None)
    return header, 8 + n


def _load_json(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({exc})") from exc


@dataclass
class CheckpointReader:
    """Open with `CheckpointReader.open(path)`; `get(name)` reads one tensor."""

    path: str
    config: dict
    generation_config: dict
    hf_quant_config: dict | None
    tensors: dict[str, TensorInfo]             # every tensor of every shard, by name (as presented)
    shards: list[str]                          # shard file names in index order
    aliases: dict[str, tuple[TensorInfo, str]] = field(default_factory=dict)   # DeepSeek .scale views
    _open_file: str | None = field(default=None, repr=False)
    _handle: object = field(default=None, repr=False)

    @classmethod
    def open(cls, path: str) -> "CheckpointReader":
        from moet.checkpoint.resolve import resolve_checkpoint   # a directory, or a repo id in the HF cache
        path = os.path.abspath(resolve_checkpoint(path))
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise CheckpointError(f"{path}: config.json is missing (not a Hugging Face checkpoint directory?)")
        config = _load_json(cfg_path, "config.json")
        gen_path = os.path.join(path, "generation_config.json")
        generation_config = _load_json(gen_path, "generation_config.json") if os.path.isfile(gen_path) else {}
        hq_path = os.path.join(path, "hf_quant_config.json")
        hf_quant = _load_json(hq_path, "hf_quant_config.json") if os.path.isfile(hq_path) else None

        index_path = os.path.join(path, INDEX_FILE)
        if os.path.isfile(index_path):
            index = _load_json(index_path, INDEX_FILE)
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index_path}: has no weight_map")
            shards = list(dict.fromkeys(weight_map.values()))
        elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
            weight_map, shards = None, [SINGLE_FILE]
        else:
            raise CheckpointError(f"{path}: no {INDEX_FILE} and no {SINGLE_FILE} (no weights found)")

        tensors: dict[str, TensorInfo] = {}
        for shard in shards:
            shard_path = os.path.join(path, shard)
            if not os.path.isfile(shard_path):
                raise CheckpointError(f"{shard_path}: shard listed in {INDEX_FILE} is missing")
            size = os.path.getsize(shard_path)
            header, data_start = read_header(shard_path)
            for name, meta in header.items():
                begin, end = meta["data_offsets"]
                if data_start + end > size:
                    raise CheckpointError(f"{shard_path}: tensor {name} ends at byte {data_start + end} past the file's "
                                          f"end ({size}): truncated shard")
                if meta["dtype"] not in ST_DTYPES:
                    raise CheckpointError(f"{shard_path}: tensor {name} has unsupported dtype {meta['dtype']}")
                tensors[name] = TensorInfo(name, shard, meta["dtype"], tuple(meta["shape"]), end - begin)
        if weight_map is not None:
            for name, shard in weight_map.items():
                if name not in tensors or tensors[name].file != shard:
                    raise CheckpointError(f"{os.path.join(path, shard)}: tensor {name} is listed in "
                                          f"{INDEX_FILE} but not stored in that shard")
        aliases = _deepseek_scale_aliases(tensors)
        return cls(path, config, generation_config, hf_quant, tensors, shards, aliases=aliases)

    # ------------------------------------------------------------------ metadata

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: tensor {name} is missing from the checkpoint") from None

    def shard_names(self, shard: str) -> list[str]:
        return [n for n, t in self.tensors.items() if t.file == shard]

    def shard_bytes(self) -> dict[str, int]:
        return {s: os.path.getsize(os.path.join(self.path, s)) for s in self.shards}

    # ------------------------------------------------------------------ data

    def get(self, name: str, *, copy: bool = True) -> torch.Tensor:
        """One tensor. copy=True: a private copy, safe to keep. copy=False: a view of the mapped
        file (it keeps the mapping, and the shard's touched pages in RSS, alive while
        referenced); for a caller that consumes it at once (decode / copy into a parameter),
        saving one transient copy of the tensor."""
        if name in self.aliases:
            stored, view = self.aliases[name]
            t = self._read(stored)
            if view == "f32":           # FP8 block scales: UE8M0 bytes, or already float
                t = _e8m0_to_f32(t) if t.element_size() == 1 else t.float()
            else:                       # MXFP4 views of packed e2m1 bytes and UE8M0 exponents
                t = t.view(torch.uint8).reshape(self.tensors[name].shape)
            return t.clone() if copy else t
        t = self._read(self.info(name))
        return t.clone() if copy else t

    def _read(self, info: TensorInfo) -> torch.Tensor:
        from safetensors import safe_open

        if self._open_file != info.file:
            self.close()
            self._handle = safe_open(os.path.join(self.path, info.file), framework="pt")
            self._open_file = info.file
        try:
            t = self._handle.get_tensor(info.name)
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"{os.path.join(self.path, info.file)}: cannot read tensor {info.name} ({exc})") from exc
        if tuple(t.shape) != info.shape:
            raise CheckpointError(f"{os.path.join(self.path, info.file)}: tensor {info.name} read as shape "
                                  f"{tuple(t.shape)}, header says {info.shape}")
        return t

    def close(self) -> None:
        self._handle = None
        self._open_file = None

    def where(self, name: str) -> str:
        """'<dir>/<shard>: tensor <name>' for error messages."""
        info = self.tensors.get(name)
        return f"{os.path.join(self.path, info.file) if info else self.path}: tensor {name}"
