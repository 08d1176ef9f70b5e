"""Helpers the tool-task tests share: identifier words and the family a tool schema belongs to."""
from __future__ import annotations

import re

from moet.probe import tools


def words(identifier: str) -> list[str]:
    """snake_case or camelCase -> lower-case words (digits stay a word)."""
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", identifier).lower().split("_")


def family_of(schema: dict) -> tools.Family:
    """The family whose descriptions include this function schema's description."""
    return next(f for f in tools.FAMILIES if schema["description"] in f.descs)


def toy_rows(recipe: str, vocab: int, n_rows: int):
    """The data stage of a micro recipe at toy size (tiny corpus and tokenizer, one worker):
    (tokenizer, mix, rows, stats, the rows decoded to one string)."""
    import random

    from moet.probe import chat_format
    from tools.train_tiny import data, tokenizer_build
    from tools.train_tiny.recipe import RECIPES
    mix = RECIPES[recipe].mix
    rng = random.Random(0)
    code = [f"def f{i}(x):\n    return x + {i}\n" * 20 for i in range(60)]
    text = ["Some prose about modules and packages. " * 30 for _ in range(10)]
    sample = code + text + [chat_format.render_conversation(data.CHAT_TASKS[k](rng))
                            for k, _ in mix.task_share for _ in range(30)]
    tok = tokenizer_build.train(sample, vocab)
    mix = type(mix)(**{**mix.__dict__, "fact_prose_docs": 20, "chunk": 20})
    rows, stats = data.build_rows(tokenizer=tok, code=code, text=text, n_rows=n_rows, mix=mix, seed=1, workers=1,
                                  log=lambda m: None)
    joined = "".join(tok.decode_batch(rows.astype(int).tolist(), skip_special_tokens=False))
    return tok, mix, rows, stats, joined
