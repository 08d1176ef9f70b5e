"""Checkpoint identity: a stable hash that keys pack files (quantization cache) to the exact
checkpoint they were built from.

What is hashed, in this order, into one SHA-256 (hex digest, prefixed "ckpt-v1-"):
  1. config.json, parsed and re-serialised canonically (sorted keys, no whitespace), so
     reformatting the file does not change the identity but any value does;
  2. hf_quant_config.json the same way, when present (it changes how bytes are interpreted);
  3. the tensor -> shard map (model.safetensors.index.json's weight_map, sorted; for a single
     file, the file name);
  4. per shard file (sorted by name): its name, its size in bytes, the SHA-256 of its
     safetensors header (every tensor's name, dtype, shape and byte offsets), and a content
     fingerprint: SHA-256 over SAMPLES windows of WINDOW bytes at fixed, evenly spaced
     offsets of the data section (first and last window included).
Not hashed: the directory path and file times (moving or copying a checkpoint keeps its
packs valid), generation_config.json and tokenizer files (they do not change any weight).

Why a fingerprint and not a full content hash: hashing a 700 GB checkpoint reads all of it
(minutes at disk speed) on every boot just to look up the cache. Re-exports, re-quantizations
and different revisions change the header, the sizes or the sampled bytes; what the sample
cannot see is a few bytes changed in place at the same size, which no tool produces by
accident. Pack rows carry their own checksums, so a corrupt pack is caught independently.
`identity(path, full=True)` hashes every byte for anyone who wants that guarantee (and keys
packs differently: the two modes never collide because the prefix differs).
"""
from __future__ import annotations

import hashlib
import json
import os
import struct

from moet.checkpoint.reader import INDEX_FILE, SINGLE_FILE, CheckpointReader

VERSION = "v1"
SAMPLES = 16
WINDOW = 64 * 1024


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _file_fingerprint(path: str, full: bool) -> tuple[bytes, bytes]:
    """(sha256 of the header bytes, sha256 of sampled or all data bytes)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = f.read(n)
        start = 8 + n
        data = hashlib.sha256()
        if full:
            while chunk := f.read(16 * 2**20):
                data.update(chunk)
        else:
            span = max(size - start - WINDOW, 0)
            for i in range(SAMPLES):
                f.seek(start + span * i // (SAMPLES - 1))
                data.update(f.read(WINDOW))
    return hashlib.sha256(header).digest(), data.digest()


def identity(path_or_reader: str | CheckpointReader, *, full: bool = False) -> str:
    reader = (path_or_reader if isinstance(path_or_reader, CheckpointReader)
              else CheckpointReader.open(path_or_reader))
    h = hashlib.sha256()
    h.update(b"config\0" + _canonical(reader.config))
    if reader.hf_quant_config is not None:
        h.update(b"hf_quant\0" + _canonical(reader.hf_quant_config))
    weight_map = sorted((name, info.file) for name, info in reader.tensors.items())
    index_kind = INDEX_FILE if os.path.isfile(os.path.join(reader.path, INDEX_FILE)) else SINGLE_FILE
    h.update(b"map\0" + index_kind.encode() + b"\0" + _canonical(weight_map))
    for shard in sorted(reader.shards):
        p = os.path.join(reader.path, shard)
        head, data = _file_fingerprint(p, full)
        h.update(b"file\0" + shard.encode() + b"\0" + str(os.path.getsize(p)).encode() + b"\0" + head + data)
    return f"ckpt-{VERSION}-{'full' if full else 'fp'}-{h.hexdigest()}"
