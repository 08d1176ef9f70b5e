"""Recipe full-v3's training generators (tools/train_tiny/tool_tasks.py, copy_tasks.lookup_sample):
held-out names stay held out, every call is answerable from the listed schemas, names are
too varied to memorise, the chat template renders the multi-turn conversations, and the
v3 task mix goes through the row builder (a toy-size run of data.build_rows)."""
from __future__ import annotations

import json
import random
import re
from collections import Counter

import pytest

from moet.probe import chat_format, tools
from tools.train_tiny import copy_tasks, tool_tasks

N = 2500


@pytest.fixture(scope="module")
def convs():
    rng = random.Random(11)
    return [tool_tasks.sample(rng) for _ in range(N)]


def _schemas(conv) -> dict[str, dict]:
    return {t["function"]["name"]: t["function"] for t in conv.tools}


def _family_of(schema: dict) -> tools.Family:
    return next(f for f in tools.FAMILIES if schema["description"] in f.descs)


def test_held_out_names_never_appear(convs):
    heldout_fn = {f.names[-1] for f in tools.FAMILIES}
    heldout_arg = {(f.key, a.slot): a.names[-1] for f in tools.FAMILIES for a in f.args if len(a.names) >= 3}
    eval_names = {t["function"]["name"] for c in tools.eval_cases(150) for t in c.tools}
    words = set()
    for conv in convs:
        for name, fn in _schemas(conv).items():
            assert name not in eval_names
            snake = re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()
            assert not any(snake.endswith(h) for h in heldout_fn), name
            words |= set(snake.split("_"))
            fam = _family_of(fn)
            for a, key in zip(fam.args, fn["parameters"]["properties"]):
                held = heldout_arg.get((fam.key, a.slot))
                assert held is None or re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", key).lower() != held, (fam.key, key)
    # random compounds never borrow a word of a held-out name (family words of train variants may)
    train_words = {w for f in tools.FAMILIES for n in f.names[:-1] for w in n.split("_")}
    assert not (words & tool_tasks._HELDOUT_WORDS) - train_words


def test_every_call_is_answerable_from_the_listed_schemas(convs):
    kinds, requests = Counter(), 0
    for conv in convs:
        schemas = _schemas(conv)
        assert 1 <= len(schemas) <= 5 and len(schemas) == len(conv.tools)  # names unique within a list
        listed = {_family_of(fn).key for fn in schemas.values()}
        for prev, m in zip(conv.messages, conv.messages[1:]):
            if m["role"] != "assistant":
                continue
            calls = m.get("tool_calls") or []
            if prev["role"] == "user":
                requests += 1
                kind = "call" if calls else ("none" if m["content"].startswith("Sorry, I can't") else "direct")
                kinds[kind] += 1
                if kind == "none":  # declined: the request's family has no listed tool
                    cannot = m["content"].removeprefix("Sorry, I can't ").removesuffix(" with the tools I have.")
                    assert next(f for f in tools.FAMILIES if f.cannot == cannot).key not in listed
            for tc in calls:
                fn = schemas[tc["function"]["name"]]
                args, props = tc["function"]["arguments"], fn["parameters"]["properties"]
                assert set(fn["parameters"]["required"]) <= set(args)
                assert list(args) == [k for k in props if k in args]  # schema order
                assert all(str(v) in prev["content"] for v in args.values())  # the request states every value
    share = {k: v / requests for k, v in kinds.items()}
    assert abs(share["none"] - tool_tasks.DECLINE_P) < 0.03 and abs(share["direct"] - tool_tasks.DIRECT_P) < 0.03
    assert requests / len(convs) > 1.5  # several requests per tool list


def test_names_are_too_varied_to_memorise(convs):
    per_family: dict[str, Counter] = {}
    for conv in convs:
        for name, fn in _schemas(conv).items():
            per_family.setdefault(_family_of(fn).key, Counter())[name] += 1
    for key, names in per_family.items():
        total = sum(names.values())
        assert len(names) > 0.6 * total, key           # mostly distinct names per family
        assert names.most_common(1)[0][1] < 0.1 * total, key  # the most frequent (an unprefixed variant)


def test_rendered_calls_parse_back(convs):
    for conv in convs[:300]:
        text = chat_format.render_conversation(conv)
        replies = text.split(chat_format.ASSISTANT + "\n")[1:]
        calls = [tc["function"] for m in conv.messages if m["role"] == "assistant" for tc in m.get("tool_calls") or []]
        parsed = [chat_format.parse_reply(r) for r in replies]
        assert all(p.valid for p in parsed)
        got = [c for p in parsed for c in p.tool_calls]
        assert got == [(c["name"], {k: str(v) for k, v in c["arguments"].items()}) for c in calls]


def test_template_equals_python_renderer(ckpt, convs):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    rng = random.Random(5)
    for conv in convs[:40] + [copy_tasks.lookup_sample(rng) for _ in range(10)]:
        hf = tok.apply_chat_template(conv.messages, tools=conv.tools, tokenize=False)
        assert hf == chat_format.render(conv.messages, conv.tools)


def test_lookup_answers_are_the_quoted_records_names():
    rng = random.Random(2)
    for _ in range(500):
        conv = copy_tasks.lookup_sample(rng)
        table = conv.messages[0]["content"].split("\n\n")[0].split("\n")
        records = {}
        for line in table:
            if line.startswith("{"):
                r = json.loads(line)
                records[r["description"]] = r["name"]
            else:
                name, desc = line.split(" - ", 1)
                records[desc] = name
        assert len(set(records.values())) == len(records) == len(table)
        for q, a in zip(conv.messages[::2], conv.messages[1::2]):
            asked = [d for d in records if d in q["content"].split("\n\n")[-1]]
            assert a["content"] in {records[d] for d in asked}


def test_v3_mix_goes_through_the_row_builder():
    """Toy-size data stage of recipe micro-v3 (its mix, tiny corpus and tokenizer, one worker)."""
    from tools.train_tiny import data, tokenizer_build
    from tools.train_tiny.recipe import RECIPES
    mix = RECIPES["micro-v3"].mix
    assert dict(mix.task_share) == dict(RECIPES["full-v3"].mix.task_share)
    rng = random.Random(0)
    code = [f"def f{i}(x):\n    return x + {i}\n" * 20 for i in range(60)]
    text = ["Some prose about modules and packages. " * 30 for _ in range(10)]
    sample = code + text + [chat_format.render_conversation(data.CHAT_TASKS[k](rng))
                            for k, _ in mix.task_share for _ in range(30)]
    tok = tokenizer_build.train(sample, 600)
    mix = type(mix)(**{**mix.__dict__, "fact_prose_docs": 20, "chunk": 20})
    rows, stats = data.build_rows(tokenizer=tok, code=code, text=text, n_rows=12, mix=mix, seed=1, workers=1,
                                  log=lambda m: None)
    assert rows.shape == (12, mix.seq_len + 2) and rows.max() < tok.get_vocab_size()
    assert stats["chat_docs"] > 0 and stats["chat_tokens"] > 0.2 * rows.size
    decoded = tok.decode_batch(rows.astype(int).tolist(), skip_special_tokens=False)
    joined = "".join(decoded)
    assert "<tool_call>" in joined and "<tools>" in joined
    assert re.search(r"(description is|described as|has the description|which name\?)", joined)
