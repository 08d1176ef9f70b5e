"""One HTTP request's work on the engine: its engine requests (one per prompt, each sampling
n sequences), merged into one stream of per-choice deltas.

The engine yields cumulative outputs; clients want what is new. Deltas are cut by length from
the cumulative text and token lists; a trailing U+FFFD (an incomplete UTF-8 character that the
next token may complete) is held back until the text grows past it or the choice finishes.

Leaving the stream early for any reason (client gone, cancelled task, timeout, error) aborts
every unfinished engine request, which frees its KV blocks at once.

Per wake-up, not per token: a single-prompt request (the common case) iterates the engine's
generate() in the consumer's own task (no pump task, no queue hop); with several prompts, pump
tasks feed one queue and everything queued is taken in one wake, the newest output per engine
request (outputs are cumulative). The deadline is one timer per request, not one per wait;
it and a client disconnect (interrupt()) wake the waiting consumer by cancelling its wait,
which the stream turns into Timeout or ClientGone.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from moet.errors import ConfigError, MoetError, RequestFailed
from moet.outputs import PositionLogprobs, RequestOutput
from moet.sampling_params import SamplingParams
from moet.serve.errors import APIError, BadRequest, Timeout, Unavailable
from moet.serve.metrics import ServerMetrics
from moet.serve.protocol import UsageInfo

log = logging.getLogger("moet.serve")


class ClientGone(Exception):
    """The client disconnected (raised by a stream that interrupt() woke); not an API error:
    there is no one left to send one to."""


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class WholeChoice:
    """One choice's deltas joined up, for a response that is sent in one piece."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None   # None when logprobs were not asked for
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Choice:
    text_len: int = 0
    tokens: int = 0
    done: bool = False
    first_at: float | None = None
    last_at: float = 0.0


@dataclass
class EngineJob:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    first_index: int     # choice index of this job's output 0
    prompt_index: int = 0


class Generation:
    def __init__(self, engine, metrics: ServerMetrics | None, request_id: str, prompts: list[list[int]],
                 params: SamplingParams, n: int, timeout_s: float, keep_output: bool = True):
        self.engine, self.metrics, self.timeout_s = engine, metrics, timeout_s
        self.keep_output = keep_output      # False: the prompt is scored, what is generated is dropped
        self.prompt_logprobs: dict[int, list[PositionLogprobs | None]] = {}   # prompt index -> positions
        self.arrival = time.perf_counter()
        self.prompt_tokens = sum(len(p) for p in prompts)
        # one engine request per prompt; the engine samples its n sequences (sharing the prompt's KV)
        self.jobs = [EngineJob(f"{request_id}-{i}", ids, dataclasses.replace(params, n=n), i * n, i)
                     for i, ids in enumerate(prompts)]
        self.choices: dict[int, _Choice] = {k: _Choice() for k in range(len(prompts) * n)}
        self.completion_tokens = 0
        self.finished_jobs: set[str] = set()
        self._interrupt: BaseException | None = None   # set by interrupt(): what the waiting stream raises
        self._waiting: asyncio.Task | None = None       # the task blocked in _wait, if any
        self._cancel_sent = False

    def interrupt(self, exc: BaseException) -> None:
        """Make the stream raise `exc` at its next wait, or now if it is waiting (its wait is
        cancelled: the engine request is aborted on the way out). Idempotent: the first wins."""
        if self._interrupt is None:
            self._interrupt = exc
        task = self._waiting
        if task is not None and not self._cancel_sent and not task.done():
            self._cancel_sent = True
            task.cancel()

    def _expire(self) -> None:
        self.interrupt(Timeout(f"generation ran past the server's request timeout ({self.timeout_s:g} s); "
                               "ask for fewer tokens or raise --request-timeout-s"))

    async def _wait(self, awaitable):
        if self._interrupt is not None:
            awaitable.close()
            raise self._interrupt
        task = self._waiting = asyncio.current_task()
        try:
            return await awaitable
        except asyncio.CancelledError:
            # our own cancel (interrupt) becomes the interrupt's exception; anyone else's stays
            if self._cancel_sent and self._interrupt is not None and task.uncancel() == 0:
                self._cancel_sent = False
                raise self._interrupt from None
            raise
        finally:
            self._waiting = None

    # ------------------------------------------------------------------ internals

    async def _pump(self, job: EngineJob, queue: asyncio.Queue) -> None:
        try:
            async for out in self.engine.generate(job.request_id, job.prompt_ids, job.params):
                await queue.put((job, out))
                if out.finished:
                    self.finished_jobs.add(job.request_id)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the consumer, which raises it in the handler
            await queue.put((job, exc))
        finally:
            await queue.put((job, None))

    def _deltas(self, job: EngineJob, out: RequestOutput) -> list[ChoiceDelta]:
        now = time.perf_counter()
        deltas = []
        if out.prompt_logprobs is not None and job.prompt_index not in self.prompt_logprobs:
            self.prompt_logprobs[job.prompt_index] = list(out.prompt_logprobs)
        for c in out.outputs:
            idx = job.first_index + c.index
            st = self.choices[idx]
            if st.done:
                continue
            finished = c.finish_reason is not None or out.finished
            if not self.keep_output:
                st.done = finished
                if finished:
                    if self.metrics is not None:
                        self.metrics.finished("length", now - self.arrival)
                    deltas.append(ChoiceDelta(idx, "", [], [] if c.logprobs is not None else None, "length", None))
                continue
            stable = len(c.text) if finished or not c.text.endswith("\ufffd") else len(c.text.rstrip("\ufffd"))
            text = c.text[st.text_len:stable] if stable > st.text_len else ""
            new_ids = c.token_ids[st.tokens:]
            lps = list(c.logprobs[st.tokens:len(c.token_ids)]) if c.logprobs is not None else None
            if new_ids and self.metrics is not None:
                self.metrics.observe_tokens(st.first_at is None, now - self.arrival, now - (st.last_at or now),
                                            len(new_ids))
            if new_ids:
                st.first_at = st.first_at or now
                st.last_at = now
            st.text_len = max(st.text_len, stable)
            st.tokens = len(c.token_ids)
            self.completion_tokens += len(new_ids)
            if finished:
                st.done = True
                if self.metrics is not None:
                    self.metrics.finished(c.finish_reason, now - self.arrival)
            if text or new_ids or finished:
                deltas.append(ChoiceDelta(idx, text, new_ids, lps, c.finish_reason if finished else None,
                                          c.stop_reason if finished else None))
        return deltas

    # ------------------------------------------------------------------ public

    @staticmethod
    def _engine_error(item: BaseException) -> BaseException:
        if isinstance(item, ConfigError):         # a request that can never run: the client's to fix
            return BadRequest(str(item), param=getattr(item, "param", None))
        if isinstance(item, RequestFailed):       # it alone failed inside the engine: 500 internal_error
            return APIError(str(item))
        if isinstance(item, MoetError):           # shutting down, a failed step: not the client's fault
            return Unavailable(str(item))
        if isinstance(item, asyncio.CancelledError):
            return Unavailable("the engine cancelled this request (shutting down?)")
        return Unavailable(f"the engine failed on this request: {type(item).__name__}: {item}")

    async def stream(self) -> AsyncIterator[list[ChoiceDelta]]:
        """Per wake-up: the deltas of the choices that moved. Raises BadRequest for a request
        the engine refuses, Timeout past timeout_s, Unavailable when the engine fails, and
        ClientGone after interrupt(ClientGone())."""
        loop = asyncio.get_running_loop()
        timer = loop.call_later(max(0.0, self.arrival + self.timeout_s - time.perf_counter()), self._expire)
        single = len(self.jobs) == 1
        outs = tasks = queue = None
        if single:
            job = self.jobs[0]
            outs = self.engine.generate(job.request_id, job.prompt_ids, job.params)
        else:
            queue = asyncio.Queue()
            tasks = [asyncio.create_task(self._pump(job, queue)) for job in self.jobs]
        live = len(self.jobs)
        try:
            while live:
                err = None
                if single:
                    try:
                        out = await self._wait(outs.__anext__())
                    except StopAsyncIteration:    # the engine dropped the request without finishing it
                        return
                    except (APIError, ClientGone, asyncio.CancelledError):
                        raise
                    except BaseException as exc:  # noqa: BLE001 -- the engine's, turned into an API error
                        raise self._engine_error(exc) from exc
                    if out.finished:
                        self.finished_jobs.add(job.request_id)
                        live = 0
                    deltas = self._deltas(job, out)
                else:
                    batch = [await self._wait(queue.get())]
                    while not queue.empty():
                        batch.append(queue.get_nowait())
                    newest: dict[str, tuple[EngineJob, RequestOutput]] = {}
                    for j, item in batch:
                        if item is None:
                            live -= 1
                        elif isinstance(item, BaseException):
                            err = err or item
                        else:
                            newest[j.request_id] = (j, item)
                    deltas = [d for j, o in newest.values() for d in self._deltas(j, o)]
                if deltas:
                    yield deltas
                if err is not None:
                    raise self._engine_error(err) from err
        finally:
            timer.cancel()
            if tasks:
                for t in tasks:
                    if not t.done():
                        t.cancel()
            if outs is not None:
                await outs.aclose()               # a generator left mid-way queues its abort itself
            for job in self.jobs:
                if job.request_id not in self.finished_jobs:
                    try:
                        await asyncio.shield(self.engine.abort(job.request_id))
                    except Exception:   # an engine shutting down must not mask the request's own error
                        log.warning("abort of %s failed", job.request_id, exc_info=True)
            if tasks:   # let the cancelled pumps unwind (the engine's generate() sees the cancellation too)
                await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self, with_logprobs: bool) -> list[WholeChoice]:
        """The whole stream joined up per choice (index = choice index). Chat and completions
        both answer a non-streamed request this way; they differ only in how they shape it."""
        whole = [WholeChoice(logprobs=[] if with_logprobs else None) for _ in range(self.num_choices)]
        async for deltas in self.stream():
            for d in deltas:
                w = whole[d.index]
                w.text += d.text
                w.token_ids += d.token_ids
                if d.logprobs is not None and w.logprobs is not None:
                    w.logprobs += d.logprobs
                if d.finish_reason is not None:
                    w.finish_reason, w.stop_reason = d.finish_reason, d.stop_reason
        return whole

    def usage(self) -> UsageInfo:
        """The tokens counted so far, in the response's usage shape."""
        return UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                         total_tokens=self.prompt_tokens + self.completion_tokens)

    @property
    def num_choices(self) -> int:
        return len(self.choices)
