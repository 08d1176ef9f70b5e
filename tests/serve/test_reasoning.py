"""The <think> split: complete and streamed agree under any chunking; tags never leak."""
from __future__ import annotations

import random

import pytest

from moet.errors import ConfigError
from moet.serve.reasoning import ReasoningParser
from moet.serve.reasoning_parsers import default_reasoning_parser, get_reasoning_parser

CASES = [  # text, starts_in_reasoning, reasoning, content
    ("<think>12+30: 2+0=2, 1+3=4</think>\n42", False, "12+30: 2+0=2, 1+3=4", "42"),
    ("<think></think>\nParis.", False, None, "Paris."),
    ("  \n<think>a<b>c</think>The end </think> stays", False, "a<b>c", "The end </think> stays"),
    ("No block here <think>x</think>", False, None, "No block here <think>x</think>"),
    ("<think>unfinished thoughts", False, "unfinished thoughts", ""),
    ("prefilled thought</think>\n\nanswer", True, "prefilled thought", "answer"),
    ("", False, None, ""),
    ("<thi", False, None, "<thi"),
]


@pytest.mark.parametrize("text,pre,reasoning,content", CASES)
def test_complete(text, pre, reasoning, content):
    assert ReasoningParser().parse(text, pre) == (reasoning, content)


@pytest.mark.parametrize("text,pre,reasoning,content", CASES)
def test_stream_matches_complete_for_any_chunking(text, pre, reasoning, content):
    rng = random.Random(len(text))
    for trial in range(25):
        if trial == 0:
            chunks = list(text)
        else:
            cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 6)))) if len(text) > 1 else []
            chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        s = ReasoningParser().stream(pre)
        r = c = ""
        for ch in chunks:
            d = s.feed(ch)
            r, c = r + d.reasoning, c + d.content
            assert "</think" not in r and not c.startswith("<think>")
        d = s.finish()
        r, c = r + d.reasoning, c + d.content
        assert ((r or None), c) == (reasoning, content)


def test_prompt_detection_and_registry():
    p = ReasoningParser()
    assert p.starts_in_reasoning("<|assistant|>\n<think>\n")
    assert not p.starts_in_reasoning("<|assistant|>\n<think></think>\n")
    assert get_reasoning_parser("deepseek_r1").name == "think"
    with pytest.raises(ConfigError):
        get_reasoning_parser("nope")
    assert default_reasoning_parser("... <think> ...") == "think" and default_reasoning_parser("plain") is None
