"""Reasoning parser: `<think>...</think>` at the start of a reply becomes `reasoning_content`,
the rest `content` (`moet serve --reasoning-parser think`; GLM-4.5/4.7, DeepSeek-R1, Qwen3,
Kimi-K2-Thinking and moet-tiny all use these tags).

Two ways a reply can be in reasoning:
  - the model opens the block itself (moet-tiny and GLM: the reply starts with `<think>`);
  - the chat template already wrote `<think>` at the end of the prompt (DeepSeek-R1 style):
    the reply starts inside the block; `starts_in_reasoning` says so.
A reply with no block is all content. A block that never closes (max_tokens ran out) is all
reasoning. The streamed split equals the complete one: the complete parser is the stream fed
everything at once. Tags split across tokens are held back, never emitted as text.
"""
from __future__ import annotations

from dataclasses import dataclass


THINK_START, THINK_END = "<think>", "</think>"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


def partial_marker(text: str, marker: str) -> int:
    """Characters at the end of `text` that could be the start of `marker` (held back)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReasoningStream:
    """One choice: feed() text deltas, then finish(). States: start (not yet known whether a
    block opens), reasoning, content."""

    def __init__(self, starts_in_reasoning: bool = False, start: str = THINK_START, end: str = THINK_END):
        self.start, self.end = start, end
        self.state = "reasoning" if starts_in_reasoning else "start"
        self.buf = ""
        self.skip_ws = False  # drop whitespace right after the closing tag

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        self.buf += text
        while True:
            if self.state == "start":
                s = self.buf.lstrip()
                if s.startswith(self.start):
                    self.buf, self.state = s[len(self.start):], "reasoning"
                    continue
                if self.start.startswith(s):  # empty or a prefix of the tag: wait
                    return out
                self.state, self.skip_ws = "content", True
                continue
            if self.state == "reasoning":
                i = self.buf.find(self.end)
                if i < 0:
                    keep = partial_marker(self.buf, self.end)
                    out.reasoning += self.buf[: len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                out.reasoning += self.buf[:i]
                self.buf, self.state, self.skip_ws = self.buf[i + len(self.end):], "content", True
                continue
            if self.skip_ws:
                self.buf = self.buf.lstrip()
                if not self.buf:
                    return out
                self.skip_ws = False
            out.content += self.buf
            self.buf = ""
            return out

    def finish(self) -> ReasoningDelta:
        out = ReasoningDelta()
        if self.state == "reasoning":
            out.reasoning = self.buf       # an unclosed block: all of it was reasoning
        elif self.state == "start":
            out.content = self.buf.lstrip()
        elif not self.skip_ws:
            out.content = self.buf
        self.buf = ""
        return out


class ReasoningParser:
    """Configured once per server; makes one stream per choice."""

    name = "think"
    # harmony (serve/harmony.py): replies decoded with special tokens kept, and the end-of-turn
    # texts a parser downstream reads left in the text
    needs_special_tokens = False
    keeps_end_markers: tuple[str, ...] = ()

    def __init__(self, start: str = THINK_START, end: str = THINK_END):
        self.start_tag, self.end_tag = start, end

    def starts_in_reasoning(self, prompt_text: str) -> bool:
        """True when the template left the reply inside an open block."""
        tail = prompt_text.rstrip()
        return tail.endswith(self.start_tag)

    def stream(self, starts_in_reasoning: bool = False) -> ReasoningStream:
        return ReasoningStream(starts_in_reasoning, self.start_tag, self.end_tag)

    def parse(self, text: str, starts_in_reasoning: bool = False) -> tuple[str | None, str]:
        """-> (reasoning or None when there was no block / an empty one, content)."""
        s = self.stream(starts_in_reasoning)
        a, b = s.feed(text), s.finish()
        reasoning = a.reasoning + b.reasoning
        return (reasoning or None), a.content + b.content
