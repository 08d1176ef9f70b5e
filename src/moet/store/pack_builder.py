"""Open a checkpoint's pack, building, resuming or repairing it first when needed.

First boot quantizes in a stream: one MoE block (pack layer) at a time, its expert tensors read
from the checkpoint one projection at a time and converted on arrival (quant/requantize.py, the
same functions the loader uses, so pack rows equal the loader's pool bit for bit) into a
layer buffer of num_experts slots, then written (pwrite + fdatasync) and only then recorded in
the sidecar. Host memory: that one layer's rows, one projection's tensors and the open shard's
touched pages. A kill at any point keeps every layer already recorded; the next boot checks
their checksums and continues with the rest.

Later boots reuse the pack when its sidecar matches what is asked for: format version, tag,
checkpoint identity, quantizer version and options, row layout, layer list. Otherwise:
  - no, unreadable or malformed sidecar, or any of those differ -> rebuilt from scratch (logged)
  - incomplete (a killed first boot)                   -> written layers verified, the rest built
  - file shorter than the sidecar says (truncated)     -> the layers it cut are rebuilt
  - pack_verify="full": every row checked at boot      -> damaged layers rebuilt
  - rebuild=True                                       -> rebuilt from scratch
A damaged row found later, while serving, raises RowDamaged; the engine re-converts it from the
checkpoint and writes it back (RowRepairer, below), or the read fails (PackError naming
--pack-verify full). Building needs a writable pack directory (ConfigError naming --pack-dir);
a complete, valid pack in a read-only one is served as it is. Locks: open_pack's docstring.
"""
from __future__ import annotations

import re

import errno
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from moet.checkpoint import Checkpoint
from moet.checkpoint import weight_format as wf
from moet.checkpoint.identity import identity as checkpoint_identity
from moet.checkpoint.spec import ModelSpec, expert_ref
from moet.errors import CheckpointError, ConfigError, PackError
from moet.quant import requantize
from moet.store.pack_file import (READ_ONLY_ERRNOS, PackFile, PackLock, PackMeta, PackPaths, RowLayout,
                                  default_checksum, not_writable, pool_rows)

log = logging.getLogger("moet.store")

PACK_TAGS = ("w2", "fp4")
# Bump when a tag's conversion produces different bytes for the same checkpoint (packs of the
# old version are then rebuilt, never reused).
QUANTIZER_VERSIONS = {"w2": 1, "fp4": 1}
VERIFY_MODES = ("lazy", "full")


def quantizer(tag: str, zero_mode: str = "auto", scale_rule: str = "published") -> dict:
    if tag not in PACK_TAGS:
        raise ConfigError(f"no pack format for expert_format={tag!r}; packs hold {', '.join(PACK_TAGS)}")
    opts = {"zero_mode": zero_mode, "scale_rule": scale_rule} if tag == "w2" else {}
    return {"name": tag, "version": QUANTIZER_VERSIONS[tag], "options": opts}


def quantizer_key(q: dict) -> str:
    """Short, stable file-name key of a quantizer spec (different options -> different packs)."""
    h = hashlib.sha256(json.dumps(q, sort_keys=True).encode()).hexdigest()[:10]
    return f"q{q['version']}-{h}"


def pack_layers(spec: ModelSpec) -> list[str]:
    """The MoE blocks a pack holds, in row order: decoder layers, then MTP layers (their decoder
    layer has the last layer's kind)."""
    names = [f"model.layers.{i}" for i in spec.moe_layers]
    if spec.layer_kinds and spec.layer_kinds[-1] == "moe":
        names += [f"mtp.{j}.layer" for j in range(spec.num_mtp_layers)]
    return names


def row_layout(spec: ModelSpec, tag: str) -> RowLayout:
    """The pack row layout of format `tag` for `spec`'s routed experts (what one slot of a pool holds)."""
    return RowLayout.of_pool(tag, requantize.new_pool(spec, tag, 1, torch.float32, "cpu"))


def expert_row_bytes(spec: ModelSpec, tag: str) -> int:
    """Bytes of one (layer, expert) row in `tag` (the pack's row, without the 4 KiB padding)."""
    return row_layout(spec, tag).row_bytes


@dataclass(frozen=True)
class _Source:
    """One on-disk expert parameter: per-expert (expert >= 0) or fused over experts (-1)."""
    names: dict[str, str]     # role -> on-disk tensor
    fmt: str
    expert: int               # -1: fused [E, ...]
    proj: str                 # gate_proj | up_proj | down_proj | gate_up_proj (fused)
    shard: int
    where: str


def _sources_by_layer(ckpt: Checkpoint, layers: list[str]) -> dict[int, list[_Source]]:
    """Every routed-expert parameter of the checkpoint, grouped by pack layer, sorted by shard
    so a layer's reads visit each shard once."""
    spec, reader = ckpt.spec, ckpt.reader
    index = {name: i for i, name in enumerate(layers)}
    shard_no = {s: i for i, s in enumerate(reader.shards)}
    out: dict[int, list[_Source]] = {i: [] for i in range(len(layers))}
    for disk_name, info in reader.tensors.items():
        if wf.primary_name(disk_name) is not None:
            continue
        base = disk_name[: -len(wf.MXFP4_BLOCKS)] if disk_name.endswith(wf.MXFP4_BLOCKS) else disk_name
        name = spec.canonical_name(base)
        if any(p.search(name) for p in wf.IGNORED_NAMES) or any(re.search(p, name) for p in spec.ignored):
            continue
        ref = expert_ref(name)
        if ref is None:
            continue
        block = f"model.layers.{ref.layer}" if ref.layer is not None else f"mtp.{ref.mtp}.layer"
        if block not in index:
            if ref.mtp is not None and ref.mtp >= spec.num_mtp_layers:
                continue
            raise CheckpointError(f"{reader.where(disk_name)}: routed-expert tensor for a block that is not MoE "
                                  "(config.json and the weights disagree)")
        fmt = wf.tensor_format(base, reader.tensors)
        names = wf.companions(base, fmt)
        for role, n in names.items():
            if n not in reader:
                raise CheckpointError(f"{reader.where(disk_name)}: {fmt} weight without its {role} tensor {n}")
        where = reader.where(disk_name)
        shape = wf.logical_shape(fmt, {r: reader.info(n).shape for r, n in names.items()})
        h, i = spec.hidden_size, spec.moe_intermediate_size
        if ref.expert is not None:
            want = (h, i) if ref.proj == "down_proj" else (i, h)
        else:
            want = requantize.fused_shape(spec, ref.proj, fmt)
            if fmt not in ("float", "mxfp4"):
                raise CheckpointError(f"{where}: fused {fmt} expert tensors are not supported (per-expert tensors are)")
        if tuple(shape) != want:
            raise CheckpointError(f"{where}: shape {list(shape)} does not match the {list(want)} that config.json implies")
        out[index[block]].append(_Source(names, fmt, -1 if ref.expert is None else ref.expert, ref.proj,
                                         shard_no[info.file], where))
    for srcs in out.values():
        srcs.sort(key=lambda s: (s.shard, s.where))
    return out


def _convert_layer(ckpt: Checkpoint, tag: str, srcs: list[_Source], layout: RowLayout, w2_opts: dict, device,
                   where: str, only: list[int] | None = None) -> torch.Tensor:
    """One pack layer's rows (uint8 [E, stride], CPU), converted with quant/requantize.py; `only`:
    just those experts' rows (uint8 [len(only), stride], in that order), reading only their
    tensors (per-expert checkpoints) or their slices (fused ones)."""
    spec, reader = ckpt.spec, ckpt.reader
    e_count = spec.router.num_experts
    want = list(range(e_count)) if only is None else list(only)
    slot = {e: k for k, e in enumerate(want)}
    pool = requantize.new_pool(spec, tag, len(want), torch.float32, device)
    seen: set[tuple[int, str]] = set()

    def add(expert: int, proj: str, fmt: str, parts: dict, at: str) -> None:
        if not 0 <= expert < e_count:
            raise CheckpointError(f"{at}: expert {expert} is out of range (config says {e_count} experts)")
        if (expert, proj) in seen:
            raise CheckpointError(f"{at}: expert {expert} {proj} is stored twice (per-expert and fused?)")
        requantize.convert_into(pool, slot[expert], spec, proj, fmt, parts, w2_opts, at)
        seen.add((expert, proj))

    for s in srcs:
        if s.expert >= 0 and only is not None and s.expert not in slot:
            continue
        parts = {r: reader.get(n, copy=False) for r, n in s.names.items()}
        if s.expert >= 0:
            add(s.expert, s.proj, s.fmt, parts, s.where)
        else:
            for x in want:
                for proj, one in requantize.split_fused(spec, s.proj, s.fmt, parts, x):
                    add(x, proj, s.fmt, one, f"{s.where}[{x}]")
        del parts
    if only is None:
        requantize.check_all_arrived(e_count, seen, where)
    else:
        missing = [(e, p) for e in want for p in requantize.PROJS if (e, p) not in seen]
        if missing:
            raise CheckpointError(f"{where}: routed expert tensors missing from the checkpoint, e.g. expert "
                                  f"{missing[0][0]} {missing[0][1]}")
    layout.check_pool(pool, where)
    return pool_rows(pool, layout)


def expected_meta(ckpt: Checkpoint, tag: str, q: dict, ident: str, rank: int = 0) -> PackMeta:
    layers = pack_layers(ckpt.spec)
    if not layers:
        raise ConfigError(f"{ckpt.path}: the model has no routed experts; it needs no pack")
    layout = row_layout(ckpt.spec, tag)
    return PackMeta(tag=tag, checkpoint_identity=ident, quantizer=q, layers=layers,
                    num_experts=ckpt.spec.router.num_experts, row=layout.to_json(), rank=rank,
                    checksum=default_checksum())


def _fresh_file(paths: PackPaths, meta: PackMeta) -> None:
    """An empty pack file of the full size (space reserved up front: a full disk fails now,
    not after an hour of quantizing) and a sidecar listing no layer."""
    if os.path.exists(paths.sidecar):
        os.unlink(paths.sidecar)      # first: a crash below must not leave an old sidecar on new bytes
    fd = os.open(paths.data, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            os.posix_fallocate(fd, 0, meta.file_bytes)
        except OSError as exc:
            raise ConfigError(f"{paths.data}: cannot reserve {meta.file_bytes / 2**30:.2f} GiB for the pack "
                              f"({exc.strerror}); free disk space or point --pack-dir elsewhere") from exc
        os.fsync(fd)
    finally:
        os.close(fd)
    meta.write_atomic(paths.sidecar)


LOCK_WAIT_S = 10.0     # how long open_pack waits for other readers before it gives up building


def open_pack(ckpt: Checkpoint, pack_dir: str, *, tag: str = "w2", zero_mode: str = "auto",
              scale_rule: str = "published", verify: str = "lazy", rebuild: bool = False, o_direct: bool = False,
              device: torch.device | str = "cpu", progress: bool = False, rank: int = 0,
              lock_wait_s: float | None = None) -> PackFile:
    """The checkpoint's pack for `tag`, complete and valid; built / resumed / repaired first when
    needed. The pack is returned holding a shared lock until closed. `device` converts (a GPU is
    far faster).

    Locking (PackLock: a held lock is never converted in place): check under the shared lock;
    if the pack cannot be used as it is, release it, take the exclusive lock, check again (another
    process may have built it meanwhile), build, release, and start over under the shared lock.
    Waiting for a process that builds is unbounded (a build ends); waiting for readers (another
    server using this pack) to let go is bounded by `lock_wait_s` (default LOCK_WAIT_S), then a
    PackError names them."""
    if verify not in VERIFY_MODES:
        raise ConfigError(f"pack_verify={verify!r} is not supported; choose one of {', '.join(VERIFY_MODES)}")
    if rank != 0:
        raise ConfigError("packs are single-rank for now (rank 0); multi-GPU expert placement comes later")
    q = quantizer(tag, zero_mode, scale_rule)
    ident = checkpoint_identity(ckpt.reader)
    paths = PackPaths.of(pack_dir, ident, tag, quantizer_key(q), rank)
    want = expected_meta(ckpt, tag, q, ident, rank)
    wait_s = LOCK_WAIT_S if lock_wait_s is None else lock_wait_s
    lock = PackLock(paths.lock)
    built, builds, trusted = 0, 0, None
    try:
        while True:
            lock.shared(log.info)
            meta = None if rebuild else _reusable(paths, want, verify, trusted)
            if meta is not None:
                pack = PackFile(paths, meta, o_direct=o_direct, lock=lock)
                break
            lock.unlock()
            if builds >= 3:                 # built and checked here, yet unusable right after: never loop
                raise PackError(f"{paths.data}: the pack was built but does not read back as complete and valid "
                                "(another process rebuilding it at the same time?); check the disk, or use "
                                "--pack-dir for a separate pack")
            _check_writable(paths)
            if not _take_exclusive(lock, paths, wait_s, rebuild):
                continue                    # a builder held it: wait for it under the shared lock, re-check
            builds += 1
            try:
                todo, meta = _plan_writable(paths, want, verify, rebuild)
                if todo:
                    _build_writable(ckpt, tag, paths, meta, todo, q, device, progress)
            finally:
                lock.unlock()
            built += len(todo)
            rebuild = False                 # done once; a rebuild by another process meanwhile is theirs
            trusted = meta.to_json()        # just built or checked: not verified again below
    except BaseException:
        lock.close()
        raise
    pack.built_layers = built
    return pack


def _take_exclusive(lock: PackLock, paths: PackPaths, wait_s: float, rebuild: bool) -> bool:
    """The exclusive lock (holding no lock before): True once held; False when a builder held it
    (the caller waits for it under the shared lock and checks the pack again). Readers are waited
    for at most `wait_s` seconds: a server holds its shared lock until it exits."""
    t0 = time.monotonic()
    while True:
        if lock.try_exclusive():
            return True
        if not lock.try_shared():
            return False                    # someone holds it exclusively: a build, which ends
        lock.unlock()                       # only readers hold it
        if time.monotonic() - t0 >= wait_s:
            pids = lock.holders()
            who = f"pid {', '.join(map(str, pids))}" if pids else "pid unknown"
            why = "--rebuild-pack was given" if rebuild else "the pack must be built, resumed or repaired"
            raise PackError(f"another moet process ({who}) holds the pack {paths.data} open for reading, and {why}; "
                            f"waited {wait_s:g}s for it: stop that process (or wait for it to exit), or use "
                            "--pack-dir for a separate pack")
        time.sleep(0.05)


def _check_writable(paths: PackPaths) -> None:
    """Building needs the pack directory writable: say so (and name --pack-dir) before waiting
    for a lock or converting anything."""
    d = os.path.dirname(paths.data)
    if not os.access(d, os.W_OK):
        raise not_writable(d, OSError(errno.EACCES, "not writable"), "the pack is missing, incomplete or damaged "
                           "and must be built there")


def _plan_writable(paths: PackPaths, want: PackMeta, verify: str, rebuild: bool) -> tuple[list[int], PackMeta]:
    d = os.path.dirname(paths.data)
    try:
        return _plan(paths, want, verify, rebuild)
    except OSError as exc:
        if exc.errno in READ_ONLY_ERRNOS:
            raise not_writable(exc.filename or d, exc, "the pack must be built or repaired") from None
        raise


def _build_writable(ckpt, tag, paths, meta, todo, q, device, progress) -> None:
    try:
        _build(ckpt, tag, paths, meta, todo, q, device, progress)
    except OSError as exc:
        if exc.errno in READ_ONLY_ERRNOS:
            raise not_writable(exc.filename or paths.data, exc, "writing the pack") from None
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ConfigError(f"{paths.data}: {exc.strerror} while writing the pack; free disk space or pass "
                              "--pack-dir DIR on another disk") from None
        raise


def _read_sidecar(paths: PackPaths) -> tuple[PackMeta | None, str | None]:
    """(the sidecar, None) or (None, why it cannot be used: missing or malformed)."""
    try:
        have = PackMeta.read(paths.sidecar)
    except PackError as exc:
        return None, str(exc)
    return have, None if have is not None else "no sidecar"


def _reusable(paths: PackPaths, want: PackMeta, verify: str, trusted: str | None = None) -> PackMeta | None:
    """The sidecar if the pack can be used as it is (checked under the shared lock), else None.
    `trusted`: the sidecar this process has just built or checked; if it is still the one on
    disk, its rows are not verified again."""
    have, _ = _read_sidecar(paths)
    if have is None or have.key() != want.key() or not have.complete:
        return None
    if not os.path.exists(paths.data) or os.path.getsize(paths.data) < have.file_bytes:
        return None
    if verify == "full" and have.to_json() != trusted:
        with PackFile(paths, have) as pf:
            buf = bytearray(pf.stride)
            if any(pf.verify_layer(l, buf) for l in range(len(have.layers))):
                return None
    return have


def _plan(paths: PackPaths, want: PackMeta, verify: str, rebuild: bool) -> tuple[list[int], PackMeta]:
    """(pack layers to (re)build, the sidecar to build onto). Holds the exclusive lock."""
    have, unusable = _read_sidecar(paths)
    reason = None
    if rebuild:
        reason = "--rebuild-pack was given"
    elif have is None:
        reason = unusable
    elif have.key() != want.key():
        diff = [k for k in want.key() if have.key().get(k) != want.key()[k]]
        reason = f"sidecar differs in {', '.join(diff)}"
    elif not os.path.exists(paths.data):
        reason = "pack file missing"
    if reason is not None:
        if have is not None or os.path.exists(paths.data) or os.path.exists(paths.sidecar):
            log.warning("rebuilding pack %s: %s", paths.data, reason)
        _fresh_file(paths, want)
        return list(range(len(want.layers))), want
    meta = have
    size = os.path.getsize(paths.data)
    if size < meta.file_bytes:
        cut = [l for l in meta.layers_written if (l + 1) * meta.num_experts * meta.row["stride"] > size]
        if cut:
            log.warning("pack %s is truncated (%d of %d bytes): rebuilding layers %s", paths.data, size,
                        meta.file_bytes, cut)
        _forget(meta, cut)
        with open(paths.data, "r+b") as f:
            os.posix_fallocate(f.fileno(), 0, meta.file_bytes)
    # A killed build's layers are re-checked before they are kept; a complete pack is checked
    # row by row at every read from disk, or all at once here with verify="full".
    check = list(meta.layers_written) if (verify == "full" or not meta.complete) else []
    if check:
        with PackFile(paths, meta) as pf:
            buf = bytearray(pf.stride)
            bad = [l for l in check if pf.verify_layer(l, buf)]
        if bad:
            log.warning("pack %s: layers %s fail their checksums: rebuilding them", paths.data, bad)
        _forget(meta, bad)
    if not meta.complete:
        meta.write_atomic(paths.sidecar)
    return [l for l in range(len(meta.layers)) if l not in meta.layers_written], meta


def _forget(meta: PackMeta, layers: list[int]) -> None:
    for l in layers:
        meta.layers_written.remove(l)
        meta.checksums.pop(str(l), None)


def _build(ckpt: Checkpoint, tag: str, paths: PackPaths, meta: PackMeta, todo: list[int], q: dict, device,
           progress: bool) -> None:
    layout = meta.layout
    w2_opts = q["options"] if tag == "w2" else {}
    sources = _sources_by_layer(ckpt, meta.layers)
    layer_bytes = meta.num_experts * layout.stride
    bar = tqdm(total=len(todo) * layer_bytes, unit="B", unit_scale=True, unit_divisor=1024,
               desc=f"building {tag} pack ({len(todo)}/{len(meta.layers)} layers)", disable=not progress)
    t0 = time.monotonic()
    with PackFile(paths, meta, writable=True) as pf:
        for l in todo:
            where = f"{ckpt.path}: {meta.layers[l]}"
            rows = _convert_layer(ckpt, tag, sources[l], layout, w2_opts, device, where)
            sums = pf.write_layer(l, rows)
            del rows
            pf.commit_layer(l, sums)          # after fdatasync: the layer is durable
            bar.update(layer_bytes)
    ckpt.reader.close()
    bar.close()
    log.info("built %d pack layers of %s in %.1fs", len(todo), paths.data, time.monotonic() - t0)


class RowRepairer:
    """Rows of an open pack re-converted from its checkpoint while serving: a row that fails its
    checksum when read (PackFile.read_row_into raises RowDamaged) gets the bytes the builder
    would write, checked against the checksum the sidecar recorded for it, then written back
    (PackFile.rewrite_row) so the pack is whole again. The checkpoint is read lazily, only the
    damaged expert's tensors (per-expert checkpoints) or its slices (fused ones)."""

    def __init__(self, ckpt: Checkpoint, pack: PackFile, device: torch.device | str = "cpu"):
        self.ckpt, self.pack, self.device = ckpt, pack, device
        self._sources: dict[int, list[_Source]] | None = None

    def row(self, layer: int, expert: int) -> torch.Tensor:
        """Row (layer, expert) converted from the checkpoint: uint8 [stride], CPU. Raises
        PackError when it differs from the checksum the pack recorded (then the pack was built
        from other bytes or by other code: only a rebuild helps), CheckpointError when the
        checkpoint cannot be read."""
        pack, meta = self.pack, self.pack.meta
        if self._sources is None:
            self._sources = _sources_by_layer(self.ckpt, meta.layers)
        opts = meta.quantizer.get("options", {}) if meta.tag == "w2" else {}
        where = f"{self.ckpt.path}: {meta.layers[layer]}"
        try:
            row = _convert_layer(self.ckpt, meta.tag, self._sources[layer], pack.layout, opts, self.device, where,
                                 only=[expert])[0]
        finally:
            self.ckpt.reader.close()          # no shard stays mapped while serving
        if pack._checksum(memoryview(row.numpy())) != meta.checksums[str(layer)][expert]:
            raise PackError(f"{pack.where(layer, expert)}: re-converted from the checkpoint, the row still differs "
                            "from the checksum the pack recorded (checkpoint or moet changed since the build?); "
                            "restart with --rebuild-pack")
        return row

    def repair(self, layer: int, expert: int, out: memoryview) -> str | None:
        """Fill `out` (stride bytes) with the row's right bytes and write them back to the pack.
        Returns None when the row on disk is whole again, else why it is not (the bytes in
        `out` are right either way)."""
        row = self.row(layer, expert)
        memoryview(out).cast("B")[:] = memoryview(row.numpy())
        try:
            self.pack.rewrite_row(layer, expert, row.numpy())
        except OSError as exc:
            return f"cannot rewrite it ({exc.strerror or exc}): served from the checkpoint, the pack stays damaged"
        if not self.pack.row_ok(layer, expert):
            return "rewritten, but it still reads back wrong (failing disk?)"
        return None
