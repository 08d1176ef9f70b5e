"""The HTTP app over FakeAsyncEngine (a test double of contract 2), served by uvicorn on a free
loopback port and driven with the official openai client and raw httpx."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from moet.serve.api_server import build_app
from moet.serve.reasoning import ReasoningParser
from moet.serve.serve_config import ServeConfig
from moet.serve.tool_parsers import get_tool_parser
from tests.serve.fake_engine import FakeAsyncEngine
from tests.serve.server_thread import ServerThread

CALL = ("<think></think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}},
                                                "required": ["city"]}}}


def script(prompt: str) -> str:
    if "<tool_response>" in prompt:
        return "<think></think>\nIt is 21 degrees in Paris."
    if prompt.endswith("<think></think>\n") and "<tools>" in prompt:   # forced call (thinking off)
        return "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call>"
    if "<tools>" in prompt:
        return CALL
    if "12+30" in prompt:
        return "<think>2+0=2, 1+3=4</think>\n42"
    return "<think></think>\nHello there, friend."


def _matcher(grammar: str):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(FakeAsyncEngine().tokenizer)
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(grammar))


def make_app(engine, **cfg):
    return build_app(engine, ServeConfig(**cfg), tool_parser=get_tool_parser("glm45"),
                     reasoning_parser=ReasoningParser(), generation_config={"do_sample": False, "max_new_tokens": 64})


@pytest.fixture(scope="module")
def engine():
    return FakeAsyncEngine(script)


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(make_app(engine)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _prompt_len(engine, messages, tools=None, **kw):
    text = engine.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kw)
    return len(engine.tokenizer.encode(text, add_special_tokens=False))


def _reply_len(engine, text):
    return len(engine.tokenizer.encode(text, add_special_tokens=False)) + 1  # + the eos token


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["moet-tiny"]
    assert client.models.retrieve("moet-tiny").id == "moet-tiny"
    assert httpx.get(server.url + "/health").status_code == 200


def test_chat_plain_with_reasoning_split_and_usage(engine, client):
    msgs = [{"role": "user", "content": "What is 12+30?"}]
    r = client.chat.completions.create(model="moet-tiny", messages=msgs)
    m = r.choices[0].message
    assert m.content == "42" and m.model_extra["reasoning_content"] == "2+0=2, 1+3=4"
    assert r.choices[0].finish_reason == "stop" and not m.tool_calls
    assert r.usage.prompt_tokens == _prompt_len(engine, msgs)
    assert r.usage.completion_tokens == _reply_len(engine, script("12+30"))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert engine.params_seen[-1].temperature == 0.0 and engine.params_seen[-1].max_tokens == 64  # generation_config


def test_chat_stream_matches_and_reports_usage(engine, client, caplog):
    caplog.set_level("INFO", logger="moet.serve")
    msgs = [{"role": "user", "content": "What is 12+30?"}]
    chunks = list(client.chat.completions.create(model="moet-tiny", messages=msgs, stream=True,
                                                 stream_options={"include_usage": True}))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices)
    assert content == "42" and reasoning == "2+0=2, 1+3=4"
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == _reply_len(engine, script("12+30"))
    assert chunks[-1].usage.prompt_tokens == _prompt_len(engine, msgs)
    time.sleep(0.2)  # the log line is written once the response has been sent
    line = f"POST /v1/chat/completions 200 prompt={_prompt_len(engine, msgs)} completion={_reply_len(engine, script('12+30'))}"
    assert any(line in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_tool_call_parsed_complete_and_streamed(engine, client):
    msgs = [{"role": "user", "content": "Weather in Paris for 2 days?"}]
    r = client.chat.completions.create(model="moet-tiny", messages=msgs, tools=[WEATHER])
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert call.id.startswith("call_")
    assert "<tools>" in engine.prompts_seen[-1] and '"name": "get_weather"' in engine.prompts_seen[-1]

    chunks = list(client.chat.completions.create(model="moet-tiny", messages=msgs, tools=[WEATHER], stream=True))
    deltas = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1  # the whole call in one delta: id, name and complete arguments
    assert deltas[0].function.name == "get_weather" and json.loads(deltas[0].function.arguments)["days"] == 2
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_result_turn_renders_history(engine, client):
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 21})}]
    r = client.chat.completions.create(model="moet-tiny", messages=msgs, tools=[WEATHER])
    assert r.choices[0].message.content == "It is 21 degrees in Paris." and r.choices[0].finish_reason == "stop"
    seen = engine.prompts_seen[-1]
    assert ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call><|end|>") in seen
    assert '<tool_response>\n{"temperature": 21}\n</tool_response><|assistant|>\n' in seen


def test_tool_choice_none_and_named(engine, client):
    msgs = [{"role": "user", "content": "Weather?"}]
    r = client.chat.completions.create(model="moet-tiny", messages=msgs, tools=[WEATHER], tool_choice="none")
    assert "<tools>" not in engine.prompts_seen[-1] and not r.choices[0].message.tool_calls
    r = client.chat.completions.create(model="moet-tiny", messages=msgs, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert engine.prompts_seen[-1].endswith("<|assistant|>\n<think></think>\n")
    grammar = engine.params_seen[-1].structured_outputs.grammar     # the reply is a call under a grammar
    matcher = _matcher(grammar)
    assert matcher.accept_string(script(engine.prompts_seen[-1])) and matcher.is_completed()
    assert not _matcher(grammar).accept_string("<tool_call>get_time\n")       # only the named function
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}
    chunks = list(client.chat.completions.create(model="moet-tiny", messages=msgs, tools=[WEATHER], stream=True,
                                                 tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Rome"}]


def test_chat_n_seed_stop_logprobs(engine, client):
    msgs = [{"role": "user", "content": "Say hello"}]
    r = client.chat.completions.create(model="moet-tiny", messages=msgs, n=2, seed=5, temperature=0.7, top_p=0.9,
                                       logprobs=True, top_logprobs=3, max_completion_tokens=40)
    sp = engine.params_seen[-1]
    assert (sp.n, sp.seed, sp.temperature, sp.top_p, sp.logprobs, sp.max_tokens) == (2, 5, 0.7, 0.9, 3, 40)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[1].message.content.endswith("#1")
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens // 2 and all(len(t.top_logprobs) == 3 for t in lp)
    assert "".join(t.token for t in lp).startswith("<think></think>")
    r = client.chat.completions.create(model="moet-tiny", messages=msgs, stop=[","])
    assert r.choices[0].message.content == "Hello there" and engine.params_seen[-1].stop == [","]
    r = client.chat.completions.create(model="moet-tiny", messages=msgs, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_completions(engine, client):
    r = client.completions.create(model="moet-tiny", prompt="def fib(n):", max_tokens=5, echo=True, logprobs=2)
    c = r.choices[0]
    assert c.text.startswith("def fib(n):") and c.finish_reason == "length" and r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens == len(engine.tokenizer("def fib(n):").input_ids)
    # echo + logprobs: the prompt's tokens come first, scored (the first has nothing to predict it)
    n_prompt = r.usage.prompt_tokens
    assert len(c.logprobs.tokens) == n_prompt + 5 and c.logprobs.token_logprobs[0] is None
    assert c.logprobs.top_logprobs[0] is None and all(len(t) == 2 for t in c.logprobs.top_logprobs[1:])
    assert engine.params_seen[-1].prompt_logprobs == 2
    r = client.completions.create(model="moet-tiny", prompt=["a", "b"], n=2, max_tokens=4)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    ids = engine.tokenizer("hello").input_ids
    stream = list(client.completions.create(model="moet-tiny", prompt=ids, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in stream if ch.choices)
    assert text == engine.tokenizer.decode(engine.tokenizer.encode(script("x"), add_special_tokens=False)[:4])
    assert stream[-1].usage.completion_tokens == 4 and stream[-1].usage.prompt_tokens == len(ids)


def test_sixteen_concurrent_streams(server):
    async def one(c, i):
        s = await c.chat.completions.create(model="moet-tiny", messages=[{"role": "user", "content": f"hi {i}"}],
                                            stream=True)
        return "".join([ch.choices[0].delta.content or "" async for ch in s if ch.choices])

    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        return await asyncio.gather(*(one(c, i) for i in range(16)))

    assert asyncio.run(main()) == ["Hello there, friend."] * 16


BAD = [  # (body or raw bytes, status, substring of the message)
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "gpt-9"),
    ({"messages": [{"role": "user", "content": "word " * 600}]}, 413, "maximum context length"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 ** 9}, 400, "at most"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}, 400, "type 'object'"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {}}]}, 400, "name"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
      "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "nope"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, 400, "response_format.json_schema.schema: Unsupported type"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema",
                                                                           "json_schema": {"name": "x"}}}, 400,
     "needs json_schema.schema"),
    ({"messages": [{"role": "user", "content": "hi"}], "guided_regex": "[a-"}, 400, "guided_regex: Regex parsing"),
    ({"messages": [{"role": "user", "content": "hi"}], "guided_grammar": 'root ::= "a" root'}, 400,
     "guided_grammar: the grammar admits no string"),
    ({"messages": [{"role": "user", "content": "hi"}], "guided_grammar": "root ::= x"}, 400,
     'Rule "x" is not defined'),
    ({"messages": [{"role": "user", "content": "hi"}], "guided_choice": []}, 400, "non-empty list"),
    ({"prompt": "hi", "guided_regex": "a", "guided_choice": ["x"]}, 400, "one output constraint"),
    ({"prompt": "hi", "structured_outputs": {"jsonn": {}}}, 400, "unknown key 'jsonn'"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, 400, "cannot also follow response_format"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 1}}, 400, "logit_bias"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
      "function": {"name": "f", "arguments": "{oops"}}]}]}, 400, "not valid JSON"),
]


@pytest.mark.parametrize("body,status,needle", BAD)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client, body, status, needle):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
    r = httpx.post(server.url + path, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] and "code" in err
    ok = client.chat.completions.create(model="moet-tiny", messages=[{"role": "user", "content": "hi"}])
    assert ok.choices[0].message.content == "Hello there, friend."


def test_completions_errors(server):
    for body, status in [({"prompt": []}, 400), ({"prompt": [[1, 2], []]}, 400), ({"prompt": [10 ** 9]}, 400),
                         ({"prompt": "x", "suffix": "y"}, 400), ({"prompt": "x", "stream_options": {}}, 400)]:
        r = httpx.post(server.url + "/v1/completions", json=body)
        assert r.status_code == status, (body, r.text)
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0).models.retrieve("other")


def test_api_key():
    engine = FakeAsyncEngine(script)
    with ServerThread(make_app(engine, api_key="sekret")) as s:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert httpx.post(s.url + "/v1/chat/completions", json={}).status_code == 401
        ok = openai.OpenAI(base_url=s.url + "/v1", api_key="sekret", max_retries=0)
        assert ok.models.list().data[0].id == "moet-tiny"
        assert httpx.get(s.url + "/health").status_code == 200   # health and metrics stay open


def test_queue_bound_and_timeout():
    engine = FakeAsyncEngine(script, step_s=0.05)
    with ServerThread(make_app(engine, max_pending_requests=1, request_timeout_s=1.5)) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "hi"}]
        # a long request (ignore_eos would run to max_tokens) holds the only slot ...
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
            s.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 100, "ignore_eos": True}, timeout=30)))
        t.start()
        deadline = time.time() + 10                  # wait until it holds the slot (not a fixed sleep:
        while not engine.running and time.time() < deadline:   # a loaded machine may be slower)
            time.sleep(0.01)
        assert engine.running
        with pytest.raises(openai.RateLimitError):   # ... so a second one is refused at once
            c.chat.completions.create(model="moet-tiny", messages=msgs)
        t.join()
        r = result["r"]          # and the long one runs past --request-timeout-s: 504, aborted
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
        assert engine.aborted and not engine.running
        assert c.chat.completions.create(model="moet-tiny", messages=msgs, max_tokens=3).choices[0].finish_reason == "length"


def test_client_disconnect_aborts_and_frees_blocks():
    engine = FakeAsyncEngine(script, step_s=0.05)
    with ServerThread(make_app(engine)) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "hi"}]
        # a client that drops a stream aborts its request and frees its blocks
        with httpx.stream("POST", s.url + "/v1/chat/completions", timeout=30, json={
                "messages": msgs, "stream": True, "max_tokens": 200, "ignore_eos": True}) as resp:
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert resp.status_code == 200 and got[0].startswith("data: ")
            assert engine.running
        deadline = time.time() + 5
        while engine.running and time.time() < deadline:
            time.sleep(0.02)
        assert not engine.running and len(engine.aborted) == 1 and engine.stats().kv_usage == 0

        # the same for a non-streamed request whose client gives up
        engine.aborted.clear()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 200, "ignore_eos": True},
                       timeout=0.2)
        deadline = time.time() + 5
        while engine.running and time.time() < deadline:
            time.sleep(0.02)
        assert not engine.running and len(engine.aborted) == 1
        # and it still serves
        assert c.chat.completions.create(model="moet-tiny", messages=msgs).choices[0].message.content == "Hello there, friend."


def test_metrics_exposes_latencies_tokens_and_engine_counters(server, client):
    client.chat.completions.create(model="moet-tiny", messages=[{"role": "user", "content": "hi"}])
    text = httpx.get(server.url + "/metrics").text
    for name in ("moet:num_requests_running", "moet:num_requests_waiting", "moet:kv_cache_usage_perc",
                 "moet:prompt_tokens_total", "moet:generation_tokens_total", "moet:expert_cache_hits",
                 "moet:w2_rows", "moet:time_to_first_token_seconds_bucket", "moet:inter_token_latency_seconds_count",
                 "moet:e2e_request_latency_seconds_count", 'moet:request_success_total{finished_reason="stop"'):
        assert name in text, name
    ttft = [l for l in text.splitlines() if l.startswith("moet:time_to_first_token_seconds_count")]
    assert float(ttft[0].split()[-1]) >= 1
    assert 'moet:http_requests_total{endpoint="/v1/chat/completions",status="200"}' in text


def test_load_test_client_counts_every_request_and_no_failures(server):
    """moet.bench.serve's HTTP load (N concurrent clients, a fixed number of requests) against
    the test double: every request completes with exactly max_tokens tokens, none fails."""
    from moet.bench.serve import http_load
    res, check = asyncio.run(http_load(server.url, requests=24, concurrency=8, max_tokens=6,
                                       deadline=time.perf_counter() + 120, check_ids=[1, 5, 9]))
    assert res["failures"] == 0 and res["requests_done"] == 24 and res["generated_tokens"] == 24 * 6
    assert 0 < res["latency_p50_s"] <= res["latency_p99_s"] and res["ttft_p50_s"] is not None
    assert check == script("hi")   # raw completion text: no parser in the way


def test_load_from_several_client_processes_merges_into_one_pass(server):
    """--client-procs: the requests and the concurrency split over spawned client processes, each
    request number taken once, every token counted, one wall time from the earliest start to the
    last end, the clients' own CPU reported."""
    from moet.bench.serve import http_load_procs
    res, check = http_load_procs(server.url, requests=10, concurrency=4, max_tokens=5,
                                 deadline=time.perf_counter() + 120, procs=3, check_ids=[1, 5, 9])
    assert res["failures"] == 0 and res["requests_done"] == 10 and res["complete"]
    assert res["generated_tokens"] == 10 * 5 and res["client_procs"] == 3
    assert res["warmup"]["requests_done"] == 10 and res["warmup"]["failures"] == 0
    assert 0 < res["client_cpu_per_wall"] and res["client_cpu_us_per_token"] > 0
    assert res["wall_s"] >= res["latency_p99_s"] > 0
    assert check == script("hi")


def test_special_token_parsers_decode_with_special_tokens_and_drop_the_eos_text():
    """Kimi-K2 / DeepSeek-V3 markers are special tokens: the server asks the engine to keep them
    and cuts the end-of-turn token's text from the reply."""
    kimi = ('Checking<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
            '<|tool_call_argument_begin|>{"city": "Kyiv"}<|tool_call_end|><|tool_calls_section_end|>')
    engine = FakeAsyncEngine(lambda prompt: kimi)
    app = build_app(engine, ServeConfig(), tool_parser=get_tool_parser("kimi_k2"), reasoning_parser=None)
    with ServerThread(app) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "Weather in Kyiv?"}]
        r = c.chat.completions.create(model="moet-tiny", messages=msgs, tools=[WEATHER])
        assert engine.params_seen[-1].skip_special_tokens is False
        m = r.choices[0].message
        assert m.content == "Checking" and [(t.id, t.function.name, json.loads(t.function.arguments))
                                            for t in m.tool_calls] == [("functions.get_weather:0", "get_weather",
                                                                        {"city": "Kyiv"})]
        chunks = list(c.chat.completions.create(model="moet-tiny", messages=msgs, tools=[WEATHER], stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "Checking"
        r = c.chat.completions.create(model="moet-tiny", messages=msgs)   # no tools: special tokens skipped
        assert engine.params_seen[-1].skip_special_tokens is True and "<|end|>" not in r.choices[0].message.content
