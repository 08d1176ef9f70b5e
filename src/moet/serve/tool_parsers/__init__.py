"""Tool-call parsers, chosen with `moet serve --tool-call-parser NAME` (default: picked from
the chat template's markup, see `default_tool_parser`)."""
from __future__ import annotations

from moet.errors import ConfigError
from moet.serve.tool_parsers.base import ParsedToolCall, ToolCallStream, ToolParseDelta, ToolParser
from moet.serve.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from moet.serve.tool_parsers.glm45 import Glm45ToolParser
from moet.serve.tool_parsers.hermes import HermesToolParser
from moet.serve.tool_parsers.kimi_k2 import KimiK2ToolParser
from moet.serve.tool_parsers.minimax_m2 import MiniMaxM2ToolParser
from moet.serve.tool_parsers.openai import OpenAIToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "glm45": Glm45ToolParser, "glm47": Glm45ToolParser,
    "hermes": HermesToolParser,
    "deepseek_v3": DeepSeekV3ToolParser, "deepseek_v31": DeepSeekV3ToolParser,
    "kimi_k2": KimiK2ToolParser,
    "minimax_m2": MiniMaxM2ToolParser,
    "openai": OpenAIToolParser, "harmony": OpenAIToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ConfigError(f"--tool-call-parser {name!r} is unknown; choose one of "
                          f"{', '.join(sorted(TOOL_PARSERS))} (or none)") from None


# Markup that identifies a format in a chat template, most specific first. The template is
# what the model was trained to read and write, so it decides; the architecture alone does not
# (Kimi-K2 and moet-tiny are both DeepseekV3ForCausalLM with different tool syntax).
_TEMPLATE_MARKERS = (
    ("to=functions.", "openai"),
    ("<minimax:tool_call>", "minimax_m2"),
    ("<arg_key>", "glm45"),
    ("tool_calls_section_begin", "kimi_k2"),
    ("tool▁calls▁begin", "deepseek_v3"),
    ("<tool_call>", "hermes"),
)
# GLM-5 writes tool calls as GLM-4.7 does (<tool_call>name<arg_key>..</arg_key><arg_value>..)
_FAMILY_DEFAULTS = {"Glm4MoeForCausalLM": "glm45", "GlmMoeDsaForCausalLM": "glm45",
                    "MiniMaxM2ForCausalLM": "minimax_m2", "GptOssForCausalLM": "openai"}


def default_tool_parser(chat_template: str | None, architecture: str | None = None) -> str | None:
    for marker, name in _TEMPLATE_MARKERS:
        if chat_template and marker in chat_template:
            return name
    return _FAMILY_DEFAULTS.get(architecture or "")


__all__ = ["TOOL_PARSERS", "ParsedToolCall", "ToolCallStream", "ToolParseDelta", "ToolParser",
           "default_tool_parser", "get_tool_parser"]
