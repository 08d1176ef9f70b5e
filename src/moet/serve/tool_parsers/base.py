"""What every tool-call parser shares: the complete and the streaming interface, and the
streaming state machine that guarantees a client never sees half a call.

A model writes tool calls inside "regions" that open with a fixed marker (`<tool_call>` for
GLM-4.5 and Hermes, `<｜tool▁calls▁begin｜>` for DeepSeek-V3, ...). The stream:
  - outside a region, passes text through as content, holding back a tail that could be the
    start of the marker (a marker split across tokens must not leak out as content);
  - inside a region, buffers text until the format's parser (`take`) can cut off whole calls,
    and emits each call in one piece: id, name and complete JSON arguments in a single delta;
  - at the end, hands an unfinished region back as content (nothing is lost, nothing is half).
The complete parser is the stream fed everything at once, so streamed and non-streamed
responses agree by construction.

Content whitespace: leading whitespace and whitespace that only separates content from a call
or from the end are dropped (GLM writes "\\n" before and after calls); whitespace between two
pieces of content is kept.
"""
from __future__ import annotations

import ast
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from moet.serve.reasoning import partial_marker


@dataclass
class ParsedToolCall:
    name: str
    arguments: str          # JSON object text
    id: str | None = None   # a parser-given id (Kimi-K2's "functions.name:0"); else the server makes one


@dataclass
class ToolParseDelta:
    content: str = ""
    calls: list[ParsedToolCall] = field(default_factory=list)

    def extend(self, other: "ToolParseDelta") -> None:
        self.content += other.content
        self.calls.extend(other.calls)


@dataclass
class Taken:
    """What a format's `take` cut off the front of a region buffer."""
    calls: list[ParsedToolCall]
    rest: str               # the unconsumed text (inside the region unless closed)
    closed: bool            # the region ended; `rest` is content again
    invalid: str = ""       # raw text of a malformed call, handed back as content


class InvalidToolCall(ValueError):
    """A complete call block that does not parse; its raw text becomes content."""


class ToolParser(ABC):
    """One model family's tool-call syntax. Subclasses set `name` and `region_start` and
    implement `take` (usually with `take_single_call` or `take_section_calls` below) and
    `call_prefix`."""

    name: ClassVar[str]
    region_start: ClassVar[str]
    # True when the markers are special tokens that decode(skip_special_tokens=True) would drop.
    needs_special_tokens: ClassVar[bool] = False
    # end-of-turn token texts this format reads (harmony's <|call|>), left in the reply's text
    keeps_end_markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tools: list[dict[str, Any]] | None = None):
        # name -> JSON schema of the parameters, to type GLM's string-valued arguments
        self.schemas: dict[str, dict[str, Any]] = {}
        for t in tools or []:
            f = t.get("function", t)
            self.schemas[f["name"]] = f.get("parameters") or {}

    @abstractmethod
    def take(self, buf: str) -> Taken | None:
        """`buf` is text inside a region (after `region_start`). Cut every complete call off its
        front; None when not even one call (or the region's end) is complete yet."""

    # A reply made only of calls (tool_choice required / named, under a grammar; serve/
    # structured.py): reply_open, then calls separated by call_separator, then reply_close.
    reply_open: ClassVar[str] = ""
    reply_close: ClassVar[str] = ""
    call_separator: ClassVar[str] = "\n"

    @abstractmethod
    def call_pieces(self, name: str, parameters: dict[str, Any], index: int) -> list:
        """One call to `name` (the reply's `index`-th) as grammar pieces, in order: a str is literal
        text, ("json", schema) a JSON value matching the schema, ("text", stop) free text without
        `stop` in it, ("choice", [str]) one of the strings, ("optional", [pieces]) pieces that may
        be left out."""

    @abstractmethod
    def call_prefix(self, name: str | None) -> str:
        """Text that opens a call (to `name`, or to a function the model picks when None), put
        at the start of the reply when tool_choice forces a call."""

    # ------------------------------------------------------------------ shared helpers

    def typed_value(self, function: str, arg: str, raw: str) -> Any:
        """A string-valued argument as the schema's type: strings stay as written; numbers,
        booleans, objects and arrays are parsed as JSON (then as a Python literal), else kept."""
        prop = self.schemas.get(function, {}).get("properties", {}).get(arg, {})
        kind = prop.get("type")
        if kind == "string" or kind is None and not prop:
            return raw
        for parse in (json.loads, ast.literal_eval):
            try:
                return parse(raw.strip())
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                continue
        return raw

    @staticmethod
    def text_value_piece(schema: dict[str, Any]) -> Any:
        """The grammar piece of one argument written as plain text (GLM's arg_value, MiniMax's
        parameter): one of a string enum, free text up to the closing tag for a string, else JSON
        of the schema (what typed_value reads back)."""
        enum = schema.get("enum")
        if enum and all(isinstance(v, str) for v in enum):
            return ("choice", list(enum))
        if schema.get("type") == "string":
            return ("text", "</")
        return ("json", schema)

    @classmethod
    def text_argument_pieces(cls, parameters: dict[str, Any], open_tag: Callable[[str], str], close_tag: str) -> list:
        """Every argument of a schema as open_tag(key) VALUE close_tag, in the schema's property order,
        the required ones always and the others optional."""
        required = set(parameters.get("required") or ())
        pieces: list = []
        for key, schema in (parameters.get("properties") or {}).items():
            arg = [open_tag(key), cls.text_value_piece(schema), close_tag]
            pieces += arg if key in required else [("optional", arg)]
        return pieces

    @staticmethod
    def arguments_json(args: Any) -> str:
        return json.dumps(args, ensure_ascii=False)

    # ------------------------------------------------------------------ entry points

    def stream(self) -> "ToolCallStream":
        return ToolCallStream(self)

    def parse(self, text: str) -> ToolParseDelta:
        s = self.stream()
        out = s.feed(text)
        out.extend(s.finish())
        return out


# ---------------------------------------------------------------------- region shapes
# The formats differ in how a call's block is written but their regions come in two shapes
# only; each shape's `take` lives here once so that parsers of the same shape cannot drift
# apart in how they cut blocks, close regions or hand back malformed calls.

def take_single_call(buf: str, call_start: str, call_end: str,
                     parse_call: Callable[[str], ParsedToolCall]) -> Taken | None:
    """`take` for a region that is one call, `call_start` BLOCK `call_end` (GLM-4.5, Hermes):
    the region closes with the block; a block that does not parse comes back as content."""
    end = buf.find(call_end)
    if end < 0:
        return None
    block, rest = buf[:end], buf[end + len(call_end):]
    try:
        return Taken([parse_call(block)], rest, closed=True)
    except InvalidToolCall:
        return Taken([], rest, closed=True, invalid=call_start + block + call_end)


def take_section_calls(buf: str, call_start: str, call_end: str, section_end: str,
                       parse_call: Callable[[str], ParsedToolCall]) -> Taken | None:
    """`take` for a region that is a section of calls, (`call_start` BLOCK `call_end`)* then
    `section_end` (DeepSeek-V3, Kimi-K2): every complete block is cut off, a block that does
    not parse comes back as content, and the region closes only at `section_end`."""
    calls: list[ParsedToolCall] = []
    invalid = ""
    rest = buf
    while True:
        s = rest.lstrip()
        if s.startswith(section_end):
            return Taken(calls, s[len(section_end):], closed=True, invalid=invalid)
        if not s.startswith(call_start) or call_end not in s:
            break
        block, rest = s[len(call_start): s.index(call_end)], s[s.index(call_end) + len(call_end):]
        try:
            calls.append(parse_call(block))
        except InvalidToolCall:
            invalid += call_start + block + call_end
    if not calls and not invalid:
        return None
    return Taken(calls, rest, closed=False, invalid=invalid)


class ToolCallStream:
    """Incremental parsing of one choice's content. feed() deltas of text, then finish()."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.buf = ""            # text not yet emitted
        self.in_region = False
        self.pending_ws = ""     # whitespace held until we know content follows it
        self.emitted_content = False
        self.num_calls = 0

    def _content(self, text: str, out: ToolParseDelta) -> None:
        """Emit content, holding trailing whitespace and dropping leading whitespace."""
        if not text:
            return
        body = text.rstrip()
        tail = text[len(body):]
        if body:
            if not self.emitted_content:
                body = body.lstrip()
                self.pending_ws = ""
            out.content += self.pending_ws + body
            self.emitted_content = True
            self.pending_ws = tail
        else:
            self.pending_ws += tail if self.emitted_content else ""

    def feed(self, text: str) -> ToolParseDelta:
        out = ToolParseDelta()
        self.buf += text
        marker = self.parser.region_start
        while True:
            if not self.in_region:
                i = self.buf.find(marker)
                if i < 0:
                    keep = partial_marker(self.buf, marker)
                    self._content(self.buf[: len(self.buf) - keep], out)
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                self._content(self.buf[:i], out)
                self.buf = self.buf[i + len(marker):]
                self.in_region = True
            taken = self.parser.take(self.buf)
            if taken is None:
                return out
            if taken.invalid:
                self._content(taken.invalid, out)
            out.calls.extend(taken.calls)
            self.num_calls += len(taken.calls)
            self.buf = taken.rest
            if taken.closed:
                self.in_region = False
            elif not taken.calls and not taken.invalid:
                return out  # take() made no progress: wait for more text

    def finish(self) -> ToolParseDelta:
        out = ToolParseDelta()
        if self.in_region:  # an unterminated call: give it back as text
            self._content(self.parser.region_start + self.buf, out)
        else:
            self._content(self.buf, out)
        self.buf, self.pending_ws, self.in_region = "", "", False
        return out
