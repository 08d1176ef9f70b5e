"""`moet serve` wiring (flags, parser defaults from the shipped model's template) and the
OpenAI-messages -> chat-template conversion."""
from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest

from moet.errors import ConfigError
from moet.serve.chat_template import render_chat, template_messages
from moet.serve.errors import BadRequest
from moet.serve.protocol import ChatCompletionRequest
from moet.serve.serve_cli import build_server_app, resolve_parsers
from tests.serve.fake_engine import FakeAsyncEngine


def test_serve_help_lists_engine_and_server_flags():
    out = subprocess.run([sys.executable, "-m", "moet.cli", "serve", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0
    for flag in ("--port", "--host", "--api-key", "--tool-call-parser", "--reasoning-parser", "--expert-format",
                 "--max-model-len", "--help-all"):
        assert flag in out.stdout, flag
    assert "--max-pending-requests" not in out.stdout           # not a common one: --help-all has it
    every = subprocess.run([sys.executable, "-m", "moet.cli", "serve", "--help-all"], capture_output=True, text=True,
                           timeout=120)
    assert every.returncode == 0
    for flag in ("--max-pending-requests", "--request-timeout-s", "--[no-]log-requests", "--expert-cache-slots"):
        assert flag in every.stdout, flag


def test_shipped_model_gets_glm45_and_think_by_default():
    from moet.assets import default_model
    from moet.config import EngineConfig
    from moet.serve.serve_config import ServeConfig
    engine = FakeAsyncEngine()
    app = build_server_app(EngineConfig(model=default_model()), ServeConfig(), engine=engine)
    state = app.state.moet
    assert state.tool_parser.name == "glm45" and state.reasoning_parser.name == "think"
    assert state.sampling_defaults == {"temperature": 0.0, "max_tokens": 256}   # generation_config.json
    assert resolve_parsers(None, None, "auto", "auto") == (None, None)
    tool, reasoning = resolve_parsers("<arg_key>", None, "none", "none")
    assert tool is None and reasoning is None
    with pytest.raises(ConfigError, match="tool-call-parser"):
        resolve_parsers(None, None, "glm99", "auto")


def test_chat_template_file_replaces_the_checkpoints(tmp_path):
    """--chat-template FILE: the server renders with it (and picks parsers from it: no think or tool
    markup here, so none), the served names from --served-model-name."""
    import httpx

    from moet.assets import default_model
    from moet.config import EngineConfig
    from moet.serve.serve_config import ServeConfig
    from tests.serve.server_thread import ServerThread
    path = tmp_path / "plain.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]")
    engine = FakeAsyncEngine()
    app = build_server_app(EngineConfig(model=default_model()),
                           ServeConfig(chat_template=str(path), served_model_name=["tiny", "alias"]), engine=engine)
    state = app.state.moet
    assert state.tool_parser is None and state.reasoning_parser is None and state.model_names == ["tiny", "alias"]
    with ServerThread(app) as s:
        r = httpx.post(s.url + "/v1/chat/completions", timeout=30,
                       json={"model": "alias", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["model"] == "alias"
        assert engine.prompts_seen[-1].endswith("[user] hi\n[assistant]")
        tok = httpx.post(s.url + "/tokenize", timeout=30, json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert tok["tokens"] == engine.tokenizer.encode("[user] hi\n[assistant]", add_special_tokens=False)


def _req(messages, tools=None):
    return ChatCompletionRequest.model_validate({"messages": messages, "tools": tools})


CALL_HISTORY = [{"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


def test_template_messages_shape():
    msgs = template_messages(_req(CALL_HISTORY).messages)
    assert msgs[0] == {"role": "system", "content": "Be brief."}
    assert msgs[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 2}
    assert msgs[3]["tool_call_id"] == "c1"
    # an assistant turn's reasoning under both names templates read (gpt-oss's harmony: thinking)
    turn = dict(CALL_HISTORY[2], reasoning_content="Paris, two days")
    m = template_messages(_req([CALL_HISTORY[1], turn]).messages)[1]
    assert m["reasoning_content"] == m["thinking"] == "Paris, two days"
    with pytest.raises(BadRequest, match="image_url"):
        template_messages(_req([{"role": "user", "content": [{"type": "image_url", "text": None}]}]).messages)


def test_render_matches_the_python_renderer_of_the_shipped_format():
    from moet.probe.chat_format import render
    engine = FakeAsyncEngine()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
    req = _req(CALL_HISTORY, tools)
    text = render_chat(functools.partial(engine.tokenizer.apply_chat_template, tokenize=False), req.messages, req.tools)
    expect = render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                     {"role": "assistant", "content": "", "tool_calls": [{"function": {
                         "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
                     {"role": "tool", "content": "sunny"}], tools, add_generation_prompt=True)
    assert text == expect


class _StringArgsTokenizer:
    """A template that concatenates arguments as text (DeepSeek-V3's does): dicts make it fail."""
    chat_template = "x"

    def apply_chat_template(self, conversation, tools=None, **kw):
        out = ""
        for m in conversation:
            for tc in m.get("tool_calls") or []:
                out += "ARGS:" + tc["function"]["arguments"]   # TypeError for a dict, like Jinja's +
            out += m["content"] or ""
        return out


def test_template_that_wants_string_arguments_gets_them():
    text = render_chat(_StringArgsTokenizer().apply_chat_template, _req(CALL_HISTORY).messages, None)
    assert json.loads(text.split("ARGS:")[1].split("}")[0] + "}") == {"city": "Paris", "days": 2}
