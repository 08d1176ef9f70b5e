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

Recipe full-v5 (same generator, other NameRules; `sample_v5`). Why v4 failed (H200 run
2026-11-29, runs/full-v4/tool_diag.py): the think line quoted the right description 97.5% and
the call copied the think line's name 97.5%, but the name after `->` was right 45% on
training-style names and 0% on the probe's (namespace + canonical words, `girepi_share_price`):
FORBIDDEN_WORDS made every canonical word unwritable inside a name, so the model loops
(`girepi_nepi_nepi_...`) or writes an unrelated name (`joinSum` for `population_lookup`). v5
lets any word occur inside a name while keeping names uninformative (V5_NAMES):
- 20% of function names are one of the family's trained variants (`population_lookup`, the
  realistic case), so recalling "weather tools are called get_weather" pays off on at most a
  fifth of the calls; the other 80% are compounds of pseudo-words, ordinary English words,
  verbs and canonical words of OTHER families/arguments (a weather tool may be `stock_quote`),
  never a word of the tool's own family; half of all function names get a namespace word.
  Argument names likewise (20% a trained variant of their own slot, else a compound without
  their slot's words). Held out as before: no evaluation namespace (nor any word that could be
  one, `_could_be_eval_namespace`, unless it is a canonical word), and no held-out variant as a
  whole name or argument name; but the held-out variants' WORDS now occur inside names.
- More description -> name lookups per token (the half-learned step): 1-6 requests per tool
  list (mean 3.3 vs 2.25) and a call prefers a tool not yet called in the conversation
  (`fresh_targets`), so a later request can not copy an earlier call instead of looking up.
"""
from __future__ import annotations

import functools
import json
import random
import re
from dataclasses import dataclass

from moet.probe import arithmetic, facts
from moet.probe.chat_format import Conversation
from moet.probe.needle import ADJECTIVES, NOUNS
from moet.probe.tools import (FAMILIES, Arg, Family, _is_eval_namespace, _namespace, _request, _style, _values,
                              _variants, _word)

Rng = random.Random

# Every word of every function-name and argument-name variant of every family (trained and
# held out): a training name containing one could be recalled from the request's family.
FORBIDDEN_WORDS = frozenset(w for f in FAMILIES for n in f.names for w in n.split("_")) | frozenset(
    w for f in FAMILIES for a in f.args for n in a.names for w in n.split("_"))
CANONICAL_WORDS = FORBIDDEN_WORDS  # v5 borrows them instead
_ALL_VERBS = tuple((
    "get set find make run list fetch load save send check show open start stop update delete read write "
    "add remove do call use build apply sync post put scan pick ask track plan book sort count mark tag "
    "view edit move copy join split merge rank rate lock ping").split())
_VERBS = tuple(w for w in _ALL_VERBS if w not in FORBIDDEN_WORDS and not _is_eval_namespace(w))
# English words pass the probe's namespace test by chance (crc32 % 5): left out too, so that no
# word of a training name could be an evaluation namespace.
_WORDS = tuple(w for w in ADJECTIVES + NOUNS if w not in FORBIDDEN_WORDS and not _is_eval_namespace(w))

DECLINE_P = 0.27          # requests no listed tool serves (the probe: 20% of its cases)
DIRECT_P = 0.05           # plain questions (capital, arithmetic) with tools present
RESULT_P = 0.15           # a final call followed by the tool result and an answer
SYSTEM_P = 0.15           # conversations that open with a system prompt
THINK_P = 0.8             # conversations with think lines (the rest: thinking off)
TURNS = ((1, 0.3), (2, 0.3), (3, 0.25), (4, 0.15))
TURNS_V5 = ((1, 0.1), (2, 0.15), (3, 0.25), (4, 0.25), (5, 0.15), (6, 0.1))  # mean 3.3

_SYLLABLE_WORD = re.compile(r"([bdfgklmnprstvz][aeiou]){2,3}")


def _could_be_eval_namespace(word: str) -> bool:
    """True for words moet.probe.tools._namespace(.., "eval") can draw (2-3 syllables of its
    alphabet, crc32 % 5 == 0): `time`, `date`, `make`, ... A narrower test than v4's
    _is_eval_namespace on every word, which left a fifth of all English words unwritable."""
    return bool(_SYLLABLE_WORD.fullmatch(word)) and _is_eval_namespace(word)


@dataclass(frozen=True)
class NameRules:
    """How a tool list's function and argument names are drawn.

    A compound (1 + randint(*parts) - 1 words) draws each word from: a pseudo-word (1-3
    syllables, not in `banned`, never an evaluation namespace) below source_p[0], an English
    word below source_p[1], a verb below source_p[2], else a word of `canonical` that is not a
    word of the tool's own family (function names) or own slot (argument names); then a number
    with number_p. With own_p a name is instead one of the trained canonical variants of its
    own family / slot; function names get a training namespace word in front with namespace_p.
    Zero probabilities draw nothing from the RNG: V4_NAMES reproduces v4's stream exactly."""
    words: tuple[str, ...]
    verbs: tuple[str, ...]
    banned: frozenset[str]
    canonical: tuple[str, ...] = ()
    source_p: tuple[float, float, float] = (0.45, 0.8, 1.0)
    fn_parts: tuple[int, int] = (1, 4)
    arg_parts: tuple[int, int] = (1, 2)
    number_p: float = 0.1
    own_p: float = 0.0          # function names and argument names, each drawn independently
    namespace_p: float = 0.0    # function names only (the probe's argument names have none)


V4_NAMES = NameRules(words=_WORDS, verbs=_VERBS, banned=FORBIDDEN_WORDS)
V5_NAMES = NameRules(
    words=tuple(w for w in ADJECTIVES + NOUNS if not _could_be_eval_namespace(w) or w in CANONICAL_WORDS),
    verbs=tuple(w for w in _ALL_VERBS if not _could_be_eval_namespace(w) or w in CANONICAL_WORDS),
    banned=frozenset(), canonical=tuple(sorted(CANONICAL_WORDS)),
    source_p=(0.3, 0.55, 0.7), fn_parts=(1, 3), arg_parts=(1, 2), number_p=0.1, own_p=0.2, namespace_p=0.5)


def family_words(family: Family) -> frozenset[str]:
    """Every word of the family's function-name and argument-name variants: a v5 compound for
    one of its tools borrows none of them (so only own_p of its names point to the family)."""
    return frozenset(w for n in family.names for w in n.split("_")) | frozenset(
        w for a in family.args for n in a.names for w in n.split("_"))


def slot_words(arg: Arg) -> frozenset[str]:
    return frozenset(w for n in arg.names for w in n.split("_"))


@functools.lru_cache(maxsize=None)
def _without(pool: tuple[str, ...], exclude: frozenset[str]) -> tuple[str, ...]:
    return tuple(w for w in pool if w not in exclude)


def _pseudo(rng: Rng, banned: frozenset[str] = FORBIDDEN_WORDS) -> str:
    while True:
        w = _word(rng, rng.randint(1, 3))
        if not _is_eval_namespace(w) and w not in banned:
            return w


def _compound(rng: Rng, parts: tuple[int, int], rules: NameRules, exclude: frozenset[str]) -> list[str]:
    """`exclude`: words of the tool's own family / the argument's own slot (v4: all forbidden
    anyway, so its pools and draws are unchanged)."""
    p_pseudo, p_word, p_verb = rules.source_p
    banned = rules.banned | exclude
    words = []
    for _ in range(rng.randint(*parts)):
        k = rng.random()
        words.append(_pseudo(rng, banned) if k < p_pseudo else rng.choice(_without(rules.words, exclude))
                     if k < p_word else rng.choice(_without(rules.verbs, exclude)) if k < p_verb
                     else rng.choice(_without(rules.canonical, exclude)))
    if rng.random() < rules.number_p:
        words.append(str(rng.randint(0, 99)))
    return words


def random_name(rng: Rng, camel: bool, parts: tuple[int, int], rules: NameRules = V4_NAMES,
                exclude: frozenset[str] = frozenset()) -> str:
    """A compound identifier nobody could guess from the tool's purpose."""
    return _style(_compound(rng, parts, rules, exclude), camel)


def function_name(rng: Rng, family: Family, camel: bool, rules: NameRules = V4_NAMES) -> str:
    """The family's held-out variant never occurs (its words are the family's own, which a
    compound never borrows); another family's may, as a misleading name."""
    if rules.own_p and rng.random() < rules.own_p:
        words = rng.choice(_variants(family.names, "train")).split("_")
    else:
        words = _compound(rng, rules.fn_parts, rules, family_words(family))
    if rules.namespace_p and rng.random() < rules.namespace_p:
        words = [_namespace(rng, "train")] + words
    return _style(words, camel)


def argument_name(rng: Rng, arg: Arg, camel: bool, rules: NameRules = V4_NAMES) -> str:
    if rules.own_p and rng.random() < rules.own_p:
        words = rng.choice(_variants(arg.names, "train")).split("_")
    else:
        words = _compound(rng, rules.arg_parts, rules, slot_words(arg))
    return _style(words, camel)


def make_tool(rng: Rng, family: Family, camel: bool, taken: set[str], rules: NameRules = V4_NAMES
              ) -> tuple[str, dict[str, str], dict]:
    """-> (name, slot -> argument name, schema), laid out as moet.probe.tools.make_tool lays out
    the probe's schemas. Names are unique within one tool list, argument names within a tool."""
    while True:
        name = function_name(rng, family, camel, rules)
        if name not in taken:
            taken.add(name)
            break
    arg_names: dict[str, str] = {}
    for a in family.args:
        while True:
            n = argument_name(rng, a, camel, rules)
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


def sample(rng: Rng, names: NameRules = V4_NAMES, turns: tuple[tuple[int, float], ...] = TURNS,
           fresh_targets: bool = False) -> Conversation:
    """1-5 tools, then 1-4 requests against that list. A request is a call (answered from the
    tool result unless it is the last turn, where RESULT_P are), a decline, or a plain question.
    meta: the first request's kind (and name/arguments for a call). The defaults are recipe
    full-v4's (its recorded stream); `fresh_targets`: a call picks among the listed tools not
    called yet in this conversation while there are any."""
    n_tools = rng.randint(1, 5)
    fams = rng.sample(FAMILIES, k=n_tools + 4)
    listed, absent = fams[:n_tools], fams[n_tools:]
    per_tool_case = rng.random() < 0.3  # the probe draws camelCase per tool; most clients per list
    camel_list = rng.random() < 0.3
    taken: set[str] = set()
    tools = []
    for f in listed:
        camel = (rng.random() < 0.3) if per_tool_case else camel_list
        tools.append((f, *make_tool(rng, f, camel, taken, names)))
    rng.shuffle(tools)
    think = rng.random() < THINK_P
    msgs = [{"role": "system", "content": "You are a helpful assistant."}] if rng.random() < SYSTEM_P else []
    n_turns = _pick(rng, turns)
    meta: dict = {}
    called: set[str] = set()
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
            fresh = [t for t in tools if t[1] not in called] if fresh_targets else []
            fam, name, arg_names, schema = rng.choice(fresh or tools)
            called.add(name)
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


def sample_v5(rng: Rng) -> Conversation:
    """Recipe full-v5's tool conversations: V5_NAMES, 1-6 requests per list, fresh targets."""
    return sample(rng, V5_NAMES, TURNS_V5, fresh_targets=True)
