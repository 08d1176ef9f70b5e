"""One engine run of a few prompts, as the family tests compare them: build an LLMEngine from
EngineConfig fields, generate every prompt, close it, and hand back what the comparisons read."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineRun:
    tokens: list[list[int]]                       # per prompt, in order
    logprobs: list[list[dict[int, float]]]        # per prompt, per generated token (when asked for)
    stats: dict                                   # EngineStats.extra
    gate_counters: object | None                  # the FP4 gate's counters, when it ran


def run_engine(prompts: list[list[int]], sampling, **config) -> EngineRun:
    from moet.config import EngineConfig
    from moet.engine.llm_engine import LLMEngine

    eng = LLMEngine.from_config(EngineConfig(**config))
    try:
        out = eng.generate_all([(str(i), p, sampling) for i, p in enumerate(prompts)])
        outs = [out[str(i)].outputs[0] for i in range(len(prompts))]
        return EngineRun([o.token_ids for o in outs],
                         [[{t: lp.logprob for t, lp in d.items()} for d in (o.logprobs or [])] for o in outs],
                         eng.stats().extra, eng.gate.counters if eng.gate is not None else None)
    finally:
        eng.close()
