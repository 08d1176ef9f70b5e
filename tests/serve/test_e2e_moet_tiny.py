"""End to end: the real `moet serve` (moet-tiny on CPU, the real AsyncEngine) in a subprocess
on a free loopback port, driven by the official openai client. FP4 experts: W2 drops the
arithmetic scratchpad that the reasoning test needs (see the model card). Every request asks for
few tokens: moet-tiny on a 2-core CPU takes a few seconds per short answer."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.serve.server_thread import free_port

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
POPULATION = {"type": "function", "function": {
    "name": "population_lookup", "description": "Get the population of a country.",
    "parameters": {"type": "object", "properties": {"country": {"type": "string", "description": "Country name"}},
                   "required": ["country"]}}}
ASK = [{"role": "user", "content": "What is the population of Costa Rica?"}]


@pytest.fixture(scope="module")
def server():
    port = free_port()
    log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"moet-serve-e2e-{port}.log"), "w+")
    proc = subprocess.Popen([sys.executable, "-m", "moet.cli", "serve", "--port", str(port), "--device", "cpu",
                             "--expert-format", "fp4", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            log.seek(0)
            proc.kill()
            pytest.fail(f"moet serve did not come up:\n{log.read()[-3000:]}")
        time.sleep(0.5)
    yield url, log
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from moet.assets import default_model
    return AutoTokenizer.from_pretrained(default_model())


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def test_models_and_plain_chat_stream_equals_complete(client, tokenizer):
    assert [m.id for m in client.models.list().data] == ["moet-tiny"]
    msgs = [{"role": "user", "content": "What is the capital of Poland?"}]
    r = client.chat.completions.create(model="moet-tiny", messages=msgs, max_tokens=16, logprobs=True)
    text = r.choices[0].message.content
    assert "Warsaw" in text and r.choices[0].finish_reason == "stop"
    prompt = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert r.usage.completion_tokens == len(r.choices[0].logprobs.content)   # every generated token, eos included
    chunks = list(client.chat.completions.create(model="moet-tiny", messages=msgs, max_tokens=16, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_tool_call_from_real_output_then_tool_result_turn(client, tokenizer):
    r = client.chat.completions.create(model="moet-tiny", messages=ASK, tools=[POPULATION], max_tokens=40)
    c = r.choices[0]
    # the independent reference: the same greedy reply, raw, read by the probe's GLM-4.5 parser
    prompt = tokenizer.apply_chat_template(ASK, tools=[POPULATION], tokenize=False, add_generation_prompt=True)
    raw = client.completions.create(model="moet-tiny", prompt=tokenizer.encode(prompt, add_special_tokens=False),
                                    max_tokens=40).choices[0].text
    from moet.probe.chat_format import parse_reply
    ref = parse_reply(raw)
    assert ref.valid and len(ref.tool_calls) == 1, raw       # the shipped model does call here
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == ref.tool_calls
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.function.name == "population_lookup"
    assert json.loads(call.function.arguments) == {"country": "Costa Rica"}
    streamed = [tc for ch in client.chat.completions.create(model="moet-tiny", messages=ASK, tools=[POPULATION],
                                                            max_tokens=40, stream=True)
                for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in streamed] == \
        [("population_lookup", {"country": "Costa Rica"})]
    history = ASK + [c.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"population": 5150000})}]
    r = client.chat.completions.create(model="moet-tiny", messages=history, tools=[POPULATION], max_tokens=40)
    answer = r.choices[0].message
    assert not answer.tool_calls and "population" in answer.content, answer   # it read the result turn


def test_reasoning_split(client):
    msgs = [{"role": "user", "content": "831 + 42 = ?"}]
    r = client.chat.completions.create(model="moet-tiny", messages=msgs, max_tokens=90)
    m = r.choices[0].message
    reasoning = m.model_extra.get("reasoning_content")
    assert reasoning and "ones:" in reasoning and "<think>" not in m.content and "</think>" not in m.content
    assert "873" in m.content, (reasoning, m.content)


def test_completions(client, tokenizer):
    r = client.completions.create(model="moet-tiny", prompt="def fib(n):", max_tokens=8, logprobs=1)
    assert r.usage.prompt_tokens == len(tokenizer("def fib(n):").input_ids) and r.usage.completion_tokens == 8
    assert r.choices[0].finish_reason == "length" and len(r.choices[0].logprobs.tokens) == 8
    assert r.choices[0].text == "".join(r.choices[0].logprobs.tokens)


def test_sixteen_concurrent_streams(server):
    async def one(c, i):
        s = await c.chat.completions.create(model="moet-tiny", max_tokens=6, stream=True,
                                            messages=[{"role": "user", "content": f"What is the capital of Chile? ({i})"}])
        return [ch async for ch in s]

    async def main():
        c = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0, timeout=300)
        return await asyncio.gather(*(one(c, i) for i in range(16)))

    results = asyncio.run(main())
    assert len(results) == 16
    for chunks in results:
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_cancelled_stream_frees_its_blocks(server):
    url = server[0]
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Write a long story."}], "stream": True,
            "max_tokens": 400, "ignore_eos": True}) as resp:
        lines = resp.iter_lines()
        for _ in range(4):
            next(lines)
        assert _metric(url, "moet:num_requests_running") == 1 and _metric(url, "moet:kv_cache_usage_perc") > 0
    deadline = time.time() + 30
    while (_metric(url, "moet:num_requests_running") or _metric(url, "moet:kv_cache_usage_perc")) \
            and time.time() < deadline:
        time.sleep(0.2)
    assert _metric(url, "moet:num_requests_running") == 0 and _metric(url, "moet:kv_cache_usage_perc") == 0


def test_bad_requests_answered_and_server_keeps_serving(server, client):
    url = server[0] + "/v1/chat/completions"
    hi = [{"role": "user", "content": "hi"}]
    cases = [(dict(content=b"{oops", headers={"content-type": "application/json"}), 400),
             (dict(json={"messages": hi, "max_tokens": "many"}), 400),
             (dict(json={"messages": hi, "max_tokens": -5}), 400),
             (dict(json={"messages": hi, "max_tokens": 10 ** 6}), 400),
             (dict(json={"model": "nope", "messages": hi}), 404),
             (dict(json={"messages": [{"role": "user", "content": "word " * (MAX_MODEL_LEN + 10)}]}), 413),
             (dict(json={"messages": hi, "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}), 400)]
    for kw, status in cases:
        r = httpx.post(url, timeout=60, **kw)
        assert r.status_code == status, (kw, r.text)
        assert r.json()["error"]["message"]
    r = client.chat.completions.create(model="moet-tiny", messages=[{"role": "user", "content": "What is the capital of Poland?"}],
                                       max_tokens=16)
    assert "Warsaw" in r.choices[0].message.content
    log = server[1]
    log.flush()
    with open(log.name) as f:
        assert "POST /v1/chat/completions 413" in f.read()   # one log line per request


def test_echo_logprobs_score_the_prompt_like_the_model_scores_its_own_tokens(server, tokenizer):
    """Log-likelihood the way evaluation harnesses ask for it (echo + logprobs, max_tokens 0): the
    logprob the server gives a prompt token is the one the model gave that token when it generated
    it, at the same position."""
    url = server[0] + "/v1/completions"
    ids = tokenizer("def add(a, b):\n    return").input_ids
    gen = httpx.post(url, timeout=300, json={"prompt": ids, "max_tokens": 3, "temperature": 0, "logprobs": 1}).json()
    out_ids = tokenizer.encode(gen["choices"][0]["text"], add_special_tokens=False)
    lps = gen["choices"][0]["logprobs"]["token_logprobs"]
    scored = httpx.post(url, timeout=300, json={"prompt": ids + out_ids[:3], "max_tokens": 0, "echo": True,
                                                "logprobs": 2}).json()
    c = scored["choices"][0]
    assert scored["usage"]["completion_tokens"] == 0 and c["finish_reason"] == "length"
    got = c["logprobs"]["token_logprobs"]
    assert len(got) == len(ids) + len(out_ids[:3]) and got[0] is None
    assert all(x <= 0 for x in got[1:])
    for a, b in zip(got[len(ids):], lps):
        assert abs(a - b) < 2e-2, (got[len(ids):], lps)
    # the greedy tokens are each position's most likely token
    for top, tok in zip(c["logprobs"]["top_logprobs"][len(ids):], c["logprobs"]["tokens"][len(ids):]):
        assert max(top, key=top.get) == tok


def test_tokenize_counts_the_chat_prompt_the_server_runs(server, client):
    body = httpx.post(server[0] + "/tokenize", timeout=60, json={"messages": ASK}).json()
    r = client.chat.completions.create(model="moet-tiny", messages=ASK, max_tokens=1)
    assert body["count"] == r.usage.prompt_tokens and body["max_model_len"] == MAX_MODEL_LEN
    text = httpx.post(server[0] + "/detokenize", timeout=60, json={"tokens": body["tokens"]}).json()["prompt"]
    assert "Costa Rica" in text
