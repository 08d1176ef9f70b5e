"""Chat templates rendered with a time limit, and templates a client sends rendered in a process
of their own.

A Jinja chat template is a program. transformers already compiles it in Jinja's immutable
sandbox (no attribute access to Python internals, no mutation of the inputs), which keeps it from
reaching the machine, but not from spending it: nested loops, or one filter call that builds a
gigabyte string, stall whatever thread renders it. Two kinds of template, two guards:

- The server's own template (the checkpoint's, or --chat-template): trusted code. It renders in
  the request's worker thread under a deadline that a trace function checks on every line the
  template executes, so a template that loops on some input is stopped at the limit and the
  thread is free again (one Python-level check per template line; templates are short).
- A template from the request (only with --trust-request-chat-template): untrusted. It renders
  in a child process with an address-space limit; past the time limit the child is killed and a
  fresh one is started for the next request. Nothing a template does there can stall the server
  or take its memory.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import pickle
import sys
import threading
import time
from typing import Any

from moet.serve.errors import BadRequest

log = logging.getLogger("moet.serve")

CHILD_MEMORY_BYTES = 2 << 30     # address space a client template may add to the render process


class TemplateTimeout(Exception):
    pass


def render_with_deadline(tokenizer, timeout_s: float, **kwargs) -> str:
    """tokenizer.apply_chat_template(tokenize=False, **kwargs) in this thread, stopped with
    TemplateTimeout once it has run timeout_s seconds inside the template's own code."""
    deadline = time.monotonic() + timeout_s

    def line(frame, event, arg):
        if time.monotonic() > deadline:
            raise TemplateTimeout(f"the chat template took longer than {timeout_s:g} s")
        return line

    def call(frame, event, arg):
        # Jinja compiles templates to Python code whose file name is "<template>"; only those
        # frames pay for per-line checks
        return line if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(call)
    try:
        return tokenizer.apply_chat_template(tokenize=False, **kwargs)
    finally:
        sys.settrace(previous)


def _limit_memory(extra: int) -> None:
    try:
        import resource
    except ImportError:       # not a POSIX system: the time limit still holds
        return
    try:
        with open("/proc/self/status") as f:
            vm = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return
    resource.setrlimit(resource.RLIMIT_AS, (vm + extra, vm + extra))


def _child(conn, tokenizer_bytes: bytes, memory_bytes: int) -> None:
    """The render process: one request at a time from `conn`, one reply each."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C on the server reaches the process group
    tokenizer = pickle.loads(tokenizer_bytes)
    _limit_memory(memory_bytes)
    conn.send(("ready", None))
    while True:
        try:
            kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send(("ok", tokenizer.apply_chat_template(tokenize=False, **kwargs)))
        except MemoryError:
            conn.send(("error", f"the chat template needed more than {memory_bytes >> 20} MiB"))
        except BaseException as exc:  # noqa: BLE001 -- whatever a template raises is the client's to see
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class RequestTemplateRenderer:
    """Renders client-sent templates in a child process (spawned lazily, replaced after a kill).
    One render at a time: client templates are an opt-in debugging aid, not a hot path."""

    def __init__(self, tokenizer, timeout_s: float, memory_bytes: int = CHILD_MEMORY_BYTES):
        self._tokenizer_bytes = pickle.dumps(tokenizer)
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self._lock = threading.Lock()
        self._proc = None
        self._conn = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_child, args=(child, self._tokenizer_bytes, self.memory_bytes),
                           name="moet-template", daemon=True)
        proc.start()
        child.close()
        # the first start imports transformers in the child: not counted against a request's limit
        if not parent.poll(120) or parent.recv()[0] != "ready":
            proc.kill()
            raise BadRequest("the chat template sandbox did not start")
        self._proc, self._conn = proc, parent

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
            self._conn.close()
        self._proc = self._conn = None

    def render(self, **kwargs: Any) -> str:
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._kill()
                self._start()
            try:
                self._conn.send(kwargs)
                ready = self._conn.poll(self.timeout_s)
                status, value = self._conn.recv() if ready else ("timeout", None)
            except (EOFError, OSError, BrokenPipeError):
                status, value = "died", None
            if status in ("timeout", "died"):
                self._kill()
                if status == "timeout":
                    raise BadRequest(f"the request's chat template took longer than {self.timeout_s:g} s",
                                     param="chat_template")
                raise BadRequest("the request's chat template crashed its render process "
                                 "(out of memory?)", param="chat_template")
            if status == "error":
                raise BadRequest(f"the request's chat template failed: {value}", param="chat_template")
            return value

    def close(self) -> None:
        with self._lock:
            self._kill()
