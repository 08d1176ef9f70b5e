"""Pack files: every routed expert of a checkpoint in one format ("tag"), one row per
(layer, expert), on local disk. The persistent quantization cache and the bottom rung of the
residency ladder (pack -> host arena -> device slots). Byte layout: docs/formats.md, "Pack files".

    <pack_dir>/<checkpoint identity>/<tag>-<quantizer key>.rank<r>.pack   rows, nothing else
                                     <...>.rank<r>.json                   sidecar (this module's PackMeta)
                                     <...>.rank<r>.lock                   flock: readers share, a builder alone
                                     <...>.rank<r>.hot.json               the host arena's hot set

Row (l, e) starts at byte (l * num_experts + e) * stride; stride = the row's bytes rounded up
to 4 KiB, so every row is O_DIRECT-legal and rows never share a page. A row is the
concatenation of one pool slot's fields (kernels/pools.py) as raw bytes at the offsets the
sidecar names, zero padded: copying a row into a slot of a pool of the same tag gives exactly
the bytes the loader would have computed.

Crash safety: rows are written with os.pwrite and made durable with os.fdatasync before the
sidecar lists their layer (the sidecar is replaced atomically: temp file, fsync, os.replace,
fsync of the directory). A layer not in `layers_written` is never read; a layer in it has a
checksum per row (xxh64 over the full stride) that every read from disk checks.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Callable

import torch

from moet.errors import ConfigError, PackError
from moet.kernels.pools import DensePool, FP4Pool, W2Pool

FORMAT = "moet-pack"
FORMAT_VERSION = 1
ROW_ALIGN = 4096          # rows start on a page: O_DIRECT-legal, no row shares a page
FIELD_ALIGN = 64          # fields start on a cache line (any dtype's alignment)
POOL_CLASSES = {"w2": W2Pool, "fp4": FP4Pool, "bf16": DensePool}


class RowDamaged(PackError):
    """A row read from disk is short or fails its checksum: (layer, expert) can be re-converted
    from the checkpoint (pack_builder.RowRepairer) while serving."""

    def __init__(self, msg: str, layer: int, expert: int):
        super().__init__(msg)
        self.layer, self.expert = layer, expert


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


# ----------------------------------------------------------------------------- checksums

def _xxh64(data) -> str:
    import xxhash

    return xxhash.xxh64_hexdigest(data)


def _blake2b64(data) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def checksum_fn(name: str) -> Callable[[object], str]:
    """The row checksum named in a sidecar. xxh64 (~10 GB/s a core) when the xxhash package is
    installed, else blake2b-64 (stdlib, slower): a pack names its own, so either reads back."""
    if name == "xxh64":
        try:
            import xxhash  # noqa: F401
        except ImportError:
            raise PackError("this pack's rows carry xxh64 checksums but the xxhash package is not installed; "
                            "pip install xxhash (or rebuild the pack here with --rebuild-pack)") from None
        return _xxh64
    if name == "blake2b-64":
        return _blake2b64
    raise PackError(f"unknown pack checksum {name!r} (written by a newer moet?); rebuild with --rebuild-pack")


def default_checksum() -> str:
    try:
        import xxhash  # noqa: F401
        return "xxh64"
    except ImportError:
        return "blake2b-64"


# ----------------------------------------------------------------------------- row layout

@dataclass(frozen=True)
class RowField:
    name: str                 # the pool field (kernels/pools.py)
    dtype: str                # torch dtype name: "uint8", "float8_e4m3fn", "float32", ...
    shape: tuple[int, ...]    # one slot's shape (the pool's shape without the leading slot dim)
    offset: int               # byte offset inside the row
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class RowLayout:
    """How one pool slot is laid out as a row of bytes. Derived from a pool, so the pack and the
    pools that compute from it cannot disagree."""
    tag: str
    fields: tuple[RowField, ...]
    attrs: dict               # the pool's non-tensor fields (e.g. W2Pool.layout), part of the format
    row_bytes: int            # bytes of data in a row (fields + inner alignment)
    stride: int               # row_bytes rounded up to ROW_ALIGN

    @classmethod
    def of_pool(cls, tag: str, pool) -> "RowLayout":
        fields, attrs, off = [], {}, 0
        for name in pool.__slots__:
            t = getattr(pool, name)
            if not isinstance(t, torch.Tensor):
                attrs[name] = t
                continue
            off = _round_up(off, FIELD_ALIGN)
            nbytes = t[0].numel() * t.element_size()
            fields.append(RowField(name, str(t.dtype).removeprefix("torch."), tuple(t.shape[1:]), off, nbytes))
            off += nbytes
        return cls(tag, tuple(fields), attrs, off, _round_up(off, ROW_ALIGN))

    def to_json(self) -> dict:
        return {"tag": self.tag, "fields": [asdict(f) | {"shape": list(f.shape)} for f in self.fields],
                "attrs": self.attrs, "row_bytes": self.row_bytes, "stride": self.stride}

    @classmethod
    def from_json(cls, d: dict) -> "RowLayout":
        return cls(d["tag"], tuple(RowField(f["name"], f["dtype"], tuple(f["shape"]), f["offset"], f["nbytes"])
                                   for f in d["fields"]), dict(d["attrs"]), d["row_bytes"], d["stride"])

    def new_pool(self, num_slots: int, device) -> W2Pool | FP4Pool | DensePool:
        """An all-zero pool of this layout: the device cache's pool, the one the MoE layers read."""
        cls = POOL_CLASSES[self.tag]
        tensors = {f.name: torch.zeros((num_slots, *f.shape), dtype=f.torch_dtype, device=device) for f in self.fields}
        return cls(**tensors, **self.attrs)

    def check_pool(self, pool, what: str) -> None:
        if RowLayout.of_pool(self.tag, pool).to_json() != self.to_json():
            raise PackError(f"{what}: pool layout {RowLayout.of_pool(self.tag, pool).to_json()} differs from the "
                            f"pack's {self.to_json()}")


def field_bytes(pool, f: RowField) -> torch.Tensor:
    """uint8 [slots, f.nbytes] view of one pool field (pools are contiguous)."""
    t = getattr(pool, f.name)
    return t.view(torch.uint8).reshape(t.shape[0], f.nbytes)


def pool_rows(pool, layout: RowLayout) -> torch.Tensor:
    """Every slot of `pool` as rows: uint8 [slots, stride] on the CPU, zero padded."""
    n = getattr(pool, layout.fields[0].name).shape[0]
    rows = torch.zeros(n, layout.stride, dtype=torch.uint8)
    for f in layout.fields:
        rows[:, f.offset:f.offset + f.nbytes] = field_bytes(pool, f).cpu()
    return rows


def copy_row_into_slot(pool, layout: RowLayout, slot: int, row: torch.Tensor, non_blocking: bool = False) -> None:
    """row: uint8 [>= row_bytes] (host; pinned for an asynchronous copy to a GPU pool)."""
    for f in layout.fields:
        field_bytes(pool, f)[slot].copy_(row[f.offset:f.offset + f.nbytes], non_blocking=non_blocking)


# ----------------------------------------------------------------------------- paths, sidecar

@dataclass(frozen=True)
class PackPaths:
    data: str
    sidecar: str
    lock: str
    hot_set: str

    @classmethod
    def of(cls, pack_dir: str, identity: str, tag: str, quantizer_key: str, rank: int) -> "PackPaths":
        stem = os.path.join(os.path.abspath(os.path.expanduser(pack_dir)), identity, f"{tag}-{quantizer_key}.rank{rank}")
        return cls(stem + ".pack", stem + ".json", stem + ".lock", stem + ".hot.json")



class _Malformed(Exception):
    """A sidecar field of the wrong shape (PackMeta.from_dict turns it into a PackError)."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise _Malformed(what)


def _check_row(row) -> None:
    _need(isinstance(row, dict), "row is not an object")
    for k in ("tag", "fields", "attrs", "row_bytes", "stride"):
        _need(k in row, f"row.{k} is missing")
    _need(isinstance(row["tag"], str), "row.tag is not a string")
    _need(isinstance(row["attrs"], dict), "row.attrs is not an object")
    _need(_is_int(row["row_bytes"]) and row["row_bytes"] > 0, "row.row_bytes is not a positive integer")
    _need(_is_int(row["stride"]) and row["stride"] >= row["row_bytes"] and row["stride"] % ROW_ALIGN == 0,
          f"row.stride is not a multiple of {ROW_ALIGN} at least row_bytes")
    _need(isinstance(row["fields"], list) and row["fields"], "row.fields is not a non-empty list")
    for f in row["fields"]:
        _need(isinstance(f, dict) and set(f) == {"name", "dtype", "shape", "offset", "nbytes"},
              "a row field lacks name / dtype / shape / offset / nbytes")
        _need(isinstance(f["name"], str) and isinstance(f["dtype"], str)
              and isinstance(getattr(torch, f["dtype"], None), torch.dtype), f"row field {f.get('name')!r}: bad dtype")
        _need(isinstance(f["shape"], list) and all(_is_int(x) and x >= 0 for x in f["shape"]),
              f"row field {f['name']!r}: bad shape")
        _need(_is_int(f["offset"]) and _is_int(f["nbytes"]) and f["offset"] >= 0 and f["nbytes"] >= 0
              and f["offset"] + f["nbytes"] <= row["row_bytes"], f"row field {f['name']!r}: outside the row")


def _check_sidecar(d) -> None:
    _need(isinstance(d, dict), "not a JSON object")
    known = {f.name for f in fields(PackMeta)} | {"complete"}
    unknown = sorted(set(d) - known)
    _need(not unknown, f"unknown keys {unknown}")
    for k in ("tag", "checkpoint_identity", "quantizer", "layers", "num_experts", "row"):
        _need(k in d, f"{k} is missing")
    for k in ("tag", "checkpoint_identity", "checksum", "format"):
        _need(k not in d or isinstance(d[k], str), f"{k} is not a string")
    for k in ("rank", "num_ranks", "format_version"):
        _need(k not in d or _is_int(d[k]), f"{k} is not an integer")
    _need(isinstance(d["quantizer"], dict), "quantizer is not an object")
    layers, e = d["layers"], d["num_experts"]
    _need(isinstance(layers, list) and layers and all(isinstance(x, str) for x in layers),
          "layers is not a non-empty list of names")
    _need(_is_int(e) and e > 0, "num_experts is not a positive integer")
    _check_row(d["row"])
    written = d.get("layers_written", [])
    _need(isinstance(written, list) and all(_is_int(l) and 0 <= l < len(layers) for l in written)
          and len(set(written)) == len(written), f"layers_written is not a list of distinct layers 0..{len(layers) - 1}")
    sums = d.get("checksums", {})
    _need(isinstance(sums, dict), "checksums is not an object")
    _need(set(sums) == {str(l) for l in written}, "checksums do not list exactly the layers in layers_written")
    for k, v in sums.items():
        _need(isinstance(v, list) and len(v) == e and all(isinstance(x, str) for x in v),
              f"checksums[{k}] is not {e} strings (one per expert)")


@dataclass
class PackMeta:
    """The sidecar. Everything that decides whether a pack's bytes are the ones wanted."""
    tag: str
    checkpoint_identity: str
    quantizer: dict           # {"name", "version", "options"}: a change means different bytes
    layers: list[str]         # pack layer -> the model's MoE block ("model.layers.3", "mtp.0.layer")
    num_experts: int
    row: dict                 # RowLayout.to_json()
    rank: int = 0
    num_ranks: int = 1
    checksum: str = "xxh64"
    layers_written: list[int] = field(default_factory=list)   # durable and checksummed, in write order
    checksums: dict[str, list[str]] = field(default_factory=dict)  # str(layer) -> one per expert
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    @property
    def layout(self) -> RowLayout:
        return RowLayout.from_json(self.row)

    @property
    def file_bytes(self) -> int:
        return len(self.layers) * self.num_experts * self.row["stride"]

    @property
    def complete(self) -> bool:
        return len(set(self.layers_written)) == len(self.layers)

    def key(self) -> dict:
        """What must match for a pack to be reused (everything but the progress fields)."""
        d = asdict(self)
        for k in ("layers_written", "checksums", "checksum"):
            d.pop(k)
        return d

    def to_json(self) -> str:
        d = asdict(self)
        d["complete"] = self.complete
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def read(cls, path: str) -> "PackMeta | None":
        """The sidecar, or None if there is none. An unreadable or malformed one (not JSON, a
        field of the wrong type, lists of the wrong length, layers out of range) raises PackError:
        open_pack then rebuilds the pack, as for a missing sidecar."""
        try:
            with open(path) as f:
                d = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:          # ValueError: bad JSON or bad UTF-8
            raise PackError(f"{path}: unreadable pack sidecar ({exc}); the pack is rebuilt "
                            "(or pass --rebuild-pack)") from None
        return cls.from_dict(d, path)

    @classmethod
    def from_dict(cls, d, where: str = "pack sidecar") -> "PackMeta":
        """A sidecar's JSON object, checked field by field (every later use of it indexes lists
        by layer and expert, so a short list must fail here, not as an IndexError mid-serve)."""
        try:
            _check_sidecar(d)
            d = {k: v for k, v in d.items() if k != "complete"}
            meta = cls(**d)
        except _Malformed as exc:
            raise PackError(f"{where}: malformed pack sidecar ({exc}); the pack is rebuilt "
                            "(or pass --rebuild-pack)") from None
        return meta

    def write_atomic(self, path: str) -> None:
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(self.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path))


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- lock

# errno values that mean "this directory / file system does not let us write"
READ_ONLY_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS)


def not_writable(where: str, exc: OSError, doing: str) -> ConfigError:
    """The one-line error for a pack directory moet cannot write (names the flag that fixes it)."""
    return ConfigError(f"{where}: {exc.strerror or exc} ({doing}); the pack directory must be writable to build or "
                       "repair a pack: pass --pack-dir DIR with a writable DIR")


def lock_holders(fd: int) -> list[int]:
    """Process ids (other than ours) holding a flock on the file of `fd`, from /proc/locks (Linux;
    [] where it cannot be read): for the error message only."""
    try:
        st = os.fstat(fd)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    pids = []
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  READ  1234 08:02:5678 0 EOF" ("->" marks a blocked waiter)
        if "->" in parts or len(parts) < 6 or parts[1] != "FLOCK":
            continue
        try:
            maj, mnr, ino = parts[5].split(":")
            key = (int(maj, 16), int(mnr, 16), int(ino))
            pid = int(parts[4])
        except ValueError:
            continue
        if key == want and pid != os.getpid() and pid not in pids:
            pids.append(pid)
    return pids


class PackLock:
    """fcntl.flock on the pack's lock file. Shared: the pack is read as it is (any number of
    readers, e.g. several servers). Exclusive: one process checks and builds, resumes or repairs
    layers, with no reader. A held lock is never converted in place: flock drops a lock before it
    converts it (not atomic), and a reader upgrading to exclusive waits for every other reader,
    which a server never lets go of until it exits. open_pack releases one lock before it asks
    for the other and checks the pack again under each.

    A read-only pack directory: the lock file is opened read-only when it exists (flock needs no
    write access); when it does not exist and cannot be created, locking is skipped (`fd` = -1):
    such a pack is only read, never built here (a writer elsewhere is still caught by the per-row
    checksums)."""

    def __init__(self, path: str):
        self.path = path
        self.fd = -1
        self.readonly = False
        d = os.path.dirname(path)
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as exc:
            if exc.errno not in READ_ONLY_ERRNOS:
                raise
            raise not_writable(d, exc, "creating the pack directory") from None
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            if exc.errno not in READ_ONLY_ERRNOS:
                raise
            self.readonly = True
            try:
                self.fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                self.fd = -1

    def _try(self, mode: int) -> bool:
        if self.fd < 0:
            return True
        try:
            fcntl.flock(self.fd, mode | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            return False

    def try_shared(self) -> bool:
        return self._try(fcntl.LOCK_SH)

    def try_exclusive(self) -> bool:
        return self._try(fcntl.LOCK_EX)

    def shared(self, log: Callable[[str], None] | None = None, poll_s: float = 30.0) -> None:
        """Take the shared lock, waiting while another process holds it exclusively: a build or
        repair, which ends (no exclusive holder waits for anything else). Logs who it waits for."""
        if self.try_shared():
            return
        t0 = time.monotonic()
        while True:
            if log:
                who = ", ".join(map(str, lock_holders(self.fd))) or "?"
                log(f"waiting for {self.path}: another moet process (pid {who}) is building or repairing this pack "
                    f"({time.monotonic() - t0:.0f}s so far)")
            # a blocking flock cannot time out; poll so the wait stays visible in the log
            deadline = time.monotonic() + poll_s
            while time.monotonic() < deadline:
                if self.try_shared():
                    if log:
                        log(f"got {self.path} after {time.monotonic() - t0:.1f}s")
                    return
                time.sleep(0.05)

    def unlock(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def holders(self) -> list[int]:
        return lock_holders(self.fd) if self.fd >= 0 else []

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the flock
            self.fd = -1


# ----------------------------------------------------------------------------- the file

class PackFile:
    """An open pack: row reads (any thread) for the arena, layer writes for the builder."""

    def __init__(self, paths: PackPaths, meta: PackMeta, *, writable: bool = False, o_direct: bool = False,
                 lock: PackLock | None = None):
        self.paths, self.meta, self.lock = paths, meta, lock
        self.layout = meta.layout
        self.stride = self.layout.stride
        self.num_layers, self.num_experts = len(meta.layers), meta.num_experts
        self._checksum = checksum_fn(meta.checksum)
        self.fd = os.open(paths.data, os.O_RDWR if writable else os.O_RDONLY)
        self.direct_fd = -1
        if o_direct:
            try:
                self.direct_fd = os.open(paths.data, os.O_RDONLY | os.O_DIRECT)
            except OSError as exc:
                os.close(self.fd)
                raise ConfigError(f"{paths.data}: the file system does not allow O_DIRECT ({exc.strerror}); "
                                  "drop --o-direct or put --pack-dir on a local disk") from exc
        self.built_layers = 0          # set by the builder: layers (re)built when this pack was opened
        self.bytes_read = 0

    def offset(self, layer: int, expert: int) -> int:
        return (layer * self.num_experts + expert) * self.stride

    def where(self, layer: int, expert: int) -> str:
        return f"{self.paths.data}: row (layer {layer} = {self.meta.layers[layer]}, expert {expert})"

    # ---- reads

    def read_row_into(self, layer: int, expert: int, buf: memoryview, *, verify: bool = True) -> None:
        """Read row (layer, expert) into `buf` (writable, exactly `stride` bytes; 4 KiB aligned
        when the pack was opened with o_direct) and check its checksum."""
        if not 0 <= layer < self.num_layers or not 0 <= expert < self.num_experts:
            raise PackError(f"{self.paths.data}: row ({layer}, {expert}) is outside the pack "
                            f"({self.num_layers} layers x {self.num_experts} experts)")
        sums = self.meta.checksums.get(str(layer))
        if sums is None:
            raise PackError(f"{self.where(layer, expert)} was never written (incomplete pack)")
        fd = self.direct_fd if self.direct_fd >= 0 else self.fd
        n = os.preadv(fd, [buf], self.offset(layer, expert))
        if n != self.stride:
            raise RowDamaged(f"{self.where(layer, expert)}: read {n} of {self.stride} bytes (truncated pack file); "
                             "restart with --pack-verify full to rebuild the damaged layers", layer, expert)
        self.bytes_read += n
        if verify and self._checksum(buf) != sums[expert]:
            raise RowDamaged(f"{self.where(layer, expert)}: checksum mismatch (the pack is corrupt on disk); restart "
                             "with --pack-verify full to find and rebuild damaged layers, or --rebuild-pack",
                             layer, expert)

    def verify_layer(self, layer: int, buf: bytearray | None = None) -> list[int]:
        """Experts of `layer` whose row is short or fails its checksum (reads the whole layer)."""
        buf = buf if buf is not None else bytearray(self.stride)
        sums = self.meta.checksums.get(str(layer))
        if sums is None or len(sums) != self.num_experts:
            return list(range(self.num_experts))
        bad = []
        mv = memoryview(buf)
        for e in range(self.num_experts):
            n = os.preadv(self.fd, [mv], self.offset(layer, e))
            if n != self.stride or self._checksum(mv) != sums[e]:
                bad.append(e)
        return bad

    def row_ok(self, layer: int, expert: int, buf: bytearray | None = None) -> bool:
        """Row (layer, expert) reads back whole and matches its checksum (buffered read)."""
        buf = buf if buf is not None else bytearray(self.stride)
        sums = self.meta.checksums.get(str(layer))
        n = os.preadv(self.fd, [memoryview(buf)], self.offset(layer, expert))
        return sums is not None and n == self.stride and self._checksum(buf) == sums[expert]

    # ---- writes (builder, row repair)

    def rewrite_row(self, layer: int, expert: int, row) -> None:
        """Put one row's bytes (exactly `stride`, already checked against the sidecar's checksum)
        back on disk through a write descriptor of its own (the pack is open read-only while
        serving) and make them durable. Safe under the shared lock: other readers see either the
        damaged bytes (and repair them the same way) or these, which are the recorded ones."""
        view = memoryview(row).cast("B")
        if len(view) != self.stride:
            raise ValueError(f"a row is {self.stride} bytes, got {len(view)}")
        fd = os.open(self.paths.data, os.O_WRONLY)
        try:
            done, off = 0, self.offset(layer, expert)
            while done < self.stride:
                done += os.pwrite(fd, view[done:], off + done)
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def write_layer(self, layer: int, rows: torch.Tensor) -> list[str]:
        """pwrite a layer's rows (uint8 [num_experts, stride], CPU) and fdatasync them; returns
        their checksums. The caller records the layer in the sidecar only after this returns."""
        if tuple(rows.shape) != (self.num_experts, self.stride) or rows.dtype != torch.uint8:
            raise ValueError(f"layer rows must be uint8 [{self.num_experts}, {self.stride}], got {rows.dtype} "
                             f"{tuple(rows.shape)}")
        data = rows.contiguous().numpy()
        view = memoryview(data).cast("B")
        off, total = self.offset(layer, 0), len(view)
        done = 0
        while done < total:
            done += os.pwrite(self.fd, view[done:], off + done)
        os.fdatasync(self.fd)
        return [self._checksum(view[e * self.stride:(e + 1) * self.stride]) for e in range(self.num_experts)]

    def commit_layer(self, layer: int, checksums: list[str]) -> None:
        """Record a durable layer in the sidecar (atomically)."""
        self.meta.checksums[str(layer)] = checksums
        if layer not in self.meta.layers_written:
            self.meta.layers_written.append(layer)
        self.meta.write_atomic(self.paths.sidecar)

    def close(self) -> None:
        for fd in (self.fd, self.direct_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.direct_fd = -1
        if self.lock is not None:
            self.lock.close()
            self.lock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
