"""POST /v1/responses (OpenAI's Responses API) over the chat machinery: a Responses request is
translated into a chat completion request and run by ChatPlan / Generation exactly as
/v1/chat/completions runs it (template, tool parser, reasoning parser, sampling defaults, the
same 400s); only the shapes differ, so the two routes cannot drift apart in what they generate.

    instructions            -> a system message, first (not carried over by previous_response_id,
                               as in OpenAI's API)
    previous_response_id    -> that response's conversation (its input and its output), then
    input items             -> messages: message -> its role; function_call -> an assistant
                               tool call; function_call_output -> a tool message; reasoning ->
                               the next assistant turn's reasoning_content
    tools, tool_choice      -> chat's function tools and tool_choice (required / named: the reply is
                               calls under a grammar, as in chat); parallel_tool_calls passed on
    max_output_tokens       -> max_completion_tokens
    text.format             -> response_format (json_object / json_schema: constrained decoding,
                               as chat does it)

    reasoning_content -> a `reasoning` item; content -> a `message` item; each tool call -> a
    `function_call` item (a reply with none of these is one empty message). finish_reason length
    -> status incomplete (max_output_tokens), and the item being written then is incomplete; a
    reply cut inside its reasoning has no message, as OpenAI answers it.

Stored responses (store, the default) live in memory for the server's lifetime, in an LRU
bounded by count and by bytes: a conversation continued past its eviction gets the same 400
as an unknown id.
"""
from __future__ import annotations

import json
import threading
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator

from pydantic import TypeAdapter

from moet.serve.chat import ChatPlan, chat_response
from moet.serve.chat_output import ChoiceDeltaParts
from moet.serve.errors import APIError, BadRequest
from moet.serve.generation import ChoiceDelta
from moet.serve.protocol import ChatCompletionRequest, UsageInfo, now
from moet.serve.request_body import validate
from moet.serve.responses_protocol import (
    FunctionCallInput, FunctionCallItem, FunctionCallOutputInput, IncompleteDetails, InputItem, InputMessage,
    NamedFunctionChoice, OutputMessage, OutputText, ReasoningInput, ReasoningItem, ReasoningTextPart, Response,
    ResponseErrorInfo, ResponsesRequest, ResponseUsage)
from moet.serve.server_state import ServerState
from moet.serve.sse import encode_json

# A stored response keeps its whole conversation (so a continuation never depends on an
# ancestor that was evicted); the byte bound keeps long conversations from holding the
# server's memory, the count bound keeps lookups and eviction cheap.
STORE_MAX_RESPONSES = 4096
STORE_MAX_BYTES = 256 * 2 ** 20

# chat's field names in errors -> the Responses request's
_PARAM_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                "response_format": "text"}

_ITEMS = TypeAdapter(list[InputItem])


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseStore:
    """Responses by id, with the conversation a previous_response_id continues. Kept as JSON
    text: entries cannot be changed through a caller's reference, and their size is known.
    Plans read it in worker threads and responses are put on the event loop, hence the lock."""

    def __init__(self, max_responses: int = STORE_MAX_RESPONSES, max_bytes: int = STORE_MAX_BYTES):
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._entries: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        entry = (json.dumps(response, ensure_ascii=False), json.dumps(conversation, ensure_ascii=False))
        size = len(entry[0]) + len(entry[1])
        if size > self.max_bytes:
            return
        with self._lock:
            self._drop(response["id"])
            self._entries[response["id"]] = entry
            self._bytes += size
            while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= len(entry[0]) + len(entry[1])
        return entry is not None

    def _get(self, response_id: str) -> tuple[str, str] | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def response(self, response_id: str) -> dict[str, Any] | None:
        entry = self._get(response_id)
        return json.loads(entry[0]) if entry is not None else None

    def conversation(self, response_id: str) -> list[dict[str, Any]] | None:
        entry = self._get(response_id)
        return json.loads(entry[1]) if entry is not None else None

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def __len__(self) -> int:
        return len(self._entries)


# ------------------------------------------------------------------------ input items -> chat messages

def input_messages(items: str | list) -> list[dict[str, Any]]:
    """Input items (validated) as chat messages, in ChatMessage's shape. Consecutive function
    calls after an assistant message are that turn's tool calls; a reasoning item belongs to
    the assistant turn that follows it (and is dropped when none does)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    reasoning: str | None = None
    for item in items:
        if isinstance(item, ReasoningInput):
            reasoning = item.text if reasoning is None else f"{reasoning}\n{item.text}"
            continue
        if isinstance(item, InputMessage):
            msg: dict[str, Any] = {"role": item.role, "content": item.text}
            if item.role == "assistant" and reasoning:
                msg["reasoning_content"] = reasoning
            out.append(msg)
        elif isinstance(item, FunctionCallInput):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if reasoning is None and last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                msg = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning:
                    msg["reasoning_content"] = reasoning
                out.append(msg)
        elif isinstance(item, FunctionCallOutputInput):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
        reasoning = None
    return out


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a continuation renders: output items are
    valid input items, so they go through the same conversion a client's resent history does."""
    return input_messages(_ITEMS.validate_python(output)) if output else []


# ------------------------------------------------------------------------ the plan

class ResponsesPlan:
    """Everything decided before the engine runs: the conversation, the chat request that
    generates the reply, and what the Response echoes."""

    def __init__(self, state: ServerState, req: ResponsesRequest, store: ResponseStore):
        self.state, self.req, self.store = state, req, store
        for name, asked in (("background", bool(req.background)), ("conversation", req.conversation is not None),
                            ("prompt", req.prompt is not None), ("top_logprobs", bool(req.top_logprobs))):
            if asked:
                raise BadRequest(f"{name} is not supported by moet's /v1/responses", param=name)
        if (req.tool_choice == "required" or isinstance(req.tool_choice, NamedFunctionChoice)) and not req.tools:
            raise BadRequest("tool_choice other than none/auto needs tools", param="tool_choice")
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            found = store.conversation(req.previous_response_id)
            if found is None:
                # OpenAI's answer, status and code included (a stored response that was evicted
                # or never stored, store: false, is unknown too)
                raise BadRequest(f"Previous response with id '{req.previous_response_id}' not found.",
                                 param="previous_response_id", code="previous_response_not_found")
            history = found
        self.conversation = history + input_messages(req.input)
        messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + self.conversation
        try:
            self.chat = ChatPlan(state, validate(ChatCompletionRequest, self._chat_body(messages)))
        except APIError as exc:
            raise _in_responses_terms(exc) from None
        self.model_name = self.chat.model_name
        self.usage: UsageInfo | None = None

    def _chat_body(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        req = self.req
        body: dict[str, Any] = {"model": req.model, "messages": messages}
        if req.max_output_tokens is not None:
            body["max_completion_tokens"] = req.max_output_tokens
        for name in ("temperature", "top_p", "seed", "user", "parallel_tool_calls"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
        if req.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(
                include={"name", "description", "parameters", "strict"}, exclude_none=True)} for t in req.tools]
        if isinstance(req.tool_choice, NamedFunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
        elif req.tool_choice is not None:
            body["tool_choice"] = req.tool_choice
        fmt = req.text.format if req.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                k: v for k, v in (("name", fmt.name), ("schema", fmt.schema_), ("description", fmt.description),
                                  ("strict", fmt.strict)) if v is not None}}
        return body

    @staticmethod
    def response_id(request_id: str) -> str:
        return "resp_" + request_id.split("-", 1)[-1]

    def response(self, response_id: str, created_at: int, status: str, output: list,
                 usage: UsageInfo | None = None, error: ResponseErrorInfo | None = None) -> Response:
        req = self.req
        tool_choice: Any = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunctionChoice) \
            else (req.tool_choice or "auto")
        return Response(
            id=response_id, created_at=created_at, status=status,
            completed_at=now() if status == "completed" else None, error=error,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens, model=self.model_name,
            output=output, parallel_tool_calls=req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
            previous_response_id=req.previous_response_id,
            reasoning={"effort": req.reasoning.effort if req.reasoning else None,
                       "summary": req.reasoning.summary if req.reasoning else None},
            store=req.store, temperature=self.chat.params.temperature, top_p=self.chat.params.top_p,
            text=req.text.model_dump(by_alias=True, exclude_none=True) if req.text is not None and req.text.format
            else {"format": {"type": "text"}},
            tool_choice=tool_choice, tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
            truncation=req.truncation or "disabled",
            usage=ResponseUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                                total_tokens=usage.total_tokens) if usage is not None else None,
            user=req.user, metadata=req.metadata or {})

    def remember(self, body: dict[str, Any]) -> None:
        """Store a finished response (unless store is false) with the conversation it ends."""
        if self.req.store:
            self.store.put(body, self.conversation + output_messages(body["output"]))


def _in_responses_terms(exc: APIError) -> APIError:
    """An error chat raised, naming the Responses field the client sent."""
    field = (exc.param or "").split(".")[0]
    if field in _PARAM_NAMES:
        if field == "response_format":   # chat's message names chat's field: say where it came from
            exc.message = f"text.format: {exc.message}"
            exc.args = (exc.message,)
        exc.param = _PARAM_NAMES[field]
    return exc


# ------------------------------------------------------------------------ one JSON response

async def responses_response(plan: ResponsesPlan, request_id: str) -> dict[str, Any]:
    created = now()
    chat = await chat_response(plan.chat, request_id)
    plan.usage = chat.usage
    (choice,) = chat.choices
    msg = choice.message
    incomplete = choice.finish_reason == "length"
    items: list = []
    if msg.reasoning_content:
        items.append(ReasoningItem(id=new_id("rs"), content=[ReasoningTextPart(text=msg.reasoning_content)],
                                   status="completed"))
    if msg.content or not items and not msg.tool_calls:      # a reply with no output at all is an empty message
        items.append(OutputMessage(id=new_id("msg"), status="completed",
                                   content=[OutputText(text=msg.content or "")]))
    if incomplete and items:   # the item being written when the budget ran out
        items[-1].status = "incomplete"
    items += [FunctionCallItem(id=new_id("fc"), call_id=c.id, name=c.function.name, arguments=c.function.arguments,
                               status="completed") for c in msg.tool_calls]
    body = plan.response(plan.response_id(request_id), created, "incomplete" if incomplete else "completed",
                         items, chat.usage).model_dump()
    plan.remember(body)
    return body


# ------------------------------------------------------------------------ server-sent events

class ResponsesStream:
    """A Generation's deltas as Responses events: `event: TYPE` + `data: {...}` frames, numbered
    by sequence_number, no [DONE] (OpenAI's framing). Items open as their first text arrives
    (reasoning, then the message; a tool call whole, as the parser gives it) and close when the
    next kind starts or the reply ends; response.completed (or .incomplete) carries the full
    Response, whose output is exactly the items streamed."""

    def __init__(self, plan: ResponsesPlan, request_id: str):
        self.plan = plan
        self.gen = plan.chat.generation(request_id)
        self.response_id = plan.response_id(request_id)
        self.created_at = now()
        self.seq = 0
        self.output: list[dict[str, Any]] = []      # items as they stand, index = output_index
        self.open: dict[str, Any] | None = None    # the reasoning or message item being written
        self.open_text = ""

    def current_usage(self) -> UsageInfo:
        return self.gen.usage()

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {encode_json(data)}\n\n"

    def _snapshot(self, status: str, **kw: Any) -> dict[str, Any]:
        return self.plan.response(self.response_id, self.created_at, status, list(self.output), **kw).model_dump()

    # items ------------------------------------------------------------------

    def _open(self, kind: str) -> list[str]:
        if kind == "message":
            item = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": []}
        else:
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        self.output.append(item)
        self.open, self.open_text = item, ""
        i = len(self.output) - 1
        return [self._event("response.output_item.added", output_index=i, item=item),
                self._event("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
                            part=part)]

    def _close(self, status: str) -> list[str]:
        item, text, i = self.open, self.open_text, len(self.output) - 1
        self.open = None
        if item is None:
            return []
        if item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": []}
            done = self._event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                               text=text, logprobs=[])
        else:
            part = {"type": "reasoning_text", "text": text}
            done = self._event("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                               text=text)
        item["content"], item["status"] = [part], status
        return [done,
                self._event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=i, item=item)]

    def _text(self, kind: str, delta: str) -> list[str]:
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self._close("completed") + self._open(kind)
        self.open_text += delta
        i, item_id = len(self.output) - 1, self.open["id"]
        if kind == "message":
            out.append(self._event("response.output_text.delta", item_id=item_id, output_index=i, content_index=0,
                                   delta=delta, logprobs=[]))
        else:
            out.append(self._event("response.reasoning_text.delta", item_id=item_id, output_index=i,
                                   content_index=0, delta=delta))
        return out

    def _parts(self, parts: ChoiceDeltaParts) -> list[str]:
        out = []
        if parts.reasoning:
            out += self._text("reasoning", parts.reasoning)
        if parts.content:
            out += self._text("message", parts.content)
        for c in parts.calls:
            out += self._close("completed")
            item = {"id": new_id("fc"), "type": "function_call", "call_id": c.id, "name": c.name,
                    "arguments": "", "status": "in_progress"}
            self.output.append(item)
            i = len(self.output) - 1
            out.append(self._event("response.output_item.added", output_index=i, item=dict(item)))
            # the parser hands over each call whole: its arguments are one delta
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                                   delta=c.arguments))
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                   arguments=c.arguments))
            item["arguments"], item["status"] = c.arguments, "completed"
            out.append(self._event("response.output_item.done", output_index=i, item=item))
        return out

    # the stream --------------------------------------------------------------

    async def events(self, deltas_iter: AsyncIterator[list[ChoiceDelta]]) -> AsyncIterator[str]:
        yield (self._event("response.created", response=self._snapshot("in_progress"))
               + self._event("response.in_progress", response=self._snapshot("in_progress")))
        chat = self.plan.chat
        parser = chat.choice_parser()
        prefix = getattr(chat, "prefix", "")
        if prefix:              # a forced call's opener is part of the reply
            parser.feed(prefix)
        finish = None
        try:
            async for deltas in deltas_iter:
                out: list[str] = []
                for d in deltas:
                    out += self._parts(parser.feed(d.text, final=d.finish_reason is not None))
                    if d.finish_reason is not None:
                        finish = d.finish_reason
                if out:
                    yield "".join(out)
        except APIError as exc:  # headers are gone: report in-band, then end the response as failed
            code = exc.code if isinstance(exc.code, str) else exc.type
            yield (self._event("error", code=code, message=exc.message, param=exc.param)
                   + self._event("response.failed", response=self._snapshot(
                       "failed", usage=self.gen.usage(), error=ResponseErrorInfo(code="server_error",
                                                                                  message=exc.message))))
            return
        incomplete = finish == "length"
        status = "incomplete" if incomplete else "completed"
        out = self._close(status)
        if not self.output:     # a reply with no output at all is an empty message
            out += self._open("message") + self._close(status)
        body = self._snapshot(status, usage=self.gen.usage())
        self.plan.remember(body)
        out.append(self._event("response.incomplete" if incomplete else "response.completed", response=body))
        yield "".join(out)
