"""GLM-4.5 / GLM-4.7 tool calls (and moet-tiny's, which copies them): XML-ish blocks

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

one block per call. Values are written as plain text; the tool's JSON schema decides whether a
value stays a string or is read as a number / boolean / object (as vLLM's glm45 parser does).
"""
from __future__ import annotations

import re

from moet.serve.tool_parsers.base import InvalidToolCall, ParsedToolCall, Taken, ToolParser, take_single_call

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class Glm45ToolParser(ToolParser):
    name = "glm45"
    region_start = CALL_START

    def take(self, buf: str) -> Taken | None:
        return take_single_call(buf, CALL_START, CALL_END, self._call)

    def _call(self, block: str) -> ParsedToolCall:
        name, _, body = block.partition("\n")
        if "<arg_key>" in name:  # "name<arg_key>..." on one line
            name, body = name[: name.index("<arg_key>")], name[name.index("<arg_key>"):] + "\n" + body
        name = name.strip()
        if not name or any(c in name for c in "<>{}\"' \t"):
            raise InvalidToolCall(f"bad function name {name!r}")
        if _ARG.sub("", body).strip():  # anything but key/value pairs inside the block
            raise InvalidToolCall("text outside <arg_key>/<arg_value> pairs")
        args = {k.strip(): self.typed_value(name, k.strip(), v) for k, v in _ARG.findall(body)}
        return ParsedToolCall(name, self.arguments_json(args))

    def call_pieces(self, name: str, parameters: dict, index: int) -> list:
        """Arguments in the schema's property order, the required ones always; a string value as
        plain text (what typed_value keeps as a string), any other as JSON."""
        return ([f"{CALL_START}{name}\n"]
                + self.text_argument_pieces(parameters, lambda key: f"<arg_key>{key}</arg_key>\n<arg_value>",
                                            "</arg_value>\n")
                + [CALL_END])

    def call_prefix(self, name: str | None) -> str:
        return CALL_START + (f"{name}\n" if name else "")
