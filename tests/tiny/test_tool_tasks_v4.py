"""Recipe full-v4's tool conversations (tools/train_tiny/tool_tasks_v4.py): no canonical or
held-out name ever appears in a training tool list, every call and decline is answerable from
the listed descriptions, the think lines quote the listed description and name and parse back
through chat_format and the shipped Jinja template, the probe's reply budget holds them, and
the v4 mix goes through the row builder (a toy-size run of data.build_rows). The reply-budget
check also covers recipe full-v5, which keeps v4's think line (the same think_call)."""
from __future__ import annotations

import random
import re
from collections import Counter

import pytest

from moet.probe import chat_format, tools
from tests.tiny.tool_names import family_of as _family_of
from tests.tiny.tool_names import toy_rows
from tests.tiny.tool_names import words as _words
from tools.train_tiny import tool_tasks_v4 as v4

N = 2500


@pytest.fixture(scope="module")
def convs():
    rng = random.Random(17)
    return [v4.sample(rng) for _ in range(N)]




def _listed_names(conv) -> list[str]:
    """Every function and argument name of the conversation's tool list."""
    out = []
    for t in conv.tools:
        fn = t["function"]
        out += [fn["name"], *fn["parameters"]["properties"]]
    return out


def test_no_canonical_name_or_word_in_training_tool_lists(convs):
    # The reference is rebuilt here from the families (not tool_tasks_v4.FORBIDDEN_WORDS).
    canon_names = {n for f in tools.FAMILIES for n in f.names} | {n for f in tools.FAMILIES for a in f.args
                                                                  for n in a.names}
    canon_words = {w for n in canon_names for w in n.split("_")}
    seen = 0
    for conv in convs:
        for name in _listed_names(conv):
            words = _words(name)
            assert "_".join(words) not in canon_names, name
            assert not set(words) & canon_words, name
            seen += 1
    assert seen > 5 * N


def test_no_held_out_name_leaks(convs):
    """Nothing the probe evaluates with (names of its held-out cases, evaluation namespaces,
    held-out variants) occurs in training tool lists, think lines or calls."""
    eval_names, eval_functions = set(), set()
    for c in tools.eval_cases(150):
        for t in c.tools:
            eval_functions.add(t["function"]["name"])
            eval_names |= {t["function"]["name"], *t["function"]["parameters"]["properties"]}
    eval_words = {w for n in eval_names for w in _words(n)}
    heldout = {f.names[-1] for f in tools.FAMILIES} | {a.names[-1] for f in tools.FAMILIES for a in f.args}
    for conv in convs:
        text = chat_format.render_conversation(conv)
        for name in _listed_names(conv):
            words = _words(name)
            assert name not in eval_names and "_".join(words) not in heldout, name
            assert not set(words) & eval_words, name
            assert not any(tools._is_eval_namespace(w) for w in words if w.isalpha()), name
        for m in conv.messages:
            for tc in m.get("tool_calls") or []:
                assert tc["function"]["name"] in _listed_names(conv)
        # (argument names such as "portions" also occur in requests; function names, namespaced, never)
        assert not any(n in text for n in eval_functions)


def test_calls_declines_and_think_lines_follow_the_listed_descriptions(convs):
    kinds, requests, thinking = Counter(), 0, 0
    for conv in convs:
        schemas = {t["function"]["name"]: t["function"] for t in conv.tools}
        assert 1 <= len(schemas) == len(conv.tools) <= 5  # names unique within a list
        listed = {_family_of(fn).key for fn in schemas.values()}
        for prev, m in zip(conv.messages, conv.messages[1:]):
            if m["role"] != "assistant" or prev["role"] != "user":
                continue
            requests += 1
            calls = m.get("tool_calls") or []
            think = m.get("reasoning_content")
            if calls:
                kinds["call"] += 1
                (tc,) = calls
                fn = schemas[tc["function"]["name"]]
                fam = _family_of(fn)
                args, props = tc["function"]["arguments"], fn["parameters"]["properties"]
                assert set(fn["parameters"]["required"]) <= set(args) and list(args) == [k for k in props if k in args]
                assert all(str(v) in prev["content"] for v in args.values())  # the request states every value
                assert fam.key in listed
                if think is not None:
                    assert think == f"{fam.cannot}: \"{fn['description']}\" -> {fn['name']}"
            elif m["content"].startswith("Sorry, I can't"):
                kinds["none"] += 1
                cannot = m["content"].removeprefix("Sorry, I can't ").removesuffix(" with the tools I have.")
                fam = next(f for f in tools.FAMILIES if f.cannot == cannot)
                assert fam.key not in listed  # declined only when no listed tool serves the request
                assert think in (None, f"{cannot}: none")
            else:
                kinds["direct"] += 1
            if calls or m["content"].startswith("Sorry"):  # think lines exactly where thinking is on
                assert (think is not None) == conv.enable_thinking
                thinking += think is not None
    share = {k: v / requests for k, v in kinds.items()}
    assert abs(share["none"] - v4.DECLINE_P) < 0.03 and abs(share["direct"] - v4.DIRECT_P) < 0.02
    assert requests / N > 2.0  # several decisions per tool list
    assert abs(thinking / (kinds["call"] + kinds["none"]) - v4.THINK_P) < 0.04


def test_names_are_too_varied_to_memorise(convs):
    per_family: dict[str, Counter] = {}
    for conv in convs:
        for t in conv.tools:
            per_family.setdefault(_family_of(t["function"]).key, Counter())[t["function"]["name"]] += 1
    for key, names in per_family.items():
        total = sum(names.values())
        assert len(names) > 0.8 * total and names.most_common(1)[0][1] < 0.02 * total, key


def test_think_lines_parse_back_and_match_the_template(ckpt, convs):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    for conv in convs[:300]:
        text = chat_format.render_conversation(conv)
        replies = [r for r in text.split(chat_format.ASSISTANT + "\n")[1:]]
        answers = [m for m in conv.messages if m["role"] == "assistant"]
        assert len(replies) == len(answers)
        for r, m in zip(replies, answers):
            p = chat_format.parse_reply(r)
            assert p.valid and p.reasoning == (m.get("reasoning_content") or "")
            want = [(tc["function"]["name"], {k: str(v) for k, v in tc["function"]["arguments"].items()})
                    for tc in m.get("tool_calls") or []]
            assert p.tool_calls == want and p.content == (m["content"] or "")
    for conv in convs[:40]:
        assert tok.apply_chat_template(conv.messages, tools=conv.tools, tokenize=False) == \
            chat_format.render(conv.messages, conv.tools)


def test_probe_reply_budget_holds_the_think_line():
    """The tools probe generates 96 new tokens: the ideal reply (think line + call + <|end|>)
    to every held-out call case must fit with a margin (v2's tokenizer; v4's is trained on
    these lines and splits them no worse in practice)."""
    from tokenizers import Tokenizer

    from moet.probe.loader import default_checkpoint
    tok = Tokenizer.from_file(str(default_checkpoint() / "tokenizer.json"))
    lens = []
    for c in tools.eval_cases(150):
        if c.meta["kind"] != "call":
            continue
        fn = next(t["function"] for t in c.tools if t["function"]["name"] == c.meta["name"])
        reply = {"role": "assistant", "content": "",
                 "reasoning_content": v4.think_call(_family_of(fn), fn["description"], fn["name"]),
                 "tool_calls": [{"type": "function", "function": {"name": fn["name"], "arguments": c.meta["arguments"]}}]}
        prompt = chat_format.render_conversation(c, add_generation_prompt=True)
        full = chat_format.render(c.messages + [reply], c.tools)
        assert full.startswith(prompt)
        parsed = chat_format.parse_reply(full[len(prompt):])
        assert tools.score(parsed, c.meta)["correct"]
        lens.append(len(tok.encode(full[len(prompt):], add_special_tokens=False).ids))
    assert len(lens) == 90 and max(lens) <= 84, max(lens)


def test_v4_mix_goes_through_the_row_builder():
    """Toy-size data stage of recipe micro-v4 (its mix, tiny corpus and tokenizer, one worker)."""
    from tools.train_tiny.recipe import RECIPES
    assert dict(RECIPES["micro-v4"].mix.task_share) == dict(RECIPES["full-v4"].mix.task_share)
    tok, mix, rows, stats, joined = toy_rows("micro-v4", 600, 12)
    assert rows.shape == (12, mix.seq_len + 2) and rows.max() < tok.get_vocab_size()
    assert stats["chat_docs"] > 0 and stats["chat_tokens"] > 0.3 * rows.size
    assert "<tool_call>" in joined and "<tools>" in joined
    assert re.search(r"<think>[a-z ]+: \"[^\"]+\" -> \w+</think>", joined)  # a call's think line
    assert re.search(r"<think>[a-z ]+: none</think>", joined)             # a decline's


def test_v4_keeps_v2_facts_share_and_v3_steps():
    """Facts' share of all tokens >= v2's (chat_share x task share; needle rows unchanged), and
    no more steps than v3 (2300 steps = 343.6 s of H200 training)."""
    from tools.train_tiny.recipe import RECIPES
    v2, v3, v4r = RECIPES["full-v2"], RECIPES["full-v3"], RECIPES["full-v4"]

    def facts_share(r):
        return r.mix.chat_share * dict(r.mix.task_share)["facts"]
    assert facts_share(v4r) >= facts_share(v2) and v4r.mix.needle_rows == v2.mix.needle_rows
    assert v4r.steps <= v3.steps and v4r.batch_rows == v3.batch_rows and v4r.shape == v3.shape
    assert abs(sum(s for _, s in v4r.mix.task_share) - 1) < 1e-9
