"""The FastAPI app: OpenAI's routes over an engine that follows contract 2
(moet.engine.async_engine.AsyncEngine, or any object with its shape).

    GET  /v1/models            the served model (one card per served name)
    POST /v1/chat/completions  chat (JSON or server-sent events)
    POST /v1/completions       raw prompts (JSON or server-sent events)
    POST /v1/responses         OpenAI's Responses API over the chat machinery (responses.py)
    GET, DELETE /v1/responses/{id}  a stored response
    POST /tokenize, /detokenize  vLLM's tokenizer endpoints
    GET  /health               200 while the engine answers stats() and is whole, else 503
    GET  /metrics              Prometheus text format (moet.serve.metrics)
    GET  /version              moet's version

Request bodies are parsed here, not by FastAPI, so every failure has OpenAI's error shape and
a status that says what was wrong (errors.py lists them); a bad request never takes the
server down. Everything that costs time in proportion to a request's size (parsing, chat
templates, tokenizing) runs in worker threads (ServerState.off_loop), so one huge request
never stalls the event loop that every stream and /health share. A client that goes away aborts its engine requests at once (a watcher on the
connection: streamed, it interrupts the generation's wait for the engine; non-streamed, it
cancels the handler's work). One log line per request at the end of its response: method,
path, status, prompt / completion tokens, seconds.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from moet import __version__

from moet.serve.chat import ChatPlan, ChatStream, chat_response
from moet.serve.completion import CompletionPlan, CompletionStream, completion_response
from moet.serve.errors import APIError, MethodNotAllowed, NotFound, Unauthorized, Unavailable
from moet.serve.generation import ClientGone, Generation
from moet.serve.metrics import CONTENT_TYPE, ServerMetrics
from moet.serve.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ModelCard, ModelList, VersionResponse, random_id)
from moet.serve.request_body import parse_request, read_body
from moet.serve.responses import ResponsesPlan, ResponsesStream, ResponseStore, responses_response
from moet.serve.responses_protocol import ResponseDeleted, ResponsesRequest
from moet.serve.reasoning import ReasoningParser
from moet.serve.sampling import generation_defaults
from moet.serve.serve_config import ServeConfig
from moet.serve.server_state import ServerState
from moet.serve.tokenization import detokenize, tokenize
from moet.serve.tool_parsers import ToolParser

log = logging.getLogger("moet.serve")


def error_response(exc: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
    return JSONResponse(exc.response().model_dump(), status_code=exc.status, headers=headers)


async def read_request(request: Request, model: type[BaseModel], state: ServerState):
    """The body, read up to --max-request-bytes, parsed and validated in a worker thread."""
    body = await read_body(request.stream(), request.headers.get("content-length"), state.config.max_request_bytes)
    return await state.off_loop(parse_request, body, model)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`; if the client goes away first, cancel it (its finally-blocks abort the
    engine requests) and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _guarded(request: Request, gen: Generation, events: AsyncIterator[str],
                   on_close: Callable[[], None]) -> AsyncIterator[str]:
    """Server-sent events that stop, and abort generation, as soon as the client disconnects,
    whatever the ASGI server's disconnect signalling: a watcher on the connection interrupts
    the generation, whose wait for the engine then raises ClientGone (one watcher task per
    request; nothing extra per event)."""
    def gone(w: asyncio.Future) -> None:
        if not w.cancelled() and w.exception() is None:
            gen.interrupt(ClientGone())

    watcher = asyncio.ensure_future(_wait_disconnect(request))
    watcher.add_done_callback(gone)
    try:
        async for item in events:
            yield item
    except ClientGone:
        request.state.status_note = "client disconnected"
    finally:
        watcher.remove_done_callback(gone)
        watcher.cancel()
        await events.aclose()
        on_close()


async def _chain(first: list, rest: AsyncIterator[list]) -> AsyncIterator[list]:
    yield first
    async for x in rest:
        yield x


class AuthAndLog:
    """Pure ASGI middleware (streams pass through untouched): the API key check on /v1 routes,
    the per-request log line once the response has been fully sent, HTTP status counts, and a
    JSON 500 instead of a dropped connection when a handler has a bug."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        cfg = self.state.config
        status = [0]

        async def send_and_watch(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        path = scope.get("path", "")
        try:
            if cfg.api_key and path.startswith("/v1") and \
                    dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1") != f"Bearer {cfg.api_key}":
                await error_response(Unauthorized("missing or wrong API key: send 'Authorization: Bearer KEY'"))(
                    scope, receive, send_and_watch)
            else:
                await self.app(scope, receive, send_and_watch)
        except Exception as exc:  # a bug must cost one request, not the server
            log.exception("unhandled error on %s", path)
            if status[0] == 0:
                await error_response(APIError(f"internal error: {type(exc).__name__}: {exc}"))(
                    scope, receive, send_and_watch)
        finally:
            self.state.metrics.http_requests.labels(path if path.startswith("/v1/") or path in ("/health", "/metrics")
                                                    else "other", str(status[0])).inc()
            if cfg.log_requests:
                st = scope.get("state") or {}
                u = st.get("usage")
                tokens = f" prompt={u.prompt_tokens} completion={u.completion_tokens}" if u is not None else ""
                note = st.get("status_note")
                log.info("%s %s %d%s %.3fs%s", scope.get("method"), path, status[0], tokens,
                         time.perf_counter() - start, f" ({note})" if note else "")


def build_app(engine, config: ServeConfig | None = None, *, tool_parser: type[ToolParser] | None = None,
              reasoning_parser: ReasoningParser | None = None, generation_config: dict | None = None,
              model_path: str | None = None, chat_template: str | None = None) -> FastAPI:
    """The app over `engine` (contract 2). Parsers are given resolved (serve_cli picks them from
    the flags and the chat template); generation_config supplies sampling defaults; chat_template
    (--chat-template) replaces the tokenizer's own."""
    config = config or ServeConfig()
    names = list(config.served_model_name or [engine.model_name])
    state = ServerState(engine=engine, config=config, model_name=names[0],
                        metrics=ServerMetrics(engine, names[0]), tool_parser=tool_parser,
                        reasoning_parser=reasoning_parser, sampling_defaults=generation_defaults(generation_config),
                        model_path=model_path, model_names=names, chat_template=chat_template)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        try:
            await engine.shutdown()
        except Exception:
            log.exception("engine shutdown failed")
        finally:
            state.close()

    app = FastAPI(title="moet", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.moet = state
    app.add_middleware(AuthAndLog, state=state)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        # routing's own errors (no such route, wrong method) in OpenAI's shape, like every other error
        if exc.status_code == 405:
            return error_response(MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}"))
        if exc.status_code == 404:
            return error_response(NotFound(f"no route {request.method} {request.url.path}; the API is under /v1 "
                                           "(docs/serve.md lists the routes)"))
        err = APIError(str(exc.detail))
        err.status = exc.status_code
        return error_response(err)

    # stats() waits for the engine's lock, which a step holds: never on the event loop, where it
    # would stall every stream for a step's length
    def engine_health() -> tuple[str, str]:
        engine.stats()                                  # raises once the engine is gone
        check = getattr(engine, "health", None)
        return check() if check is not None else ("ok", "")

    @app.get("/health")
    async def health():
        try:
            status, reason = await asyncio.to_thread(engine_health)
        except Exception as exc:
            return error_response(Unavailable(f"engine not healthy: {type(exc).__name__}: {exc}"))
        if status != "ok":      # serving, but not whole (a pack row being repaired): not ready for more
            return error_response(Unavailable(f"engine {status}: {reason}", code=status))
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(await asyncio.to_thread(state.metrics.render), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version():
        return JSONResponse(VersionResponse(version=__version__).model_dump())

    def cards() -> list[ModelCard]:
        return [ModelCard(id=n, root=model_path, max_model_len=engine.max_model_len) for n in names]

    @app.get("/v1/models")
    async def models():
        return JSONResponse(ModelList(data=cards()).model_dump())

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        try:
            state.check_model(name)
        except APIError as exc:
            return error_response(exc)
        return JSONResponse(ModelCard(id=state.response_model_name(name), root=model_path,
                                      max_model_len=engine.max_model_len).model_dump())

    async def serve(request: Request, req_model, make_plan, respond, stream_cls, prefix: str):
        try:
            req = await read_request(request, req_model, state)
            state.admit()
        except APIError as exc:
            return error_response(exc)
        try:  # templates and tokenizing: in a worker thread, never on the event loop
            plan = await state.off_loop(make_plan, state, req)
        except APIError as exc:
            state.release()
            return error_response(exc)
        except BaseException:
            state.release()
            raise
        request_id = random_id(prefix)
        if not req.stream:
            try:
                result = await until_disconnect(request, respond(plan, request_id))
            except APIError as exc:
                return error_response(exc)
            finally:
                state.release()
                request.state.usage = getattr(plan, "usage", None)
            if result is None:
                request.state.status_note = "client disconnected"
                return Response(status_code=499)
            # a dict is dumped already: the Responses API sends its unset fields as null
            return JSONResponse(result if isinstance(result, dict) else result.model_dump(exclude_none=True))

        stream = stream_cls(plan, request_id)
        deltas = stream.gen.stream()
        try:  # the first engine step decides the status, so engine refusals still get a 4xx
            first = await until_disconnect(request, deltas.__anext__())
        except (APIError, StopAsyncIteration, Exception, asyncio.CancelledError) as exc:
            await deltas.aclose()
            state.release()
            if isinstance(exc, APIError):
                return error_response(exc)
            if isinstance(exc, StopAsyncIteration):
                return error_response(Unavailable("the engine ended the request without output"))
            raise
        if first is None:
            await deltas.aclose()
            state.release()
            request.state.status_note = "client disconnected"
            return Response(status_code=499)

        def on_close() -> None:
            state.release()
            request.state.usage = stream.current_usage()

        body = _guarded(request, stream.gen, stream.events(_chain(first, deltas)), on_close)
        return StreamingResponse(body, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, ChatCompletionRequest, ChatPlan, chat_response, ChatStream, "chatcmpl")

    responses_store = ResponseStore()
    app.state.responses = responses_store

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await serve(request, ResponsesRequest, functools.partial(ResponsesPlan, store=responses_store),
                           responses_response, ResponsesStream, "resp")

    def unknown_response(response_id: str) -> JSONResponse:
        return error_response(NotFound(f"Response with id '{response_id}' not found.", param="response_id"))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        body = responses_store.response(response_id)
        return JSONResponse(body) if body is not None else unknown_response(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        if not responses_store.delete(response_id):
            return unknown_response(response_id)
        return JSONResponse(ResponseDeleted(id=response_id).model_dump())

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, CompletionRequest, CompletionPlan, completion_response, CompletionStream, "cmpl")

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        try:
            body = await read_body(request.stream(), request.headers.get("content-length"), config.max_request_bytes)
            return JSONResponse((await state.off_loop(tokenize, state, body)).model_dump(exclude_none=True))
        except APIError as exc:
            return error_response(exc)

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        try:
            req = await read_request(request, DetokenizeRequest, state)
            return JSONResponse((await state.off_loop(detokenize, state, req)).model_dump())
        except APIError as exc:
            return error_response(exc)

    return app
