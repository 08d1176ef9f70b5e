"""One request never hurts another, over HTTP (issue 34): the real AsyncEngine on the tiny
glm4_moe checkpoint (CPU) behind the app. A request with stop_token_ids outside the vocabulary
is answered 400 with error.param "stop_token_ids" while a concurrent stream finishes normally
(before, it was admitted and its first step failed every running request with a 503); a request
that fails inside the engine on its own gets 500 internal_error and the stream beside it goes on."""
from __future__ import annotations

import json

import httpx
import pytest

from moet.config import EngineConfig
from moet.engine.async_engine import AsyncEngine
from moet.engine.detokenizer import IncrementalDetokenizer
from moet.engine.llm_engine import LLMEngine
from moet.testing.tiny_checkpoint import VOCAB, cached_checkpoint
from tests.serve.server_thread import ServerThread

PROMPT = list(b"The quick brown fox jumps over")
MARK = list(b"~~fault~~")              # the prompt prefix whose request the injected fault hits


@pytest.fixture(scope="module")
def server():
    from moet.serve.api_server import build_app

    cfg = EngineConfig(model=cached_checkpoint("glm4_moe"), expert_format="bf16", dtype="float32", device="cpu",
                       block_size=4, max_num_batched_tokens=32, max_num_seqs=8, enable_prefix_caching=False)
    engine = AsyncEngine(LLMEngine.from_config(cfg))
    with ServerThread(build_app(engine, tool_parser=None, reasoning_parser=None)) as s:
        yield s


def _solo(url: str) -> list[int]:
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _streamed_beside(url: str, other: dict) -> tuple[str, str | None, httpx.Response]:
    """A greedy stream of 40 tokens; once its first chunk is in, `other` is posted. -> (the
    stream's text, its finish_reason, other's response)."""
    with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
            "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        chunks, reply = [], None
        for line in lines:
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunks.append(json.loads(line[6:]))
            if reply is None:                      # the stream is running: now the other request
                reply = httpx.post(url + "/v1/completions", timeout=120, json=other)
    assert all("error" not in c for c in chunks), chunks
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    finish = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")][-1]
    return text, finish, reply


def test_out_of_vocab_stop_ids_get_400_with_param_while_a_stream_finishes(server):
    want = _solo(server.url)
    text, finish, bad = _streamed_beside(server.url, {
        "prompt": list(b"hello"), "max_tokens": 8, "temperature": 0, "stop_token_ids": [VOCAB + 5], "min_tokens": 3})
    assert bad.status_code == 400, bad.text
    err = bad.json()["error"]
    assert err["param"] == "stop_token_ids" and err["type"] == "invalid_request_error"
    assert str(VOCAB + 5) in err["message"]
    assert text == want and finish == "length"


def test_a_request_failing_inside_the_engine_gets_500_alone(server, monkeypatch):
    want = _solo(server.url)
    orig = IncrementalDetokenizer.update

    def update(self):
        if self.seq.prompt_token_ids[:len(MARK)] == MARK and self.seq.num_output_tokens >= 2:
            raise RuntimeError("injected detokenizer fault")
        return orig(self)

    monkeypatch.setattr(IncrementalDetokenizer, "update", update)
    text, finish, bad = _streamed_beside(server.url, {
        "prompt": MARK + list(b" go"), "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert bad.status_code == 500, bad.text
    err = bad.json()["error"]
    assert err["type"] == "internal_error" and "failed inside the engine" in err["message"]
    assert "injected detokenizer fault" in err["message"]
    assert text == want and finish == "length"
    monkeypatch.undo()
    assert httpx.get(server.url + "/health").status_code == 200 and _solo(server.url) == want
