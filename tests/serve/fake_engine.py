"""FakeAsyncEngine: a TEST DOUBLE of contract 2 (moet.engine.async_engine.AsyncEngine) for the
server's unit tests. It never runs a model: each request's reply text comes from a script
(a function of the prompt text), is tokenized with the real moet-tiny tokenizer and handed
out one token per step (or `tokens_per_step`, as a real engine's output looks to a consumer
that fell behind: several tokens in one cumulative output), cumulatively, exactly as the
contract says. `moet serve` never uses it.
"""
from __future__ import annotations

import asyncio
import functools
import math
from dataclasses import dataclass, field
from typing import Callable

from moet.assets import default_model
from moet.errors import ConfigError
from moet.outputs import CompletionOutput, Logprob, RequestOutput
from moet.sampling_params import SamplingParams


@dataclass
class FakeStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    last_step_time_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


@functools.lru_cache(maxsize=1)
def _tokenizer():  # loading takes seconds on a small CPU box: once per test session
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(default_model())


class FakeAsyncEngine:
    def __init__(self, script: Callable[[str], str] | None = None, *, max_model_len: int = 512,
                 step_s: float = 0.0, tokenizer=None, tokens_per_step: int = 1):
        self.tokenizer = tokenizer or _tokenizer()
        self.model_name = "moet-tiny"
        self.max_model_len = max_model_len
        self.eos_token_ids = {self.tokenizer.convert_tokens_to_ids("<|end|>")}
        self.script = script or (lambda prompt: "Hello there, friend.")
        self.step_s = step_s
        self.tokens_per_step = tokens_per_step
        self.running: dict[str, int] = {}     # request id -> KV "blocks" held
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.params_seen: list[SamplingParams] = []
        self.prompts_seen: list[str] = []
        self._stats = FakeStats(extra={"expert_cache_hits": 7.0, "w2_rows": 128.0})
        self.shut_down = False

    def _logprobs(self, tid: int, k: int, step: int) -> dict[int, Logprob]:
        # deterministic, normalised-looking values: the sampled token has rank 1
        out = {tid: Logprob(-0.1 * (step % 3), 1, self.tokenizer.decode([tid]))}
        for r in range(1, k):
            other = (tid + r) % len(self.tokenizer)
            out[other] = Logprob(-1.0 - r, r + 1, self.tokenizer.decode([other]))
        return out

    async def generate(self, request_id: str, prompt, params: SamplingParams):
        ids = list(prompt) if isinstance(prompt, list) else self.tokenizer(prompt).input_ids
        if len(ids) >= self.max_model_len:
            raise ConfigError(f"prompt of {len(ids)} tokens does not fit max_model_len={self.max_model_len}")
        prompt_text = self.tokenizer.decode(ids, skip_special_tokens=False)
        self.params_seen.append(params)
        self.prompts_seen.append(prompt_text)
        reply = self.script(prompt_text)
        eos = min(self.eos_token_ids)
        budget = params.max_tokens or (self.max_model_len - len(ids))
        seqs = []
        for i in range(params.n):
            r = reply if params.n == 1 else f"{reply} #{i}"
            toks = self.tokenizer.encode(r, add_special_tokens=False)
            # ignore_eos: the model keeps talking (the reply again and again) until max_tokens
            toks = (toks * (budget // len(toks) + 1))[:budget] if params.ignore_eos else toks + [eos]
            seqs.append(toks)
        self.running[request_id] = max(1, math.ceil(len(ids) / 16))
        self._stats.num_running = len(self.running)
        self._stats.prompt_tokens_total += len(ids)
        try:
            limit = min(max(len(s) for s in seqs), budget)
            k = self.tokens_per_step
            for step in sorted(set(range(k, limit + 1, k)) | {limit}):
                if request_id in self.aborted:
                    return
                await asyncio.sleep(self.step_s)
                outs, done = [], True
                for i, toks in enumerate(seqs):
                    cut = toks[:min(step, budget)]
                    fin = None
                    if cut and cut[-1] == eos:
                        fin = "stop"
                    elif len(cut) >= budget:
                        fin = "length"
                    text = self.tokenizer.decode(cut, skip_special_tokens=params.skip_special_tokens)
                    for s in params.stop_list:
                        if s in text:
                            text, fin = text[: text.index(s)], "stop"
                    if fin is None:
                        done = False
                    lps = [self._logprobs(t, params.logprobs, j) for j, t in enumerate(cut)] \
                        if params.logprobs is not None else None
                    outs.append(CompletionOutput(i, text, cut, None, lps, fin, None))
                self._stats.generation_tokens_total += len(seqs)
                plps = [None] + [self._logprobs(t, params.prompt_logprobs, j) for j, t in enumerate(ids[1:])] \
                    if params.prompt_logprobs is not None else None
                yield RequestOutput(request_id, None, ids, plps, outs, finished=done)
                if done:
                    self.finished.append(request_id)
                    return
        finally:
            self.running.pop(request_id, None)
            self._stats.num_running = len(self.running)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.running.pop(request_id, None)   # "frees its KV blocks at once"
        self._stats.num_running = len(self.running)

    def stats(self) -> FakeStats:
        self._stats.kv_usage = sum(self.running.values()) / 100
        return self._stats

    async def shutdown(self) -> None:
        self.shut_down = True
