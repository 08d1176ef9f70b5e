"""EngineProcess: contract 2 (the server's EngineClient) with the engine in a child process.

Why: AsyncEngine runs the engine in a thread of the server process, so every microsecond the
event loop spends on HTTP (JSON, SSE framing, socket sends) is taken from the engine through the
GIL. On the serve_overhead stand-in (16 streams, 2 ms steps of which 1.5 ms Python) the engine's
steps got markedly longer under HTTP load and HTTP decode fell well below the Python API's. Here the
engine owns a process (and a GIL) of its own: vLLM V1's AsyncLLM / EngineCore split.

    parent (the server)                          child (spawned: no CUDA / fork hazards)
    generate(): tokenize in a worker thread,     builds the engine: build(*build_args)
      send (ADD, key, id, ids, params)    --->   inbox thread: recv -> inbox -> wake
    abort(): send (ABORT, id, ack)        --->   engine loop = AsyncEngine's thread loop: drain
    reader thread: recv, rebuild cumulative <---   the inbox between steps, step back to back,
      RequestOutputs, one wake per loop            one message per step: each touched request's
      per step (newest output replaces one         DELTA (new ids / text / logprobs, finish
      not yet taken), stats snapshot               state; the prompt only in the first) + stats

A step message never carries a cumulative output (that would be O(n^2) bytes over a long
generation); logprobs travel as tuples (pickling the Logprob dataclass costs ~3x more in the
child). The parent loads its own tokenizer (the server's chat templates need it; encode_prompt
is LLMEngine.encode, so the ids and prompt text are the engine's). Requests are keyed by a
parent-side number, so a refused duplicate id never touches the running request's stream.

Errors: the child's start-up exception is re-raised in the parent with its type and message
(pickled; MoetError with both when it does not pickle); a request that can never run raises
from generate() before anything is yielded (RequestError keeps its `param`); a request that
failed inside the engine (RequestOutput.error) gets a FAILED event with that error, alone, as
does one whose step message cannot be built or pickled; a step() that raises fails the running
requests and the engine keeps serving; when the child dies, every pending generate() and abort() ends with a
MoetError saying so, new ones fail at once and stats() raises (so /health answers 503);
shutdown() returns either way. The child ignores SIGINT (Ctrl-C on `moet serve` reaches the
whole process group; the parent's shutdown stops the child cleanly) and stops when the parent
goes away (its inbox hits EOF). Only pipes are shared; nothing to clean up beyond the process.
"""
from __future__ import annotations

import asyncio
import atexit
import functools
import itertools
import logging
import multiprocessing as mp
import multiprocessing.util  # noqa: F401  (its exit hook first, so that ours, registered below, runs before it)
import pickle
from multiprocessing.reduction import ForkingPickler
import signal
import threading
import time
import traceback
import weakref
from typing import Any, AsyncIterator, Callable

from moet.engine.async_engine import _END, _call, _push_all, _Refused, _Stream, _stream_outputs, served_model_name
from moet.engine.stats import SNAPSHOT_INTERVAL_S
from moet.errors import MoetError, RequestFailed
from moet.outputs import CompletionOutput, Logprob, RequestOutput
from moet.sampling_params import SamplingParams

log = logging.getLogger("moet.engine")

_ADD, _ABORT, _STOP = 0, 1, 2                      # parent -> child
_OUT, _ENDED, _REFUSED, _FAILED, _ACK = 0, 1, 2, 3, 4   # child -> parent, per event of a step message
_SHUTTING_DOWN = "the engine is shutting down; retry on a new engine"


# ---------------------------------------------------------------------------- wire format

def _pack_positions(positions: list) -> list:
    """Per-position logprob dicts -> tuples (None kept: prompt position 0 has none)."""
    return [None if p is None else [(t, lp.logprob, lp.rank, lp.decoded_token) for t, lp in p.items()]
            for p in positions]


def _unpack_positions(packed: list) -> list:
    return [None if p is None else {t: Logprob(v, r, d) for t, v, r, d in p} for p in packed]


class _Sent:
    """Child side: what the parent already has of one request (to send only what is new)."""
    __slots__ = ("key", "first", "n_plps", "seqs")

    def __init__(self, key: int):
        self.key = key
        self.first = True
        self.n_plps = 0
        self.seqs: dict[int, list] = {}             # index -> [token ids sent, text sent, logprobs sent]

    def delta(self, out: RequestOutput) -> tuple:
        prompt = (out.prompt, out.prompt_token_ids) if self.first else None
        self.first = False
        plps = None
        if out.prompt_logprobs is not None and len(out.prompt_logprobs) != self.n_plps:
            off = min(self.n_plps, len(out.prompt_logprobs))
            plps = (off, _pack_positions(out.prompt_logprobs[off:]))
            self.n_plps = len(out.prompt_logprobs)
        comps = []
        for c in out.outputs:
            s = self.seqs.get(c.index)
            if s is None:
                s = self.seqs[c.index] = [0, "", 0]
            ids, text, prev = c.token_ids, c.text, s[1]
            n0 = min(s[0], len(ids))
            # visible text only grows today; a rewrite (never expected) resends it whole
            t_off = len(prev) if text.startswith(prev) else 0
            lps = None
            if c.logprobs is not None:
                l0 = min(s[2], len(c.logprobs))
                lps = (l0, _pack_positions(c.logprobs[l0:]))
                s[2] = len(c.logprobs)
            s[0], s[1] = len(ids), text
            comps.append((c.index, n0, ids[n0:], t_off, text[t_off:], lps, c.cumulative_logprob,
                          c.finish_reason, c.stop_reason))
        return (_OUT, self.key, prompt, plps, comps, out.finished)


class _Request:
    """Parent side: one generate() call's stream and the cumulative output rebuilt so far."""
    __slots__ = ("rid", "stream", "prompt", "prompt_ids", "plps", "seqs")

    def __init__(self, rid: str, stream: _Stream):
        self.rid, self.stream = rid, stream
        self.prompt, self.prompt_ids, self.plps = None, [], None
        self.seqs: dict[int, list] = {}             # index -> [token ids, text, logprobs or None]

    def apply(self, ev: tuple) -> RequestOutput:
        _, _, prompt, plps, comps, finished = ev
        if prompt is not None:
            self.prompt, self.prompt_ids = prompt
        if plps is not None:
            if self.plps is None:
                self.plps = []
            del self.plps[plps[0]:]
            self.plps.extend(_unpack_positions(plps[1]))
        outs = []
        for index, n0, new_ids, t_off, new_text, lps, cum, reason, stop in comps:
            s = self.seqs.get(index)
            if s is None:
                s = self.seqs[index] = [[], "", None]
            ids = s[0]
            del ids[n0:]
            ids.extend(new_ids)
            s[1] = (s[1] if t_off == len(s[1]) else s[1][:t_off]) + new_text
            if lps is not None:
                if s[2] is None:
                    s[2] = []
                del s[2][lps[0]:]
                s[2].extend(_unpack_positions(lps[1]))
            # fresh lists per output, as LLMEngine._output gives: a consumer may keep an old one
            outs.append(CompletionOutput(index, s[1], list(ids), cum, list(s[2]) if s[2] is not None else None,
                                         reason, stop))
        return RequestOutput(self.rid, self.prompt, self.prompt_ids, self.plps, outs, finished=finished)


# ---------------------------------------------------------------------------- the child

def _portable(exc: BaseException) -> BaseException:
    """exc if it survives pickling (same type and message in the parent), else a MoetError."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return MoetError(f"{type(exc).__name__}: {exc}")


class _EngineLoop:
    """The child's engine loop: AsyncEngine._run's, with the parent's pipe in place of event loops."""

    def __init__(self, engine, inbox, outbox):
        self.engine, self.inbox, self.outbox = engine, inbox, outbox
        self.wake = threading.Event()
        self.ops_lock = threading.Lock()
        self.ops: list[tuple] = []
        self.stopping = False
        self.sent: dict[str, _Sent] = {}            # request id -> what the parent has of it
        self.stats_at = 0.0                          # when the last stats snapshot went to the parent

    def receive(self) -> None:
        """Inbox thread: the parent's adds / aborts into `ops`; EOF (the parent is gone) or STOP ends it."""
        while True:
            try:
                op = self.inbox.recv()
            except (EOFError, OSError):
                op = (_STOP,)
            with self.ops_lock:
                self.ops.append(op)
            self.wake.set()
            if op[0] == _STOP:
                return

    def send(self, events: list) -> None:
        # the stats snapshot rides along when due, with any request's first output or end, and always
        # once the engine is idle (so the parent's is current: blocks freed by an abort, the last step's counters)
        now = time.monotonic()
        stats = None
        if (now - self.stats_at >= SNAPSHOT_INTERVAL_S or not self.engine.has_unfinished_requests()
                or any(ev[0] != _OUT or ev[-1] or ev[2] is not None for ev in events)):   # an end, or a first output
            stats, self.stats_at = self.engine.stats(), now
        try:
            self.outbox.send(("step", events, stats))
        except OSError:                              # the parent is gone
            self.stopping = True
        except Exception:                            # an event that does not pickle: its request alone fails
            # (Connection.send pickles the whole message before writing a byte: nothing went out)
            try:
                self.outbox.send(("step", [self._picklable(ev) for ev in events], stats))
            except OSError:
                self.stopping = True

    def _picklable(self, ev: tuple) -> tuple:
        try:
            ForkingPickler.dumps(ev)                 # the pickler Connection.send uses
            return ev
        except Exception as exc:
            key = ev[1]
            rid = next((r for r, st in self.sent.items() if st.key == key), None)
            log.exception("request %r: its step message does not pickle; failing it alone", rid)
            if rid is not None:                      # still running: stop it
                self.engine.abort_request(rid)
                del self.sent[rid]
            return (_FAILED, key, RequestFailed(f"request {rid!r} failed inside the engine: its output could not be "
                                                f"sent ({type(exc).__name__}: {exc}); the engine and its other "
                                                "requests go on"))

    def _event(self, st: "_Sent", out: RequestOutput) -> tuple:
        """out as the step message's event for its request: its delta, or FAILED with its error
        (a failed request, or one whose delta cannot be built: that request alone)."""
        if out.error is not None:
            return (_FAILED, st.key, _portable(out.error))
        try:
            return st.delta(out)
        except Exception as exc:
            log.exception("request %r: its step message cannot be built; failing it alone", out.request_id)
            if not out.finished:
                self.engine.abort_request(out.request_id)
            return (_FAILED, st.key, RequestFailed(
                f"request {out.request_id!r} failed inside the engine: its output could not be sent "
                f"({type(exc).__name__}: {exc}); the engine and its other requests go on"))

    def drain(self, events: list) -> None:
        with self.ops_lock:
            ops, self.ops = self.ops, []
        for op in ops:
            if op[0] == _ADD:
                _, key, rid, prompt, params = op
                if self.stopping:
                    events.append((_REFUSED, key, MoetError(_SHUTTING_DOWN)))
                    continue
                try:
                    self.engine.add_request(rid, prompt, params)
                except Exception as exc:            # ConfigError: a request that can never run
                    events.append((_REFUSED, key, _portable(exc)))
                    continue
                self.sent[rid] = _Sent(key)
            elif op[0] == _ABORT:
                _, rid, ack = op
                self.engine.abort_request(rid)      # frees the blocks now
                st = self.sent.pop(rid, None)
                if st is not None:
                    events.append((_ENDED, st.key, None))
                if ack is not None:
                    events.append((_ACK, ack, None))
            else:
                self.stopping = True

    def run(self) -> None:
        engine = self.engine
        while True:
            self.wake.wait(timeout=0.5)
            self.wake.clear()
            while True:
                events: list = []
                self.drain(events)
                if events and not self.stopping:
                    # refusals, aborted streams' ends and abort() acks now, not after the next step
                    self.send(events)
                    events = []
                if self.stopping:
                    for rid, st in self.sent.items():
                        engine.abort_request(rid)
                        events.append((_ENDED, st.key, None))
                    self.sent.clear()
                    self.send(events)
                    return
                if not engine.has_unfinished_requests():
                    break
                try:
                    outs = engine.step()
                except Exception as exc:            # outside any request's work: fail them all, serve on
                    log.exception("engine step failed")
                    err = MoetError(f"engine step failed: {type(exc).__name__}: {exc}")
                    for rid in list(engine.requests):
                        engine.abort_request(rid)
                        st = self.sent.pop(rid, None)
                        if st is not None:
                            events.append((_FAILED, st.key, err))
                    self.sent.clear()
                    self.send(events)
                    continue
                sent = self.sent
                for out in outs:
                    st = sent.get(out.request_id)
                    if st is not None:
                        ev = self._event(st, out)
                        events.append(ev)
                        if out.finished or ev[0] == _FAILED:
                            del sent[out.request_id]
                self.send(events)


def _child_main(build: Callable[..., Any], build_args: tuple, inbox, outbox) -> None:
    # Ctrl-C reaches the whole process group; the parent's shutdown stops this process cleanly
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Progress bars here need no lock shared with other processes; tqdm's default one is a
    # multiprocessing semaphore, reported "leaked" when the parent stops this process mid-load.
    import tqdm
    tqdm.tqdm.set_lock(threading.RLock())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    from moet.engine.gc_pauses import freeze_start_up, server_start_up
    try:
        with server_start_up():                      # its collections are not pauses while serving
            engine = build(*build_args)
    except BaseException as exc:
        outbox.send(("failed", _portable(exc), traceback.format_exc()))
        return
    freeze_start_up()                                # the model's objects out of the GC's walks while serving
    try:
        outbox.send(("ready", {"model_name": served_model_name(engine.config), "max_model_len": engine.max_model_len,
                               "eos_token_ids": set(engine.eos_token_ids), "stats": engine.stats()}))
        loop = _EngineLoop(engine, inbox, outbox)
        threading.Thread(target=loop.receive, name="moet-engine-inbox", daemon=True).start()
        loop.run()
    finally:
        engine.close()                               # the expert store, if any (after the last step)


def build_llm_engine(config):
    """The child's default build: LLMEngine.from_config (module level: spawn pickles it by name)."""
    from moet.engine.llm_engine import LLMEngine
    return LLMEngine.from_config(config)


# ---------------------------------------------------------------------------- the parent

_LIVE: "weakref.WeakSet[EngineProcess]" = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    """An interpreter exiting without shutdown(): close the pipe to each child so that it sees EOF
    and stops (multiprocessing's own exit hook, registered earlier and so run later, joins it)."""
    for ep in list(_LIVE):
        try:
            ep._inbox.close()
        except OSError:
            pass


class EngineProcess:
    """EngineClient over an engine in a spawned child process. build(*build_args) runs in the
    child and returns an LLMEngine (or anything with its surface: serve_overhead's stand-in);
    load_tokenizer() runs in the parent, while the child builds, and gives the tokenizer
    encode_prompt uses (None: token-id prompts only). Blocks until the child's engine is up."""

    def __init__(self, build: Callable[..., Any], build_args: tuple = (), *,
                 load_tokenizer: Callable[[], Any] | None = None, tokenizer_source: str = "the model"):
        ctx = mp.get_context("spawn")
        self._reap_lock = threading.Lock()             # one thread at a time waits for the child
        inbox_r, self._inbox = ctx.Pipe(duplex=False)      # parent -> child
        self._outbox, outbox_w = ctx.Pipe(duplex=False)    # child -> parent
        self._proc = ctx.Process(target=_child_main, args=(build, build_args, inbox_r, outbox_w),
                                 name="moet-engine", daemon=False)
        self._proc.start()
        inbox_r.close()                                # the child holds these: EOF when it dies
        outbox_w.close()
        self.tokenizer_source = tokenizer_source
        tok: dict = {}
        tok_thread = None
        if load_tokenizer is not None:                 # in parallel with the child's start-up
            def _load():
                try:
                    tok["value"] = load_tokenizer()
                except BaseException as exc:
                    tok["error"] = exc
            tok_thread = threading.Thread(target=_load, name="moet-tokenizer", daemon=True)
            tok_thread.start()
        try:
            info = self._wait_ready()
        except BaseException:
            self._kill()
            raise
        if tok_thread is not None:
            tok_thread.join()
            if "error" in tok:
                self._inbox.send((_STOP,))
                self._kill(grace_s=30)
                raise tok["error"]
        self.tokenizer = tok.get("value")
        self.model_name: str = info["model_name"]
        self.max_model_len: int = info["max_model_len"]
        self.eos_token_ids: set[int] = info["eos_token_ids"]
        self._stats = info["stats"]
        self._send_lock = threading.Lock()             # one writer at a time; guards _dead too
        self._dead: str | None = None                  # why the child is gone (set once)
        self._stopping = False
        self._keys = itertools.count()
        self._requests: dict[int, _Request] = {}       # key -> request (loops add, the reader removes)
        self._acks: dict[int, tuple] = {}              # ack id -> (loop, future) of an abort()
        self._reader = threading.Thread(target=self._read, name="moet-engine-reader", daemon=True)
        self._reader.start()
        _LIVE.add(self)

    @classmethod
    def from_config(cls, config) -> "EngineProcess":
        from moet.engine.llm_engine import load_tokenizer

        source = config.load.tokenizer or config.model
        return cls(build_llm_engine, (config,), load_tokenizer=functools.partial(
            load_tokenizer, source, config.load.trust_remote_code), tokenizer_source=source)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def _wait_ready(self) -> dict:
        while not self._outbox.poll(0.1):
            if not self._proc.is_alive() and not self._outbox.poll(0):
                raise MoetError(f"the engine process exited during start-up ({self._exit_text()}); "
                                "its log above says why")
        try:
            msg = self._outbox.recv()
        except (EOFError, OSError):
            raise MoetError(f"the engine process exited during start-up ({self._exit_text()})") from None
        if msg[0] == "failed":
            _, exc, tb = msg
            log.debug("engine process start-up failed:\n%s", tb)
            raise exc
        return msg[1]

    def _exit_text(self) -> str:
        with self._reap_lock:
            self._proc.join(timeout=1.0)
            code = self._proc.exitcode
        if code is None:
            return "still running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    # ------------------------------------------------------------------ requests

    def _encode(self, prompt) -> dict:
        from moet.engine.llm_engine import encode_prompt

        text, ids = encode_prompt(self.tokenizer, prompt, self.tokenizer_source)
        return {"prompt_token_ids": ids, "prompt": text}

    def _post(self, op: tuple) -> bool:
        """Send an add / abort to the child; False once it is gone."""
        with self._send_lock:
            if self._dead is not None:
                return False
            try:
                self._inbox.send(op)
            except (OSError, ValueError):              # broken pipe / closed: the reader says why
                return False
        return True

    def _gone(self) -> MoetError:
        if self._stopping:
            return MoetError(_SHUTTING_DOWN)
        return MoetError(self._dead or f"the engine process (pid {self._proc.pid}) exited unexpectedly; the server "
                                       "cannot generate until it is restarted")

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if self._stopping or self._dead is not None:
            raise self._gone()
        stream = _Stream(asyncio.get_running_loop())
        if isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt_token_ids" not in prompt):
            prompt = await asyncio.to_thread(self._encode, prompt)
        key = next(self._keys)
        self._requests[key] = _Request(request_id, stream)   # before the send: the reader must find it
        if self._stopping or not self._post((_ADD, key, request_id, prompt, params)):
            self._requests.pop(key, None)
            raise self._gone()
        outs = _stream_outputs(stream, lambda: self._post((_ABORT, request_id, None)))
        try:
            async for item in outs:
                yield item
        finally:
            await outs.aclose()

    async def abort(self, request_id: str) -> None:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        ack = next(self._keys)
        self._acks[ack] = (loop, fut)
        if self._post((_ABORT, request_id, ack)):
            await fut
        else:                                          # the child is gone: nothing runs
            self._acks.pop(ack, None)

    def stats(self):
        """The snapshot sent with the last step (never waits for a step); raises once the
        engine process is gone, so /health turns 503."""
        if self._dead is not None:
            raise MoetError(self._dead)
        return self._stats

    def health(self) -> tuple[str, str]:
        """LLMEngine.health() as the last step's stats tell it: ("ok", "") or ("degraded",
        reason); raises like stats() once the engine process is gone."""
        from moet.engine.expert_residency import health_from_extra

        return health_from_extra(self.stats().extra)

    async def shutdown(self) -> None:
        self._stopping = True
        self._post((_STOP,))
        await asyncio.to_thread(self._finish)

    # ------------------------------------------------------------------ the reader thread

    def _read(self) -> None:
        requests = self._requests
        while True:
            try:
                msg = self._outbox.recv()
            except (EOFError, OSError):
                break
            except Exception:                          # an undecodable message: the child misbehaves
                log.exception("bad message from the engine process")
                break
            _, events, stats = msg
            if stats is not None:
                self._stats = stats
            batches: dict = {}
            for ev in events:
                kind, key = ev[0], ev[1]
                if kind == _ACK:
                    loop, fut = self._acks.pop(key, (None, None))
                    if fut is not None:
                        _call(loop, _resolve, fut)
                    continue
                if kind == _OUT:
                    req = requests.get(key)
                    if req is None:
                        continue
                    item = req.apply(ev)
                    if item.finished:
                        del requests[key]
                else:
                    req = requests.pop(key, None)
                    if req is None:
                        continue
                    item = _END if kind == _ENDED else _Refused(ev[2]) if kind == _REFUSED else ev[2]
                batches.setdefault(req.stream.loop, []).append((req.stream, item))
            for loop, items in batches.items():
                _call(loop, _push_all, items)
        self._on_child_gone()

    def _on_child_gone(self) -> None:
        if self._stopping:
            why = "the engine process has shut down"
        else:
            why = (f"the engine process (pid {self._proc.pid}) exited unexpectedly ({self._exit_text()}); "
                   "requests in flight failed and the server cannot generate until it is restarted")
        with self._send_lock:
            self._dead = why
        if not self._stopping:
            log.error(why)
        err = MoetError(why)
        batches: dict = {}
        for key in list(self._requests):
            req = self._requests.pop(key, None)
            if req is not None:
                batches.setdefault(req.stream.loop, []).append((req.stream, _END if self._stopping else err))
        for loop, items in batches.items():
            _call(loop, _push_all, items)
        for ack in list(self._acks):
            loop, fut = self._acks.pop(ack, (None, None))
            if fut is not None:
                _call(loop, _resolve, fut)

    # ------------------------------------------------------------------ ending

    def _finish(self) -> None:
        self._kill(grace_s=60)
        self._reader.join(timeout=10)
        self._close_pipes()
        _LIVE.discard(self)

    def _kill(self, grace_s: float = 0.0) -> None:
        """Wait grace_s for the child to exit, then terminate, then kill; always reaps it."""
        p = self._proc
        with self._reap_lock:
            p.join(timeout=grace_s)
            if p.is_alive():
                if grace_s:
                    log.warning("the engine process did not stop within %.0f s: terminating it", grace_s)
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()

    def _close_pipes(self) -> None:
        for conn in (self._inbox, self._outbox):
            try:
                conn.close()
            except OSError:
                pass


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
