"""DeepSeek-V3 / V3.1 tool calls: special-token delimited, all calls in one section,

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 drops the type and the code fence: `<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>`.
Both are read. The markers are special tokens, so the server decodes with them kept.
"""
from __future__ import annotations

import json
import re

from moet.serve.tool_parsers.base import InvalidToolCall, ParsedToolCall, Taken, ToolParser, take_section_calls

SECTION_START, SECTION_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_START, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_FENCED = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.S)


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    region_start = SECTION_START
    needs_special_tokens = True

    def take(self, buf: str) -> Taken | None:
        return take_section_calls(buf, CALL_START, CALL_END, SECTION_END, self._call)

    def _call(self, block: str) -> ParsedToolCall:
        if SEP not in block:
            raise InvalidToolCall("no <｜tool▁sep｜>")
        head, tail = block.split(SEP, 1)
        if head.strip() in ("function", ""):      # V3: type<sep>name\n```json ...```
            name, _, args_text = tail.partition("\n")
            m = _FENCED.match(args_text)
            args_text = m.group(1) if m else args_text
        else:                                      # V3.1: name<sep>{json}
            name, args_text = head, tail
        name = name.strip()
        try:
            args = json.loads(args_text.strip() or "{}")
        except json.JSONDecodeError as exc:
            raise InvalidToolCall(str(exc)) from exc
        if not name or not isinstance(args, dict):
            raise InvalidToolCall("a call needs a name and a JSON object of arguments")
        return ParsedToolCall(name, self.arguments_json(args))

    reply_open, reply_close, call_separator = SECTION_START, SECTION_END, ""

    def call_pieces(self, name: str, parameters: dict, index: int) -> list:
        return [CALL_START + "function" + SEP + name + "\n```json\n", ("json", parameters), "\n```" + CALL_END]

    def call_prefix(self, name: str | None) -> str:
        return SECTION_START + CALL_START + "function" + SEP + (f"{name}\n```json\n" if name else "")
