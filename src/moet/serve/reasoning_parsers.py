"""The reasoning parsers `moet serve --reasoning-parser NAME` chooses from, and the default a
chat template implies: think (reasoning.py) and harmony (harmony.py)."""
from __future__ import annotations

from moet.errors import ConfigError
from moet.serve.harmony import HarmonyReasoningParser
from moet.serve.reasoning import THINK_START, ReasoningParser

# names vLLM uses for the same formats, accepted so that launch scripts carry over
REASONING_PARSERS = {"think": ReasoningParser, "glm45": ReasoningParser, "deepseek_r1": ReasoningParser,
                     "qwen3": ReasoningParser, "kimi_k2": ReasoningParser,
                     "harmony": HarmonyReasoningParser, "openai_gptoss": HarmonyReasoningParser}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ConfigError(f"--reasoning-parser {name!r} is unknown; choose one of "
                          f"{', '.join(sorted(REASONING_PARSERS))} (or none)") from None


def default_reasoning_parser(chat_template: str | None) -> str | None:
    """`harmony` when the chat template writes harmony channels (gpt-oss), `think` when it
    writes think blocks, else none."""
    if chat_template and "<|channel|>" in chat_template:
        return "harmony"
    return "think" if chat_template and THINK_START in chat_template else None
