"""Kimi-K2 tool calls: special-token delimited, ids of the form "functions.NAME:INDEX",

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The id is kept as the OpenAI tool-call id: Kimi's chat template writes it back when the
result comes in. The markers are special tokens, so the server decodes with them kept.
"""
from __future__ import annotations

import json
import re

from moet.serve.tool_parsers.base import InvalidToolCall, ParsedToolCall, Taken, ToolParser, take_section_calls

SECTION_START, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_START, CALL_END, ARGS = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
_ID = re.compile(r"^(?:functions\.)?(?P<name>[^\s:]+)(?::(?P<index>\d+))?$")


class KimiK2ToolParser(ToolParser):
    name = "kimi_k2"
    region_start = SECTION_START
    needs_special_tokens = True

    def take(self, buf: str) -> Taken | None:
        return take_section_calls(buf, CALL_START, CALL_END, SECTION_END, self._call)

    def _call(self, block: str) -> ParsedToolCall:
        if ARGS not in block:
            raise InvalidToolCall("no <|tool_call_argument_begin|>")
        ident, args_text = block.split(ARGS, 1)
        m = _ID.match(ident.strip())
        if not m:
            raise InvalidToolCall(f"bad call id {ident!r}")
        try:
            args = json.loads(args_text.strip() or "{}")
        except json.JSONDecodeError as exc:
            raise InvalidToolCall(str(exc)) from exc
        if not isinstance(args, dict):
            raise InvalidToolCall("arguments must be a JSON object")
        return ParsedToolCall(m["name"], self.arguments_json(args), id=ident.strip())

    reply_open, reply_close, call_separator = SECTION_START, SECTION_END, ""

    def call_pieces(self, name: str, parameters: dict, index: int) -> list:
        return [CALL_START + f"functions.{name}:{index}" + ARGS, ("json", parameters), CALL_END]

    def call_prefix(self, name: str | None) -> str:
        # the index is the call's position in the reply; a forced call is the first
        return SECTION_START + CALL_START + (f"functions.{name}:0" + ARGS if name else "functions.")
