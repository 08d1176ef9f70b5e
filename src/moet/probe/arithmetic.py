"""Short arithmetic: 2-3 digit addition and subtraction.

With thinking on, the answer is worked digit by digit in the <think> block (ones, tens,
hundreds, with the carry or borrow written out): a model this small cannot carry in its head
when it writes the most significant digit first, but each scratchpad line is a local step it
can learn. The tokenizer splits digits one per token, which makes those steps copyable.
With thinking off the model answers directly (trained on a minority of examples).
"""
from __future__ import annotations

import random
import re
import zlib

from moet.probe.chat_format import Conversation

_PLACES = ["ones", "tens", "hundreds", "thousands"]
_ADD_Q = ["What is {a} + {b}?", "Compute {a} + {b}.", "Add {a} and {b}.", "{a} + {b} = ?",
          "What is the sum of {a} and {b}?", "Calculate {a} plus {b}."]
_SUB_Q = ["What is {a} - {b}?", "Compute {a} - {b}.", "Subtract {b} from {a}.", "{a} - {b} = ?",
          "What is {a} minus {b}?", "Calculate {a} minus {b}."]


def _is_eval(op: str, a: int, b: int) -> bool:
    # 1 in 16 problems is reserved for evaluation (never trained on).
    return zlib.crc32(f"{op}{a},{b}".encode()) % 16 == 0


def _digits(n: int, width: int) -> list[int]:
    return [(n // 10 ** i) % 10 for i in range(width)]  # least significant first


def _add_steps(a: int, b: int) -> str:
    width = max(len(str(a)), len(str(b)))
    da, db, carry, lines = _digits(a, width), _digits(b, width), 0, []
    for i in range(width):
        s = da[i] + db[i] + carry
        expr = f"{da[i]} + {db[i]}" + (f" + {carry}" if carry else "")
        lines.append(f"{_PLACES[i]}: {expr} = {s}, write {s % 10}" + (", carry 1" if s >= 10 else ""))
        carry = s // 10
    if carry:
        lines.append(f"{_PLACES[width]}: write 1")
    return "\n".join(lines)


def _sub_steps(a: int, b: int) -> str:
    """a >= b."""
    width = len(str(a))
    da, db, borrow, lines = _digits(a, width), _digits(b, width), 0, []
    for i in range(width):
        top = da[i] - borrow
        expr = f"{da[i]} - {db[i]}" + (f" - {borrow}" if borrow else "")
        if top < db[i]:
            lines.append(f"{_PLACES[i]}: {expr}, borrow: {top + 10} - {db[i]} = {top + 10 - db[i]}, "
                         f"write {top + 10 - db[i]}, borrow 1")
            borrow = 1
        else:
            lines.append(f"{_PLACES[i]}: {expr} = {top - db[i]}, write {top - db[i]}")
            borrow = 0
    return "\n".join(lines)


def solve(op: str, a: int, b: int) -> tuple[str, int]:
    """-> (scratchpad for the think block, result)."""
    if op == "+":
        r = a + b
        return f"Add {a} and {b} digit by digit from the right.\n{_add_steps(a, b)}\nResult: {r}", r
    r = a - b
    if a >= b:
        return f"Subtract {b} from {a} digit by digit from the right.\n{_sub_steps(a, b)}\nResult: {r}", r
    return (f"{b} is larger than {a}, so compute {b} - {a} and make it negative.\n"
            f"{_sub_steps(b, a)}\nResult: {r}"), r


def _operands(rng: random.Random) -> tuple[str, int, int]:
    op = rng.choice("+-")
    a = rng.randint(10, 999) if rng.random() < 0.7 else rng.randint(10, 99)
    b = rng.randint(10, 999) if rng.random() < 0.7 else rng.randint(10, 99)
    return op, a, b


def _question(rng: random.Random, op: str, a: int, b: int) -> str:
    return rng.choice(_ADD_Q if op == "+" else _SUB_Q).format(a=a, b=b)


def sample(rng: random.Random) -> Conversation:
    while True:
        op, a, b = _operands(rng)
        if not _is_eval(op, a, b):
            break
    think, r = solve(op, a, b)
    answer = f"{a} {op} {b} = {r}"
    enable_thinking = rng.random() < 0.85
    msg = {"role": "assistant", "content": answer}
    if enable_thinking:
        msg["reasoning_content"] = think
    return Conversation([{"role": "user", "content": _question(rng, op, a, b)}, msg],
                        enable_thinking=enable_thinking, meta={"expected": r})


def eval_cases(n: int = 200, seed: int = 1234) -> list[Conversation]:
    rng, cases = random.Random(seed), []
    while len(cases) < n:
        op, a, b = _operands(rng)
        if _is_eval(op, a, b):
            cases.append(Conversation([{"role": "user", "content": _question(rng, op, a, b)}],
                                      meta={"expected": a + b if op == "+" else a - b}))
    return cases


_NUM = re.compile(r"-?\d+")


def is_correct(answer_text: str, expected: int) -> bool:
    """The last integer of the visible answer (after </think>) must equal the result."""
    nums = _NUM.findall(answer_text.replace(",", ""))
    return bool(nums) and int(nums[-1]) == expected
