"""gpt-oss tool calls (harmony): a message addressed to `functions.NAME` whose text is the JSON
arguments, ended by <|call|>

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>

The harmony reasoning parser (serve/harmony.py) hands each call on as
`to=functions.NAME<|message|>ARGUMENTS<|call|>`; this parser reads either form. One call per
reply: <|call|> ends the model's turn. The markers are special tokens (needs_special_tokens), and
<|call|> is an end-of-turn token the output must keep for this parser (keeps_end_markers).
"""
from __future__ import annotations

import json
import re

from moet.serve.tool_parsers.base import InvalidToolCall, ParsedToolCall, Taken, ToolParser, take_single_call

REGION_START, MESSAGE, CALL_END = "to=functions.", "<|message|>", "<|call|>"
_NAME = re.compile(r"^([A-Za-z0-9_.\-]+)")


class OpenAIToolParser(ToolParser):
    name = "openai"
    region_start = REGION_START
    needs_special_tokens = True
    keeps_end_markers = (CALL_END,)

    def take(self, buf: str) -> Taken | None:
        return take_single_call(buf, REGION_START, CALL_END, self._call)

    def _call(self, block: str) -> ParsedToolCall:
        m = _NAME.match(block)
        if not m or MESSAGE not in block:
            raise InvalidToolCall(f"bad harmony call {block[:40]!r}")
        raw = block[block.index(MESSAGE) + len(MESSAGE):].strip()
        try:
            args = json.loads(raw)
        except ValueError:
            raise InvalidToolCall("arguments are not JSON") from None
        if not isinstance(args, dict):
            raise InvalidToolCall("arguments are not a JSON object")
        return ParsedToolCall(m.group(1), self.arguments_json(args))

    reply_open, reply_close, call_separator = "", "", ""

    def call_pieces(self, name: str, parameters: dict, index: int) -> list:
        return [f"<|channel|>commentary {REGION_START}{name} <|constrain|>json{MESSAGE}", ("json", parameters), CALL_END]

    def call_prefix(self, name: str | None) -> str:
        return "<|channel|>commentary " + REGION_START + (f"{name} <|constrain|>json{MESSAGE}" if name else "")
