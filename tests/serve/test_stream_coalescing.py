"""Streaming per wake-up instead of per token, and the server's cost per streamed token.

- AsyncEngine wakes each event loop once per engine step (one call_soon_threadsafe for all of
  the step's requests, not one per request), and a consumer that fell behind gets one output
  with everything it missed instead of one per step.
- A delta of several tokens (what a coalesced wake-up hands the server) keeps OpenAI's
  semantics: tool calls whole, one logprob per token with continuous text offsets, stop
  strings not emitted, usage right, one finish_reason per choice.
- The SSE chunks, written without pydantic, are exactly what the protocol models write.
- The serve_overhead benchmark's loopback measurement, bounded: every token arrives once,
  never more events than tokens.
"""
from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import openai
import pytest

from benchmarks.benchmark_serve_overhead import InstantEngine, _cpu_s, stream_load
from moet.engine.async_engine import AsyncEngine, _push_all
from moet.sampling_params import SamplingParams
from moet.serve.api_server import build_app
from moet.serve.protocol import ChatCompletionChunk, CompletionResponse, ErrorResponse
from moet.serve.serve_config import ServeConfig
from tests.serve.fake_engine import FakeAsyncEngine, _tokenizer
from tests.serve.server_thread import ServerThread
from tests.serve.test_api_server import WEATHER, make_app, script

# ---------------------------------------------------------------------------- the engine side


def test_async_engine_wakes_each_loop_once_per_step():
    inner = InstantEngine(_tokenizer(), step_s=0.001)
    eng = AsyncEngine(inner)

    async def main():
        loop = asyncio.get_running_loop()
        calls = []
        real = loop.call_soon_threadsafe

        def counting(cb, *args, **kw):
            calls.append(cb)
            return real(cb, *args, **kw)

        loop.call_soon_threadsafe = counting
        sp = SamplingParams(max_tokens=12, ignore_eos=True)

        async def one(i):
            return [o async for o in eng.generate(f"r{i}", [1, 2, 3 + i], sp)]

        steps0 = inner.num_steps
        outs = await asyncio.gather(*(one(i) for i in range(16)))
        steps = inner.num_steps - steps0
        made = list(calls)
        await eng.shutdown()
        return outs, made, steps

    outs, calls, steps = asyncio.run(main())
    # every cross-thread wake-up of the loop, whatever its callback: one per step at most
    # (one per request per step would be 16 x 12 = 192)
    assert 12 <= steps and len(calls) <= steps and all(c is _push_all for c in calls)
    for o in outs:
        assert o[-1].finished and len(o[-1].outputs[0].token_ids) == 12
        lens = [len(x.outputs[0].token_ids) for x in o]
        assert lens == sorted(set(lens))         # cumulative, each output newer than the last


def test_a_consumer_that_falls_behind_gets_one_output_with_all_it_missed():
    inner = InstantEngine(_tokenizer(), step_s=0.002)
    eng = AsyncEngine(inner)
    sp = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=2)

    async def main():
        got = []
        async for o in eng.generate("slow", [5, 6, 7], sp):
            got.append(o)
            if len(got) == 1:
                time.sleep(0.3)                  # the event loop stalls: the engine runs on
        await eng.shutdown()
        return got

    got = asyncio.run(main())
    last = got[-1].outputs[0]
    assert len(got) < 40 and got[-1].finished and len(last.token_ids) == 40
    assert len(last.logprobs) == 40 and last.text == inner._text(40)


def test_refused_request_raises_before_output_and_aborts_nothing():
    inner = InstantEngine(_tokenizer(), step_s=0.01)
    eng = AsyncEngine(inner)

    async def main():
        sp = SamplingParams(max_tokens=30, ignore_eos=True)
        first = asyncio.create_task(eng.generate("dup", [1, 2], sp).__anext__())
        await first                              # "dup" is running
        from moet.errors import ConfigError
        with pytest.raises(ConfigError, match="already running"):
            async for _ in eng.generate("dup", [3, 4], sp):
                pass
        await asyncio.sleep(0.05)
        alive = "dup" in inner.requests          # the refused twin did not abort the original
        await eng.shutdown()
        return alive

    assert asyncio.run(main())


def test_after_shutdown_requests_are_refused_and_aborts_return():
    eng = AsyncEngine(InstantEngine(_tokenizer(), step_s=0.001))

    async def main():
        from moet.errors import MoetError
        sp = SamplingParams(max_tokens=500, ignore_eos=True)
        running = eng.generate("long", [1, 2, 3], sp)
        await running.__anext__()
        await eng.shutdown()
        rest = [o async for o in running]        # the running request just ends
        with pytest.raises(MoetError, match="shutting down"):
            async for _ in eng.generate("late", "a text prompt", sp):
                pass
        await asyncio.wait_for(eng.abort("long"), 5)   # nothing left to abort: returns at once
        return rest

    assert all(not o.finished for o in asyncio.run(main()))


# ---------------------------------------------------------------------------- the HTTP side

def _data_lines(resp) -> list[str]:
    return [line[6:] for line in resp.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.fixture(scope="module")
def chunky():
    """The test double handing out four tokens per step, as a coalesced wake-up does."""
    engine = FakeAsyncEngine(script, tokens_per_step=4)
    with ServerThread(make_app(engine)) as s:
        yield engine, s


STREAMS = [
    ("chat", {"messages": [{"role": "user", "content": "What is 12+30?"}],
              "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    ("chat", {"messages": [{"role": "user", "content": "Weather in Paris for 2 days?"}], "tools": [WEATHER]}),
    ("chat", {"messages": [{"role": "user", "content": "Say hello"}], "n": 2, "logprobs": True, "top_logprobs": 2,
              "stop": [","], "stream_options": {"include_usage": True}}),
    ("completions", {"prompt": "def fib(n):", "max_tokens": 9, "echo": True, "logprobs": 2,
                     "stream_options": {"include_usage": True}}),
    ("completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 6, "stop": [" there"],
                     "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
]


@pytest.mark.parametrize("endpoint,body", STREAMS)
def test_chunks_are_exactly_what_the_protocol_models_write(chunky, endpoint, body):
    _, s = chunky
    model = ChatCompletionChunk if endpoint == "chat" else CompletionResponse
    with httpx.stream("POST", f"{s.url}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}",
                      json={**body, "stream": True}, timeout=30) as resp:
        assert resp.status_code == 200
        lines = _data_lines(resp)
    assert len(lines) >= 2
    ids, created = set(), set()
    for data in lines:
        assert "error" not in json.loads(data), data
        # validated by the response model (extra fields forbidden) and written back unchanged
        assert model.model_validate_json(data).model_dump_json(exclude_none=True) == data
        ids.add(json.loads(data)["id"])
        created.add(json.loads(data)["created"])
    assert len(ids) == 1 and len(created) == 1


def test_coalesced_deltas_keep_openai_semantics(chunky):
    engine, s = chunky
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
    # a tool call is never split, whatever the delta size
    msgs = [{"role": "user", "content": "Weather in Paris for 2 days?"}]
    chunks = list(c.chat.completions.create(model="moet-tiny", messages=msgs, tools=[WEATHER], stream=True))
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 2}
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["tool_calls"]

    # reasoning / content split and usage as in the one-piece answer
    msgs = [{"role": "user", "content": "What is 12+30?"}]
    whole = c.chat.completions.create(model="moet-tiny", messages=msgs)
    chunks = list(c.chat.completions.create(model="moet-tiny", messages=msgs, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()

    # one logprob per token, n choices each complete; the stop string is not sent
    msgs = [{"role": "user", "content": "Say hello"}]
    chunks = list(c.chat.completions.create(model="moet-tiny", messages=msgs, n=2, logprobs=True, top_logprobs=2,
                                            stream=True, stream_options={"include_usage": True}))
    per = {0: [], 1: []}
    text = {0: "", 1: ""}
    for ch in chunks:
        for choice in ch.choices:
            per[choice.index] += choice.logprobs.content if choice.logprobs else []
            text[choice.index] += choice.delta.content or ""
    assert len(per[0]) + len(per[1]) == chunks[-1].usage.completion_tokens
    assert "".join(t.token for t in per[0]).startswith("<think></think>")
    assert all(len(t.top_logprobs) == 2 for t in per[0] + per[1])
    chunks = list(c.chat.completions.create(model="moet-tiny", messages=msgs, stop=[","], stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "Hello there"

    # completions: echo with logprobs scores the prompt's tokens first (the first has none), then the
    # completion's; text offsets run on across the echo and every delta
    chunks = list(c.completions.create(model="moet-tiny", prompt="def fib(n):", max_tokens=9, echo=True, logprobs=2,
                                       stream=True, stream_options={"include_usage": True}))
    tokens, offsets, lps = [], [], []
    for ch in chunks:
        for choice in ch.choices:
            if choice.logprobs:
                tokens += choice.logprobs.tokens
                offsets += choice.logprobs.text_offset
                lps += choice.logprobs.token_logprobs
    n_prompt = chunks[-1].usage.prompt_tokens
    assert chunks[0].choices[0].text.startswith("def fib(n):")
    assert len(tokens) == n_prompt + 9 and chunks[-1].usage.completion_tokens == 9
    assert lps[0] is None and all(isinstance(x, float) for x in lps[1:])
    assert "".join(tokens[:n_prompt]).endswith("def fib(n):")   # after the bos token the tokenizer adds
    want, at = [], 0
    for t in tokens:
        want.append(at)
        at += len(t)
    assert offsets == want


def test_streamed_timeout_is_reported_in_band_and_aborts():
    engine = FakeAsyncEngine(script, step_s=0.05)
    with ServerThread(make_app(engine, request_timeout_s=0.6)) as s:
        with httpx.stream("POST", s.url + "/v1/completions", timeout=30, json={
                "prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}) as resp:
            lines = _data_lines(resp)
        err = json.loads(lines[-1])
        assert ErrorResponse.model_validate(err).error.type == "timeout_error"
        assert engine.aborted and not engine.running


def test_disconnect_while_the_engine_is_quiet_aborts_at_once():
    """No token is on its way (a 3 s step): the connection watcher, not a failed write, must
    end the request."""
    engine = FakeAsyncEngine(script, step_s=3.0)
    with ServerThread(make_app(engine)) as s:
        t0 = time.time()
        with httpx.stream("POST", s.url + "/v1/completions", timeout=30, json={
                "prompt": "x", "max_tokens": 50, "ignore_eos": True, "stream": True}) as resp:
            next(resp.iter_lines())              # the first token (after one step) ...
        gone = time.time()                       # ... then the client goes away
        while engine.running and time.time() < gone + 5:
            time.sleep(0.02)
        assert not engine.running and len(engine.aborted) == 1
        assert time.time() - gone < 2.5 < time.time() - t0   # before the next step could have sent anything


# ---------------------------------------------------------------------------- the benchmark, bounded

@pytest.mark.parametrize("endpoint,logprobs", [("completions", 2), ("chat", None)])
def test_server_overhead_loopback_counts_every_token_once(endpoint, logprobs):
    inner = InstantEngine(_tokenizer(), step_s=0.001)
    app = build_app(AsyncEngine(inner), ServeConfig(log_requests=False), tool_parser=None, reasoning_parser=None)
    with ServerThread(app) as s:
        res = asyncio.run(stream_load(s.url, requests=12, concurrency=4, max_tokens=16, endpoint=endpoint,
                                      logprobs=logprobs, deadline=time.perf_counter() + 120))
    assert res["failures"] == 0, res["failure_examples"]
    assert res["requests_done"] == 12 and res["tokens"] == 12 * 16
    assert 12 <= res["events"] <= res["tokens"]          # at most one event per token, at least one per request
    assert set(res["texts"]) == {inner._text(16)}


def test_cpu_time_probe_reads_this_process():
    a = _cpu_s(os.getpid())
    t = time.process_time()
    while time.process_time() - t < 0.05:
        pass
    assert _cpu_s(os.getpid()) > a >= 0.0 and _cpu_s(os.getpid(), os.getpid()) > 0.0


def test_loop_histogram_renders_as_prometheus_histogram_does():
    import random

    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from moet.serve.metrics import _ITL_BUCKETS, LoopHistogram

    ref_reg, reg = CollectorRegistry(), CollectorRegistry()
    ref = Histogram("moet:inter_token_latency_seconds", "doc", ["model_name"], buckets=_ITL_BUCKETS,
                    registry=ref_reg).labels("moet-tiny")
    ours = LoopHistogram("moet:inter_token_latency_seconds", "doc", "moet-tiny", _ITL_BUCKETS)
    reg.register(ours)
    rng = random.Random(0)
    for v in [0.0, 0.001, 0.0025, 10.0, 11.0] + [rng.random() * rng.choice([0.01, 1, 20]) for _ in range(500)]:
        ref.observe(v)
        ours.observe(v)
    a, b = generate_latest(ref_reg).decode().splitlines(), generate_latest(reg).decode().splitlines()
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if "_created{" in x:                 # a timestamp: when each was made
            assert x.split()[0] == y.split()[0]
        else:
            assert x == y
