"""gpt-oss's harmony reply format, split into reasoning, content and tool calls
(`moet serve --reasoning-parser harmony`, picked by default for a chat template that writes
harmony channels).

The chat template ends the prompt with `<|start|>assistant`; the model then writes messages

    <|channel|>analysis<|message|>...thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>
    <|start|>assistant<|channel|>final<|message|>...the answer...<|return|>

(the recipient may also stand before the channel: `<|start|>assistant to=functions.x<|channel|>...`).
The analysis channel is reasoning; the final channel, and commentary to no one (a preamble), are
content; a message to `functions.NAME` is a tool call, handed on whole to the tool-call parser
(tool_parsers/openai.py) as `to=functions.NAME<|message|>ARGUMENTS<|call|>`. The markers are
special tokens, so replies are decoded with them kept (needs_special_tokens).

Why not the openai-harmony library: it parses token ids of its own o200k_harmony encoding, whose
vocabulary it downloads on first use; moet serves offline and reads the text its checkpoint's
own tokenizer decodes, which carries the same markers. The streamed split equals the complete
one (the complete parse is the stream fed everything at once), and markers split across deltas
are held back, never emitted as text.
"""
from __future__ import annotations

import re

from moet.serve.reasoning import ReasoningDelta, ReasoningParser, partial_marker

START, MESSAGE, CHANNEL = "<|start|>", "<|message|>", "<|channel|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
CALL_END = "<|call|>"
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")


class HarmonyStream:
    """One choice: feed() text deltas, then finish(). States: header (reading a message's header
    up to <|message|>), body (a message's text up to its end marker), plain (the reply is not in
    harmony form: all of it is content)."""

    def __init__(self):
        self.state, self.buf = "header", ""
        self.kind, self.header, self.body = "content", "", ""

    def _open(self, header: str) -> None:
        """A message begins: what its header says it is."""
        h = header.strip()
        h = h[len(START):] if h.startswith(START) else h
        m = _RECIPIENT.search(h)
        channel = _CHANNEL.search(h)
        if m and m.group(1).startswith("functions."):
            self.kind = "call"
        elif channel and channel.group(1) == "analysis":
            self.kind = "reasoning"
        else:
            self.kind = "content"                  # final, a preamble (commentary to no one), no channel
        self.header, self.body = header, ""

    def _emit(self, out: ReasoningDelta, text: str) -> None:
        if self.kind == "reasoning":
            out.reasoning += text
        elif self.kind == "content":
            out.content += text
        else:
            self.body += text                      # a call is handed on whole, at its end

    def _close(self, out: ReasoningDelta) -> None:
        if self.kind == "call":
            name = _RECIPIENT.search(self.header).group(1)
            out.content += f"to={name}{MESSAGE}{self.body.strip()}{CALL_END}"
        self.state, self.kind, self.body = "header", "content", ""

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        self.buf += text
        while self.buf:
            if self.state == "plain":
                out.content += self.buf
                self.buf = ""
            elif self.state == "header":
                i = self.buf.find(MESSAGE)
                if i >= 0:
                    self._open(self.buf[:i])
                    self.buf, self.state = self.buf[i + len(MESSAGE):], "body"
                    continue
                head = self.buf.lstrip()
                if head and not any(head.startswith(m) or m.startswith(head) for m in ("<|", "to=")):
                    self.state = "plain"           # the model did not write harmony: all content
                    continue
                return out                         # a header still arriving
            else:
                hits = [(self.buf.find(e), e) for e in ENDS if e in self.buf]
                if not hits:
                    keep = max(partial_marker(self.buf, e) for e in ENDS)
                    self._emit(out, self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                i, end = min(hits)
                self._emit(out, self.buf[:i])
                self.buf = self.buf[i + len(end):]
                self._close(out)
        return out

    def finish(self) -> ReasoningDelta:
        """The end of the reply: a message cut short (max_tokens) keeps what it said; a call cut
        short is not a call, so its raw text becomes content (nothing is lost)."""
        out = ReasoningDelta()
        if self.state == "body":
            if self.kind == "call":
                out.content += self.header + MESSAGE + self.body + self.buf
            else:
                self._emit(out, self.buf)
        elif self.state == "header" and self.buf.strip():
            out.content += self.buf                # a header with no message: its text
        elif self.state == "plain":
            out.content += self.buf
        self.buf, self.state, self.kind, self.body = "", "header", "content", ""
        return out


class HarmonyReasoningParser(ReasoningParser):
    name = "harmony"
    needs_special_tokens = True
    keeps_end_markers = (CALL_END,)                # the tool-call parser reads a call's end

    def __init__(self):
        super().__init__(CHANNEL + "analysis" + MESSAGE, ENDS[0])

    def starts_in_reasoning(self, prompt_text: str) -> bool:
        return False                               # every message opens with its own header

    def stream(self, starts_in_reasoning: bool = False) -> HarmonyStream:
        return HarmonyStream()
