"""Recipe full-v5's tool conversations (tools/train_tiny/tool_tasks_v4.py with V5_NAMES): every
canonical word (held-out variants' words included) occurs inside training names, no more than
NameRules.own_p of the names point to their own tool or slot, held-out names stay held out, the
probe's reply budget holds the think line, the v5 mix goes through the row builder - and v4's
recorded stream is unchanged by the NameRules refactor."""
from __future__ import annotations

import hashlib
import json
import random
import re
from collections import Counter

import pytest

from moet.probe import chat_format, tools
from tests.tiny.tool_names import family_of as _family_of
from tests.tiny.tool_names import toy_rows
from tests.tiny.tool_names import words as _words
from tools.train_tiny import tool_tasks_v4 as tt

N = 2500
OWN_P = tt.V5_NAMES.own_p


@pytest.fixture(scope="module")
def convs():
    rng = random.Random(17)
    return [tt.sample_v5(rng) for _ in range(N)]




def _slots(fn: dict) -> list[tuple[tools.Arg, str]]:
    """(Arg, listed argument name) in schema order (the generator lays props out in family.args order)."""
    return list(zip(_family_of(fn).args, fn["parameters"]["properties"]))


# Reference sets rebuilt from the families (not from tool_tasks_v4's helpers).
def _fam_words(f: tools.Family) -> set[str]:
    return {w for n in f.names for w in n.split("_")} | {w for a in f.args for n in a.names for w in n.split("_")}


def _slot_words(a: tools.Arg) -> set[str]:
    return {w for n in a.names for w in n.split("_")}


def _runs(words: list[str]) -> set[str]:
    return {"_".join(words[i:j]) for i in range(len(words)) for j in range(i + 1, len(words) + 1)}


# --- v4's stream is the recorded run's --------------------------------------------------------------
# sha256 over json.dumps([messages, tools, enable_thinking, meta], sort_keys=True) of the first n
# conversations of tool_tasks_v4.sample, computed BEFORE NameRules was introduced (2026-11-29).
V4_STREAM = {(0, 400): "734479fb57efaf3914e440dbd460d4b0fd96ffd8883a6d3fc0a144e30618fc56",
             (20251129, 400): "d5d8526aa0a7c2ba235c045c8232382880aed5973114e2f7d9f618fb40dccfbf",
             (17, 2500): "f1b251c0e6e9afd53a9dc8075c3701b3d0d0396db6e49b0518e475ff211ec089"}


@pytest.mark.parametrize("seed,n", sorted(V4_STREAM))
def test_v4_stream_unchanged(seed, n):
    rng, h = random.Random(seed), hashlib.sha256()
    for _ in range(n):
        c = tt.sample(rng)
        h.update(json.dumps([c.messages, c.tools, c.enable_thinking, c.meta], sort_keys=True).encode())
    assert h.hexdigest() == V4_STREAM[(seed, n)]


# --- v5's names ---------------------------------------------------------------------------------
def test_canonical_words_appear_inside_names(convs):
    """The words of every canonical variant - the probe's held-out ones included - are written
    inside training names, v4's failure (`girepi_nepi_nepi_...`) has nothing to stand on."""
    fn_words, arg_words, whole = Counter(), Counter(), Counter()
    for conv in convs:
        for t in conv.tools:
            fn = t["function"]
            fn_words.update(_words(fn["name"]))
            whole["_".join(_words(fn["name"]))] += 1
            for p in fn["parameters"]["properties"]:
                arg_words.update(_words(p))
    heldout_fn = {w for f in tools.FAMILIES for w in f.names[-1].split("_")}
    heldout_arg = {w for f in tools.FAMILIES for a in f.args if len(a.names) >= 3 for w in a.names[-1].split("_")}
    assert not heldout_fn - set(fn_words), heldout_fn - set(fn_words)
    assert not heldout_arg - set(arg_words), heldout_arg - set(arg_words)
    canon = {w for f in tools.FAMILIES for w in _fam_words(f)}
    assert not canon - set(fn_words) - set(arg_words)
    # realistic names occur as they are (the server test's population_lookup, get_weather, ...)
    assert whole["population_lookup"] > 0 and whole["get_weather"] > 0


def test_no_name_reveals_its_tool_beyond_own_p(convs):
    fn_total = fn_own = arg_total = arg_own = 0
    for conv in convs:
        for t in conv.tools:
            fn = t["function"]
            fn_total += 1
            fn_own += bool(set(_words(fn["name"])) & _fam_words(_family_of(fn)))
            for a, p in _slots(fn):
                arg_total += 1
                arg_own += bool(set(_words(p)) & _slot_words(a))
    assert fn_total > 2.5 * N and arg_total > 4 * N
    assert abs(fn_own / fn_total - OWN_P) < 0.02, fn_own / fn_total
    assert abs(arg_own / arg_total - OWN_P) < 0.02, arg_own / arg_total


def test_recall_alone_picks_the_tool_at_most_own_p(convs):
    """A model that recalls instead of reading descriptions picks the listed tool whose name
    shares most words with the requested family's canonical names. Among lists of 2+ tools it
    singles out the right one only when the name is the family's own variant (~own_p), and is
    misled by names borrowing the family's words elsewhere."""
    right = wrong = n = 0
    for conv in convs:
        if len(conv.tools) < 2:
            continue
        by_name = {t["function"]["name"]: t["function"] for t in conv.tools}
        for m in conv.messages:
            for tc in m.get("tool_calls") or []:
                target = by_name[tc["function"]["name"]]
                fw = _fam_words(_family_of(target))
                overlap = {k: len(set(_words(k)) & fw) for k in by_name}
                best = max(overlap.values())
                winners = [k for k, v in overlap.items() if v == best]
                n += 1
                right += best > 0 and winners == [target["name"]]
                wrong += best > 0 and target["name"] not in winners
    assert n > 1.5 * N
    print(f"recall picks right {right / n:.3f}, misled {wrong / n:.3f}")
    assert right / n < OWN_P + 0.02, right / n
    assert wrong / n > 0.03, wrong / n  # other tools' names do carry the family's words


def test_held_out_names_stay_held_out(convs):
    """As moet.probe.tools holds out: no evaluation namespace occurs in a training name, no
    family's held-out variant names a tool of that family, no slot's held-out variant names that
    slot; the probe's (namespaced) function names never occur."""
    eval_ns, eval_functions = set(), set()
    for c in tools.eval_cases(150):
        for t in c.tools:
            eval_functions.add(t["function"]["name"])
            eval_ns.add(_words(t["function"]["name"])[0])
    canon = {w for f in tools.FAMILIES for w in _fam_words(f)}
    eval_ns -= canon  # (none of the 150 cases' namespaces is a canonical word)
    for conv in convs:
        text = chat_format.render_conversation(conv)
        assert not any(n in text for n in eval_functions)
        for t in conv.tools:
            fn = t["function"]
            words = _words(fn["name"])
            assert not set(words) & eval_ns, fn["name"]
            assert not any(tt._could_be_eval_namespace(w) for w in words if w not in canon), fn["name"]
            assert _family_of(fn).names[-1] not in _runs(words), fn["name"]
            for a, p in _slots(fn):
                pw = _words(p)
                assert not set(pw) & eval_ns, p
                if len(a.names) >= 3:
                    assert a.names[-1] not in _runs(pw), p


def test_calls_follow_the_descriptions_and_targets_are_fresh(convs):
    """Every call serves a request of its tool's family with the think line of v4; a tool is
    called again only when every listed tool has been called in the conversation."""
    calls = repeats = 0
    for conv in convs:
        schemas = {t["function"]["name"]: t["function"] for t in conv.tools}
        assert 1 <= len(schemas) == len(conv.tools) <= 5
        called: list[str] = []
        for prev, m in zip(conv.messages, conv.messages[1:]):
            for tc in m.get("tool_calls") or []:
                fn = schemas[tc["function"]["name"]]
                fam = _family_of(fn)
                assert all(str(v) in prev["content"] for v in tc["function"]["arguments"].values())
                if m.get("reasoning_content") is not None:
                    assert m["reasoning_content"] == tt.think_call(fam, fn["description"], fn["name"])
                if fn["name"] in called:
                    assert set(called) >= set(schemas)
                    repeats += 1
                called.append(fn["name"])
                calls += 1
    assert calls / N > 2.0 and repeats < 0.3 * calls


def test_v5_mix_goes_through_the_row_builder():
    """Toy-size data stage of recipe micro-v5 (its mix, tiny corpus and tokenizer, one worker);
    documents longer than a row are dropped instead of stalling the chat queue. (The probe's
    reply budget for v5's think line is test_tool_tasks_v4's: the same think_call.)"""
    from tools.train_tiny.recipe import RECIPES
    assert dict(RECIPES["micro-v5"].mix.task_share) == dict(RECIPES["full-v5"].mix.task_share)
    tok, mix, rows, stats, joined = toy_rows("micro-v5", 1024, 32)   # long conversations, tiny vocabulary
    assert rows.shape == (32, mix.seq_len + 2) and rows.max() < tok.get_vocab_size()
    assert stats["chat_docs"] > 32 and stats["chat_tokens"] > 0.3 * rows.size
    assert "<tool_call>" in joined and "<tools>" in joined
    assert re.search(r"<think>[a-z ]+: \"[^\"]+\" -> \w+</think>", joined)


def test_v5_keeps_v4_budget_and_trades_little():
    """Same shape, steps, rows and chat share as v4 (so the same tokens); tools keep v4's share,
    the lookup drill grows; facts unchanged, arithmetic and the needle's drills cut by <= 0.01."""
    from tools.train_tiny.recipe import RECIPES
    v4r, v5r = RECIPES["full-v4"], RECIPES["full-v5"]
    assert (v5r.steps, v5r.batch_rows, v5r.shape, v5r.seed) == (v4r.steps, v4r.batch_rows, v4r.shape, v4r.seed)
    assert (v5r.mix.seq_len, v5r.mix.chat_share, v5r.mix.needle_rows) == (v4r.mix.seq_len, v4r.mix.chat_share,
                                                                          v4r.mix.needle_rows)
    a, b = dict(v4r.mix.task_share), dict(v5r.mix.task_share)
    assert abs(sum(b.values()) - 1) < 1e-9
    assert b["tools_v5"] == a["tools_v4"] and b["lookup"] > a["lookup"] and b["facts"] == a["facts"]
    assert all(a[k] - b[k] <= 0.01 + 1e-9 for k in ("arithmetic", "recall", "repeat"))
