"""The simple generation loop moet had before the engine: one sequence at a time, a contiguous
KV cache, the model's contiguous `hidden_states` / `forward` path. Kept unchanged in behaviour
as the oracle of the engine tests (greedy engine outputs must equal it token for token).

    ref = ReferenceLoop(llm.model, llm.tokenizer, llm.eos_token_ids, llm.max_model_len)
    out = ref.generate(prompt_token_ids, SamplingParams(temperature=0, max_tokens=8))

With `kv_format` (a quantized --kv-cache-dtype) the contiguous cache holds what a paged cache of
that format gives back for each written row, so a lossy cache is compared with its own
definition rather than with bf16.
"""
from __future__ import annotations

import math

import torch

from moet.errors import ConfigError
from moet.kernels.kv_cache import KVFormat, round_trip_gqa, round_trip_mla
from moet.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from moet.sampling_params import SamplingParams


class _FormatRows:
    """One contiguous cache tensor whose writes store `held(rows)`: the values a cache format
    gives back for them. Reads are the tensor's own."""

    def __init__(self, data: torch.Tensor, held):
        self.data, self.held = data, held

    def __setitem__(self, index, rows: torch.Tensor) -> None:
        self.data[index] = self.held(rows).to(self.data.dtype)

    def __getitem__(self, index) -> torch.Tensor:
        return self.data[index]


def _format_cache(cache: list[tuple[torch.Tensor, ...]], kind: str, fmt: KVFormat) -> list[tuple]:
    """A contiguous cache (model.new_cache) whose K / V (GQA) or latent / rope (MLA) writes go
    through `fmt`; an MLA indexer's keys (a third tensor) are not part of the KV format."""
    out = []
    for first, second, *rest in cache:
        if kind == "mla":
            held = (lambda x, p=second.shape[-1]: round_trip_mla(x, x.new_zeros(x.shape[0], p), fmt)[0],
                    lambda x, r=first.shape[-1]: round_trip_mla(x.new_zeros(x.shape[0], r), x, fmt)[1])
        else:
            held = (lambda x, dv=second.shape[-1]: round_trip_gqa(x, x.new_zeros(*x.shape[:-1], dv), fmt)[0],
                    lambda x, d=first.shape[-1]: round_trip_gqa(x.new_zeros(*x.shape[:-1], d), x, fmt)[1])
        out.append((_FormatRows(first, held[0]), _FormatRows(second, held[1]), *rest))
    return out


class ReferenceLoop:
    def __init__(self, model, tokenizer, eos_token_ids: set[int], max_model_len: int, seed: int = 0,
                 kv_format: KVFormat | None = None):
        if kv_format is not None and (kv_format.is_fp8 or kv_format.is_nvfp4) and model.spec.attention.kind == "v4":
            raise ConfigError("the reference loop holds no quantized DeepSeek-V4 cache (the engine refuses one too)")
        self.kv_format = kv_format if kv_format is not None and (kv_format.is_fp8 or kv_format.is_nvfp4) else None
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.device = next(model.parameters()).device
        self._generator = torch.Generator(device="cpu").manual_seed(seed)

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special) if self.tokenizer is not None else ""

    def _token_str(self, tid: int) -> str | None:
        return self.tokenizer.decode([tid]) if self.tokenizer is not None else None

    def _position_logprobs(self, logprobs_row: torch.Tensor, actual: int, k: int) -> PositionLogprobs:
        """vLLM semantics: the actual token (with its rank) plus the top-k."""
        out: PositionLogprobs = {}
        if k:
            vals, ids = torch.topk(logprobs_row, k)
            for r, (v, i) in enumerate(zip(vals.tolist(), ids.tolist())):
                out[i] = Logprob(v, r + 1, self._token_str(i))
        if actual not in out:
            lp = logprobs_row[actual]
            rank = int((logprobs_row > lp).sum()) + 1
            out = {actual: Logprob(float(lp), rank, self._token_str(actual)), **out}
        return out

    def _sample(self, logits: torch.Tensor, sp: SamplingParams, gen: torch.Generator) -> int:
        if sp.temperature == 0:
            return int(torch.argmax(logits))
        logits = logits.float() / sp.temperature
        if sp.top_k and sp.top_k > 0:
            kth = torch.topk(logits, min(sp.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, -math.inf)
        probs = torch.softmax(logits, dim=-1)
        if sp.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, dim=0) - sorted_p < sp.top_p
            mask = torch.zeros_like(probs, dtype=torch.bool).scatter_(0, order, keep)
            probs = torch.where(mask, probs, torch.zeros_like(probs))
            probs = probs / probs.sum()
        return int(torch.multinomial(probs.cpu(), 1, generator=gen))

    @torch.no_grad()
    def generate(self, ids: list[int], sp: SamplingParams, request_id: str = "0", prompt: str | None = None) -> RequestOutput:
        if not ids:
            raise ConfigError("empty prompt")
        if len(ids) >= self.max_model_len:
            raise ConfigError(f"prompt of {len(ids)} tokens does not fit max_model_len={self.max_model_len}; "
                              "raise --max-model-len or shorten the prompt")
        budget = self.max_model_len - len(ids)
        max_new = min(sp.max_tokens, budget) if sp.max_tokens is not None else budget
        gen = torch.Generator(device="cpu").manual_seed(sp.seed) if sp.seed is not None else self._generator
        model = self.model
        cache = model.new_cache(len(ids) + max_new, self.device)
        if self.kv_format is not None:
            cache = _format_cache(cache, model.spec.attention.kind, self.kv_format)
        x = torch.tensor(ids, dtype=torch.long, device=self.device)
        hidden = model.hidden_states(x, 0, cache)

        prompt_lps = None
        if sp.prompt_logprobs is not None:
            lp = model.logits(hidden[:-1]).float().log_softmax(-1).cpu()
            prompt_lps = [None] + [self._position_logprobs(lp[i], ids[i + 1], sp.prompt_logprobs)
                                   for i in range(len(ids) - 1)]
        logits = model.logits(hidden[-1:])[0].float()

        out_ids: list[int] = []
        out_lps: list[PositionLogprobs] | None = [] if sp.logprobs is not None else None
        cum = 0.0
        finish, stop_reason, text = "length", None, ""
        stop_ids = set(sp.stop_token_ids or [])
        blocked = sorted(stop_ids | (set() if sp.ignore_eos else self.eos_token_ids))
        while True:
            logprobs_row = logits.log_softmax(-1).cpu()
            if len(out_ids) < sp.min_tokens and blocked:  # as vLLM: no EOS / stop token before min_tokens
                logits = logits.index_fill(0, torch.tensor(blocked, device=logits.device), -math.inf)
            tok = self._sample(logits, sp, gen)
            cum += float(logprobs_row[tok])
            out_ids.append(tok)
            if out_lps is not None:
                out_lps.append(self._position_logprobs(logprobs_row, tok, sp.logprobs))
            n = len(out_ids)
            if (not sp.ignore_eos and tok in self.eos_token_ids) or tok in stop_ids:
                finish, stop_reason = "stop", (tok if tok in stop_ids else None)
                break
            if sp.stop_list:
                text = self._decode(out_ids, sp.skip_special_tokens)
                hit = min(((text.find(s), s) for s in sp.stop_list if s in text), default=None)
                if hit is not None and n >= sp.min_tokens:
                    pos, s = hit
                    text = text[: pos + len(s)] if sp.include_stop_str_in_output else text[:pos]
                    finish, stop_reason = "stop", s
                    break
            if n >= max_new:
                break
            logits = model(torch.tensor([tok], device=self.device), len(ids) + n - 1, cache)[0].float()
        if finish != "stop" or not isinstance(stop_reason, str):
            text = self._decode(out_ids, sp.skip_special_tokens)
        completion = CompletionOutput(0, text, out_ids, cum, out_lps, finish, stop_reason)
        return RequestOutput(request_id, prompt, ids, prompt_lps, [completion])
