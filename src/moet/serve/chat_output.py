"""One chat choice's generated text -> reasoning_content, content and tool calls, for the
complete response and for streamed deltas alike (the complete one is the stream run over the
whole text at once, so both agree).

    generated text ─► reasoning parser (<think>...</think>) ─► content ─► tool-call parser
                          └─► reasoning_content                             ├─► content
                                                                             └─► whole calls
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from moet.serve.reasoning import ReasoningParser
from moet.serve.tool_parsers import ParsedToolCall, ToolParser


@dataclass
class ChoiceDeltaParts:
    reasoning: str = ""
    content: str = ""
    calls: list[ParsedToolCall] = field(default_factory=list)

    def extend(self, other: "ChoiceDeltaParts") -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls.extend(other.calls)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChoiceOutputParser:
    def __init__(self, reasoning: ReasoningParser | None, starts_in_reasoning: bool, tools: ToolParser | None,
                 strip_suffixes: tuple[str, ...] = ()):
        self.reasoning = reasoning.stream(starts_in_reasoning) if reasoning is not None else None
        self.tools = tools.stream() if tools is not None else None
        # end-of-turn token texts to cut from the final delta when special tokens are decoded
        self.strip_suffixes = tuple(s for s in strip_suffixes if s)
        self.num_calls = 0

    def _content(self, text: str, final: bool) -> ChoiceDeltaParts:
        out = ChoiceDeltaParts()
        if self.tools is None:
            out.content = text
            return out
        d = self.tools.feed(text)
        if final:
            d.extend(self.tools.finish())
        out.content, out.calls = d.content, d.calls
        for c in out.calls:
            c.id = c.id or new_call_id()
        self.num_calls += len(out.calls)
        return out

    def feed(self, text: str, final: bool = False) -> ChoiceDeltaParts:
        if final:
            for s in self.strip_suffixes:
                if text.endswith(s):
                    text = text[: -len(s)]
                    break
        out = ChoiceDeltaParts()
        if self.reasoning is None:
            return self._content(text, final)
        r = self.reasoning.feed(text)
        if final:
            f = self.reasoning.finish()
            r.reasoning += f.reasoning
            r.content += f.content
        out.reasoning = r.reasoning
        out.extend(self._content(r.content, final))
        return out
