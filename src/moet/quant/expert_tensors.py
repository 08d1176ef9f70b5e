"""Find and stream the routed-expert weights of any Hugging Face MoE checkpoint, one
(layer, expert, projection) matrix at a time, without loading the model.

This is deliberately architecture-agnostic (name patterns + sibling tensors decide the
format), so the codebook study also runs on checkpoints moet cannot serve yet. Recognised:
  per-expert  ...experts.<e>.(gate_proj|up_proj|down_proj|w1|w2|w3).weight   (+ NVFP4 / FP8 siblings)
  fused       ...experts.(gate_up_proj|down_proj)  [E, N, K]                   (transformers 5 layout)
  MXFP4       ...experts.(gate_up_proj|down_proj)_blocks / _scales            (gpt-oss layout)
Shared experts ("shared_expert(s)") never match: they stay in the checkpoint's precision.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from moet.errors import CheckpointError

_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3))\.weight$")
_FUSED = re.compile(r"^(?P<prefix>.*\.experts\.(?P<proj>gate_up_proj|down_proj))$")
_MXFP4 = re.compile(r"^(?P<prefix>.*\.experts\.(?P<proj>gate_up_proj|down_proj))_blocks$")
_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass(slots=True)
class ExpertMatrix:
    """One routed-expert weight matrix in its native encoding (tensors are on the CPU)."""
    name: str                 # e.g. model.layers.3.mlp.experts.17.up_proj
    layer: int
    expert: int
    fmt: str                  # "float" | "nvfp4" | "fp8_block" | "mxfp4"
    tensors: dict[str, torch.Tensor]
    native_bytes: int


def _shard_map(ckpt: Path) -> dict[str, Path]:
    index = ckpt / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
        return {name: ckpt / f for name, f in weight_map.items()}
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{ckpt}: no model.safetensors.index.json and no *.safetensors files")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                out[name] = f
    return out


def _layer_of(name: str) -> int:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else -1


@dataclass(slots=True)
class _Group:
    prefix: str
    kind: str          # per_expert | fused | mxfp4
    expert: int


def find_expert_groups(names: list[str]) -> list[_Group]:
    groups = []
    for name in names:
        if m := _PER_EXPERT.match(name):
            groups.append(_Group(m["prefix"], "per_expert", int(m["expert"])))
        elif m := _MXFP4.match(name):
            groups.append(_Group(m["prefix"], "mxfp4", -1))
        elif (m := _FUSED.match(name)) and not name.endswith(("_blocks", "_scales")):
            groups.append(_Group(m["prefix"], "fused", -1))
    groups.sort(key=lambda g: (_layer_of(g.prefix), g.expert, g.prefix))
    return groups


_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class ExpertTensorReader:
    """Open a checkpoint directory and iterate its routed-expert matrices lazily: at most one
    shard is open and one expert matrix is materialised at a time (bounded host memory)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a directory (expected a Hugging Face checkpoint folder)")
        self.shards = _shard_map(self.path)
        self.groups = find_expert_groups(list(self.shards))
        if not self.groups:
            raise CheckpointError(f"{self.path}: no routed-expert tensors found (names like "
                                  "'model.layers.N.mlp.experts.E.up_proj.weight' or '...experts.gate_up_proj')")
        self._open: tuple[Path, object] | None = None

    def _handle(self, name: str):
        f = self.shards.get(name)
        if f is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is listed nowhere in the checkpoint")
        if self._open is None or self._open[0] != f:
            if not f.exists():
                raise CheckpointError(f"{f}: shard file missing (the index names it for {name!r})")
            try:
                self._open = (f, safe_open(str(f), framework="pt"))
            except Exception as exc:  # safetensors raises its own error types for bad headers
                raise CheckpointError(f"{f}: unreadable safetensors file ({exc}); re-download it") from exc
        return self._open[1]

    def _read(self, fn, name: str):
        try:
            return fn()
        except CheckpointError:
            raise
        except Exception as exc:  # truncated data surfaces only when a tensor is read
            raise CheckpointError(f"{self.shards[name]}: cannot read tensor {name!r} ({exc}); "
                                  "the file is truncated or corrupt, re-download it") from exc

    def _get(self, name: str) -> torch.Tensor:
        return self._read(lambda: self._handle(name).get_tensor(name), name)

    def _shape(self, name: str) -> list[int]:
        return list(self._handle(name).get_slice(name).get_shape())

    def _nbytes(self, name: str) -> int:
        sl = self._handle(name).get_slice(name)
        n = 1
        for d in sl.get_shape():
            n *= d
        return n * _ITEMSIZE.get(sl.get_dtype(), 4)

    def _member_names(self, g: _Group) -> list[str]:
        if g.kind == "per_expert":
            cands = [g.prefix + s for s in (".weight", ".weight_scale", ".weight_scale_2", ".weight_scale_inv")]
        elif g.kind == "mxfp4":
            cands = [g.prefix + "_blocks", g.prefix + "_scales"]
        else:
            cands = [g.prefix]
        return [c for c in cands if c in self.shards]

    def total_native_bytes(self) -> int:
        """Bytes of every routed-expert tensor (and its scales) as stored: the progress total."""
        return sum(self._nbytes(n) for g in self.groups for n in self._member_names(g))

    def __iter__(self) -> Iterator[ExpertMatrix]:
        for g in self.groups:
            yield from self._expand(g)

    def _expand(self, g: _Group) -> Iterator[ExpertMatrix]:
        layer = _layer_of(g.prefix)
        if g.kind == "per_expert":
            members = {n.rsplit(".", 1)[1]: self._get(n) for n in self._member_names(g)}
            w = members["weight"]
            if "weight_scale_2" in members and w.dtype == torch.uint8:
                fmt = "nvfp4"
                if "weight_scale" not in members:
                    raise CheckpointError(f"{self.path}: {g.prefix}.weight is NVFP4 but has no weight_scale")
            elif "weight_scale_inv" in members and w.dtype == torch.float8_e4m3fn:
                fmt = "fp8_block"
            elif w.is_floating_point() and w.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
                fmt, members = "float", {"weight": w}
            else:
                raise CheckpointError(f"{self.path}: tensor {g.prefix}.weight has dtype {w.dtype} and no "
                                      "recognised scale tensors (supported: BF16/FP16/FP32, FP8 block-128, NVFP4, MXFP4)")
            yield ExpertMatrix(g.prefix, layer, g.expert, fmt, members,
                               sum(t.numel() * t.element_size() for t in members.values()))
        elif g.kind == "mxfp4":
            blocks_name, scales_name = g.prefix + "_blocks", g.prefix + "_scales"
            if scales_name not in self.shards:
                raise CheckpointError(f"{self.path}: {blocks_name} has no matching {scales_name}")
            for e in range(self._shape(blocks_name)[0]):
                b = self._read(lambda: self._handle(blocks_name).get_slice(blocks_name)[e], blocks_name)
                s = self._read(lambda: self._handle(scales_name).get_slice(scales_name)[e], scales_name)
                yield ExpertMatrix(f"{g.prefix}.{e}", layer, e, "mxfp4", {"blocks": b, "scales": s}, b.numel() + s.numel())
        else:
            for e in range(self._shape(g.prefix)[0]):
                w = self._read(lambda: self._handle(g.prefix).get_slice(g.prefix)[e], g.prefix)
                yield ExpertMatrix(f"{g.prefix}.{e}", layer, e, "float", {"weight": w}, w.numel() * w.element_size())
