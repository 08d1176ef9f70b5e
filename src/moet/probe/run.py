"""The probes behind moet-tiny's model card, run through a probe model: moet's engine
(moet.probe.engine.EngineModel, what `moet probe` runs) or transformers' forward
(moet.probe.loader.Loaded, the independent reference of the tests); both offer `generate`
(greedy completions) and `score` (teacher-forced logprobs, top-K, MTP).

  code      held-out stdlib code: loss / perplexity, next-token top-1, MTP next-next top-1; with
            a FormatComparison, also top-1 agreement and KL against the reference format's
            distributions on the same positions (moet.probe.distributions says how)
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
from typing import Protocol

from moet.probe import arithmetic, chat_format, code_data, facts, needle, tools
from moet.probe.distributions import TOP_K, CodeScores, FormatComparison, compare


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
class ProbeModel(Protocol):
    """What the probes need of a model: moet.probe.engine.EngineModel (moet's engine) and
    moet.probe.loader.Loaded (transformers) both provide it."""
    tokenizer: object
    experts: str                 # bf16 | nvfp4 | w2
    activations: str             # bf16 | e4m3
    device: object
    dtype: object
    backend: str                 # moet | transformers

    def generate(self, prompts: list[list[int]], max_new_tokens: int, batch: int, tick=...) -> list[str]: ...

    def score(self, seqs: list[list[int]], k: int, batch: int, tick=...) -> CodeScores: ...


def _prompt_ids(tok, conv: chat_format.Conversation) -> list[int]:
    return tok.encode(chat_format.render_conversation(conv, add_generation_prompt=True), add_special_tokens=False)


def _no_tick(n: int) -> None:
    pass


def greedy(m: ProbeModel, convs: list[chat_format.Conversation], max_new_tokens: int, batch: int,
           tick=_no_tick) -> list[str]:
    """Greedy completions of the rendered conversations (decoded, special tokens kept so the
    parser sees <|end|>); tick(k) after each group of k prompts."""
    return m.generate([_prompt_ids(m.tokenizer, c) for c in convs], max_new_tokens, batch, tick)


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


def code_scores(m: ProbeModel, budget: Budget, tick=_no_tick) -> tuple[dict, CodeScores | None]:
    """The code probe's numbers and the per-position scores behind them (None: no code)."""
    ids, n = _code_ids(m.tokenizer, budget)
    if n == 0:
        return {"tokens": 0}, None
    seqs = [ids[i * budget.code_seq:(i + 1) * budget.code_seq] for i in range(n)]
    sc = m.score(seqs, TOP_K, max(1, budget.batch // 4), tick)
    loss = -float(sc.lp.sum()) / len(sc.lp)
    return {"tokens": len(sc.lp), "loss": round(loss, 4), "ppl": round(math.exp(loss), 3),
            "top1": round(float(sc.top1.mean()), 4),
            "mtp_top1": None if sc.mtp_hits is None else round(sc.mtp_hits / sc.mtp_count, 4)}, sc


def code_probe(m: ProbeModel, budget: Budget, tick=_no_tick, comparison: FormatComparison | None = None) -> dict:
    """With `comparison`: the reference format stores its scores there, any other format adds
    its top-1 agreement and KL against them (moet.probe.distributions)."""
    out, sc = code_scores(m, budget, tick)
    if comparison is not None and sc is not None:
        if m.experts == comparison.reference:
            comparison.scores = sc
        elif comparison.scores is not None:
            out.update(compare(comparison.scores, sc, comparison.reference))
    return out


def facts_probe(m: ProbeModel, budget: Budget, tick=_no_tick) -> dict:
    cases = facts.eval_cases(budget.facts)
    outs = greedy(m, cases, 24, budget.batch, tick)
    ok = [facts.is_correct(chat_format.parse_reply(o).content, c.meta["expected"], c.meta["country"])
          for c, o in zip(cases, outs)]
    bad = [(c.messages[0]["content"], chat_format.parse_reply(o).content) for c, o, k in zip(cases, outs, ok) if not k]
    return {"n": len(cases), "accuracy": _rate(ok), "examples_wrong": bad[:5]}


def arithmetic_probe(m: ProbeModel, budget: Budget, tick=_no_tick) -> dict:
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


def check_needle_lengths(m: ProbeModel, budget: str | Budget) -> None:
    """A ConfigError when a needle prompt would be longer than the model serves (its max_context,
    where it has one): said before any probe runs, not after the others' minutes."""
    b = BUDGETS[budget] if isinstance(budget, str) else budget
    longest = getattr(m, "max_context", None)
    if longest is not None and max(b.needle_lengths) > longest:
        from moet.errors import ConfigError
        raise ConfigError(f"needle length {max(b.needle_lengths):,} tokens: longer than this model's context "
                          f"({longest:,} tokens); pick --needle-lengths within it, or a long-context checkpoint")


def needle_probe(m: ProbeModel, budget: Budget, tick=_no_tick) -> dict:
    check_needle_lengths(m, budget)
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


def tools_probe(m: ProbeModel, budget: Budget, tick=_no_tick) -> dict:
    cases = tools.eval_cases(budget.tools)
    outs = greedy(m, cases, 96, budget.batch, tick)
    scores = [tools.score(chat_format.parse_reply(o), c.meta) for c, o in zip(cases, outs)]
    kinds: dict[str, list[dict]] = {}
    for c, sc in zip(cases, scores):
        kinds.setdefault(c.meta["kind"], []).append(sc)
    calls = kinds.get("call", [])
    bad = [(c.meta, o[:200]) for c, o, sc in zip(cases, outs, scores) if not sc["correct"]]
    forced = constrained_calls(m, [c for c in cases if c.meta["kind"] == "call"], budget) \
        if getattr(m, "backend", None) == "moet" else {}
    return {"n": len(cases),
            "call_valid": _rate([s["valid"] for s in calls]),
            "call_right_function": _rate([s["name"] for s in calls]),
            "call_right_arguments": _rate([s["args"] for s in calls]),
            **forced,
            "declines_when_no_tool_fits": _rate([s["correct"] for s in kinds.get("none", [])]),
            "answers_from_result": _rate([s["correct"] for s in kinds.get("result", [])]),
            "overall": _rate([s["correct"] for s in scores]),
            "examples_wrong": bad[:4]}


def constrained_calls(m: ProbeModel, cases: list[chat_format.Conversation], budget: Budget) -> dict:
    """The call cases again as a server runs tool_choice "required": thinking off and the reply
    under the tool-call grammar (serve/structured.py; arguments follow the schemas), so every
    reply should parse; what is left to the model is the function and the values."""
    from dataclasses import replace

    from moet.serve.structured import tool_reply_constraint
    from moet.serve.tool_parsers import get_tool_parser

    if not cases:
        return {}
    convs = [replace(c, enable_thinking=False) for c in cases]
    parser = get_tool_parser("glm45")
    grammars = [tool_reply_constraint(parser(c.tools), c.tools, None, parallel=False) for c in convs]
    outs = m.generate([_prompt_ids(m.tokenizer, c) for c in convs], 96, budget.batch, structured=grammars)
    scores = [tools.score(chat_format.parse_reply(o), c.meta) for c, o in zip(convs, outs)]
    return {"constrained_call_valid": _rate([s["valid"] for s in scores]),
            "constrained_call_right_function": _rate([s["name"] for s in scores]),
            "constrained_call_right_arguments": _rate([s["args"] for s in scores])}


PROBES = {"code": code_probe, "facts": facts_probe, "arithmetic": arithmetic_probe,
          "needle": needle_probe, "tools": tools_probe}

# Tasks (what a probe's tick counts) per probe: code sequences, else prompts.
TASKS = {"code": lambda tok, b: _code_ids(tok, b)[1],
         "facts": lambda tok, b: len(facts.eval_cases(b.facts)),
         "arithmetic": lambda tok, b: len(arithmetic.eval_cases(b.arithmetic)),
         "needle": lambda tok, b: len(b.needle_lengths) * len(b.needle_depths) * b.needle_trials,
         "tools": lambda tok, b: len(tools.eval_cases(b.tools))}


def _gate_snapshot(m: ProbeModel) -> dict | None:
    snap = getattr(m, "gate_snapshot", None)
    return snap() if snap is not None else None


def gate_rates(before: dict, after: dict) -> dict:
    """The confidence gate over one probe: the share of sampled steps that fired and the FP4 token
    rows recomputed per generated token (both 0 for teacher-forced scoring, which samples nothing
    the gate sees: prompt rows are prefill)."""
    d = {k: after[k] - before[k] for k in before}
    return {"gate_fire_rate": round(d["fires"] / d["rows_checked"], 4) if d["rows_checked"] else 0.0,
            "gate_rows_per_token": round(d["recomputed_rows"] / d["generated_tokens"], 3)
            if d["generated_tokens"] else 0.0}


def _spec_snapshot(m: ProbeModel) -> dict | None:
    snap = getattr(m, "spec_snapshot", None)
    return snap() if snap is not None else None


def spec_rates(before: dict, after: dict) -> dict:
    """MTP speculative decoding over one probe: tokens per verifying step of a sequence (kept
    drafts + its own token) and the share of drafts kept."""
    d = {k: after[k] - before[k] for k in before}
    if not d["seq_steps"]:
        return {}
    return {"mtp_tokens_per_step": round(d["emitted"] / d["seq_steps"], 3),
            "mtp_acceptance": round(d["accepted"] / d["drafts"], 4) if d["drafts"] else 0.0}


def count_tasks(tokenizer, budget: str | Budget = "full", only: tuple[str, ...] | None = None) -> int:
    """How many tasks run_all's probes tick off for one model (the total of a progress bar)."""
    b = BUDGETS[budget] if isinstance(budget, str) else budget
    return sum(TASKS[name](tokenizer, b) for name in PROBES if not only or name in only)


def run_all(m: ProbeModel, budget: str | Budget = "full", only: tuple[str, ...] | None = None, log=None,
            should_stop=None, progress=None, comparison: FormatComparison | None = None) -> dict:
    """`should_stop()` (optional) is asked before each probe; a True skips the rest. `progress`
    (optional, a tqdm bar): advanced by one per task, its postfix the running probe.
    `comparison` (optional): handed to the code probe (code_probe says what it does)."""
    b = BUDGETS[budget] if isinstance(budget, str) else budget
    out = {"experts": m.experts, "expert_activations": m.activations, "backend": m.backend, "device": str(m.device),
           "dtype": str(m.dtype).replace("torch.", ""), "budget": budget if isinstance(budget, str) else asdict(b)}
    for name, fn in PROBES.items():
        if only and name not in only:
            continue
        if should_stop is not None and should_stop():
            out[name] = {"skipped": "time budget"}
            continue
        t = time.time()
        if progress is not None:
            progress.set_postfix_str(name)
        tick = _no_tick if progress is None else progress.update
        before, spec_before = _gate_snapshot(m), _spec_snapshot(m)
        out[name] = fn(m, b, tick, comparison) if name == "code" else fn(m, b, tick)
        out[name]["seconds"] = round(time.time() - t, 1)
        if before is not None:
            out[name].update(gate_rates(before, _gate_snapshot(m)))
        if spec_before is not None:
            out[name].update(spec_rates(spec_before, _spec_snapshot(m)))
        if log:
            log({"probe": name, "experts": m.experts, "expert_activations": m.activations, "backend": m.backend,
                 **{k: v for k, v in out[name].items() if not k.startswith(("examples", "by_length_depth"))}})
    return out
