"""The host arena: rows equal the pack's, LRU eviction, scans that never evict, transient reads,
O_DIRECT equal to buffered reads, a corrupt row refused and not kept, the hot set round trip."""
import os

import pytest
import torch

from moet.checkpoint import open_checkpoint
from moet.errors import PackError
from moet.store import HostArena, open_pack
from moet.store.host_arena import arena_slots


@pytest.fixture()
def pack(tmp_path, ds_ckpt):
    with open_pack(open_checkpoint(ds_ckpt), str(tmp_path)) as p:
        yield p


def _direct(pack, key):
    buf = bytearray(pack.stride)
    pack.read_row_into(*divmod(key, pack.num_experts), memoryview(buf))
    return torch.frombuffer(buf, dtype=torch.uint8)


def test_lru_and_scan(pack):
    arena = HostArena(pack, 3, pin=False)
    keys = [0, 9, 17]
    rows = arena.rows(keys)
    assert all(torch.equal(r, _direct(pack, k)) for r, k in zip(rows, keys))
    assert (arena.hits, arena.misses) == (0, 3)
    arena.rows([0])                       # 0 becomes most recent: order 9, 17, 0
    assert arena.hot_keys() == [9, 17, 0]
    (r,) = arena.rows([5])                # evicts 9, the least recent
    assert torch.equal(r, _direct(pack, 5)) and arena.hot_keys() == [17, 0, 5]
    # a scan: hits do not promote, misses with no free slot are read aside, nothing evicted
    rows = arena.rows([17, 20, 21], scan=True)
    assert arena.hot_keys() == [17, 0, 5] and arena.transient_reads == 2
    assert torch.equal(rows[1], _direct(pack, 20)) and torch.equal(rows[2], _direct(pack, 21))
    # rows one request needs are never evicted for each other
    rows = arena.rows([1, 2, 3, 4])
    assert [torch.equal(r, _direct(pack, k)) for r, k in zip(rows, [1, 2, 3, 4])] == [True] * 4
    arena.close()


def test_scan_fills_free_slots_at_lru_end(pack):
    arena = HostArena(pack, 4, pin=False)
    arena.rows([1, 2])
    arena.rows([7, 8], scan=True)
    assert arena.hot_keys() == [8, 7, 1, 2] and arena.transient_reads == 0
    arena.rows([3])                       # the scanned rows go first
    assert arena.hot_keys() == [7, 1, 2, 3]


def test_o_direct_equals_buffered(tmp_path, ds_ckpt, pack):
    try:
        direct = open_pack(open_checkpoint(ds_ckpt), str(tmp_path), o_direct=True)
    except Exception as exc:  # a file system without O_DIRECT (tmpfs on old kernels)
        pytest.skip(f"O_DIRECT unavailable here: {exc}")
    with direct:
        assert direct.direct_fd >= 0 and direct.built_layers == 0
        arena = HostArena(direct, 5, pin=False)
        keys = [3, 11, 23, 0, 16, 19]     # more than the slots: a transient aligned buffer too
        for r, k in zip(arena.rows(keys, scan=True), keys):
            assert torch.equal(r, _direct(pack, k))


def test_corrupt_row_refused_and_not_kept(tmp_path, ds_ckpt):
    ckpt = open_checkpoint(ds_ckpt)
    with open_pack(ckpt, str(tmp_path)) as p:
        paths, stride = p.paths, p.stride
    with open(paths.data, "r+b") as f:
        f.seek(6 * stride + 10)
        f.write(b"\xff\x00\xff")
    with open_pack(ckpt, str(tmp_path)) as p:
        arena = HostArena(p, 4, pin=False)
        with pytest.raises(PackError, match="checksum mismatch"):
            arena.rows([5, 6])
        assert 6 not in arena and 5 in arena
        with pytest.raises(PackError):
            arena.rows([6])


def test_hot_set_round_trip(pack):
    arena = HostArena(pack, 4, pin=False)
    arena.rows([2, 3, 4, 5])
    arena.rows([6])                       # evicts 2
    arena.rows([3])                       # order now 4, 5, 6, 3
    assert arena.hot_keys() == [4, 5, 6, 3]
    path = arena.save_hot_set()
    assert os.path.dirname(path) == os.path.dirname(pack.paths.data)
    fresh = HostArena(pack, 3, pin=False)
    assert fresh.preload_hot_set() == 3
    assert fresh.hot_keys() == [5, 6, 3]  # the most recent rows, in order
    assert all(torch.equal(fresh.rows([k])[0], _direct(pack, k)) for k in (5, 6, 3)) and fresh.misses == 3


def test_arena_sizing(pack):
    assert arena_slots(0, pack.stride, 24) == 0
    assert arena_slots(1.0, pack.stride, 24) == 24
    assert arena_slots(3 * pack.stride / 2**30, pack.stride, 24) == 3
    assert 0 <= arena_slots(None, pack.stride, 24) <= 24
