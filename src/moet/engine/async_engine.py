"""AsyncEngine: the server's interface to LLMEngine (contract 2).

One background thread owns the engine and runs steps back to back while there is work. Adds
and aborts go through one ordered inbox that the engine thread drains between steps (a caller
never waits for the engine's lock, which a step holds: a request arriving during a busy run
would otherwise wait for a gap between two steps, and the thread that just released the lock
usually wins it back). Tokenizing a text prompt runs in a worker thread first, so it stalls
neither the event loop nor the engine. A request that can never run raises ConfigError from
generate() before anything is yielded.

Outputs: after each step the engine thread hands the step's RequestOutputs to each caller's
event loop with one call_soon_threadsafe (not one per request), and each request's stream
keeps only the newest one (outputs are cumulative, so the newest says everything the older
ones did): a consumer is woken at most once per step, and one that fell behind catches up in
one wake instead of one per missed step. Aborting (abort(), cancelling the consumer task, or
closing the iterator) is queued for the engine thread, which frees the blocks before its next
step; abort() waits for that.

Failures: a request that failed inside the engine (RequestOutput.error: RequestFailed for a
fault in its own work, MoetError when the step that ran it failed) gets that error raised from
its generate() and nothing else does; the engine serves on. Only a step() that raises (a fault
outside any request's work) fails every request, and the engine still serves new ones.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import AsyncIterator

from moet.config import EngineConfig
from moet.engine.llm_engine import LLMEngine
from moet.engine.stats import SNAPSHOT_INTERVAL_S, EngineStats
from moet.errors import MoetError
from moet.outputs import RequestOutput
from moet.sampling_params import SamplingParams

log = logging.getLogger("moet.engine")
_END = object()          # stream end marker: the engine dropped the request (aborted, shut down)
_ADD, _ABORT = 0, 1      # inbox operations


class _Refused:
    """The engine refused a request at add time (the exception to raise from generate())."""
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


class _Stream:
    """One request's outputs on its caller's event loop: the newest RequestOutput not yet taken
    and, once the request is over, how it ended (_END, an exception, or _Refused). Only touched
    on that loop."""
    __slots__ = ("loop", "latest", "end", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.latest: RequestOutput | None = None
        self.end = None
        self.waiter: asyncio.Future | None = None

    def push(self, item) -> None:
        if isinstance(item, RequestOutput):
            self.latest = item                        # cumulative: replaces one not taken yet
        elif self.end is None:
            self.end = item
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def get(self):
        while self.latest is None and self.end is None:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        item = self.latest
        if item is not None:
            self.latest = None
            return item
        return self.end


async def _stream_outputs(stream: _Stream, abort) -> AsyncIterator[RequestOutput]:
    """One request's outputs from its stream until the finished one; `abort()` queues the
    request's abort when it ends otherwise (cancelled, closed early, failed), so its blocks are
    freed at once. Shared by AsyncEngine and EngineProcess; callers aclose() it in their own
    finally (a nested async generator is otherwise only closed when collected)."""
    finished = False
    try:
        while True:
            item = await stream.get()
            if item is _END:
                return
            if isinstance(item, _Refused):            # never added: nothing to abort
                finished = True
                raise item.exc
            if isinstance(item, BaseException):
                raise item
            finished = item.finished
            yield item
            if finished:
                return
    finally:
        if not finished:
            abort()


def _call(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """fn(*args) on `loop` from another thread; nothing if the caller's loop is already closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def _push_all(items: list) -> None:
    for stream, item in items:
        stream.push(item)


def served_model_name(config) -> str:
    """The name /v1/models shows: the config's served_model_name, else the checkpoint's folder."""
    return getattr(config, "served_model_name", None) or os.path.basename(os.path.normpath(config.model))


class AsyncEngine:
    def __init__(self, engine: LLMEngine, model_name: str | None = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        cfg = engine.config
        self.model_name = model_name or served_model_name(cfg)
        self.max_model_len = engine.max_model_len
        self._lock = threading.Lock()                 # guards self.engine (the engine thread's)
        self._wake = threading.Event()
        self._inbox_lock = threading.Lock()           # guards _inbox only (never held during a step)
        self._inbox: list[tuple] = []                 # (_ADD, id, prompt, params, stream) | (_ABORT, id, loop, fut)
        self._streams: dict[str, _Stream] = {}        # engine thread only
        self._stopping = False
        self._closed = False                          # the engine thread has exited (set under _inbox_lock)
        self._stats = engine.stats()                  # refreshed when idle, else every SNAPSHOT_INTERVAL_S
        self._stats_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="moet-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        return cls(LLMEngine.from_config(config))

    @property
    def eos_token_ids(self) -> set[int]:
        return self.engine.eos_token_ids

    # ------------------------------------------------------------------ requests

    def _encode(self, prompt) -> dict:
        text, ids = self.engine.encode(prompt)
        return {"prompt_token_ids": ids, "prompt": text}

    def _post(self, op: tuple) -> bool:
        """Queue an add / abort for the engine thread; False once that thread has exited."""
        with self._inbox_lock:
            if self._closed:
                return False
            self._inbox.append(op)
        self._wake.set()
        return True

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if self._stopping:
            raise MoetError("the engine is shutting down; retry on a new engine")
        stream = _Stream(asyncio.get_running_loop())
        if isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt_token_ids" not in prompt):
            prompt = await asyncio.to_thread(self._encode, prompt)
        if self._stopping or not self._post((_ADD, request_id, prompt, params, stream)):
            raise MoetError("the engine is shutting down; retry on a new engine")
        outs = _stream_outputs(stream, lambda: self._post((_ABORT, request_id, None, None)))
        try:
            async for item in outs:
                yield item
        finally:
            await outs.aclose()

    async def abort(self, request_id: str) -> None:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if self._post((_ABORT, request_id, loop, fut)):   # else the engine thread is gone: nothing runs
            await fut

    def stats(self) -> EngineStats:
        """The latest snapshot: at most SNAPSHOT_INTERVAL_S old while steps run, current once the
        engine is idle (never waits for a running step)."""
        return self._stats

    def health(self) -> tuple[str, str]:
        """LLMEngine.health(): ("ok", "") or ("degraded", reason); never waits for a step."""
        return self.engine.health()

    async def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join)
        self.engine.close()                           # the expert store, if any (after the last step)

    # ------------------------------------------------------------------ the engine thread

    @staticmethod
    def _send(batches: dict, stream: _Stream, item) -> None:
        batches.setdefault(stream.loop, []).append((stream, item))

    @staticmethod
    def _flush(batches: dict) -> None:
        """One wake-up per event loop for everything this step produced."""
        for loop, items in batches.items():
            _call(loop, _push_all, items)

    def _drain_inbox(self, batches: dict, close: bool = False) -> None:
        """Run the queued adds and aborts in order (adds are refused while stopping); with
        close, also mark the inbox closed in the same critical section, so that nothing can
        be queued after the last drain."""
        with self._inbox_lock:
            ops, self._inbox = self._inbox, []
            self._closed = close
        for op in ops:
            if op[0] == _ADD:
                _, rid, prompt, params, stream = op
                if self._stopping:
                    self._send(batches, stream, _Refused(MoetError("the engine is shutting down; retry on a new engine")))
                    continue
                try:
                    self.engine.add_request(rid, prompt, params)
                except Exception as exc:              # ConfigError: a request that can never run
                    self._send(batches, stream, _Refused(exc))
                    continue
                self._streams[rid] = stream
            else:
                _, rid, loop, fut = op
                self.engine.abort_request(rid)        # frees the blocks now
                stream = self._streams.pop(rid, None)
                if stream is not None:
                    self._send(batches, stream, _END)
                if fut is not None:
                    _call(loop, lambda f=fut: f.done() or f.set_result(None))

    def _run(self) -> None:
        while True:
            self._wake.wait(timeout=0.5)
            self._wake.clear()
            while True:
                batches: dict = {}
                with self._lock:
                    self._drain_inbox(batches)
                    if self._stopping:
                        self._drain_inbox(batches, close=True)
                        for rid, stream in self._streams.items():
                            self.engine.abort_request(rid)
                            self._send(batches, stream, _END)
                        self._streams.clear()
                        self._flush(batches)
                        return
                    if not self.engine.has_unfinished_requests():
                        self._stats = self.engine.stats()
                        self._flush(batches)
                        break
                    try:
                        outs = self.engine.step()
                    except Exception as exc:          # outside any request's work: fail them all, serve on
                        log.exception("engine step failed")
                        err = MoetError(f"engine step failed: {type(exc).__name__}: {exc}")
                        for rid in list(self.engine.requests):
                            self.engine.abort_request(rid)
                            stream = self._streams.get(rid)
                            if stream is not None:
                                self._send(batches, stream, err)
                        self._streams.clear()
                        self._flush(batches)
                        continue
                    # a request that starts or ends sees a snapshot as new as that output
                    now = time.monotonic()
                    if (now - self._stats_at >= SNAPSHOT_INTERVAL_S
                            or any(o.finished or len(o.outputs[0].token_ids) <= 1 for o in outs if o.outputs)):
                        self._stats, self._stats_at = self.engine.stats(), now
                    streams = self._streams
                    for out in outs:
                        stream = streams.get(out.request_id)
                        if stream is not None:
                            # a failed request's stream ends with its error (raised by generate())
                            self._send(batches, stream, out if out.error is None else out.error)
                            if out.finished:
                                del streams[out.request_id]
                self._flush(batches)
