"""Training rows: packed token sequences of length seq_len + 2 (the extra two give the main
head's next token and the MTP head's next-next token for the last position).

Row layout: a needle row starts with one needle-retrieval conversation (at most one per row,
so a question never sees a second, unrelated secret earlier in the row); every row then gets
chat documents (facts, arithmetic, tool use) up to its chat quota and is completed with the
splittable stream of code/prose files. Segments after the needle are placed in a random
order, so chat documents are seen both at row start (as at inference) and after unrelated
context. Documents are not masked from each other (plain causal attention, flash-eligible).

Generation and tokenization run in a fork pool; every work item has its own seed, so the
result does not depend on the number of workers.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import random
import zlib
from dataclasses import dataclass

import numpy as np

import functools

from moet.probe import arithmetic, chat_format, facts, needle, tools
from tools.train_tiny import copy_tasks, tool_tasks, tool_tasks_v4

# Every task a Mix may name; a Mix uses those in its task_share (recipe `full` = the first three,
# `full-v2` adds tools_ns / repeat / recall, `full-v3` tools_v3 / lookup, `full-v4` tools_v4,
# `full-v5` tools_v5).
CHAT_TASKS = {"tools": tools.sample, "arithmetic": arithmetic.sample, "facts": facts.sample,
              "tools_ns": functools.partial(tools.sample, namespace_p=0.9),
              "repeat": copy_tasks.repeat_sample, "recall": copy_tasks.recall_sample,
              "tools_v3": tool_tasks.sample, "lookup": copy_tasks.lookup_sample,
              "tools_v4": tool_tasks_v4.sample, "tools_v5": tool_tasks_v4.sample_v5}


@dataclass(frozen=True)
class Mix:
    seq_len: int = 4096
    needle_rows: float = 0.30          # share of rows that start with a needle conversation
    needle_max_chars: int = 12_500     # ~3.9K tokens of code: needles reach the full context
    chat_share: float = 0.30           # share of each row's remaining space for chat documents
    task_share: tuple[tuple[str, float], ...] = (("tools", 0.48), ("arithmetic", 0.37), ("facts", 0.15))
    fact_prose_docs: int = 20_000      # facts as sentences, mixed into the prose stream
    chunk: int = 400                   # documents per work item


# --- worker side ---------------------------------------------------------------------------------
_W: dict = {}


def _init_worker(tokenizer_json: str, filler: list[str]) -> None:
    from tokenizers import Tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _W["tok"] = Tokenizer.from_str(tokenizer_json)
    _W["filler"] = filler


def _filler(rng: random.Random, n_chars: int) -> list[str]:
    """About n_chars of real text as lines, from a random place in random corpus files."""
    out, total, docs = [], 0, _W["filler"]
    while total < n_chars:
        lines = docs[rng.randrange(len(docs))].split("\n")
        i = rng.randrange(len(lines))
        for line in lines[i:]:
            if total >= n_chars:
                break
            out.append(line)
            total += len(line) + 1
    return out


def _encode(texts: list[str], add_bos_eos: bool) -> list[np.ndarray]:
    tok = _W["tok"]
    enc = tok.encode_batch(texts, add_special_tokens=add_bos_eos)
    eos = [tok.token_to_id(chat_format.EOS)] if add_bos_eos else []
    return [np.asarray(e.ids + eos, dtype=np.uint16) for e in enc]


def _work(item: tuple) -> tuple[str, list[np.ndarray]]:
    kind, seed, arg = item
    rng = random.Random(seed)
    if kind == "plain":  # arg: (start, end) into the inherited corpus list (code + prose)
        return kind, _encode(_W["filler"][arg[0]:arg[1]], True)
    if kind == "needle":
        convs = [needle.sample(rng, _filler, arg[1]) for _ in range(arg[0])]
    elif kind == "prose":
        return kind, _encode([facts.prose(rng) for _ in range(arg)], True)
    else:
        convs = [CHAT_TASKS[kind](rng) for _ in range(arg)]
    return kind, _encode([chat_format.render_conversation(c) for c in convs], False)


# --- parent side ---------------------------------------------------------------------------------
def estimate_tokens_per_doc(tokenizer, names, n: int = 300, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    out = {}
    for name in names:
        fn = CHAT_TASKS[name]
        texts = [chat_format.render_conversation(fn(rng)) for _ in range(n)]
        out[name] = float(np.mean([len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]))
    return out


def _chunks(seq: list, size: int) -> list[list]:
    return [seq[i:i + size] for i in range(0, len(seq), size)]


def _seed(*parts) -> int:
    # str hashes are salted per process; CRC32 is the same everywhere.
    return zlib.crc32(":".join(map(str, parts)).encode())


def build_rows(*, tokenizer, code: list[str], text: list[str], n_rows: int, mix: Mix, seed: int,
               workers: int, log=print) -> tuple[np.ndarray, dict]:
    """-> (rows uint16 [n_rows, seq_len + 2], stats)."""
    width = mix.seq_len + 2
    per_doc = estimate_tokens_per_doc(tokenizer, [k for k, _ in mix.task_share], seed=seed)
    n_needle = int(round(n_rows * mix.needle_rows))
    # Chat budget: about chat_share of the space left after needles (needles average ~45% of a row).
    chat_tokens = mix.chat_share * width * (n_rows - 0.45 * n_needle)
    n_chat = {k: int(chat_tokens * share / per_doc[k] * 1.15) + 1 for k, share in mix.task_share}
    items: list[tuple] = []
    for k, n in n_chat.items():
        items += [(k, _seed(seed, k, i), len(c)) for i, c in enumerate(_chunks([0] * n, mix.chunk))]
    needle_chunk = 50
    items += [("needle", _seed(seed, "needle", i), (len(c), mix.needle_max_chars))
              for i, c in enumerate(_chunks([0] * n_needle, needle_chunk))]
    items += [("prose", _seed(seed, "prose", i), len(c))
              for i, c in enumerate(_chunks([0] * mix.fact_prose_docs, 1000))]
    corpus = code + text
    items += [("plain", 0, (i, min(i + 64, len(corpus)))) for i in range(0, len(corpus), 64)]
    log(f"data: {n_rows} rows x {width}; chat docs {n_chat}; needle docs {n_needle}; "
        f"tokens/doc {({k: round(v) for k, v in per_doc.items()})}")
    ctx = mp.get_context("fork")
    results: dict[str, list[np.ndarray]] = {}
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer.to_str(), corpus)) as pool:
        for kind, arrs in pool.imap(_work, items, chunksize=1):
            results.setdefault(kind, []).extend(arrs)
    return _assemble(results, n_rows, n_needle, mix, seed, log)


def _assemble(res: dict[str, list[np.ndarray]], n_rows: int, n_needle: int, mix: Mix, seed: int, log
              ) -> tuple[np.ndarray, dict]:
    width = mix.seq_len + 2
    rng = np.random.default_rng(seed)
    chat = [a for k, _ in mix.task_share for a in res.get(k, [])]
    # A document longer than a row would never fit and stall the chat queue for every later row
    # (no full recipe has one: the longest, tools_v5, is ~1.3K tokens; micro's 1K rows do).
    dropped_chat = len(chat)
    chat = [a for a in chat if len(a) <= width]
    dropped_chat -= len(chat)
    chat = [chat[i] for i in rng.permutation(len(chat))]
    needles = [a for a in res.get("needle", []) if len(a) <= width]
    dropped_needles = len(res.get("needle", [])) - len(needles)
    plain = res["plain"] + res.get("prose", [])
    plain = [plain[i] for i in rng.permutation(len(plain))]
    stream = np.concatenate(plain)
    rows = np.empty((n_rows, width), dtype=np.uint16)
    needle_rows = set(rng.choice(n_rows, size=min(n_needle, len(needles)), replace=False).tolist())
    ci = ni = si = 0
    counts = {"chat_tokens": 0, "needle_tokens": 0, "plain_tokens": 0, "chat_docs": 0, "needle_docs": 0}

    def take_stream(n: int) -> np.ndarray:
        nonlocal si
        if si + n > len(stream):
            si = 0  # another epoch over code/prose
        out = stream[si:si + n]
        si += n
        return out

    for r in range(n_rows):
        segs, space = [], width
        if r in needle_rows:
            nd = needles[ni % len(needles)]
            ni += 1
            counts["needle_tokens"] += len(nd)
            counts["needle_docs"] += 1
            space -= len(nd)
            head = nd
        else:
            head = None
        budget = int(mix.chat_share * space)
        used = 0
        while used < budget:
            d = chat[ci % len(chat)]
            if used + len(d) > space:
                break
            ci += 1
            segs.append(d)
            used += len(d)
        counts["chat_tokens"] += used
        counts["chat_docs"] += len(segs)
        rest = space - used
        cut = int(rng.integers(0, rest + 1))
        segs += [take_stream(cut), take_stream(rest - cut)]
        counts["plain_tokens"] += rest
        order = rng.permutation(len(segs))
        parts = ([head] if head is not None else []) + [segs[i] for i in order]
        rows[r] = np.concatenate(parts)
    stats = dict(counts, rows=n_rows, width=width, chat_pool=len(chat), chat_reused=max(0, ci - len(chat)),
                 needle_pool=len(needles), needles_dropped_too_long=dropped_needles,
                 chat_dropped_too_long=dropped_chat,
                 plain_stream_tokens=int(len(stream)), plain_epochs=round(counts["plain_tokens"] / max(1, len(stream)), 3))
    log(f"data: assembled {stats}")
    return rows, stats
