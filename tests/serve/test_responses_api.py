"""POST /v1/responses (and GET / DELETE /v1/responses/{id}): the Responses API over the chat
machinery. Most tests drive the app over FakeAsyncEngine (a test double of contract 2: what the
engine was asked to generate is visible in engine.prompts_seen); the last ones run the real
`moet serve` with moet-tiny on CPU. Both through the official openai client and raw httpx."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from moet.serve.api_server import build_app
from moet.serve.reasoning import ReasoningParser
from moet.serve.responses import ResponseStore
from moet.serve.responses_protocol import STREAM_EVENTS, Response
from moet.serve.serve_config import ServeConfig
from moet.serve.tool_parsers import get_tool_parser
from tests.serve.fake_engine import FakeAsyncEngine
from tests.serve.server_thread import ServerThread, free_port

CALL = ("<think></think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>")
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city"]}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": PARAMS}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": PARAMS}}


def script(prompt: str) -> str:
    if "<tool_response>" in prompt:
        return "<think></think>\nIt is 21 degrees in Paris."
    if prompt.endswith("<think></think>\n") and "<tools>" in prompt:   # a forced call (thinking off)
        return "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call>"
    if "<tools>" in prompt:
        return CALL
    if "doubled" in prompt:
        return "<think>42*2</think>\n84"
    if "12+30" in prompt:
        return "<think>2+0=2, 1+3=4</think>\n42"
    return "<think></think>\nHello there, friend."


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


def _chat_prompt(engine, messages, tools=None) -> str:
    return engine.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)


def _tokens(engine, text: str) -> int:
    return len(engine.tokenizer.encode(text, add_special_tokens=False))


def _sse(resp: httpx.Response) -> list[dict]:
    """Every event of a Responses stream, each checked against its `event:` line and its model."""
    events, name = [], None
    for line in resp.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: "):])
            assert data["type"] == name, (name, data)
            STREAM_EVENTS[data["type"]].model_validate(data)      # the exact shape: extra fields are errors
            events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def _stream(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + "/v1/responses", json={**body, "stream": True}, timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        return _sse(resp)


def _kinds(events: list[dict]) -> list[str]:
    """Event types with runs of the same delta type collapsed into one."""
    out: list[str] = []
    for e in events:
        if not (e["type"].endswith(".delta") and out and out[-1] == e["type"]):
            out.append(e["type"])
    return out


# ---------------------------------------------------------------------------- the Response object

def test_plain_text_input_with_instructions(engine, server, client):
    r = client.responses.create(model="moet-tiny", input="What is 12+30?", instructions="Be terse.")
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed" and r.model == "moet-tiny"
    assert [o.type for o in r.output] == ["reasoning", "message"]
    reasoning, message = r.output
    assert reasoning.content[0].text == "2+0=2, 1+3=4" and reasoning.id.startswith("rs_")
    assert message.role == "assistant" and message.status == "completed" and message.id.startswith("msg_")
    assert r.output_text == "42" and message.content[0].annotations == []
    prompt = _chat_prompt(engine, [{"role": "system", "content": "Be terse."},
                                   {"role": "user", "content": "What is 12+30?"}])
    assert engine.prompts_seen[-1] == prompt                      # instructions first, as a system message
    assert r.usage.input_tokens == _tokens(engine, prompt)
    assert r.usage.output_tokens == _tokens(engine, script("12+30")) + 1          # + the eos token
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens == 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    # echoes: the effective sampling values (generation_config: greedy, max_new_tokens 64)
    assert r.instructions == "Be terse." and r.temperature == 0.0 and r.top_p == 1.0 and r.tool_choice == "auto"
    assert r.store is True and r.parallel_tool_calls is True and r.text.format.type == "text"
    assert engine.params_seen[-1].max_tokens == 64 and engine.params_seen[-1].temperature == 0.0

    raw = httpx.post(server.url + "/v1/responses", json={"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is "}, {"type": "input_text", "text": "12+30?"}]}]}).json()
    assert engine.prompts_seen[-1] == _chat_prompt(engine, [{"role": "user", "content": "What is 12+30?"}])
    # unset fields are sent as null, as OpenAI sends them, and the body is exactly the Response model
    assert raw["incomplete_details"] is None and raw["previous_response_id"] is None and raw["error"] is None
    assert raw["instructions"] is None and raw["max_output_tokens"] is None and raw["metadata"] == {}
    assert Response.model_validate(raw).model_dump() == raw


def test_sampling_fields_reach_the_engine(engine, client):
    r = client.responses.create(model="moet-tiny", input="Say hello", temperature=0.7, top_p=0.9,
                                max_output_tokens=40, metadata={"run": "a"}, user="u1",
                                extra_body={"seed": 5})
    sp = engine.params_seen[-1]
    assert (sp.temperature, sp.top_p, sp.max_tokens, sp.seed) == (0.7, 0.9, 40, 5)
    assert (r.temperature, r.top_p, r.max_output_tokens, r.metadata, r.user) == (0.7, 0.9, 40, {"run": "a"}, "u1")
    assert r.output_text == "Hello there, friend."


def test_function_call_and_its_output_as_input_items(engine, client):
    r = client.responses.create(model="moet-tiny", tools=[WEATHER], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "ask it"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": json.dumps({"city": "Paris", "days": 2})},
        {"type": "function_call_output", "call_id": "call_1", "output": json.dumps({"temperature": 21})}])
    assert r.output_text == "It is 21 degrees in Paris." and [o.type for o in r.output] == ["message"]
    # the same prompt chat completions renders for the same turns
    assert engine.prompts_seen[-1] == _chat_prompt(engine, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "ask it", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 21})}], tools=[CHAT_WEATHER])
    assert "<think>ask it</think>\n<tool_call>get_weather" in engine.prompts_seen[-1]


# ---------------------------------------------------------------------------- previous_response_id

def test_previous_response_id_continues_the_conversation(engine, client):
    r1 = client.responses.create(model="moet-tiny", input="What is 12+30?", instructions="Be terse.")
    r2 = client.responses.create(model="moet-tiny", input="And doubled?", previous_response_id=r1.id)
    first_exchange = [{"role": "user", "content": "What is 12+30?"},
                      {"role": "assistant", "content": "42", "reasoning_content": "2+0=2, 1+3=4"}]
    # the first exchange, then the new input; instructions are not carried over (OpenAI's rule)
    assert engine.prompts_seen[-1] == _chat_prompt(engine, first_exchange + [{"role": "user", "content": "And doubled?"}])
    assert "Be terse." not in engine.prompts_seen[-1]
    assert r2.output_text == "84" and r2.previous_response_id == r1.id
    r3 = client.responses.create(model="moet-tiny", input="Thanks", previous_response_id=r2.id, instructions="New.")
    assert engine.prompts_seen[-1] == _chat_prompt(engine, [{"role": "system", "content": "New."}] + first_exchange + [
        {"role": "user", "content": "And doubled?"}, {"role": "assistant", "content": "84", "reasoning_content": "42*2"},
        {"role": "user", "content": "Thanks"}])
    assert client.responses.retrieve(r1.id).model_dump() == r1.model_dump()
    assert r3.usage.input_tokens == _tokens(engine, engine.prompts_seen[-1])


def test_tool_call_continued_with_its_output_by_previous_response_id(engine, client):
    r1 = client.responses.create(model="moet-tiny", input="Weather in Paris for 2 days?", tools=[WEATHER])
    (call,) = r1.output
    assert call.type == "function_call" and call.status == "completed" and call.id.startswith("fc_")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 2}
    assert call.call_id.startswith("call_") and r1.output_text == ""
    r2 = client.responses.create(model="moet-tiny", previous_response_id=r1.id, tools=[WEATHER], input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees"}])
    assert engine.prompts_seen[-1] == _chat_prompt(engine, [
        {"role": "user", "content": "Weather in Paris for 2 days?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "21 degrees"}], tools=[CHAT_WEATHER])
    assert r2.output_text == "It is 21 degrees in Paris."


def test_store_false_get_and_delete(server, client):
    r = client.responses.create(model="moet-tiny", input="hi", store=False)
    assert r.store is False and r.output_text == "Hello there, friend."
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as e:      # not stored: nothing to continue
        client.responses.create(model="moet-tiny", input="more", previous_response_id=r.id)
    assert e.value.body["code"] == "previous_response_not_found" and e.value.body["param"] == "previous_response_id"
    kept = client.responses.create(model="moet-tiny", input="hi")
    assert client.responses.retrieve(kept.id).id == kept.id
    deleted = httpx.delete(server.url + f"/v1/responses/{kept.id}")
    assert deleted.status_code == 200 and deleted.json() == {"id": kept.id, "object": "response.deleted", "deleted": True}
    gone = httpx.get(server.url + f"/v1/responses/{kept.id}")
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "response_id"
    assert httpx.delete(server.url + f"/v1/responses/{kept.id}").status_code == 404


def test_store_is_an_lru_bounded_by_count_and_bytes():
    store = ResponseStore(max_responses=2, max_bytes=10_000)
    for i in range(3):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": str(i)}])
        if i == 1:
            assert store.conversation("r0") == [{"role": "user", "content": "0"}]   # r0 is now the newest
    assert store.response("r1") is None and store.response("r0") == {"id": "r0"} and len(store) == 2
    store.put({"id": "big"}, [{"role": "user", "content": "x" * 9_950}])           # pushes both others out
    assert len(store) == 1 and store.response("big") is not None
    store.put({"id": "huge"}, [{"role": "user", "content": "x" * 20_000}])         # never fits: not kept
    assert store.response("huge") is None and store.response("big") is not None


# ---------------------------------------------------------------------------- tools

def _matcher(grammar: str):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(FakeAsyncEngine().tokenizer)
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(grammar))


TIME = {"type": "function", "name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}
WEATHER_CALL = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call>"
TIME_CALL = "<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>UTC</arg_value>\n</tool_call>"


def _accepts(grammar: str, text: str) -> bool:
    m = _matcher(grammar)
    return m.accept_string(text) and m.is_completed()


def test_tool_choice_required_named_none_and_parallel_calls(engine, client):
    """tool_choice reaches chat's: required / named make the reply calls under a grammar (the
    fake engine does not apply it, so the grammar itself is checked); none leaves the tools out."""
    r = client.responses.create(model="moet-tiny", input="Weather?", tools=[WEATHER, TIME], tool_choice="required")
    assert engine.prompts_seen[-1].endswith("<|assistant|>\n<think></think>\n")      # thinking off
    grammar = engine.params_seen[-1].structured_outputs.grammar
    assert _accepts(grammar, WEATHER_CALL) and _accepts(grammar, TIME_CALL)
    assert _accepts(grammar, WEATHER_CALL + "\n" + TIME_CALL)                # parallel calls by default
    assert not _accepts(grammar, "It is sunny.")
    assert [(o.type, o.name, json.loads(o.arguments)) for o in r.output] == [("function_call", "get_weather",
                                                                              {"city": "Rome"})]
    assert r.tool_choice == "required" and [t.name for t in r.tools] == ["get_weather", "get_time"]

    r = client.responses.create(model="moet-tiny", input="Time?", tools=[WEATHER, TIME], parallel_tool_calls=False,
                                tool_choice={"type": "function", "name": "get_time"})
    grammar = engine.params_seen[-1].structured_outputs.grammar
    assert _accepts(grammar, TIME_CALL) and not _accepts(grammar, WEATHER_CALL)       # only the named function
    assert not _accepts(grammar, TIME_CALL + "\n" + TIME_CALL)                       # parallel_tool_calls false
    assert r.tool_choice.type == "function" and r.tool_choice.name == "get_time" and r.parallel_tool_calls is False

    r = client.responses.create(model="moet-tiny", input="Weather?", tools=[WEATHER], tool_choice="none")
    assert "<tools>" not in engine.prompts_seen[-1] and [o.type for o in r.output] == ["message"]
    assert engine.params_seen[-1].structured_outputs is None


def test_text_format_becomes_constrained_decoding(engine, server, client):
    """text.format is chat's response_format: the same constraint reaches the engine."""
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    r = client.responses.create(model="moet-tiny", input="Give JSON", text={"format": {"type": "json_object"}})
    assert engine.params_seen[-1].structured_outputs.json_object is True
    assert r.text.format.type == "json_object"
    r = httpx.post(server.url + "/v1/responses", json={"input": "Give JSON", "text": {"format": {
        "type": "json_schema", "name": "answer", "schema": schema, "strict": True}}})
    assert r.status_code == 200, r.text
    assert engine.params_seen[-1].structured_outputs.json == schema
    assert r.json()["text"] == {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}
    client.responses.create(model="moet-tiny", input="hi", text={"format": {"type": "text"}})
    assert engine.params_seen[-1].structured_outputs is None
    # chat's refusal, in the Responses request's terms
    r = httpx.post(server.url + "/v1/responses", json={"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "objectx"}}}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "text" and err["message"].startswith("text.format: "), err
    r = httpx.post(server.url + "/v1/responses", json={"input": "hi", "tools": [WEATHER], "tool_choice": "required",
                                                       "text": {"format": {"type": "json_object"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


# ---------------------------------------------------------------------------- streaming

def test_stream_event_order_and_final_response(engine, server, client, caplog):
    caplog.set_level("INFO", logger="moet.serve")
    events = _stream(server.url, {"input": "What is 12+30?"})
    assert _kinds(events) == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    created, final = events[0]["response"], events[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["id"] == final["id"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "2+0=2, 1+3=4"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "42"
    assert [e["text"] for e in events if e["type"] == "response.output_text.done"] == ["42"]
    # the final response holds exactly the items streamed, as they were when done
    assert final["output"] == [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert final["status"] == "completed" and final["completed_at"] is not None
    whole = client.responses.create(model="moet-tiny", input="What is 12+30?")
    assert final["usage"] == whole.usage.model_dump(exclude_none=True)
    assert [(o["type"], o.get("content")) for o in final["output"]] == \
        [(o.type, [c.model_dump(exclude_none=True) for c in o.content]) for o in whole.output]
    assert client.responses.retrieve(final["id"]).output_text == "42"        # stored at the end of the stream
    time.sleep(0.2)   # the log line is written once the response has been sent
    line = f"POST /v1/responses 200 prompt={whole.usage.input_tokens} completion={whole.usage.output_tokens}"
    assert any(line in rec.getMessage() for rec in caplog.records), [rec.getMessage() for rec in caplog.records]

    # the official client's helpers read the same stream
    with client.responses.stream(model="moet-tiny", input="What is 12+30?") as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == "42" and final.output_text == "42" and final.status == "completed"
    kinds = [e.type for e in client.responses.create(model="moet-tiny", input="hi", stream=True)]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"


def test_streamed_tool_call(engine, server, client):
    events = _stream(server.url, {"input": "Weather in Paris for 2 days?", "tools": [WEATHER]})
    assert _kinds(events) == ["response.created", "response.in_progress", "response.output_item.added",
                              "response.function_call_arguments.delta", "response.function_call_arguments.done",
                              "response.output_item.done", "response.completed"]
    added, delta, done_args, done = events[2:6]
    assert added["item"]["type"] == "function_call" and added["item"]["arguments"] == "" \
        and added["item"]["status"] == "in_progress"
    assert json.loads(delta["delta"]) == json.loads(done_args["arguments"]) == {"city": "Paris", "days": 2}
    assert done["item"] == {**added["item"], "arguments": done_args["arguments"], "status": "completed"}
    assert events[-1]["response"]["output"] == [done["item"]]
    with client.responses.stream(model="moet-tiny", input="Weather in Paris for 2 days?", tools=[WEATHER]) as stream:
        final = stream.until_done().get_final_response()
    (call,) = final.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris", "days": 2}


def test_max_output_tokens_makes_the_response_incomplete(engine, server, client):
    # the fake reply's first 6 tokens: <think> </think> \n Hel lo " there"
    r = client.responses.create(model="moet-tiny", input="Say hello", max_output_tokens=6)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 6 and engine.params_seen[-1].max_tokens == 6 and r.max_output_tokens == 6
    (message,) = r.output
    assert message.status == "incomplete" and r.output_text == "Hello there" and r.completed_at is None
    events = _stream(server.url, {"input": "Say hello", "max_output_tokens": 6})
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "response.incomplete" and "response.completed" not in kinds
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [(o["type"], o["status"]) for o in final["output"]] == [("message", "incomplete")]
    assert final["output"][0]["content"][0]["text"] == "Hello there" and final["usage"]["output_tokens"] == 6
    # cut inside the reasoning: the reasoning item is the incomplete one, and there is no message
    r = client.responses.create(model="moet-tiny", input="What is 12+30?", max_output_tokens=4)
    assert [(o.type, o.status) for o in r.output] == [("reasoning", "incomplete")]
    assert r.output[0].content[0].text == "2+0" and r.output_text == ""
    final = _stream(server.url, {"input": "What is 12+30?", "max_output_tokens": 4})[-1]["response"]
    assert [(o["type"], o["status"], o["content"][0]["text"]) for o in final["output"]] == \
        [("reasoning", "incomplete", "2+0")]


def test_error_after_the_stream_started_is_reported_in_band():
    engine = FakeAsyncEngine(lambda prompt: "word " * 200, step_s=0.02)
    with ServerThread(make_app(engine, request_timeout_s=0.5)) as s:
        events = _stream(s.url, {"input": "Talk"})
        assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
        assert events[-2]["code"] == "timeout_error" and "request timeout" in events[-2]["message"]
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
        assert any(e["type"] == "response.output_text.delta" for e in events)     # it had started
        assert engine.aborted and not engine.running
        assert httpx.get(s.url + f"/v1/responses/{failed['id']}").status_code == 404   # failed: not stored


# ---------------------------------------------------------------------------- refusals

BAD = [  # (body, status, param, substring of the message)
    ({"input": "hi", "previous_response_id": "resp_nope"}, 400, "previous_response_id",
     "Previous response with id 'resp_nope' not found."),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools", "web_search"),
    ({"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, 400, "tools", "file_search"),
    ({"input": 42}, 400, "input", "string or a list"),
    ({"input": {"role": "user", "content": "hi"}}, 400, "input", "string or a list"),
    ({}, 400, "input", "input"),
    ({"input": []}, 400, "input", "empty"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]}, 400,
     "input", "input_image"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input", "item_reference"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, 400, "input", "role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, 400, "input", "arguments"),
    ({"input": "hi", "tool_choice": "required"}, 400, "tool_choice", "needs tools"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice",
     "nope"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, 400, "tool_choice",
     "web_search_preview"),
    ({"input": "hi", "tools": [{**WEATHER, "parameters": {"type": "string"}}]}, 400, "tools", "type 'object'"),
    ({"input": "hi", "background": True}, 400, "background", "background"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens", "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 10 ** 6}, 400, "max_output_tokens", "at most"),
    ({"input": "hi", "temperature": "hot"}, 400, "temperature", "temperature"),
    ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, 400, "text", "schema"),
    ({"input": "hi", "metadata": {"k": "v" * 600}}, 400, "metadata", "metadata"),
    ({"input": "word " * 600}, 413, "input", "maximum context length"),
    ({"model": "gpt-9", "input": "hi"}, 404, "model", "gpt-9"),
]


@pytest.mark.parametrize("body,status,param,needle", BAD)
def test_bad_requests_get_openai_errors_naming_the_field(server, body, status, param, needle):
    for stream in (False, True):   # a streamed request is refused before the stream starts
        r = httpx.post(server.url + "/v1/responses", json={**body, "stream": stream} if body else body, timeout=30)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["param"] == param and needle in err["message"] and err["type"], err
    if param == "previous_response_id":
        assert err["code"] == "previous_response_not_found" and err["type"] == "invalid_request_error"


def test_refusals_reach_the_openai_client_and_the_server_keeps_serving(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="moet-tiny", input="hi", tools=[{"type": "web_search"}])
    assert e.value.body["param"] == "tools"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")
    assert httpx.get(server.url + "/v1/responses/resp_nope").json()["error"]["message"] == \
        "Response with id 'resp_nope' not found."
    assert client.responses.create(model="moet-tiny", input="hi").output_text == "Hello there, friend."


def test_api_key_guards_the_responses_routes():
    with ServerThread(make_app(FakeAsyncEngine(script), api_key="sekret")) as s:
        assert httpx.post(s.url + "/v1/responses", json={"input": "hi"}).status_code == 401
        assert httpx.get(s.url + "/v1/responses/resp_x").status_code == 401
        assert httpx.delete(s.url + "/v1/responses/resp_x").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).responses.create(
                model="moet-tiny", input="hi")
        ok = openai.OpenAI(base_url=s.url + "/v1", api_key="sekret", max_retries=0)
        assert ok.responses.create(model="moet-tiny", input="hi").output_text == "Hello there, friend."


# ---------------------------------------------------------------------------- the real model (moet-tiny, CPU)

POPULATION = {"type": "function", "name": "population_lookup", "description": "Get the population of a country.",
              "parameters": {"type": "object", "required": ["country"], "properties": {
                  "country": {"type": "string", "description": "Country name"}}}}


@pytest.fixture(scope="module")
def tiny():
    """`moet serve` with moet-tiny in a subprocess (FP4 experts, as test_e2e_moet_tiny.py runs it)."""
    port = free_port()
    log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"moet-serve-responses-{port}.log"), "w+")
    proc = subprocess.Popen([sys.executable, "-m", "moet.cli", "serve", "--port", str(port), "--device", "cpu",
                             "--expert-format", "fp4", "--max-model-len", "512", "--max-num-seqs", "4"],
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
    yield url, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from moet.assets import default_model
    return AutoTokenizer.from_pretrained(default_model())


@pytest.mark.slow
def test_real_model_answers_streams_the_same_and_stops_at_max_output_tokens(tiny, tokenizer):
    url, client = tiny
    ask = "What is the capital of Poland?"
    r = client.responses.create(model="moet-tiny", input=ask, max_output_tokens=16)
    assert "Warsaw" in r.output_text and r.status == "completed", r
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": ask}], tokenize=False, add_generation_prompt=True)
    assert r.usage.input_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    events = _stream(url, {"input": ask, "max_output_tokens": 16})            # greedy: the same reply
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == r.output_text
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["usage"]["output_tokens"] == \
        r.usage.output_tokens
    cut = client.responses.create(model="moet-tiny", input=ask, max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3 and cut.output[-1].status == "incomplete"


@pytest.mark.slow
def test_real_model_reasoning_item(tiny):
    url, client = tiny
    r = client.responses.create(model="moet-tiny", input="831 + 42 = ?", max_output_tokens=90)
    assert [o.type for o in r.output] == ["reasoning", "message"], r.output
    assert "ones:" in r.output[0].content[0].text and "873" in r.output_text
    assert "<think>" not in r.output_text and "</think>" not in r.output_text


@pytest.mark.slow
def test_real_model_tool_call_round_trip(tiny):
    url, client = tiny
    ask = "What is the population of Costa Rica?"
    r1 = client.responses.create(model="moet-tiny", input=ask, tools=[POPULATION], max_output_tokens=40)
    calls = [o for o in r1.output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("population_lookup", {"country": "Costa Rica"})], \
        r1.output
    r2 = client.responses.create(model="moet-tiny", previous_response_id=r1.id, tools=[POPULATION],
                                 max_output_tokens=40, input=[{"type": "function_call_output",
                                                               "call_id": calls[0].call_id,
                                                               "output": json.dumps({"population": 5150000})}])
    assert not [o for o in r2.output if o.type == "function_call"] and "population" in r2.output_text, r2.output
    assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens - 1   # it holds the first turn
    forced = client.responses.create(model="moet-tiny", input=ask, tools=[POPULATION], tool_choice="required",
                                     max_output_tokens=40)
    (call,) = forced.output
    assert call.type == "function_call" and call.name == "population_lookup"
    assert set(json.loads(call.arguments)) == {"country"}      # forcing fixes the call, not what the model writes
