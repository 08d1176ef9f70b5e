"""Hostile input against the HTTP server: every bad request gets a clear 4xx in OpenAI's shape,
and none of them can stall or hurt the other clients (server over the FakeAsyncEngine test double)."""
from __future__ import annotations

import json
import socket
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

HI = [{"role": "user", "content": "hi"}]


def make_app(engine, **cfg):
    return build_app(engine, ServeConfig(**cfg), tool_parser=get_tool_parser("glm45"),
                     reasoning_parser=ReasoningParser(), generation_config={"do_sample": False, "max_new_tokens": 64})


@pytest.fixture(scope="module")
def engine():
    return FakeAsyncEngine()


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(make_app(engine, max_request_bytes=1 << 20, max_sequences_per_request=8,
                               served_model_name=["moet-tiny", "tiny-alias"])) as s:
        yield s


def _post(server, body, path="/v1/chat/completions", **kw):
    if isinstance(body, (bytes, str)):
        return httpx.post(server.url + path, content=body, headers={"content-type": "application/json"},
                          timeout=30, **kw)
    return httpx.post(server.url + path, json=body, timeout=30, **kw)


def _still_serves(server):
    r = _post(server, {"messages": HI})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


BAD = [  # (raw body, status, param or None, substring of the message)
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages", "surrogate"),
    (b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}', 400, "messages", "surrogate"),
    (b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None, "nests deeper"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b'{"a":' * 200 + b"1" + b"}" * 200 + b"}",
     400, None, "nests deeper"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, None, "NaN"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}', 400, None, "Infinity"),
    (json.dumps({"messages": HI, "seed": 2 ** 64}).encode(), 400, "seed", "seed"),
    (json.dumps({"messages": HI, "seed": -(2 ** 63) - 1}).encode(), 400, "seed", "seed"),
    (json.dumps({"messages": HI, "n": 9}).encode(), 400, "n", "--max-sequences-per-request"),
    (json.dumps({"messages": HI, "max_tokens": -1}).encode(), 400, "max_tokens", "max_tokens"),
    (json.dumps({}).encode(), 400, "messages", "messages"),
    (json.dumps({"messages": HI, "chat_template": "{{ 'x' }}"}).encode(), 400, "chat_template",
     "--trust-request-chat-template"),
    (json.dumps({"messages": HI, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}).encode(), 400,
     "chat_template", "--trust-request-chat-template"),
    (b"\xff\xfe\x00{", 400, None, "not valid JSON"),
]


@pytest.mark.parametrize("body,status,param,needle", BAD, ids=[f"{i}-{b[3].split()[0]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_a_clear_4xx_and_the_server_keeps_serving(server, body, status, param, needle):
    r = _post(server, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
    _still_serves(server)


def test_completions_sequences_cap_counts_prompts_times_n(server):
    r = _post(server, {"prompt": ["a", "b", "c"], "n": 3, "max_tokens": 2}, path="/v1/completions")
    assert r.status_code == 400 and "9 sequences" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "prompt"
    r = _post(server, {"prompt": ["a", "b"], "n": 4, "max_tokens": 2}, path="/v1/completions")
    assert r.status_code == 200 and len(r.json()["choices"]) == 8


def test_unknown_routes_and_methods_are_openai_shaped(server):
    r = httpx.get(server.url + "/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "method_not_allowed"
    assert set(r.json()) == {"error"}


def _raw_request(port: int, head: bytes, body_chunks, read_timeout: float = 10.0) -> tuple[bytes, int]:
    """Send `head`, then body chunks until the server answers; (the response, body bytes sent)."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout) as s:
        s.sendall(head)
        s.setblocking(False)
        resp = b""
        for chunk in body_chunks:
            try:
                resp += s.recv(65536)
            except BlockingIOError:
                pass
            if resp:
                break
            try:
                s.setblocking(True)
                s.sendall(chunk)
                s.setblocking(False)
                sent += len(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
        s.setblocking(True)
        s.settimeout(read_timeout)
        try:
            while not _complete(resp):          # the head and, by its Content-Length, the whole body
                part = s.recv(65536)
                if not part:
                    break
                resp += part
        except (ConnectionResetError, socket.timeout):
            pass
    return resp, sent


def _complete(resp: bytes) -> bool:
    """A whole HTTP response: the head, then as many body bytes as its Content-Length says (the
    body may come in a later packet than the head)."""
    head, sep, body = resp.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value.strip())
    return True


def test_body_over_the_limit_is_refused_before_it_is_read(server):
    # a Content-Length over the limit: 413 at once, with no body sent at all
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 419430400\r\n\r\n")
    resp, sent = _raw_request(server.port, head, [b""])
    assert resp.startswith(b"HTTP/1.1 413") and b"--max-request-bytes" in resp

    # a chunked body with no length: refused once it passes the limit, long before 400 MiB
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    piece = 64 * 1024
    chunk = b"%x\r\n" % piece + b" " * piece + b"\r\n"

    def chunks():
        for _ in range(400 * 1024 * 1024 // piece):
            yield chunk
            time.sleep(0.001)
    resp, sent = _raw_request(server.port, head, chunks())
    assert resp.startswith(b"HTTP/1.1 413"), resp[:200]
    assert sent < 16 * (1 << 20), sent       # the limit is 1 MiB; socket buffers add a little
    _still_serves(server)


def test_served_model_name_aliases(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    assert [m.id for m in c.models.list().data] == ["moet-tiny", "tiny-alias"]
    r = c.chat.completions.create(model="tiny-alias", messages=HI)
    assert r.model == "tiny-alias" and r.choices[0].message.content
    assert c.chat.completions.create(model="moet-tiny", messages=HI).model == "moet-tiny"
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="other", messages=HI)


def test_version_tokenize_detokenize(server, engine):
    v = httpx.get(server.url + "/version").json()
    from moet import __version__
    assert v == {"version": __version__}
    tok = engine.tokenizer
    r = _post(server, {"model": "moet-tiny", "prompt": "def fib(n):", "return_token_strs": True}, path="/tokenize")
    body = r.json()
    assert body["tokens"] == tok("def fib(n):").input_ids and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == engine.max_model_len
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    r = _post(server, {"prompt": "def fib(n):", "add_special_tokens": False}, path="/tokenize")
    assert r.json()["tokens"] == tok.encode("def fib(n):", add_special_tokens=False)
    # a chat body counts exactly the prompt /v1/chat/completions would run
    chat = _post(server, {"messages": HI}, path="/tokenize").json()
    want = tok.apply_chat_template(HI, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok.encode(want, add_special_tokens=False)
    used = _post(server, {"messages": HI}).json()["usage"]["prompt_tokens"]
    assert chat["count"] == used
    r = _post(server, {"tokens": body["tokens"]}, path="/detokenize")
    assert r.status_code == 200 and r.json()["prompt"] == tok.decode(body["tokens"])
    r = _post(server, {"tokens": [len(tok) + 3]}, path="/detokenize")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert _post(server, {"prompt": "x", "model": "gpt-9"}, path="/tokenize").status_code == 404


def test_echo_with_zero_max_tokens_scores_the_prompt(server, engine):
    r = _post(server, {"prompt": "def fib(n):", "max_tokens": 0, "echo": True, "logprobs": 1},
              path="/v1/completions")
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    n_prompt = len(engine.tokenizer("def fib(n):").input_ids)
    assert c["text"] == "def fib(n):" and c["finish_reason"] == "length"
    assert len(c["logprobs"]["tokens"]) == n_prompt and c["logprobs"]["token_logprobs"][0] is None
    assert r.json()["usage"]["completion_tokens"] == 0
    r = _post(server, {"prompt": "x", "max_tokens": 0}, path="/v1/completions")
    assert r.status_code == 400 and "echo" in r.json()["error"]["message"]


class _GatedTokenizer:
    """The real tokenizer whose encode() of one marked text blocks until released: a request whose
    preparation takes as long as the test wants."""

    def __init__(self, tok, marker: str):
        self._tok, self.marker = tok, marker
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)

    def __call__(self, text, *a, **kw):
        return self._tok(text, *a, **kw)

    def encode(self, text, *a, **kw):
        if self.marker in text:
            self.entered.set()
            self.release.wait(30)
        return self._tok.encode(text, *a, **kw)


def test_a_slow_request_preparation_stalls_no_one():
    """Templates and tokenizing run off the event loop: while one request's tokenization is stuck,
    /health and other chats are answered."""
    from tests.serve.fake_engine import _tokenizer
    gated = _GatedTokenizer(_tokenizer(), "SLOWMARK")
    engine = FakeAsyncEngine(tokenizer=gated)
    with ServerThread(make_app(engine)) as s:
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
            s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "SLOWMARK " * 10}]},
            timeout=60)))
        t.start()
        assert gated.entered.wait(20)
        try:
            assert httpx.get(s.url + "/health", timeout=5).status_code == 200
            r = httpx.post(s.url + "/v1/chat/completions", json={"messages": HI}, timeout=10)
            assert r.status_code == 200
        finally:
            gated.release.set()
        t.join(30)
        assert result["r"].status_code == 200


LOOP = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}x"


def test_a_looping_server_template_is_stopped_at_the_time_limit():
    engine = FakeAsyncEngine()
    app = build_app(engine, ServeConfig(chat_template_timeout_s=0.5), tool_parser=None, reasoning_parser=None,
                    chat_template="{% if messages[0].content == 'loop' %}" + LOOP + "{% else %}ok{% endif %}")
    with ServerThread(app) as s:
        t0 = time.perf_counter()
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "loop"}]},
                       timeout=60)
        assert r.status_code == 400 and "longer than 0.5 s" in r.json()["error"]["message"]
        assert time.perf_counter() - t0 < 20
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": HI}, timeout=30)
        assert r.status_code == 200 and engine.prompts_seen[-1].endswith("ok")


def test_request_templates_with_trust_run_sandboxed_and_limited():
    engine = FakeAsyncEngine()
    with ServerThread(make_app(engine, trust_request_chat_template=True, chat_template_timeout_s=2.0)) as s:
        ok = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": HI, "chat_template": ok}, timeout=120)
        assert r.status_code == 200, r.text
        assert engine.prompts_seen[-1].endswith("<user>hi")
        # an endless template: stopped at the limit, the render process replaced
        t0 = time.perf_counter()
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": HI, "chat_template": LOOP}, timeout=120)
        assert r.status_code == 400 and "longer than 2 s" in r.json()["error"]["message"]
        assert time.perf_counter() - t0 < 60
        # a memory bomb in one filter call: refused, the server unharmed
        bomb = "{{ 'x' | center(20000000000) }}"
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": HI, "chat_template": bomb}, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
        # the sandbox still holds: no reaching Python internals from a template
        escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": HI, "chat_template": escape}, timeout=120)
        assert r.status_code == 400
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": HI, "chat_template": ok}, timeout=120)
        assert r.status_code == 200


def test_generation_config_numbers_as_floats_still_serve():
    """A checkpoint that writes top_k as 20.0: the default reaches the engine as the integer 20."""
    from moet.serve.sampling import generation_defaults
    assert generation_defaults({"top_k": 20.0, "top_p": 1, "temperature": 0.7}) == {
        "temperature": 0.7, "top_p": 1.0, "top_k": 20}
    assert generation_defaults({"top_k": 2.5, "top_p": True}) == {}
    engine = FakeAsyncEngine()
    app = build_app(engine, ServeConfig(), generation_config={"top_k": 20.0, "temperature": 0.5})
    with ServerThread(app) as s:
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": HI}, timeout=30)
        assert r.status_code == 200 and engine.params_seen[-1].top_k == 20


def test_sampling_refusals_name_their_field(server):
    r = _post(server, {"messages": HI, "stop": ["ok", ""]})       # past the schema, refused by SamplingParams
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text


def test_health_reports_a_degraded_engine():
    """An engine that serves but is not whole (a pack row failed its checksum and is being repaired)
    answers /health with 503 and the reason, in OpenAI's error shape; whole again, 200."""
    engine = FakeAsyncEngine()
    state = {"v": ("degraded", "1 pack row failed its checksum, repair pending")}
    engine.health = lambda: state["v"]
    with ServerThread(make_app(engine)) as s:
        r = httpx.get(s.url + "/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "degraded"
        assert "checksum" in r.json()["error"]["message"]
        assert httpx.post(s.url + "/v1/chat/completions", json={"messages": HI}, timeout=30).status_code == 200
        state["v"] = ("ok", "")
        assert httpx.get(s.url + "/health").status_code == 200
