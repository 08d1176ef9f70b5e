"""MiniMax-M2 tool calls: a section of XML-ish invokes

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    </minimax:tool_call>

several invokes per section. Values are plain text; the tool's JSON schema decides whether a
value stays a string or is read as a number / boolean / object (as for GLM's, typed_value).
"""
from __future__ import annotations

import re

from moet.serve.tool_parsers.base import InvalidToolCall, ParsedToolCall, Taken, ToolParser, take_section_calls

SECTION_START, SECTION_END = "<minimax:tool_call>", "</minimax:tool_call>"
CALL_START, CALL_END = "<invoke name=", "</invoke>"
_NAME = re.compile(r"""^\s*(["'])([^"'<>\s]+)\1\s*>""")
_PARAM = re.compile(r"""<parameter\s+name=(["'])(.*?)\1\s*>(.*?)</parameter>""", re.S)


class MiniMaxM2ToolParser(ToolParser):
    name = "minimax_m2"
    region_start = SECTION_START

    def take(self, buf: str) -> Taken | None:
        return take_section_calls(buf, CALL_START, CALL_END, SECTION_END, self._call)

    def _call(self, block: str) -> ParsedToolCall:
        m = _NAME.match(block)
        if not m:
            raise InvalidToolCall(f"bad invoke {block[:40]!r}")
        name, body = m.group(2), block[m.end():]
        if _PARAM.sub("", body).strip():            # anything but parameters inside the invoke
            raise InvalidToolCall("text outside <parameter> elements")
        args = {key.strip(): self.typed_value(name, key.strip(), value) for _, key, value in _PARAM.findall(body)}
        return ParsedToolCall(name, self.arguments_json(args))

    reply_open, reply_close, call_separator = SECTION_START + "\n", "\n" + SECTION_END, "\n"

    def call_pieces(self, name: str, parameters: dict, index: int) -> list:
        """Parameters in the schema's property order, the required ones always; a string value as
        plain text (what typed_value keeps as a string), any other as JSON."""
        return ([f'{CALL_START}"{name}">\n']
                + self.text_argument_pieces(parameters, lambda key: f'<parameter name="{key}">', "</parameter>\n")
                + [CALL_END])

    def call_prefix(self, name: str | None) -> str:
        return SECTION_START + "\n" + CALL_START + (f'"{name}">\n' if name else "")
