"""Tool-use conversations for recipe full-v4: every name random, the description the only
link between a request and its tool, and a short <think> line that does the lookup in steps.

Why v3 failed (H200 run 2026-11-29, runs/full-v3/): right function 0% on held-out names,
declines 0%. Its greedy calls name the canonical variant of the requested family with the
canonical argument names (`get_stock_quote` / `symbol` for the listed `girepi_share_price` /
`stock_symbol`): 35% of v3's function names and 50% of its argument names were still canonical
variants, so recalling "the stock tool is called get_stock_*" paid off on a third of the
training calls, while copying the listed name needs a lookup the model had not formed. A
model takes the cheaper solution; v4 leaves it none:
- Every function and argument name is a random compound whose words never occur in any
  canonical family name or argument name (FORBIDDEN_WORDS: all variants, trained and held
  out), so nothing about a name can be recalled from the request; only the description
  (which training and the probe share, two per family) tells which listed tool serves it.
- The think line writes the lookup out, one learnable step per span, like the arithmetic
  scratchpad:  `look up stock prices: "Get the latest price of a stock." -> girepi_share_price`
  (1) name the request's purpose (the family's `cannot` phrase: request -> family, which v3
  already did right), (2) quote the listed description of that purpose (a match against the
  <tools> lines, then a forward copy), (3) copy the name that precedes that description in
  its line (the backward lookup copy_tasks.lookup_sample drills), then the call copies the
  name from the think line, two dozen tokens back. A decline is the same line ending in
  `: none`, so call-or-decline is the one token after the purpose, with the purpose in view.
  The probe generates with thinking on (96 new tokens; the longest ideal held-out reply with
  its think line is 81 tokens of the v2 tokenizer, tests/tiny keeps it <= 84) and
  chat_format.parse_reply puts the think line into `reasoning`, the call into `tool_calls`.
  Conversations with thinking off (20%) carry no think lines: `<think></think>` pre-filled.
- More decisions per token: 1-4 requests share one tool list, 27% of requests fit no listed
  tool (declined), 5% are plain questions, and only 15% of final calls get a result and an
  answer (answering from a result is solved: 97-100% in v2/v3); fewer system prompts.

Held out exactly as in moet.probe.tools: evaluation namespaces (_is_eval_namespace) can not
occur, and the held-out name variants can not either, since every canonical word is forbidden.
"""
from __future__ import annotations

import json
import random

from moet.probe import arithmetic, facts
from moet.probe.chat_format import Conversation
from moet.probe.needle import ADJECTIVES, NOUNS
from moet.probe.tools import FAMILIES, Family, _is_eval_namespace, _request, _style, _values, _word

Rng = random.Random

# Every word of every function-name and argument-name variant of every family (trained and
# held out): a training name containing one could be recalled from the request's family.
FORBIDDEN_WORDS = frozenset(w for f in FAMILIES for n in f.names for w in n.split("_")) | frozenset(
    w for f in FAMILIES for a in f.args for n in a.names for w in n.split("_"))
_VERBS = tuple(w for w in (
    "get set find make run list fetch load save send check show open start stop update delete read write "
    "add remove do call use build apply sync post put scan pick ask track plan book sort count mark tag "
    "view edit move copy join split merge rank rate lock ping").split()
    if w not in FORBIDDEN_WORDS and not _is_eval_namespace(w))
# English words pass the probe's namespace test by chance (crc32 % 5): left out too, so that no
# word of a training name could be an evaluation namespace.
_WORDS = tuple(w for w in ADJECTIVES + NOUNS if w not in FORBIDDEN_WORDS and not _is_eval_namespace(w))

DECLINE_P = 0.27          # requests no listed tool serves (the probe: 20% of its cases)
DIRECT_P = 0.05           # plain questions (capital, arithmetic) with tools present
RESULT_P = 0.15           # a final call followed by the tool result and an answer
SYSTEM_P = 0.15           # conversations that open with a system prompt
THINK_P = 0.8             # conversations with think lines (the rest: thinking off)
TURNS = ((1, 0.3), (2, 0.3), (3, 0.25), (4, 0.15))


def _pseudo(rng: Rng) -> str:
    while True:
        w = _word(rng, rng.randint(1, 3))
        if not _is_eval_namespace(w) and w not in FORBIDDEN_WORDS:
            return w


def random_name(rng: Rng, camel: bool, parts: tuple[int, int]) -> str:
    """A compound identifier nobody could guess from the tool's purpose."""
    words = []
    for _ in range(rng.randint(*parts)):
        k = rng.random()
        words.append(_pseudo(rng) if k < 0.45 else rng.choice(_WORDS) if k < 0.8 else rng.choice(_VERBS))
    if rng.random() < 0.1:
        words.append(str(rng.randint(0, 99)))
    return _style(words, camel)


def make_tool(rng: Rng, family: Family, camel: bool, taken: set[str]) -> tuple[str, dict[str, str], dict]:
    """-> (name, slot -> argument name, schema), laid out as moet.probe.tools.make_tool lays out
    the probe's schemas. Names are unique within one tool list, argument names within a tool."""
    while True:
        name = random_name(rng, camel, (1, 4))
        if name not in taken:
            taken.add(name)
            break
    arg_names: dict[str, str] = {}
    for a in family.args:
        while True:
            n = random_name(rng, camel, (1, 2))
            if n not in arg_names.values():
                arg_names[a.slot] = n
                break
    props = {arg_names[a.slot]: {"type": a.type, "description": a.desc} for a in family.args}
    schema = {"type": "function", "function": {
        "name": name, "description": rng.choice(family.descs),
        "parameters": {"type": "object", "properties": props,
                       "required": [arg_names[a.slot] for a in family.args if a.required]}}}
    return name, arg_names, schema


def think_call(family: Family, description: str, name: str) -> str:
    return f"{family.cannot}: \"{description}\" -> {name}"


def think_decline(family: Family) -> str:
    return f"{family.cannot}: none"


def _pick(rng: Rng, table: tuple[tuple[int, float], ...]) -> int:
    x = rng.random()
    for value, p in table:
        if x < p:
            return value
        x -= p
    return table[-1][0]


def sample(rng: Rng) -> Conversation:
    """1-5 tools, then 1-4 requests against that list. A request is a call (answered from the
    tool result unless it is the last turn, where RESULT_P are), a decline, or a plain question.
    meta: the first request's kind (and name/arguments for a call)."""
    n_tools = rng.randint(1, 5)
    fams = rng.sample(FAMILIES, k=n_tools + 4)
    listed, absent = fams[:n_tools], fams[n_tools:]
    per_tool_case = rng.random() < 0.3  # the probe draws camelCase per tool; most clients per list
    camel_list = rng.random() < 0.3
    taken: set[str] = set()
    tools = []
    for f in listed:
        camel = (rng.random() < 0.3) if per_tool_case else camel_list
        tools.append((f, *make_tool(rng, f, camel, taken)))
    rng.shuffle(tools)
    think = rng.random() < THINK_P
    msgs = [{"role": "system", "content": "You are a helpful assistant."}] if rng.random() < SYSTEM_P else []
    n_turns = _pick(rng, TURNS)
    meta: dict = {}
    for turn in range(n_turns):
        last = turn == n_turns - 1
        k = rng.random()
        if k < DECLINE_P:
            fam = rng.choice(absent)
            reply = {"role": "assistant", "content": f"Sorry, I can't {fam.cannot} with the tools I have."}
            if think:
                reply["reasoning_content"] = think_decline(fam)
            msgs += [{"role": "user", "content": _request(rng, fam, _values(rng, fam))}, reply]
            meta = meta or {"kind": "none"}
        elif k < DECLINE_P + DIRECT_P:
            conv = facts.sample(rng) if rng.random() < 0.5 else arithmetic.sample(rng)
            for m in conv.messages:  # its own scratchpad only where this conversation thinks
                msgs.append(m if think else {k2: v for k2, v in m.items() if k2 != "reasoning_content"})
            meta = meta or {"kind": "direct"}
        else:
            fam, name, arg_names, schema = rng.choice(tools)
            values = _values(rng, fam)
            args = {arg_names[a.slot]: values[a.slot] for a in fam.args if a.slot in values}
            reply = {"role": "assistant", "content": "",
                     "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]}
            if think:
                reply["reasoning_content"] = think_call(fam, schema["function"]["description"], name)
            msgs += [{"role": "user", "content": _request(rng, fam, values)}, reply]
            meta = meta or {"kind": "call", "name": name, "arguments": args}
            if not last or rng.random() < RESULT_P:
                result = fam.result(rng, values)
                msgs += [{"role": "tool", "content": json.dumps(result)},
                         {"role": "assistant", "content": fam.answer.format(**values, **result)}]
    return Conversation(msgs, [t[3] for t in tools], think, meta)
