"""The shipped moet-tiny behind the real server, in this process, for tests that drive it with
real clients (lm-eval, the openai SDK): build_server_app (what `moet serve` builds: the real
AsyncEngine, in a thread of this process, parsers resolved from the chat template) under uvicorn
on a free loopback port. Every HTTP request is recorded (path, JSON body, status) so a test can
check what a client sent and that every request succeeded."""
from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from moet.assets import default_model
from moet.config import EngineConfig
from tests.serve.server_thread import ServerThread

MODEL = str(default_model())


@dataclass
class Recorded:
    method: str
    path: str
    body: bytes
    status: int

    def json(self):
        return json.loads(self.body)


class RecordRequests:
    """ASGI wrapper: one Recorded per HTTP request, appended when its response starts (moet reads
    the whole body before it answers, so the body is complete by then, and the record exists
    before the client has its answer)."""

    def __init__(self, app):
        self.app = app
        self.records: list[Recorded] = []
        self._lock = threading.Lock()

    def since(self, mark: int, path: str | None = None) -> list[Recorded]:
        with self._lock:
            return [r for r in self.records[mark:] if path is None or r.path == path]

    def __len__(self) -> int:
        with self._lock:
            return len(self.records)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []

        async def receive_and_keep():
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
            return message

        async def send_and_record(message):
            if message["type"] == "http.response.start":
                with self._lock:
                    self.records.append(Recorded(scope["method"], scope["path"], b"".join(chunks),
                                                 message["status"]))
            await send(message)

        await self.app(scope, receive_and_keep, send_and_record)


@contextmanager
def tiny_server(**engine) -> Iterator[tuple[ServerThread, RecordRequests]]:
    """moet-tiny served on CPU with the given EngineConfig fields (on top of the model and the
    device); the server's own flags at their defaults, the engine in a thread."""
    from moet.serve.serve_cli import build_server_app
    from moet.serve.serve_config import ServeConfig

    app = RecordRequests(build_server_app(EngineConfig(model=MODEL, device="cpu", **engine),
                                          ServeConfig(engine_process="false")))
    with ServerThread(app) as server:
        yield server, app
