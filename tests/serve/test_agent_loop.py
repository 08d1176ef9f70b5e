"""An agent's tool loop against the real server, with the official openai client, streamed end to
end: the model is offered a tool, the streamed tool_calls deltas are merged into calls (by index,
arguments concatenated, as agents do), the Python tool runs, the assistant turn with its
tool_calls and the `tool` turn with the result go back, and the second streamed request must end
in a plain answer (finish_reason "stop") built from the result. moet-tiny as `moet serve` serves it
by default (W2 experts with the FP4 gate, on CPU); get_weather with the names and result shape of
the weather family it was trained on (moet.probe.tools), which it calls with tool_choice auto and
required alike (MODEL_CARD.md: `get_weather` {city: Paris})."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.serve.tiny_server import tiny_server

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "Name of the city"},
        "unit": {"type": "string", "description": "celsius or fahrenheit"}},
        "required": ["city"]}}}


def get_weather(city: str, unit: str = "celsius") -> dict:
    return {"temperature": 18 if unit == "celsius" else 64, "condition": "sunny"}


TOOLS = {"get_weather": get_weather}


@pytest.fixture(scope="module")
def server():
    with tiny_server(max_model_len=512, max_num_seqs=4, kv_cache_memory_gb=0.25) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _stream(client, messages, **kw) -> dict:
    """One streamed turn, merged as an agent merges it -> {content, tool_calls, finish_reason,
    usage, roles}. Every chunk is checked on the way."""
    content, calls, finish, usage, roles = [], {}, None, None, []
    for chunk in client.chat.completions.create(model="moet-tiny", messages=messages, tools=[WEATHER], stream=True,
                                                stream_options={"include_usage": True}, max_tokens=64, **kw):
        assert chunk.object == "chat.completion.chunk" and chunk.id.startswith("chatcmpl")
        if not chunk.choices:                           # the usage chunk, last
            assert usage is None and chunk.usage is not None
            usage = chunk.usage
            continue
        assert usage is None and chunk.usage is None     # include_usage: only on the last chunk
        (choice,) = chunk.choices
        d = choice.delta
        if d.role:
            roles.append(d.role)
        content.append(d.content or "")
        for tc in d.tool_calls or []:
            assert tc.type in (None, "function"), tc
            call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            if tc.id:
                assert call["id"] is None, "a call's id comes once"
                call["id"] = tc.id
            if tc.function is not None:
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
        if choice.finish_reason is not None:
            assert finish is None
            finish = choice.finish_reason
    assert usage is not None and usage.prompt_tokens > 0 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    return {"content": "".join(content), "tool_calls": [calls[i] for i in sorted(calls)], "finish_reason": finish,
            "usage": usage, "roles": roles}


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_streamed_tool_call_loop(client, server, tool_choice):
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    first = _stream(client, messages, tool_choice=tool_choice)
    assert first["roles"] == ["assistant"]
    assert first["finish_reason"] == "tool_calls", first
    assert not first["content"].strip(), first                # a call, no text beside it
    (call,) = first["tool_calls"]
    assert call["id"] and call["name"] == "get_weather", first
    args = json.loads(call["arguments"])
    assert isinstance(args, dict) and set(WEATHER["function"]["parameters"]["required"]) <= set(args), args
    assert set(args) <= set(WEATHER["function"]["parameters"]["properties"]), args
    assert args["city"] == "Paris"

    result = TOOLS[call["name"]](**args)
    messages += [
        {"role": "assistant", "content": first["content"] or None,
         "tool_calls": [{"id": call["id"], "type": "function",
                         "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)}]
    assert messages[-1]["tool_call_id"] == messages[-2]["tool_calls"][0]["id"] == call["id"]
    # the server renders the call and its result into the second prompt
    url = server[0].url
    rendered = httpx.post(url + "/tokenize", timeout=60, json={"messages": messages, "tools": [WEATHER]}).json()
    text = httpx.post(url + "/detokenize", timeout=60, json={"tokens": rendered["tokens"]}).json()["prompt"]
    assert "<tool_call>get_weather" in text and json.dumps(result) in text, text

    second = _stream(client, messages)
    assert second["roles"] == ["assistant"] and not second["tool_calls"], second
    assert second["finish_reason"] == "stop", second
    answer = second["content"].strip()
    assert answer and "18" in answer and "sunny" in answer, second     # answered from the tool's result
    assert second["usage"].prompt_tokens == rendered["count"]


def test_the_sdk_stream_helper_accumulates_the_same_call(client):
    """openai's own accumulator (chat.completions.stream) over the same stream: it must read the
    deltas into one complete call with parsed arguments."""
    stream = getattr(client.chat.completions, "stream", None) or client.beta.chat.completions.stream
    with stream(model="moet-tiny", messages=[{"role": "user", "content": "What's the weather in Paris?"}],
                tools=[WEATHER], tool_choice="required", max_tokens=64,
                stream_options={"include_usage": True}) as s:
        events = [e.type for e in s]
        final = s.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and "tool_calls.function.arguments.done" in events
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
    assert final.usage is not None and final.usage.completion_tokens > 0
