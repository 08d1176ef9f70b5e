"""Synthetic copy and recall conversations (recipe full-v2).

Why: the first shipped run (recipe `full`, 249M tokens) retrieved a needle's digits but not its
words, and a repeated random-token sequence was not predicted at all on its second pass: no
general copy circuit (induction head) had formed; digit copying had been learned from the
arithmetic scratchpads alone. Natural text teaches copying slowly (induction heads are
reported to appear after billions of tokens); these short tasks make every answer token a
copy of an arbitrary earlier token, across the whole vocabulary, so the circuit gets a dense
gradient from the start. The needle, tool names (random namespaces) and tool arguments then
reuse it.

Recipe full-v3 adds `lookup_sample`: records whose first field (a name) must be returned when a
later field (a description) is quoted: the backward lookup a tool call needs, since a schema
line names the function before it describes it (see tool_tasks.py).
"""
from __future__ import annotations

import json
import random

from moet.probe.chat_format import Conversation
from moet.probe.needle import ADJECTIVES, NOUNS

_SYL_C, _SYL_V = "bcdfghjklmnprstvwz", "aeiou"


def _pseudo(rng: random.Random) -> str:
    return "".join(rng.choice(_SYL_C) + rng.choice(_SYL_V) for _ in range(rng.randint(1, 4)))


def _item(rng: random.Random) -> str:
    """A random token-ish item: pseudo-word, English word, identifier, number or code symbol."""
    k = rng.random()
    if k < 0.35:
        return _pseudo(rng)
    if k < 0.6:
        return rng.choice(ADJECTIVES + NOUNS)
    if k < 0.75:
        return "_".join(_pseudo(rng) for _ in range(rng.randint(2, 3)))
    if k < 0.9:
        return str(rng.randint(0, 99999))
    return rng.choice(["()", "[]", "{}", "->", "==", "!=", "+=", "::", "&&", "||", "<=", ">=", "**", "//"])


def repeat_sample(rng: random.Random) -> Conversation:
    seq = " ".join(_item(rng) for _ in range(rng.randint(4, 48)))
    ask = rng.choice(["Repeat exactly: ", "Copy this text: ", "Say this back to me: ", "Echo: "])
    return Conversation([{"role": "user", "content": ask + seq}, {"role": "assistant", "content": seq}],
                        enable_thinking=rng.random() < 0.8)


def recall_sample(rng: random.Random) -> Conversation:
    """Key-value recall: many `key: value` lines, then one key is asked for."""
    n = rng.randint(3, 64)
    keys = list(dict.fromkeys(_pseudo(rng) + (str(rng.randint(0, 99)) if rng.random() < 0.3 else "")
                              for _ in range(n)))
    values = [" ".join(_item(rng) for _ in range(rng.randint(1, 3))) for _ in keys]
    sep = rng.choice([": ", " = ", " -> "])
    table = "\n".join(f"{k}{sep}{v}" for k, v in zip(keys, values))
    i = rng.randrange(len(keys))
    q = rng.choice(["What is the value of {k}?", "Which value does {k} have?", "Look up {k}.", "{k}?"]).format(k=keys[i])
    return Conversation([{"role": "user", "content": f"{table}\n\n{q}"},
                         {"role": "assistant", "content": values[i]}],
                        enable_thinking=rng.random() < 0.8)


def _identifier(rng: random.Random) -> str:
    words = [_pseudo(rng) if rng.random() < 0.6 else rng.choice(ADJECTIVES + NOUNS) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.3:
        return words[0] + "".join(w.title() for w in words[1:])
    return "_".join(words)


def lookup_sample(rng: random.Random) -> Conversation:
    """3-12 records `{"name": ..., "description": ...}` (or `name - description` lines), then
    1-4 questions that quote a description and want the record's name."""
    n = rng.randint(3, 12)
    names = list(dict.fromkeys(_identifier(rng) for _ in range(n)))
    descs = list(dict.fromkeys(" ".join(_item(rng) for _ in range(rng.randint(2, 6))) for _ in names))
    names = names[:len(descs)]
    if rng.random() < 0.7:
        table = "\n".join(json.dumps({"name": a, "description": b}) for a, b in zip(names, descs))
    else:
        table = "\n".join(f"{a} - {b}" for a, b in zip(names, descs))
    msgs = []
    for j, i in enumerate(rng.sample(range(len(names)), k=min(len(names), rng.randint(1, 4)))):
        q = rng.choice(["Which name has the description \"{d}\"?", "Which entry is described as: {d}?",
                        "Name the item whose description is {d}.", "{d} -> which name?"]).format(d=descs[i])
        msgs += [{"role": "user", "content": f"{table}\n\n{q}" if j == 0 else q},
                 {"role": "assistant", "content": names[i]}]
    return Conversation(msgs, enable_thinking=rng.random() < 0.8)
