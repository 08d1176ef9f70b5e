"""Two processes on one pack (issue 34): a lock is never upgraded in place. A process that must
rebuild a pack another process is reading (serving) gives up after a bounded wait with an error
naming that process; one that only reads it shares it at once. Each case runs in subprocesses
(flock is per open file, and the hang being guarded against is between processes)."""
import json
import os
import subprocess
import sys
import time

import pytest

from moet.checkpoint import open_checkpoint
from moet.errors import PackError
from moet.store import open_pack, pack_builder
from moet.store.pack_file import PackLock

HOLDER = r"""
import json, os, sys
from moet.checkpoint import open_checkpoint
from moet.store import open_pack
with open_pack(open_checkpoint(sys.argv[1]), sys.argv[2]) as p:
    print(json.dumps({"pid": os.getpid(), "built": p.built_layers}), flush=True)
    sys.stdin.read()                          # hold the shared lock until the test closes stdin
"""

OPENER = r"""
import json, sys, time
from moet.checkpoint import open_checkpoint
from moet.errors import MoetError
from moet.store import open_pack, pack_builder
pack_builder.LOCK_WAIT_S = float(sys.argv[4])
t0 = time.monotonic()
try:
    with open_pack(open_checkpoint(sys.argv[1]), sys.argv[2], rebuild=sys.argv[3] == "rebuild") as p:
        out = {"ok": True, "built": p.built_layers}
except MoetError as exc:
    out = {"ok": False, "type": type(exc).__name__, "error": str(exc)}
out["seconds"] = time.monotonic() - t0
print(json.dumps(out), flush=True)
"""


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))


def _run(script, *args, timeout):
    """The script's last stdout line as JSON; a hang past `timeout` fails the test (and is killed)."""
    try:
        res = subprocess.run([sys.executable, "-c", script, *map(str, args)], env=_env(), capture_output=True,
                             text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"open_pack did not return within {timeout}s while another process held the pack")
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture
def holder(tmp_path, ds_ckpt):
    """A process that built the pack and keeps it open (shared lock), as a running server does."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER, ds_ckpt, str(tmp_path)], env=_env(), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line, p.stderr.read()[-3000:]
        info = json.loads(line)
        assert info["built"] > 0
        yield info
    finally:
        p.stdin.close()
        p.wait(timeout=60)


def test_rebuild_while_another_process_serves_fails_within_the_bound(tmp_path, ds_ckpt, holder):
    # the old open_pack took the shared lock, then upgraded to exclusive: it waited for the
    # holder's exit (forever, for a server)
    out = _run(OPENER, ds_ckpt, tmp_path, "rebuild", 1.0, timeout=120)
    assert not out["ok"] and out["type"] == "PackError"
    msg = out["error"]
    assert "\n" not in msg and f"pid {holder['pid']}" in msg and "--pack-dir" in msg and "--rebuild-pack" in msg
    assert out["seconds"] < 30


def test_second_reader_serves_at_once(tmp_path, ds_ckpt, holder):
    out = _run(OPENER, ds_ckpt, tmp_path, "reuse", 1.0, timeout=120)
    assert out["ok"] and out["built"] == 0


def test_no_lock_upgrade_in_process(tmp_path, ds_ckpt, monkeypatch):
    """Within one process: open_pack never asks for the exclusive lock while holding the shared
    one (a flock conversion), and a build leaves only the shared lock held."""
    ckpt = open_checkpoint(ds_ckpt)
    held = {}
    real_try, real_unlock = PackLock._try, PackLock.unlock
    import fcntl

    def spy_try(self, mode):
        assert not (mode == fcntl.LOCK_EX and held.get(id(self)) == "sh"), "shared lock upgraded in place"
        ok = real_try(self, mode)
        if ok:
            held[id(self)] = "ex" if mode == fcntl.LOCK_EX else "sh"
        return ok

    def spy_unlock(self):
        held.pop(id(self), None)
        real_unlock(self)

    monkeypatch.setattr(PackLock, "_try", spy_try)
    monkeypatch.setattr(PackLock, "unlock", spy_unlock)
    for kw in ({}, {"rebuild": True}, {"verify": "full"}):          # build, rebuild, reuse after a check
        with open_pack(ckpt, str(tmp_path), **kw) as pack:
            assert held[id(pack.lock)] == "sh"
            assert pack.built_layers == (0 if kw.get("verify") else len(pack.meta.layers))


def test_rebuild_refused_while_this_process_reads_it(tmp_path, ds_ckpt):
    """The same conflict inside one process (two opens of one pack): bounded, not a deadlock."""
    ckpt = open_checkpoint(ds_ckpt)
    with open_pack(ckpt, str(tmp_path)) as first:
        t0 = time.monotonic()
        with pytest.raises(PackError, match="holds the pack .* open for reading"):
            open_pack(ckpt, str(tmp_path), rebuild=True, lock_wait_s=0.3)
        assert time.monotonic() - t0 < 10
        with open_pack(ckpt, str(tmp_path)) as second:            # reading it again is fine
            assert second.built_layers == 0 and first.meta.checksums == second.meta.checksums


def test_waits_for_a_builder_then_reuses(tmp_path, ds_ckpt):
    """An exclusive holder (a build) is waited for, however long; then the pack is re-checked."""
    ckpt = open_checkpoint(ds_ckpt)
    with open_pack(ckpt, str(tmp_path)) as pack:
        lock_path = pack.paths.lock
    other = PackLock(lock_path)
    assert other.try_exclusive()
    release = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])   # a timer
    import threading

    def later():
        release.wait()
        other.close()

    threading.Thread(target=later, daemon=True).start()
    t0 = time.monotonic()
    with open_pack(ckpt, str(tmp_path), lock_wait_s=0.1) as pack:    # the bound is for readers only
        assert pack.built_layers == 0
    assert time.monotonic() - t0 >= 1.0
    assert pack_builder.LOCK_WAIT_S > 0
