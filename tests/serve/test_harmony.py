"""gpt-oss's harmony replies (serve/harmony.py + tool_parsers/openai.py): the analysis channel
is reasoning, the final channel and preambles content, a message to functions.NAME one whole
tool call; streamed under any chunking equal to the complete parse, never a marker in content or
reasoning; replies cut short lose nothing; text that is not harmony is content."""
from __future__ import annotations

import json
import random

import pytest

from moet.serve.chat_output import ChoiceOutputParser
from moet.serve.harmony import HarmonyReasoningParser
from moet.serve.reasoning_parsers import default_reasoning_parser, get_reasoning_parser
from moet.serve.tool_parsers import default_tool_parser, get_tool_parser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]

THINK = "<|channel|>analysis<|message|>The user wants Oslo's weather. Call the tool.<|end|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Oslo", "days": 2}<|call|>')
CALL_RECIPIENT_FIRST = ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
                        '{"city": "Bergen"}<|call|>')
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Oslo.<|return|>"
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Checking the forecast.<|end|>"

CASES = [
    # text, reasoning, content, calls
    (THINK + FINAL, "The user wants Oslo's weather. Call the tool.", "It is sunny in Oslo.", []),
    (THINK + CALL, "The user wants Oslo's weather. Call the tool.", "", [("get_weather", {"city": "Oslo", "days": 2})]),
    (THINK + PREAMBLE + CALL_RECIPIENT_FIRST, "The user wants Oslo's weather. Call the tool.",
     "Checking the forecast.", [("get_weather", {"city": "Bergen"})]),
    ("<|channel|>final<|message|>Just an answer.", None, "Just an answer.", []),          # cut short
    ("Plain text, not harmony <b>.", None, "Plain text, not harmony <b>.", []),
]


def _parser():
    return ChoiceOutputParser(get_reasoning_parser("harmony"), False, get_tool_parser("openai")(TOOLS))


def _run(chunks):
    p = _parser()
    reasoning, content, calls = "", "", []
    for i, ch in enumerate(chunks):
        d = p.feed(ch, final=i == len(chunks) - 1)
        reasoning += d.reasoning
        content += d.content
        for c in d.calls:
            calls.append((c.name, json.loads(c.arguments)))
            assert c.id
        for text in (reasoning, content):
            assert "<|" not in text and "to=functions" not in text, text
    return reasoning or None, content, calls


def _chunkings(text: str, rng: random.Random):
    yield [text]
    yield list(text)
    for _ in range(15):
        cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(1, min(10, len(text) - 1))))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("text,reasoning,content,calls", CASES)
def test_reasoning_content_and_calls_under_any_chunking(text, reasoning, content, calls):
    for chunks in _chunkings(text, random.Random(len(text))):
        assert _run(chunks) == (reasoning, content, calls)


def test_a_call_cut_short_comes_back_as_text():
    text = THINK + '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"ci'
    reasoning, content, calls = HarmonyReasoningParser().parse(text)[0], None, None
    p = _parser()
    d = p.feed(text, final=True)
    assert d.reasoning == reasoning and d.calls == []
    assert d.content.startswith("<|start|>assistant<|channel|>commentary to=functions.get_weather") and \
        d.content.endswith('{"ci')


def test_bad_arguments_are_content_and_the_parsers_are_picked_by_default():
    p = _parser()
    d = p.feed(THINK + "<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>not json<|call|>",
               final=True)
    assert d.calls == [] and "not json" in d.content
    template = "{% for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>... to=functions.{{ x }}"
    assert default_reasoning_parser(template) == "harmony"
    assert default_tool_parser(template) == "openai"
    assert default_tool_parser(None, "GptOssForCausalLM") == "openai"
    hp = get_reasoning_parser("openai_gptoss")
    assert hp.needs_special_tokens and "<|call|>" in hp.keeps_end_markers


def test_end_of_turn_call_marker_is_kept_for_the_parser():
    """The server strips end-of-turn token texts from the last delta, except the ones a parser reads:
    a call ended by the <|call|> end-of-turn token still parses."""
    p = ChoiceOutputParser(get_reasoning_parser("harmony"), False, get_tool_parser("openai")(TOOLS),
                           strip_suffixes=("<|return|>",))
    d = p.feed(THINK + CALL, final=True)
    assert [(c.name, json.loads(c.arguments)) for c in d.calls] == [("get_weather", {"city": "Oslo", "days": 2})]
