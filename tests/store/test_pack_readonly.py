"""A read-only pack directory (issue 34): a complete, valid pack there is served as it is (the lock
file opened read-only, or no lock when none exists); anything that would have to write there (a
first build, a stale pack, a directory that cannot be created) is one ConfigError naming
--pack-dir, never an OSError traceback.

The directory is made read-only for real: as root (who ignores file modes) in a private mount
namespace with a read-only bind mount (EROFS); otherwise by chmod (EACCES). Each case runs in a
subprocess that prints the outcome as JSON."""
import json
import os
import shutil
import stat
import subprocess
import sys

import pytest

from moet.checkpoint import open_checkpoint
from moet.store import open_pack

CASE = r"""
import json, os, sys
from moet.errors import MoetError
ckpt_path, pack_dir, case = sys.argv[1:4]
out = {}
try:
    if case == "llm":
        from moet.llm import LLM
        from moet.sampling_params import SamplingParams
        with LLM(ckpt_path, pack_dir=pack_dir, expert_format="w2", dtype="float32", device="cpu",
                 expert_cache_slots=8, num_kv_blocks=40, block_size=8, max_num_seqs=2) as llm:
            res = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3, temperature=0.0),
                               use_tqdm=False)
            out = {"ok": True, "tokens": res[0].outputs[0].token_ids,
                   "built": llm.engine.stats().extra["pack_built_layers"]}
    else:
        from moet.checkpoint import open_checkpoint
        from moet.store import open_pack
        with open_pack(open_checkpoint(ckpt_path), pack_dir) as p:
            buf = bytearray(p.stride)
            for l in range(p.num_layers):
                for e in range(p.num_experts):
                    p.read_row_into(l, e, memoryview(buf))         # every row, checksums checked
            out = {"ok": True, "built": p.built_layers, "lockless": p.lock.fd < 0}
except MoetError as exc:
    out = {"ok": False, "type": type(exc).__name__, "error": str(exc)}
print(json.dumps(out), flush=True)
"""


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))


def _can_unshare() -> bool:
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


def run_readonly(ro_dir: str, *args) -> dict:
    """CASE with `ro_dir` read-only for it."""
    argv = [sys.executable, "-c", CASE, *map(str, args)]
    if os.geteuid() == 0:
        if not _can_unshare():
            pytest.skip("running as root without mount namespaces: cannot make a directory read-only")
        shell = ("mount --make-rprivate / && mount --bind \"$0\" \"$0\" && mount -o remount,bind,ro \"$0\" "
                 "&& exec \"$@\"")
        cmd = ["unshare", "-m", "sh", "-c", shell, ro_dir, *argv]
        res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    else:
        modes = {}
        for root, dirs, files in os.walk(ro_dir):
            for n in [root] + [os.path.join(root, f) for f in files]:
                modes[n] = stat.S_IMODE(os.stat(n).st_mode)
                os.chmod(n, modes[n] & ~0o222)
        try:
            res = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=300)
        finally:
            for n, m in modes.items():
                os.chmod(n, m)
    assert res.returncode == 0, res.stderr[-3000:]           # no traceback: the case printed its outcome
    return json.loads(res.stdout.strip().splitlines()[-1])


def _one_line_pack_dir_error(out: dict) -> str:
    assert not out["ok"] and out["type"] == "ConfigError", out
    assert "\n" not in out["error"] and "--pack-dir" in out["error"]
    return out["error"]


@pytest.fixture
def built(tmp_path, ds_ckpt):
    """(checkpoint, directory holding a complete pack of it)."""
    d = tmp_path / "packs"
    with open_pack(open_checkpoint(ds_ckpt), str(d)) as p:
        assert p.built_layers == len(p.meta.layers)
        paths = p.paths
    return ds_ckpt, str(d), paths


def test_complete_pack_served_from_a_readonly_directory(built):
    ckpt, d, _ = built
    out = run_readonly(d, ckpt, d, "reuse")
    assert out == {"ok": True, "built": 0, "lockless": False}


def test_complete_pack_without_a_lock_file_served_lockless(built):
    ckpt, d, paths = built
    os.unlink(paths.lock)
    out = run_readonly(d, ckpt, d, "reuse")
    assert out == {"ok": True, "built": 0, "lockless": True}


def test_engine_serves_from_a_readonly_pack(built):
    ckpt, d, _ = built
    out = run_readonly(d, ckpt, d, "llm")
    assert out["ok"], out
    assert out["built"] == 0 and len(out["tokens"]) == 3


def test_first_build_in_a_readonly_directory_names_the_flag(tmp_path, ds_ckpt):
    d = tmp_path / "empty"
    d.mkdir()
    msg = _one_line_pack_dir_error(run_readonly(str(d), ds_ckpt, str(d), "reuse"))
    assert str(d) in msg


def test_stale_pack_in_a_readonly_directory_names_the_flag(built):
    ckpt, d, paths = built
    side = json.load(open(paths.sidecar))
    side["quantizer"]["version"] = 0               # must be rebuilt, which needs to write
    json.dump(side, open(paths.sidecar, "w"))
    _one_line_pack_dir_error(run_readonly(d, ckpt, d, "reuse"))


def test_pack_dir_that_cannot_be_created_names_the_flag(tmp_path, ds_ckpt):
    d = tmp_path / "ro"
    d.mkdir()
    _one_line_pack_dir_error(run_readonly(str(d), ds_ckpt, str(d / "sub" / "packs"), "reuse"))
    _one_line_pack_dir_error(run_readonly(str(d), ds_ckpt, str(d / "sub" / "packs"), "llm"))
