"""Ctrl-C on `moet serve` / `moet generate` / `moet probe` (the real commands on moet-tiny, CPU):
one line, exit status 130, no traceback, no multiprocessing leak report, nothing left running.

A terminal's Ctrl-C sends SIGINT to the whole foreground process group (the server, the engine
process, multiprocessing's resource tracker), so the tests start each command in a session of
its own and signal its group the same way."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

BAD = ("Traceback", "leaked", "resource_tracker", "Exception ignored", "Thread 0x")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Run:
    """A `moet` command in a new session, its stdout + stderr collected by a thread."""

    def __init__(self, argv: list[str]):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moet.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
            # a test runner started in the background has SIGINT ignored, which its children inherit
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.chunks: list[str] = []
        self.reader = threading.Thread(target=lambda: self.chunks.extend(iter(lambda: self.proc.stdout.read(1), "")),
                                       daemon=True)
        self.reader.start()

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    def wait_for(self, needle: str, timeout: float = 400) -> None:
        deadline = time.time() + timeout
        while needle not in self.text:
            if self.proc.poll() is not None or time.time() > deadline:
                self.kill()
                pytest.fail(f"{needle!r} never came:\n{self.text[-3000:]}")
            time.sleep(0.1)

    def interrupt(self) -> tuple[int, str]:
        """Ctrl-C as a terminal sends it; the exit status and the whole output (the resource
        tracker's report, if any, comes after the command exits: wait for the pipe's end)."""
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            rc = self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"no exit within 120 s of SIGINT:\n{self.text[-3000:]}")
        self.reader.join(timeout=60)
        return rc, self.text

    def group_gone(self, timeout: float = 20) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.2)
        return False

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _quiet_exit(run: _Run, rc: int, out: str) -> None:
    assert rc == 130, out[-3000:]
    assert out.count("moet: interrupted") == 1, out[-3000:]
    assert not [b for b in BAD if b in out], out[-3000:]
    assert run.group_gone(), "a process of the command's group is still running"


SERVE = ["serve", "--device", "cpu", "--max-model-len", "256", "--max-num-seqs", "2"]


@pytest.mark.parametrize("engine_process", ["true", "false"])
def test_serve_ctrl_c_while_serving(engine_process):
    port = _free_port()
    run = _Run([*SERVE, "--port", str(port), "--engine-process", engine_process])
    try:
        run.wait_for(f"at http://127.0.0.1:{port}/v1\n")
        # printed once the socket listens: /health answers at once
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        rc, out = run.interrupt()
    finally:
        run.kill()
    assert out.count("moet: serving moet-tiny at") == 1
    _quiet_exit(run, rc, out)


def test_serve_ctrl_c_while_the_engine_process_loads():
    run = _Run([*SERVE, "--port", str(_free_port()), "--engine-process", "true"])
    try:
        run.wait_for("loading (")                        # the child is loading the model
        rc, out = run.interrupt()
    finally:
        run.kill()
    assert "serving moet-tiny at" not in out
    _quiet_exit(run, rc, out)


def test_generate_and_probe_ctrl_c():
    run = _Run(["generate", "--device", "cpu", "--prompt", "def fib(n):", "--max-tokens", "3000", "--ignore-eos"])
    try:
        run.wait_for("loading (")
        time.sleep(1)
        rc, out = run.interrupt()
    finally:
        run.kill()
    _quiet_exit(run, rc, out)
    run = _Run(["probe", "--device", "cpu", "--budget", "tiny", "--only", "facts"])
    try:
        run.wait_for("task/s")                           # the progress bar: tasks done / total, rate
        rc, out = run.interrupt()
    finally:
        run.kill()
    assert "/12 [" in out                                # the tiny budget's 12 facts prompts are the total
    _quiet_exit(run, rc, out)
