"""The probes behind moet-tiny's model card, run through transformers' forward:

  code      held-out stdlib code: loss / perplexity, next-token top-1, MTP next-next top-1
  facts     capitals, held-out phrasings, greedy, exact capital in the answer
  arithmetic  2-3 digit add/sub (thinking on), final number exact
  needle    pass rate by context length (prompt tokens) and depth
  tools     held-out tool names: valid markup, right function, right arguments; declining
            when no tool fits; answering from a tool result

All greedy and deterministic for a given device/dtype. Progress: `run_all(progress=bar)` advances
a tqdm-like bar (update(n), set_postfix_str(s)) by one per prompt / code sequence done, out of
`count_tasks` per model.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from moet.probe import arithmetic, chat_format, code_data, facts, needle, tools
from moet.probe.loader import Loaded


@dataclass(frozen=True)
class Budget:
    facts: int | None            # None = every country x every held-out phrasing
    arithmetic: int
    tools: int
    needle_lengths: tuple[int, ...]
    needle_depths: tuple[float, ...]
    needle_trials: int
    code_tokens: int
    code_seq: int
    batch: int


BUDGETS = {
    "full": Budget(None, 200, 150, (256, 512, 1024, 2048, 3072, 4000), (0.1, 0.3, 0.5, 0.7, 0.9), 4,
                   200_000, 1024, 64),
    "quick": Budget(40, 20, 20, (256, 1024), (0.2, 0.8), 1, 20_000, 512, 16),
    "tiny": Budget(12, 6, 5, (160,), (0.5,), 2, 2_000, 256, 8),
}


# --- helpers ------------------------------------------------------------------------------------------
def _prompt_ids(tok, conv: chat_format.Conversation) -> list[int]:
    return tok.encode(chat_format.render_conversation(conv, add_generation_prompt=True), add_special_tokens=False)


def _no_tick(n: int) -> None:
    pass


@torch.no_grad()
def greedy(m: Loaded, convs: list[chat_format.Conversation], max_new_tokens: int, batch: int,
           tick=_no_tick) -> list[str]:
    """Greedy completions (decoded, special tokens kept so the parser sees <|end|>); tick(k) after
    each batch of k prompts."""
    tok, dev = m.tokenizer, m.device
    prompts = [_prompt_ids(tok, c) for c in convs]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # little padding per batch
    out: list[str] = [""] * len(prompts)
    for b in range(0, len(order), batch):
        idx = order[b:b + batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for j, i in enumerate(idx):
            ids[j, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[j, width - len(prompts[i]):] = 1
        gen = m.model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_new_tokens,
                               do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        for j, i in enumerate(idx):
            out[i] = tok.decode(gen[j, width:].tolist(), skip_special_tokens=False).replace(tok.pad_token, "")
        tick(len(idx))
    return out


def _rate(xs: list[bool]) -> float:
    return round(sum(xs) / len(xs), 4) if xs else float("nan")


# --- probes ------------------------------------------------------------------------------------------------
def _code_ids(tok, budget: Budget) -> tuple[list[int], int]:
    """The held-out code's token ids and how many code_seq-token sequences the probe scores."""
    ids: list[int] = []
    for _, text in code_data.heldout_texts():
        ids += tok.encode(text, add_special_tokens=True) + [tok.eos_token_id]
        if len(ids) >= budget.code_tokens + budget.code_seq:
            break
    return ids, min(len(ids), budget.code_tokens) // budget.code_seq


@torch.no_grad()
def code_probe(m: Loaded, budget: Budget, tick=_no_tick) -> dict:
    dev = m.device
    ids, n = _code_ids(m.tokenizer, budget)
    if n == 0:
        return {"tokens": 0}
    x = torch.tensor(ids[: n * budget.code_seq]).view(n, budget.code_seq)
    nll = top1 = mtp_top1 = count = mtp_count = 0.0
    for b in range(0, n, max(1, budget.batch // 4)):
        xb = x[b:b + max(1, budget.batch // 4)].to(dev)
        h = m.model.model(xb).last_hidden_state
        logits = m.model.lm_head(h)[:, :-1].float()
        tgt = xb[:, 1:]
        nll += float(F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="sum"))
        top1 += float((logits.argmax(-1) == tgt).sum())
        count += tgt.numel()
        mtp_logits = m.mtp(m.model, xb, h)[:, :-1]  # position t predicts t+2
        mtp_top1 += float((mtp_logits.argmax(-1) == xb[:, 2:]).sum())
        mtp_count += xb[:, 2:].numel()
        tick(xb.shape[0])
    loss = nll / count
    return {"tokens": int(count), "loss": round(loss, 4), "ppl": round(math.exp(loss), 3),
            "top1": round(top1 / count, 4), "mtp_top1": round(mtp_top1 / mtp_count, 4)}


def facts_probe(m: Loaded, budget: Budget, tick=_no_tick) -> dict:
    cases = facts.eval_cases(budget.facts)
    outs = greedy(m, cases, 24, budget.batch, tick)
    ok = [facts.is_correct(chat_format.parse_reply(o).content, c.meta["expected"], c.meta["country"])
          for c, o in zip(cases, outs)]
    bad = [(c.messages[0]["content"], chat_format.parse_reply(o).content) for c, o, k in zip(cases, outs, ok) if not k]
    return {"n": len(cases), "accuracy": _rate(ok), "examples_wrong": bad[:5]}


def arithmetic_probe(m: Loaded, budget: Budget, tick=_no_tick) -> dict:
    cases = arithmetic.eval_cases(budget.arithmetic)
    outs = greedy(m, cases, 128, budget.batch, tick)
    ok = [arithmetic.is_correct(chat_format.parse_reply(o).content, c.meta["expected"]) for c, o in zip(cases, outs)]
    bad = [(c.messages[0]["content"], chat_format.parse_reply(o).content) for c, o, k in zip(cases, outs, ok) if not k]
    return {"n": len(cases), "accuracy": _rate(ok), "examples_wrong": bad[:5]}


def _needle_lines() -> list[str]:
    lines: list[str] = []
    for _, text in code_data.heldout_texts():
        lines += text.split("\n")
    return lines


def needle_cases(tok, budget: Budget) -> list[chat_format.Conversation]:
    """Prompts whose rendered length (generation prompt included) is at most the target."""
    import random
    lines, cases = _needle_lines(), []
    for li, length in enumerate(budget.needle_lengths):
        for di, depth in enumerate(budget.needle_depths):
            for trial in range(budget.needle_trials):
                rng = random.Random(f"needle:{length}:{depth}:{trial}")
                start = rng.randrange(len(lines))
                src = lines[start:] + lines[:start]
                lo, hi = 1, min(len(src), length)  # >= 1 token per line
                while lo < hi:  # the most lines that fit
                    mid = (lo + hi + 1) // 2
                    conv = needle.eval_case(random.Random(trial), src[:mid], depth)
                    if len(_prompt_ids(tok, conv)) + 16 <= length:
                        lo = mid
                    else:
                        hi = mid - 1
                conv = needle.eval_case(random.Random(f"{trial}:{li}:{di}"), src[:lo], depth)
                conv.meta.update(length=length)
                cases.append(conv)
    return cases


def needle_probe(m: Loaded, budget: Budget, tick=_no_tick) -> dict:
    cases = needle_cases(m.tokenizer, budget)
    outs = []
    for length in budget.needle_lengths:  # batch by length: long prompts need small batches
        sub = [c for c in cases if c.meta["length"] == length]
        bs = max(1, budget.batch * 512 // max(512, length))
        outs += greedy(m, sub, 24, bs, tick)
    table: dict[str, dict[str, float]] = {}
    ok_all = []
    for c, o in zip(cases, outs):
        ok = needle.is_correct(chat_format.parse_reply(o).content, c.meta["expected"])
        ok_all.append(ok)
        table.setdefault(str(c.meta["length"]), {}).setdefault(str(c.meta["depth"]), []).append(ok)
    by_len = {L: _rate([x for v in d.values() for x in v]) for L, d in table.items()}
    grid = {L: {D: _rate(v) for D, v in d.items()} for L, d in table.items()}
    upto2k = [ok for c, ok in zip(cases, ok_all) if c.meta["length"] <= 2048]
    return {"n": len(cases), "pass_rate": _rate(ok_all), "pass_rate_upto_2048": _rate(upto2k),
            "by_length": by_len, "by_length_depth": grid}


def tools_probe(m: Loaded, budget: Budget, tick=_no_tick) -> dict:
    cases = tools.eval_cases(budget.tools)
    outs = greedy(m, cases, 96, budget.batch, tick)
    scores = [tools.score(chat_format.parse_reply(o), c.meta) for c, o in zip(cases, outs)]
    kinds: dict[str, list[dict]] = {}
    for c, sc in zip(cases, scores):
        kinds.setdefault(c.meta["kind"], []).append(sc)
    calls = kinds.get("call", [])
    bad = [(c.meta, o[:200]) for c, o, sc in zip(cases, outs, scores) if not sc["correct"]]
    return {"n": len(cases),
            "call_valid": _rate([s["valid"] for s in calls]),
            "call_right_function": _rate([s["name"] for s in calls]),
            "call_right_arguments": _rate([s["args"] for s in calls]),
            "declines_when_no_tool_fits": _rate([s["correct"] for s in kinds.get("none", [])]),
            "answers_from_result": _rate([s["correct"] for s in kinds.get("result", [])]),
            "overall": _rate([s["correct"] for s in scores]),
            "examples_wrong": bad[:4]}


PROBES = {"code": code_probe, "facts": facts_probe, "arithmetic": arithmetic_probe,
          "needle": needle_probe, "tools": tools_probe}

# Tasks (what a probe's tick counts) per probe: code sequences, else prompts.
TASKS = {"code": lambda tok, b: _code_ids(tok, b)[1],
         "facts": lambda tok, b: len(facts.eval_cases(b.facts)),
         "arithmetic": lambda tok, b: len(arithmetic.eval_cases(b.arithmetic)),
         "needle": lambda tok, b: len(b.needle_lengths) * len(b.needle_depths) * b.needle_trials,
         "tools": lambda tok, b: len(tools.eval_cases(b.tools))}


def count_tasks(tokenizer, budget: str | Budget = "full", only: tuple[str, ...] | None = None) -> int:
    """How many tasks run_all's probes tick off for one model (the total of a progress bar)."""
    b = BUDGETS[budget] if isinstance(budget, str) else budget
    return sum(TASKS[name](tokenizer, b) for name in PROBES if not only or name in only)


def run_all(m: Loaded, budget: str | Budget = "full", only: tuple[str, ...] | None = None, log=None,
            should_stop=None, progress=None) -> dict:
    """`should_stop()` (optional) is asked before each probe; a True skips the rest. `progress`
    (optional, a tqdm bar): advanced by one per task, its postfix the running probe."""
    b = BUDGETS[budget] if isinstance(budget, str) else budget
    out = {"experts": m.experts, "expert_activations": m.activations, "device": str(m.device), "dtype": str(m.dtype).replace("torch.", ""),
           "budget": budget if isinstance(budget, str) else asdict(b)}
    for name, fn in PROBES.items():
        if only and name not in only:
            continue
        if should_stop is not None and should_stop():
            out[name] = {"skipped": "time budget"}
            continue
        t = time.time()
        if progress is not None:
            progress.set_postfix_str(name)
        out[name] = fn(m, b) if progress is None else fn(m, b, progress.update)
        out[name]["seconds"] = round(time.time() - t, 1)
        if log:
            log({"probe": name, "experts": m.experts, "expert_activations": m.activations, **{k: v for k, v in out[name].items()
                                                         if not k.startswith(("examples", "by_length_depth"))}})
    return out
