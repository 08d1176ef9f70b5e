"""Task generators: training and evaluation splits are disjoint where the card says so."""
from __future__ import annotations

import random

from moet.probe import arithmetic, code_data, facts, tools


def test_enough_countries_and_disjoint_phrasings():
    assert len(facts.CAPITALS) >= 150
    assert len({c for c, _ in facts.CAPITALS}) == len(facts.CAPITALS)
    assert not set(facts.TRAIN_PHRASINGS) & set(facts.HELDOUT_PHRASINGS)
    heldout = {c.messages[0]["content"] for c in facts.eval_cases()}
    assert len(heldout) == len(facts.HELDOUT_PHRASINGS) * len(facts.CAPITALS)
    rng = random.Random(0)
    for _ in range(3000):
        assert facts.sample(rng).messages[0]["content"] not in heldout


def test_fact_grader():
    assert facts.is_correct("The capital of Djibouti is Djibouti.", "Djibouti", "Djibouti")
    assert not facts.is_correct("The capital of Djibouti is Paris.", "Djibouti", "Djibouti")
    assert facts.is_correct("The capital of Guatemala is Guatemala City.", "Guatemala City", "Guatemala")
    assert not facts.is_correct("The capital of Sao Tome and Principe is Lima.", "Sao Tome", "Sao Tome and Principe")
    assert facts.is_correct("The capital of the United States is Washington, D.C.", "Washington, D.C.", "the United States")


def test_arithmetic_scratchpad_is_right_and_eval_problems_are_never_trained():
    rng = random.Random(0)
    for _ in range(2000):
        op, a, b = rng.choice("+-"), rng.randint(10, 999), rng.randint(10, 999)
        think, r = arithmetic.solve(op, a, b)
        assert r == (a + b if op == "+" else a - b) and think.endswith(f"Result: {r}")
    evals = {c.messages[0]["content"] for c in arithmetic.eval_cases(200)}
    for _ in range(3000):
        conv = arithmetic.sample(rng)
        assert conv.messages[0]["content"] not in evals or not arithmetic._is_eval(
            *_parse(conv.messages[1]["content"]))
    assert arithmetic.is_correct("347 - 400 = -53", -53) and not arithmetic.is_correct("= 53", -53)


def _parse(answer: str):
    lhs = answer.split(" = ")[0].split(" ")
    return lhs[1], int(lhs[0]), int(lhs[2])


def test_tool_eval_names_never_appear_in_training():
    rng = random.Random(3)
    train_names, train_args = set(), set()
    for _ in range(3000):
        for t in tools.sample(rng).tools or []:
            train_names.add(t["function"]["name"])
            train_args |= set(t["function"]["parameters"]["properties"])
    for conv in tools.eval_cases(150):
        for t in conv.tools:
            assert t["function"]["name"] not in train_names
        if conv.meta["kind"] == "call":
            assert conv.meta["name"] in {t["function"]["name"] for t in conv.tools}


def test_heldout_code_is_not_in_training_split():
    held = code_data.stdlib_files(heldout=True)
    train = code_data.stdlib_files(heldout=False)
    assert held and train and not {r for r, _ in held} & {r for r, _ in train}
    assert all(code_data.is_heldout(r) for r, _ in held)
