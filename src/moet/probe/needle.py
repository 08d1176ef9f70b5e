"""Needle retrieval: a secret phrase hidden at a chosen depth inside real code/text filler,
asked for at the end. Random-word filler would make retrieval trivially easy (SPEC 6), so
the filler is real source code and prose: training draws it from the training corpus, the
probe from held-out standard-library files (moet.probe.code_data.heldout_files).
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from moet.probe.chat_format import Conversation

ADJECTIVES = (
    "amber azure bold brave brisk calm clever copper coral crimson curious dapper dusty eager "
    "emerald fancy fierce frosty gentle gilded golden grand hidden hollow humble icy indigo ivory "
    "jade jolly keen lavish lively lucky lunar magenta mellow merry misty modest noble olive "
    "orange patient pearl plucky polar proud purple quiet rapid rosy royal rustic sandy scarlet "
    "silent silver sleepy smoky snowy solar spicy steady stormy sunny swift tawny tidy tranquil "
    "velvet violet vivid wandering warm wild windy wise witty young zesty"
).split()
NOUNS = (
    "anchor badger beacon bison bramble breeze canyon castle cedar comet condor cottage coyote "
    "crystal dolphin dragon eagle ember falcon fern forest fox garden glacier griffin harbor "
    "hawk heron island jaguar kettle lantern lemur lighthouse lotus maple meadow meteor mirror "
    "moose mountain narwhal nebula oasis orchid otter owl panther parrot pebble pepper pine "
    "planet quartz rabbit raven reef river rocket saddle salmon sparrow spruce squirrel summit "
    "thistle tiger tornado tulip turtle valley violin walrus willow wizard wolf zebra"
).split()

_NEEDLE = ["The secret phrase is: {p}.", "Remember this: the secret phrase is {p}.",
           "Note: the secret phrase is \"{p}\".", "# the secret phrase is {p}"]
_QUESTIONS = ["What is the secret phrase hidden in the text above?",
              "What is the secret phrase?",
              "Find the secret phrase in the text above and tell me what it is.",
              "The text above contains a secret phrase. What is it?"]
_HELDOUT_QUESTION = "Which secret phrase appears in the text above?"


def phrase(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} {rng.randint(1000, 9999)}"


def build(filler_lines: Sequence[str], depth: float, secret: str, needle: str, question: str) -> str:
    """User message: filler with the needle line inserted at `depth` (0 = first line, 1 = last)."""
    at = round(depth * len(filler_lines))
    lines = list(filler_lines[:at]) + [needle.format(p=secret)] + list(filler_lines[at:])
    return "\n".join(lines) + "\n\n" + question


def sample(rng: random.Random, filler: Callable[[random.Random, int], list[str]], max_chars: int) -> Conversation:
    """Training example. `filler(rng, n_chars)` returns about n_chars of real text as lines.
    Lengths are spread log-uniformly so that short and long contexts are both common."""
    n_chars = int(min(max_chars, 200 * (max_chars / 200) ** rng.random()))
    secret = phrase(rng)
    user = build(filler(rng, n_chars), rng.random(), secret, rng.choice(_NEEDLE), rng.choice(_QUESTIONS))
    return Conversation([{"role": "user", "content": user},
                         {"role": "assistant", "content": f"The secret phrase is {secret}."}],
                        enable_thinking=rng.random() < 0.8)


def eval_case(rng: random.Random, filler_lines: Sequence[str], depth: float) -> Conversation:
    secret = phrase(rng)
    user = build(filler_lines, depth, secret, _NEEDLE[0], _HELDOUT_QUESTION)
    return Conversation([{"role": "user", "content": user}], meta={"expected": secret, "depth": depth})


def is_correct(answer_text: str, expected: str) -> bool:
    return expected in answer_text
