"""AsyncEngine: the server's interface to LLMEngine (contract 2).

One background thread owns the engine and runs steps back to back while there is work; each
request has an asyncio.Queue on the caller's event loop, fed through call_soon_threadsafe with
the cumulative RequestOutput after every step that produced tokens for it. Adding a request
runs in a worker thread (tokenizing and validating must not stall the event loop, and the
engine is only touched under one lock), so a request that can never run raises ConfigError
from generate() before anything is yielded. Aborting (abort(), cancelling the consumer task, or
closing the iterator) is queued for the engine thread, which frees the blocks before its next
step; abort() waits for that.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import AsyncIterator

from moet.config import EngineConfig
from moet.engine.llm_engine import LLMEngine
from moet.engine.stats import EngineStats
from moet.errors import MoetError
from moet.outputs import RequestOutput
from moet.sampling_params import SamplingParams

log = logging.getLogger("moet.engine")
_END = object()          # queue sentinel: the engine shut down


class AsyncEngine:
    def __init__(self, engine: LLMEngine, model_name: str | None = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        cfg = engine.config
        self.model_name = model_name or getattr(cfg, "served_model_name", None) or \
            os.path.basename(os.path.normpath(cfg.model))
        self.max_model_len = engine.max_model_len
        self._lock = threading.Lock()                 # guards self.engine
        self._wake = threading.Event()
        self._inbox_lock = threading.Lock()           # guards _aborts only (never held during a step)
        self._aborts: list[tuple[str, asyncio.AbstractEventLoop | None, asyncio.Future | None]] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self._stats = engine.stats()
        self._thread = threading.Thread(target=self._run, name="moet-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        return cls(LLMEngine.from_config(config))

    @property
    def eos_token_ids(self) -> set[int]:
        return self.engine.eos_token_ids

    # ------------------------------------------------------------------ requests

    def _add(self, request_id: str, prompt, params: SamplingParams, loop, queue) -> None:
        with self._lock:
            if self._stopping:
                raise MoetError("the engine is shutting down; retry on a new engine")
            self.engine.add_request(request_id, prompt, params)
            self._streams[request_id] = (loop, queue)
        self._wake.set()

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        await asyncio.to_thread(self._add, request_id, prompt, params, loop, queue)
        finished = False
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:                          # cancelled, closed early or failed: free its blocks
                self._queue_abort(request_id, None, None)

    def _queue_abort(self, request_id: str, loop, fut) -> None:
        with self._inbox_lock:
            self._aborts.append((request_id, loop, fut))
        self._wake.set()

    async def abort(self, request_id: str) -> None:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue_abort(request_id, loop, fut)
        await fut

    def stats(self) -> EngineStats:
        """The snapshot taken after the last step (never waits for a running step)."""
        return self._stats

    async def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join)
        self.engine.close()                           # the expert store, if any (after the last step)

    # ------------------------------------------------------------------ the engine thread

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        loop, queue = stream
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:                          # the caller's loop is closed
            pass

    def _drain_aborts(self) -> None:
        with self._inbox_lock:
            aborts, self._aborts = self._aborts, []
        for rid, loop, fut in aborts:
            self.engine.abort_request(rid)            # frees the blocks now
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream[0].call_soon_threadsafe(stream[1].put_nowait, _END)
            if fut is not None:
                loop.call_soon_threadsafe(lambda f=fut: f.done() or f.set_result(None))

    def _run(self) -> None:
        while True:
            self._wake.wait(timeout=0.5)
            self._wake.clear()
            while True:
                with self._lock:
                    self._drain_aborts()
                    if self._stopping:
                        for rid in list(self._streams):
                            self.engine.abort_request(rid)
                            self._deliver(rid, _END)
                        self._streams.clear()
                        return
                    if not self.engine.has_unfinished_requests():
                        self._stats = self.engine.stats()
                        break
                    try:
                        outs = self.engine.step()
                    except Exception as exc:          # fail every request, keep serving new ones
                        log.exception("engine step failed")
                        err = MoetError(f"engine step failed: {type(exc).__name__}: {exc}")
                        for rid in list(self.engine.requests):
                            self.engine.abort_request(rid)
                            self._deliver(rid, err)
                        self._streams.clear()
                        continue
                    self._stats = self.engine.stats()
                    for out in outs:
                        self._deliver(out.request_id, out)
                        if out.finished:
                            self._streams.pop(out.request_id, None)
