"""Hermes-style tool calls (Qwen2.5 / Qwen3, NousResearch Hermes, many fine-tunes): one JSON
object per block,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""
from __future__ import annotations

import json

from moet.serve.tool_parsers.base import InvalidToolCall, ParsedToolCall, Taken, ToolParser, take_single_call

CALL_START, CALL_END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    region_start = CALL_START

    def take(self, buf: str) -> Taken | None:
        return take_single_call(buf, CALL_START, CALL_END, self._call)

    def _call(self, block: str) -> ParsedToolCall:
        try:
            obj = json.loads(block.strip())
        except json.JSONDecodeError as exc:
            raise InvalidToolCall(str(exc)) from exc
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            raise InvalidToolCall("a Hermes call is a JSON object with a 'name'")
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some fine-tunes write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError as exc:
                raise InvalidToolCall(str(exc)) from exc
        if not isinstance(args, dict):
            raise InvalidToolCall("arguments must be a JSON object")
        return ParsedToolCall(obj["name"], self.arguments_json(args))

    def call_pieces(self, name: str, parameters: dict, index: int) -> list:
        return [CALL_START + '\n{"name": ' + json.dumps(name) + ', "arguments": ', ("json", parameters),
                "}\n" + CALL_END]

    def call_prefix(self, name: str | None) -> str:
        return CALL_START + "\n" + ('{"name": ' + json.dumps(name) + ', "arguments": ' if name else "")
