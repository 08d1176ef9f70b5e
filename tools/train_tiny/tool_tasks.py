"""Tool-use conversations for recipe full-v3: names that can only be copied, selection by
description, declines, several requests per tool list.

Diagnosis of the shipped v2 model (tool probe: markup valid 91%, right function 0%, never
declines), from its greedy replies on held-out and on training-distribution prompts:
- Selection is at chance. Even on training-style prompts the model calls *some* listed tool
  (the exact name of another tool in ~40% of calls) and fills it with the requested family's
  arguments: it has not learned to find the schema line that serves the request.
- The name is recalled, not copied. Training names were one of three variants per family plus
  a random namespace word; the model copies the namespace (random, so it had to) and then
  writes a variant it memorised (`buri_get_airfber_reservation` for `buri_get_airfare`,
  `gugo_note` for `gugo_note_create`). The tokenizer is not the obstacle: names split at `_`
  and camel humps into common pieces (`b uri _ get _ a ir f are`).
- It never declines: 10% of training tool conversations declined, and deciding that no line
  matches needs the same selection skill it lacks.
Selection is hard for a second reason: in a schema line the name comes *before* the
description, so the model must match the request against a later field and emit the line's
earlier one; and each conversation gives that choice a gradient on one token.

So here: most function and argument names are random compounds (pseudo-words, English words,
verbs, digits; snake or camel case), so a memorised name is useless and the description is
the only reliable way to pick a tool; 1-3 requests share one tool list (more choices per
schema token); 22% of requests fit no tool and are declined, 8% are plain questions. The
generic form of the skill (match a later field, copy the earlier one) is drilled separately
by copy_tasks.lookup_sample.

Held out exactly as in moet.probe.tools: evaluation namespaces, the last function-name and
argument-name variant of every family, and (here too) every word of those held-out names.
"""
from __future__ import annotations

import json
import random

from moet.probe import arithmetic, facts
from moet.probe.chat_format import Conversation
from moet.probe.needle import ADJECTIVES, NOUNS
# The probe's family definitions and helpers: training and evaluation must agree on families,
# descriptions, requests and the held-out split.
from moet.probe.tools import (FAMILIES, Family, _is_eval_namespace, _namespace, _request, _style, _values,
                              _variants, _word)

Rng = random.Random

# Words of held-out names never appear in generated training names.
_HELDOUT_WORDS = frozenset(w for f in FAMILIES for w in f.names[-1].split("_")) | frozenset(
    w for f in FAMILIES for a in f.args if len(a.names) >= 3 for w in a.names[-1].split("_"))
_VERBS = tuple(w for w in (
    "get set find make run list fetch load save send check show open start stop update delete read write "
    "add remove do call use build apply sync post put scan pick ask track plan book sort count mark tag "
    "view edit move copy join split merge rank rate lock ping").split() if w not in _HELDOUT_WORDS)
_WORDS = tuple(w for w in ADJECTIVES + NOUNS if w not in _HELDOUT_WORDS)

RANDOM_NAME_P = 0.65      # share of function names that are random compounds
RANDOM_ARG_P = 0.5        # share of argument names that are random compounds
DECLINE_P = 0.22          # requests no listed tool serves
DIRECT_P = 0.08           # plain questions (capital, arithmetic) with tools present
TURNS = ((1, 0.5), (2, 0.3), (3, 0.2))


def _pseudo(rng: Rng) -> str:
    while True:
        w = _word(rng, rng.randint(1, 3))
        if not _is_eval_namespace(w) and w not in _HELDOUT_WORDS:
            return w


def random_name(rng: Rng, camel: bool, parts: tuple[int, int] = (1, 4)) -> str:
    """A compound identifier nobody could guess from the tool's purpose."""
    words = []
    for _ in range(rng.randint(*parts)):
        k = rng.random()
        words.append(_pseudo(rng) if k < 0.45 else rng.choice(_WORDS) if k < 0.8 else rng.choice(_VERBS))
    if rng.random() < 0.1:
        words.append(str(rng.randint(0, 99)))
    return _style(words, camel)


def make_tool(rng: Rng, family: Family, camel: bool, taken: set[str]) -> tuple[str, dict[str, str], dict]:
    """-> (name, slot -> argument name, schema). Names are unique within one tool list."""
    while True:
        if rng.random() < RANDOM_NAME_P:
            name = random_name(rng, camel)
        else:
            words = rng.choice(_variants(family.names, "train")).split("_")
            if rng.random() < 0.6:
                words = [_namespace(rng, "train")] + words
            name = _style(words, camel)
        if name not in taken:
            taken.add(name)
            break
    arg_names: dict[str, str] = {}
    for a in family.args:
        while True:
            if rng.random() < RANDOM_ARG_P:
                n = random_name(rng, camel, (1, 2))
            else:
                n = _style(rng.choice(_variants(a.names, "train")).split("_"), camel)
            if n not in arg_names.values():
                arg_names[a.slot] = n
                break
    props = {arg_names[a.slot]: {"type": a.type, "description": a.desc} for a in family.args}
    schema = {"type": "function", "function": {
        "name": name, "description": rng.choice(family.descs),
        "parameters": {"type": "object", "properties": props,
                       "required": [arg_names[a.slot] for a in family.args if a.required]}}}
    return name, arg_names, schema


def _pick(rng: Rng, table: tuple[tuple[int, float], ...]) -> int:
    x = rng.random()
    for value, p in table:
        if x < p:
            return value
        x -= p
    return table[-1][0]


def sample(rng: Rng) -> Conversation:
    """1-5 tools, then 1-3 requests against that list. A request is a call (answered from the
    tool result unless it is the last turn, where 35% are), a decline, or a plain question.
    meta: the first request's kind (and name/arguments for a call)."""
    n_tools = rng.randint(1, 5)
    fams = rng.sample(FAMILIES, k=n_tools + 3)
    listed, absent = fams[:n_tools], fams[n_tools:]
    per_tool_case = rng.random() < 0.3  # the probe draws camelCase per tool; most clients per list
    camel_list = rng.random() < 0.3
    taken: set[str] = set()
    tools = []
    for f in listed:
        camel = (rng.random() < 0.3) if per_tool_case else camel_list
        tools.append((f, *make_tool(rng, f, camel, taken)))
    rng.shuffle(tools)
    msgs = [{"role": "system", "content": "You are a helpful assistant."}] if rng.random() < 0.3 else []
    n_turns = _pick(rng, TURNS)
    meta: dict = {}
    for turn in range(n_turns):
        last = turn == n_turns - 1
        k = rng.random()
        if k < DECLINE_P:
            fam = rng.choice(absent)
            msgs += [{"role": "user", "content": _request(rng, fam, _values(rng, fam))},
                     {"role": "assistant", "content": f"Sorry, I can't {fam.cannot} with the tools I have."}]
            meta = meta or {"kind": "none"}
        elif k < DECLINE_P + DIRECT_P:
            conv = facts.sample(rng) if rng.random() < 0.5 else arithmetic.sample(rng)
            msgs += conv.messages
            meta = meta or {"kind": "direct"}
        else:
            fam, name, arg_names, _ = rng.choice(tools)
            values = _values(rng, fam)
            args = {arg_names[a.slot]: values[a.slot] for a in fam.args if a.slot in values}
            msgs += [{"role": "user", "content": _request(rng, fam, values)},
                     {"role": "assistant", "content": "",
                      "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]}]
            meta = meta or {"kind": "call", "name": name, "arguments": args}
            if not last or rng.random() < 0.35:
                result = fam.result(rng, values)
                msgs += [{"role": "tool", "content": json.dumps(result)},
                         {"role": "assistant", "content": fam.answer.format(**values, **result)}]
    return Conversation(msgs, [t[3] for t in tools], rng.random() < 0.8, meta)
