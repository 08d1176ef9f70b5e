"""EngineProcess (the engine in a spawned child process) against AsyncEngine (the engine in a
thread): identical greedy outputs, abort frees the child's blocks, refusals raise before the
first output, a failed step keeps serving, a killed child fails every request clearly and
turns /health bad, start-up errors keep their type and message, shutdown reaps the child.
The tiny glm4_moe checkpoint (byte-level tokenizer) on CPU: each child costs a few seconds
to spawn (torch import), so one shared child serves most tests."""
import asyncio
import multiprocessing
import os
import signal
import time

import httpx
import pytest

from moet.config import EngineConfig
from moet.engine.async_engine import AsyncEngine
from moet.engine.engine_process import EngineProcess, build_llm_engine
from moet.engine.llm_engine import LLMEngine
from moet.errors import ConfigError, MoetError
from moet.sampling_params import SamplingParams
from moet.testing.tiny_checkpoint import cached_checkpoint

PROMPT = list(b"The quick brown fox jumps over")


def _config(path, **kw) -> EngineConfig:
    # no prefix cache: a warm one changes the rounding of reused K/V (docs/architecture.md), and
    # the shared child's cache would depend on which tests ran before
    args = dict(model=path, expert_format="bf16", dtype="float32", device="cpu", block_size=4,
                max_num_batched_tokens=32, max_num_seqs=8, enable_prefix_caching=False)
    args.update(kw)
    return EngineConfig(**args)


@pytest.fixture(scope="module")
def path():
    return cached_checkpoint("glm4_moe")


@pytest.fixture(scope="module")
def proc_engine(path):
    ep = EngineProcess.from_config(_config(path))
    yield ep
    asyncio.run(ep.shutdown())


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def _collect(engine, rid, prompt, sp) -> list:
    return [o async for o in engine.generate(rid, prompt, sp)]


MIXED = [  # (prompt, params): text and token-id prompts, logprobs, prompt logprobs, n > 1, a stop string
    ("Hello there, engine", SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=3)),
    (PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=2)),
    ({"prompt": "abc abc abc"}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2, logprobs=1)),
    (list(b"xyz xyz xyz"), None),           # a stop string from its own greedy text (see the test)
]
STOP_PROMPT = list(b"xyz xyz xyz")


def _stop_string(text: str) -> str:
    """Two characters the greedy reply reaches after a few tokens (the random tiny model's text)."""
    for i in range(3, len(text) - 1):
        if "\ufffd" not in text[i:i + 2] and text[i:i + 2] not in text[:i + 1]:
            return text[i:i + 2]
    raise AssertionError(f"no stop string in {text!r}")


def _final(outs) -> tuple:
    last = outs[-1]
    return (last.finished, last.prompt, last.prompt_token_ids,
            repr(last.prompt_logprobs),
            [(c.index, c.text, c.token_ids, repr(c.logprobs), c.cumulative_logprob, c.finish_reason, c.stop_reason)
             for c in last.outputs])


def test_greedy_outputs_equal_the_thread_engine(path, proc_engine):
    # one at a time, the schedule (hence every rounding) is the same: identical ids, text,
    # logprobs; all at once, the batches depend on arrival timing (~1e-7 in a logprob), the
    # greedy tokens and text do not
    async def one_by_one(engine):
        return [await _collect(engine, f"s{i}", p, sp) for i, (p, sp) in enumerate(MIXED)]

    async def together(engine):
        return await asyncio.gather(*(_collect(engine, f"t{i}", p, sp) for i, (p, sp) in enumerate(MIXED)))

    thread = AsyncEngine(LLMEngine.from_config(_config(path)))
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    stop = _stop_string(asyncio.run(_collect(thread, "plain", STOP_PROMPT, plain))[-1].outputs[0].text)
    MIXED[3] = (STOP_PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))
    try:
        want, want_batched = asyncio.run(one_by_one(thread)), asyncio.run(together(thread))
    finally:
        asyncio.run(thread.shutdown())
    got, got_batched = asyncio.run(one_by_one(proc_engine)), asyncio.run(together(proc_engine))
    for w, g in zip(want, got):
        assert _final(g) == _final(w)
    for w, g in zip(want_batched, got_batched):
        assert [(c.text, c.token_ids) for c in g[-1].outputs] == [(c.text, c.token_ids) for c in w[-1].outputs]
    for g in got + got_batched:            # streamed cumulatively: every output extends the one before
        for a, b in zip(g, g[1:]):
            for ca, cb in zip(a.outputs, b.outputs):
                assert cb.token_ids[:len(ca.token_ids)] == ca.token_ids and cb.text.startswith(ca.text)
        assert g[-1].finished and not any(o.finished for o in g[:-1])
    assert got[3][-1].outputs[0].finish_reason == "stop" and got[3][-1].outputs[0].stop_reason == stop
    assert got[1][-1].prompt_logprobs is not None and len(got[1][-1].prompt_logprobs) == len(PROMPT)
    assert proc_engine.model_name == thread.model_name and proc_engine.max_model_len == thread.max_model_len
    assert proc_engine.eos_token_ids == thread.eos_token_ids


def test_abort_and_cancel_free_the_childs_blocks(proc_engine):
    sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        got = []
        async for o in proc_engine.generate("x", PROMPT, sp):
            got.append(o)
            if len(got) == 2:
                assert proc_engine.stats().num_free_kv_blocks < proc_engine.stats().num_kv_blocks
                await proc_engine.abort("x")       # returns once the child freed the blocks
                st = proc_engine.stats()
                assert st.num_running == 0 and st.num_free_kv_blocks == st.num_kv_blocks
        assert len(got) <= 3 and not got[-1].finished

        async def consume():
            async for _ in proc_engine.generate("y", PROMPT, sp):
                pass
        task = asyncio.create_task(consume())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await proc_engine.abort("never-existed")                 # harmless
        for _ in range(100):
            st = proc_engine.stats()
            if st.num_running == 0 and st.num_free_kv_blocks == st.num_kv_blocks:
                return st
            await asyncio.sleep(0.05)
        raise AssertionError(f"blocks not freed: {st}")

    asyncio.run(main())


def test_refused_requests_raise_before_yielding(proc_engine):
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)

    async def main():
        for prompt, match in (([1] * 10_000, "max_model_len"), ([10**6], "token ids"), ([], "empty")):
            seen = []
            with pytest.raises(ConfigError, match=match):
                async for o in proc_engine.generate("bad", prompt, sp):
                    seen.append(o)
            assert seen == []
        # a duplicate id is refused without touching the running request's stream
        first = proc_engine.generate("dup", PROMPT, sp)
        a = await first.__anext__()
        with pytest.raises(ConfigError, match="already running"):
            async for _ in proc_engine.generate("dup", PROMPT, sp):
                pass
        rest = [o async for o in first]
        assert rest[-1].finished and len(rest[-1].outputs[0].token_ids) == 30 and not a.finished

    asyncio.run(main())


class _FailingStep:
    """An LLMEngine whose step() raises while a request with id 'boom' runs (built in the child)."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        if "boom" in self._engine.requests:
            raise RuntimeError("injected step failure")
        return self._engine.step()


def build_failing(config):
    return _FailingStep(build_llm_engine(config))


def test_step_failure_fails_running_requests_and_keeps_serving_then_child_death(path):
    from moet.serve.api_server import build_app
    from tests.serve.server_thread import ServerThread

    ep = EngineProcess(build_failing, (_config(path),))
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def step_failure():
        with pytest.raises(MoetError, match="injected step failure"):
            await _collect(ep, "boom", PROMPT, sp)
        outs = await _collect(ep, "after", PROMPT, sp)
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 8

    asyncio.run(step_failure())
    app = build_app(ep, tool_parser=None, reasoning_parser=None)
    with ServerThread(app) as server:
        assert httpx.get(server.url + "/health").status_code == 200
        pid = ep.pid

        async def killed():
            long = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
            agen = ep.generate("long", PROMPT, long)
            await agen.__anext__()
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(MoetError, match="exited unexpectedly .*killed by SIGKILL"):
                async for _ in agen:
                    pass
            with pytest.raises(MoetError, match="exited unexpectedly"):
                await _collect(ep, "new", PROMPT, sp)
            await ep.abort("long")                              # returns: nothing runs
        asyncio.run(killed())
        r = httpx.get(server.url + "/health")
        assert r.status_code == 503 and "exited unexpectedly" in r.text
        with pytest.raises(MoetError):
            ep.stats()
    # the lifespan's shutdown ran (and returned) on the dead child
    assert not _alive(pid) and not ep._proc.is_alive()


def test_start_up_errors_keep_type_and_message(path, tmp_path, proc_engine):
    for cfg in (_config(path, num_kv_blocks=5, max_model_len=40), _config(str(tmp_path / "missing"))):
        with pytest.raises(Exception) as thread_err:
            LLMEngine.from_config(cfg)
        with pytest.raises(type(thread_err.value)) as proc_err:
            EngineProcess.from_config(cfg)
        assert str(proc_err.value) == str(thread_err.value)
    assert not [p for p in multiprocessing.active_children() if p.name == "moet-engine" and p.pid != proc_engine.pid]


def test_shutdown_leaves_no_child(path):
    ep = EngineProcess.from_config(_config(path))
    pid = ep.pid
    assert _alive(pid)
    sp = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)

    async def main():
        agen = ep.generate("running", PROMPT, sp)
        await agen.__anext__()
        t0 = time.perf_counter()
        await ep.shutdown()                                     # a running request ends, the child exits
        assert time.perf_counter() - t0 < 30
        assert not any(o.finished for o in [o async for o in agen])   # ends, without an error
        with pytest.raises(MoetError, match="shutting down"):
            await _collect(ep, "late", PROMPT, sp)

    asyncio.run(main())
    assert not _alive(pid) and ep._proc.exitcode == 0
    assert ep not in multiprocessing.active_children()


def test_serve_flag_and_the_stand_in_engine_in_a_child(tmp_path):
    import argparse
    import json

    from benchmarks import benchmark_serve_overhead as serve_overhead
    from moet.serve.serve_config import add_serve_arguments, serve_config_from_args

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    from moet.errors import ConfigError
    from moet.serve.serve_config import ENGINE_PROCESS_MIN_CPUS, ServeConfig, uses_engine_process

    on, off, auto = (serve_config_from_args(p.parse_args(a)) for a in
                     (["--engine-process", "true"], ["--engine-process", "False"], []))
    assert (on.engine_process, off.engine_process, auto.engine_process) == ("true", "false", "auto")
    assert uses_engine_process(on, cpus=1) and not uses_engine_process(off, cpus=64)
    # auto: a process only where it gets a core of its own next to the server's event loop
    assert uses_engine_process(auto, cpus=ENGINE_PROCESS_MIN_CPUS)
    assert not uses_engine_process(auto, cpus=ENGINE_PROCESS_MIN_CPUS - 1)
    assert ServeConfig(engine_process=True).engine_process == "true"      # Python callers may pass a bool
    with pytest.raises(ConfigError, match="engine_process='sometimes'"):
        ServeConfig(engine_process="sometimes")
    # serve_overhead's stand-in, built in the child by its factory: every reply checked
    out = tmp_path / "r.json"
    assert serve_overhead.main(["--rows", "python_process", "--requests", "6", "--concurrency", "3", "--max-tokens",
                                "8", "--step-ms", "1", "--logprobs", "2", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["python_process"]
    assert row["requests_done"] == 6 and row["failures"] == 0 and row["tokens"] == 48 and row["engine_steps"] > 0
    assert row["engine_cpu_us_per_token"] is not None          # (whole clock ticks: 0 for so short a pass)
