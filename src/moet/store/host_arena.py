"""The host arena: a fixed number of host-memory slots, each holding one pack row, between the
pack on disk and the device cache. Pinned when CUDA is available (the device cache copies from
it asynchronously), page-aligned plain memory otherwise.

- LRU: a hit moves a row to the most-recent end; a miss takes a free slot, else evicts the
  least recent row that the same request does not need. (Frequency pinning was measured to
  lose on real traces in the published system; the device cache above keeps frequencies.)
- Scans (prefill batches) take free slots only and never evict; their rows enter at the
  least-recent end, so a long prompt cannot flush the decode working set. A row that finds no
  free slot is read into a transient buffer that lives until the copy out of it is done.
- Reads go to a small thread pool with os.preadv (the GIL is released during the read);
  buffered by default, O_DIRECT when the pack was opened with it (slots are 4 KiB aligned).
  Every row read from disk is checked against its checksum (PackFile.read_row_into); a damaged
  row goes to `repair` (the engine's: re-converted from the checkpoint and rewritten) when set.
- The hot set (resident rows in LRU order) is saved beside the pack and preloaded at boot.
"""
from __future__ import annotations

import json
import mmap
import os
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import torch

from moet.errors import ConfigError, MoetError
from moet.store.pack_file import PackFile, RowDamaged, fsync_dir

PAGE = 4096


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """uint8 [nbytes], page-aligned: pinned (cudaHostAlloc, page-aligned) or an anonymous mmap."""
    if pin:
        # torch's caching host allocator may hand out a block inside a larger pinned region
        # (not page-aligned on the H200 box's torch 2.11): over-allocate one page and align the view
        t = torch.empty(nbytes + PAGE, dtype=torch.uint8, pin_memory=True)
        off = -t.data_ptr() % PAGE
        t = t[off:off + nbytes]
        if t.data_ptr() % PAGE:
            raise ConfigError("pinned host memory could not be page-aligned; drop --o-direct")
        return t
    mm = mmap.mmap(-1, max(nbytes, 1))
    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)


class HostArena:
    """`repair(layer, expert, out)`: called (in the caller's thread) for a row that reads back
    damaged (RowDamaged); fills `out` with the right bytes or raises. None: the damage is raised."""

    def __init__(self, pack: PackFile, num_slots: int, *, pin: bool | None = None, threads: int = 4,
                 repair: Callable[[int, int, memoryview], None] | None = None):
        self.repair = repair
        if num_slots < 0:
            raise ConfigError(f"host arena slots must be >= 0, got {num_slots}")
        self.pack = pack
        self.stride = pack.stride
        self.num_slots = num_slots
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.buf = host_buffer(num_slots * self.stride, self.pin).view(num_slots, self.stride)
        self._slot_of: OrderedDict[int, int] = OrderedDict()   # row key -> slot; least recent first
        self._free = list(range(num_slots - 1, -1, -1))
        self._io = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="moet-arena")
        self.hits = self.misses = self.transient_reads = 0

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.stride

    def key(self, layer: int, expert: int) -> int:
        return layer * self.pack.num_experts + expert

    def __contains__(self, key: int) -> bool:
        return key in self._slot_of

    def _take_slot(self, needed: set[int], scan: bool) -> int | None:
        if self._free:
            return self._free.pop()
        if scan:
            return None
        for k in self._slot_of:                       # least recent first
            if k not in needed:
                return self._slot_of.pop(k)
        return None

    def rows(self, keys: Sequence[int], *, scan: bool = False) -> list[torch.Tensor]:
        """Host rows (uint8 [stride] each) for pack row keys (layer * num_experts + expert),
        read from the pack where absent. A returned row stays valid until the next call."""
        needed = set(keys)
        out: dict[int, torch.Tensor] = {}
        reads: list[tuple[int, torch.Tensor, int | None]] = []
        for k in dict.fromkeys(keys):
            s = self._slot_of.get(k)
            if s is not None:
                self.hits += 1
                if not scan:
                    self._slot_of.move_to_end(k)
                out[k] = self.buf[s]
                continue
            self.misses += 1
            s = self._take_slot(needed, scan)
            if s is None:
                self.transient_reads += 1
                view = host_buffer(self.stride, self.pin)
            else:
                self._slot_of[k] = s
                if scan:
                    self._slot_of.move_to_end(k, last=False)
                view = self.buf[s]
            out[k] = view
            reads.append((k, view, s))
        if reads:
            futures = [self._io.submit(self._read, k, v) for k, v, _ in reads]
            errors = []
            for (k, view, s), fut in zip(reads, futures):
                exc = fut.exception()
                if isinstance(exc, RowDamaged) and self.repair is not None and not errors:
                    try:
                        self.repair(exc.layer, exc.expert, memoryview(view.numpy()))
                        exc = None
                    except MoetError as failed:
                        exc = failed
                if exc is not None:
                    errors.append(exc)
                    if s is not None:                  # a bad row never stays resident
                        del self._slot_of[k]
                        self._free.append(s)
            if errors:
                raise errors[0]
        return [out[k] for k in keys]

    def _read(self, key: int, view: torch.Tensor) -> None:
        layer, expert = divmod(key, self.pack.num_experts)
        self.pack.read_row_into(layer, expert, memoryview(view.numpy()))

    # ---- hot set

    def hot_keys(self) -> list[int]:
        """Resident rows, least recent first."""
        return list(self._slot_of)

    def save_hot_set(self, path: str | None = None) -> str:
        path = path or self.pack.paths.hot_set
        meta = self.pack.meta
        doc = {"checkpoint_identity": meta.checkpoint_identity, "tag": meta.tag, "layers": len(meta.layers),
               "num_experts": meta.num_experts,
               "rows": [list(divmod(k, meta.num_experts)) for k in self.hot_keys()]}
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path))
        return path

    def preload_hot_set(self, path: str | None = None) -> int:
        """Read the saved hot set's most recent rows (up to the arena's size); returns how many.
        A hot set of another pack, or an unreadable one, is ignored (it is only a hint)."""
        path = path or self.pack.paths.hot_set
        meta = self.pack.meta
        try:
            with open(path) as f:
                doc = json.load(f)
            if (doc["checkpoint_identity"], doc["tag"], doc["layers"], doc["num_experts"]) != (
                    meta.checkpoint_identity, meta.tag, len(meta.layers), meta.num_experts):
                return 0
            keys = [self.key(int(l), int(e)) for l, e in doc["rows"]
                    if 0 <= int(l) < len(meta.layers) and 0 <= int(e) < meta.num_experts]
        except (OSError, ValueError, KeyError, TypeError):
            return 0
        keys = keys[-self.num_slots:] if self.num_slots else []
        if keys:
            self.rows(keys)          # a corrupt row raises PackError like any read
        return len(keys)

    def close(self) -> None:
        self._io.shutdown(wait=True)


def available_host_bytes() -> int:
    """MemAvailable (Linux), else physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def arena_slots(host_arena_gb: float | None, stride: int, total_rows: int) -> int:
    """Slots for EngineConfig.store.host_arena_gb: that many GiB, or unset: the whole pack if it fits
    in half the available host memory, else that half."""
    budget = available_host_bytes() // 2 if host_arena_gb is None else int(host_arena_gb * 2**30)
    return max(0, min(total_rows, budget // stride))
