"""OpenAI's Responses API (POST /v1/responses) as pydantic models: the request, the Response
object and its output items, and the streamed events.

As in protocol.py, request models accept unknown fields (clients send newer fields; they are
ignored) and validate types and ranges, so a bad value is a 400 naming the field. What moet
cannot serve is refused here too, with a message that says so, rather than silently ignored:
built-in tools (web_search, file_search, ...), non-text input (images, files, audio), input
items other than messages, function calls and their outputs, and reasoning. Response and event
models forbid unknown fields, so a typo in the server is a test failure, not a client surprise.

Only the shapes live here; responses.py turns a request into a chat completion request and its
result back into a Response.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from moet.serve.protocol import FunctionDefinition, _Request, _Response

# ------------------------------------------------------------------------ request: input items

INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
TEXT_PART_TYPES = ("input_text", "output_text", "text", "refusal")


class InputTextPart(_Request):
    """A text part of a message. input_text is the user's, output_text an earlier assistant
    reply's; `text` (chat's name) and `refusal` are read as text too."""
    type: Literal["input_text", "output_text", "text", "refusal"]
    text: str | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _has_text(self):
        if (self.refusal if self.type == "refusal" else self.text) is None:
            raise ValueError(f"a content part of type {self.type!r} needs "
                             f"{'refusal' if self.type == 'refusal' else 'text'}")
        return self

    @property
    def value(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


def _text_parts_only(content: Any) -> Any:
    # images, files and audio get a message that names them, not pydantic's union report
    if isinstance(content, list):
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in TEXT_PART_TYPES:
                raise ValueError(f"content[{j}] has type {kind!r}: moet serves text only "
                                 f"(parts of type {', '.join(TEXT_PART_TYPES[:2])})")
    return content


class InputMessage(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputTextPart]
    id: str | None = None
    status: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        return _text_parts_only(v)

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.value for p in self.content)


class FunctionCallInput(_Request):
    """A call the model made in an earlier turn (an output item sent back as input)."""
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputInput(_Request):
    """The caller's result for a function_call, matched by call_id."""
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputTextPart]
    id: str | None = None
    status: str | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        return _text_parts_only(v)

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.value for p in self.output)


class ReasoningText(_Request):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningInput(_Request):
    """Reasoning from an earlier turn: rendered as the next assistant turn's reasoning_content
    (templates that keep reasoning in their history show it; others drop it)."""
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        parts = self.content if self.content else self.summary
        return "\n".join(p.text for p in parts)


def _item_type(v: Any) -> str:
    return (v.get("type") if isinstance(v, dict) else getattr(v, "type", None)) or "message"


InputItem = Annotated[Union[
    Annotated[InputMessage, Tag("message")],
    Annotated[FunctionCallInput, Tag("function_call")],
    Annotated[FunctionCallOutputInput, Tag("function_call_output")],
    Annotated[ReasoningInput, Tag("reasoning")],
], Discriminator(_item_type)]


# ------------------------------------------------------------------------ request: tools, format

class FunctionTool(FunctionDefinition):
    """Responses' function tool: chat's function definition, flat (no `function` wrapper)."""
    type: Literal["function"]


class NamedFunctionChoice(_Request):
    type: Literal["function"]
    name: str = Field(min_length=1)


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_needs_one(self):
        if self.type == "json_schema" and (self.schema_ is None or not self.name):
            raise ValueError("format json_schema needs a name and a schema")
        return self


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Request):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2 ** 63), le=2 ** 63 - 1)
    stream: bool = False
    previous_response_id: str | None = Field(default=None, min_length=1)
    store: bool = True
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # refused below when asked for: moet has no background mode, no stored prompts or
    # conversations, and no logprobs on this route
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, v: Any) -> Any:
        # what moet cannot serve gets one message naming the item, not pydantic's report of
        # every union member it tried
        if isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ValueError(f"input must be a string or a list of input items, not {type(v).__name__}")
        if not v:
            raise ValueError("input must not be empty")
        for i, item in enumerate(v):
            if not isinstance(item, dict):
                raise ValueError(f"input[{i}] must be an object (an input item)")
            kind = item.get("type", "message")
            if kind not in INPUT_ITEM_TYPES:
                raise ValueError(f"input[{i}] has type {kind!r}, which moet does not support "
                                 f"(supported: {', '.join(INPUT_ITEM_TYPES)})")
            field = {"message": "content", "function_call_output": "output"}.get(kind)
            try:
                _text_parts_only(item.get(field) if field else None)
            except ValueError as exc:
                raise ValueError(f"input[{i}].{field}: {exc}") from None
        return v

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, v: Any) -> Any:
        if isinstance(v, list):
            for i, tool in enumerate(v):
                kind = tool.get("type") if isinstance(tool, dict) else None
                if kind != "function":
                    raise ValueError(f"tools[{i}] has type {kind!r}: moet serves function tools only "
                                     "(built-in tools such as web_search or file_search run on OpenAI's servers)")
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice(cls, v: Any) -> Any:
        if isinstance(v, dict) and v.get("type") != "function":
            raise ValueError(f"tool_choice of type {v.get('type')!r} is not supported: use none, auto, required "
                             "or {\"type\": \"function\", \"name\": ...}")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        # OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512
        if v is not None and (len(v) > 16 or any(len(k) > 64 or len(x) > 512 for k, x in v.items())):
            raise ValueError("metadata holds at most 16 pairs, keys of at most 64 characters and values of at most 512")
        return v


# ------------------------------------------------------------------------ response: output items

class OutputText(_Response):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(_Response):
    id: str
    type: Literal["message"] = "message"
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class ReasoningTextPart(_Response):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(_Response):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningTextPart]
    status: Literal["in_progress", "completed", "incomplete"]


class FunctionCallItem(_Response):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = Annotated[Union[OutputMessage, ReasoningItem, FunctionCallItem], Field(discriminator="type")]


class InputTokensDetails(_Response):
    cached_tokens: int = 0


class OutputTokensDetails(_Response):
    reasoning_tokens: int = 0


class ResponseUsage(_Response):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)


class IncompleteDetails(_Response):
    reason: Literal["max_output_tokens"]


class ResponseErrorInfo(_Response):
    code: str
    message: str


class Response(_Response):
    """The Response object. Every field is always present (null when unset), as OpenAI sends it:
    dump it with model_dump(), not exclude_none."""
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    completed_at: int | None = None
    error: ResponseErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    background: bool = False


class ResponseDeleted(_Response):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


# ------------------------------------------------------------------------ streamed events
# The stream writes these as plain dicts (one json encoder, no pydantic per token, as sse.py
# does for chat); the models pin their shapes, and tests hold every streamed event to them.

class _Event(_Response):
    sequence_number: int


class ResponseLifecycleEvent(_Event):
    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete",
                  "response.failed"]
    response: Response


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: Annotated[Union[OutputText, ReasoningTextPart], Field(discriminator="type")]


class OutputTextDeltaEvent(_Event):
    type: Literal["response.output_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class OutputTextDoneEvent(_Event):
    type: Literal["response.output_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningTextDeltaEvent(_Event):
    type: Literal["response.reasoning_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDoneEvent(_Event):
    type: Literal["response.reasoning_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"]
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"]
    item_id: str
    output_index: int
    arguments: str


class ErrorEvent(_Event):
    type: Literal["error"]
    code: str | None = None
    message: str
    param: str | None = None


STREAM_EVENTS: dict[str, type[_Event]] = {
    **{t: ResponseLifecycleEvent for t in ("response.created", "response.in_progress", "response.completed",
                                           "response.incomplete", "response.failed")},
    "response.output_item.added": OutputItemEvent, "response.output_item.done": OutputItemEvent,
    "response.content_part.added": ContentPartEvent, "response.content_part.done": ContentPartEvent,
    "response.output_text.delta": OutputTextDeltaEvent, "response.output_text.done": OutputTextDoneEvent,
    "response.reasoning_text.delta": ReasoningTextDeltaEvent, "response.reasoning_text.done": ReasoningTextDoneEvent,
    "response.function_call_arguments.delta": FunctionCallArgumentsDeltaEvent,
    "response.function_call_arguments.done": FunctionCallArgumentsDoneEvent,
    "error": ErrorEvent,
}
