"""Pack files: built in a stream from a checkpoint, equal to the loader's pools byte for byte,
reused when valid; corruption, truncation, a lost sidecar, stale options and killed writers are
detected and repaired (or refused), never used."""
import json
import os
import subprocess
import sys

import pytest

from moet.checkpoint import open_checkpoint
from moet.errors import PackError
from moet.store import open_pack, pack_builder
from moet.store.pack_file import PackFile, PackMeta
from moet.testing.tiny_checkpoint import cached_checkpoint

from .conftest import assert_pack_equals_pools, resident_rows


def _sums(pack) -> dict:
    return {k: list(v) for k, v in pack.meta.checksums.items()}


@pytest.mark.parametrize("family,fmt,tag", [
    ("deepseek_v3", "bf16", "w2"),     # per-expert float tensors, MTP MoE layer
    ("mixtral", "mxfp4", "w2"),        # fused gpt-oss style tensors
    ("glm4_moe", "nvfp4", "fp4"),      # NVFP4 bytes copied, second tag
])
def test_pack_rows_equal_resident_pools(tmp_path, family, fmt, tag):
    path = cached_checkpoint(family, fmt, tokenizer=False)
    ckpt = open_checkpoint(path)
    with open_pack(ckpt, str(tmp_path), tag=tag) as pack:
        assert pack.built_layers == len(pack.meta.layers) == len(pack_builder.pack_layers(ckpt.spec))
        assert pack.stride % 4096 == 0 and pack.layout.row_bytes <= pack.stride
        assert os.path.getsize(pack.paths.data) == pack.meta.file_bytes
        side = json.load(open(pack.paths.sidecar))
        assert side["complete"] and side["tag"] == tag and side["format_version"] == 1
        assert side["quantizer"]["name"] == tag and len(side["checksums"]) == len(side["layers"])
        assert_pack_equals_pools(pack, resident_rows(path, tag))
        sums = _sums(pack)
    with open_pack(ckpt, str(tmp_path), tag=tag, verify="full") as again:   # reused, not rebuilt
        assert again.built_layers == 0 and _sums(again) == sums


def test_options_key_separate_packs(tmp_path, ds_ckpt):
    ckpt = open_checkpoint(ds_ckpt)
    with open_pack(ckpt, str(tmp_path)) as a, open_pack(ckpt, str(tmp_path), scale_rule="mse") as b:
        assert a.paths.data != b.paths.data and b.built_layers == len(b.meta.layers)
        assert b.meta.quantizer["options"]["scale_rule"] == "mse"
        assert_pack_equals_pools(b, resident_rows(ds_ckpt, "w2", scale_rule="mse"))


def test_corrupt_byte_detected_then_repaired(tmp_path, ds_ckpt):
    ckpt = open_checkpoint(ds_ckpt)
    with open_pack(ckpt, str(tmp_path)) as pack:
        sums, paths, stride, e_n = _sums(pack), pack.paths, pack.stride, pack.num_experts
    off = (1 * e_n + 5) * stride + 777                 # layer 1, expert 5
    with open(paths.data, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x10]))
    with open_pack(ckpt, str(tmp_path)) as pack:       # lazy: reused, the bad row refused on read
        assert pack.built_layers == 0
        pack.read_row_into(1, 4, memoryview(bytearray(stride)))
        with pytest.raises(PackError, match="checksum mismatch.*--pack-verify full"):
            pack.read_row_into(1, 5, memoryview(bytearray(stride)))
    with open_pack(ckpt, str(tmp_path), verify="full") as pack:   # full: found and rebuilt
        assert pack.built_layers == 1 and _sums(pack) == sums
        assert_pack_equals_pools(pack, resident_rows(ds_ckpt, "w2"))


def test_truncated_pack_detected_and_repaired(tmp_path, ds_ckpt):
    ckpt = open_checkpoint(ds_ckpt)
    with open_pack(ckpt, str(tmp_path)) as pack:
        sums, paths, stride, e_n = _sums(pack), pack.paths, pack.stride, pack.num_experts
    os.truncate(paths.data, (2 * e_n + 3) * stride + 100)    # cuts into the last layer
    meta = PackMeta.read(paths.sidecar)
    with PackFile(paths, meta) as raw:                          # a reader of the cut file refuses
        with pytest.raises(PackError, match="truncated"):
            raw.read_row_into(2, 3, memoryview(bytearray(stride)))
    with open_pack(ckpt, str(tmp_path)) as pack:
        assert pack.built_layers == 1 and _sums(pack) == sums
        assert os.path.getsize(paths.data) == pack.meta.file_bytes


def test_deleted_sidecar_rebuilt(tmp_path, ds_ckpt):
    ckpt = open_checkpoint(ds_ckpt)
    with open_pack(ckpt, str(tmp_path)) as pack:
        sums, paths, n = _sums(pack), pack.paths, len(pack.meta.layers)
    os.unlink(paths.sidecar)
    with open_pack(ckpt, str(tmp_path)) as pack:
        assert pack.built_layers == n and _sums(pack) == sums


def test_stale_sidecar_rebuilt_and_rebuild_flag(tmp_path, ds_ckpt):
    ckpt = open_checkpoint(ds_ckpt)
    with open_pack(ckpt, str(tmp_path)) as pack:
        sums, paths, n = _sums(pack), pack.paths, len(pack.meta.layers)
    side = json.load(open(paths.sidecar))
    side["quantizer"]["version"] = 0                  # written by an older quantizer
    json.dump(side, open(paths.sidecar, "w"))
    with open_pack(ckpt, str(tmp_path)) as pack:
        assert pack.built_layers == n and pack.meta.quantizer["version"] == 1 and _sums(pack) == sums
    with open_pack(ckpt, str(tmp_path), rebuild=True) as pack:
        assert pack.built_layers == n


def test_exception_mid_build_resumes(tmp_path, ds_ckpt, monkeypatch):
    ckpt = open_checkpoint(ds_ckpt)
    with open_pack(ckpt, str(tmp_path / "clean")) as clean:
        want, n = _sums(clean), len(clean.meta.layers)
    real = PackFile.write_layer
    calls = []

    def failing(self, layer, rows):
        calls.append(layer)
        if len(calls) == 2:                  # the second layer dies half written
            half = rows.clone()
            half[rows.shape[0] // 2:] = 0
            real(self, layer, half)
            raise KeyboardInterrupt
        return real(self, layer, rows)

    monkeypatch.setattr(PackFile, "write_layer", failing)
    with pytest.raises(KeyboardInterrupt):
        open_pack(ckpt, str(tmp_path / "p"))
    monkeypatch.setattr(PackFile, "write_layer", real)
    meta = PackMeta.read(pack_builder.PackPaths.of(str(tmp_path / "p"), pack_builder.checkpoint_identity(ckpt.reader),
                                                   "w2", pack_builder.quantizer_key(pack_builder.quantizer("w2")),
                                                   0).sidecar)
    assert meta.layers_written == [calls[0]] and not meta.complete
    with open_pack(ckpt, str(tmp_path / "p")) as pack:
        assert pack.built_layers == n - 1 and _sums(pack) == want


KILLER = r"""
import os, signal, sys
from moet.checkpoint import open_checkpoint
from moet.store import open_pack
from moet.store.pack_file import PackFile
real = PackFile.write_layer
n = [0]
def dying(self, layer, rows):
    n[0] += 1
    if n[0] == int(sys.argv[3]):            # SIGKILL in the middle of writing this layer
        half = rows.clone(); half[rows.shape[0] // 2:] = 0
        os.pwrite(self.fd, half.numpy().tobytes(), self.offset(layer, 0))
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, layer, rows)
PackFile.write_layer = dying
open_pack(open_checkpoint(sys.argv[1]), sys.argv[2])
"""

BUILDER = r"""
import json, sys, time
from moet.checkpoint import open_checkpoint
from moet.store import open_pack, pack_builder
real = pack_builder._convert_layer
def slow(*a, **k):
    time.sleep(0.4)                          # widen the window in which the other process waits
    return real(*a, **k)
pack_builder._convert_layer = slow
with open_pack(open_checkpoint(sys.argv[1]), sys.argv[2]) as p:
    print(json.dumps({"built": p.built_layers, "sums": p.meta.checksums, "complete": p.meta.complete}))
"""


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))


def test_sigkill_mid_layer_resumes(tmp_path, ds_ckpt):
    ckpt = open_checkpoint(ds_ckpt)
    with open_pack(ckpt, str(tmp_path / "clean")) as clean:
        want, n = _sums(clean), len(clean.meta.layers)
    res = subprocess.run([sys.executable, "-c", KILLER, ds_ckpt, str(tmp_path / "p"), "2"], env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == -9, res.stderr[-2000:]
    with open_pack(ckpt, str(tmp_path / "p")) as pack:
        assert pack.built_layers == n - 1 and _sums(pack) == want
        assert_pack_equals_pools(pack, resident_rows(ds_ckpt, "w2"))


def test_two_processes_one_builds_other_waits(tmp_path, ds_ckpt):
    procs = [subprocess.Popen([sys.executable, "-c", BUILDER, ds_ckpt, str(tmp_path)], env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    n = len(pack_builder.pack_layers(open_checkpoint(ds_ckpt).spec))
    assert sorted(o["built"] for o in outs) == [0, n]          # exactly one built, the other read it
    assert all(o["complete"] for o in outs) and outs[0]["sums"] == outs[1]["sums"]
