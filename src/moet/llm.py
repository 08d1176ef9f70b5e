"""The offline API, shaped like vLLM's:

    from moet import LLM, SamplingParams
    llm = LLM("/models/GLM-4.5-Air", expert_format="w2")
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    out[0].outputs[0].text

Every EngineConfig field is an LLM keyword. Internals are deliberately simple for now: one
sequence at a time with a contiguous KV cache (the engine issue replaces the loop with
continuous batching and a paged cache behind the same API).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from moet.checkpoint import open_checkpoint
from moet.config import EngineConfig
from moet.errors import ConfigError, MoetError
from moet.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from moet.sampling_params import SamplingParams

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={device} requested but no CUDA device is available; use --device cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, checkpoint_dtype: str, weight_format: str) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    if weight_format != "float":
        return torch.bfloat16
    return _DTYPES.get(checkpoint_dtype, torch.bfloat16)


class LLM:
    def __init__(self, model: str, **kwargs: Any):
        unknown = set(kwargs) - set(EngineConfig.field_names())
        if unknown:
            raise ConfigError(f"unknown LLM option(s) {', '.join(sorted(unknown))}; "
                              f"valid: {', '.join(EngineConfig.field_names()[1:])}")
        self.config = cfg = EngineConfig(model=model, **kwargs)
        self.checkpoint = ckpt = open_checkpoint(cfg.model)
        self.spec = ckpt.spec
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, ckpt.spec.torch_dtype, ckpt.weight_format)
        self.max_model_len = cfg.max_model_len or ckpt.spec.max_position_embeddings
        from moet.model import load_model

        self.model = load_model(ckpt, expert_format=cfg.expert_format, dtype=self.dtype, device=self.device,
                                zero_mode=cfg.w2_zero_mode, scale_rule=cfg.w2_scale_rule,
                                load_mtp=cfg.load_mtp, progress=True)
        self.tokenizer = self._load_tokenizer(cfg.tokenizer or cfg.model, cfg.trust_remote_code)
        gen = ckpt.reader.generation_config
        eos = gen.get("eos_token_id", None)
        eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set(ckpt.spec.eos_token_ids)
        self.eos_token_ids = {int(e) for e in eos_ids if e is not None}
        self._generator = torch.Generator(device="cpu").manual_seed(cfg.seed)
        self._next_id = 0

    @staticmethod
    def _load_tokenizer(path: str, trust_remote_code: bool):
        """None when the directory has no tokenizer files (token-id prompts still work)."""
        import os

        from transformers import AutoTokenizer

        if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
            return None
        try:
            return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except Exception as exc:  # transformers raises many types here
            raise MoetError(f"{path}: cannot load a tokenizer ({type(exc).__name__}: {exc}); "
                            "pass tokenizer=DIR, trust_remote_code=True for a tokenizer that ships its own code "
                           "(e.g. Kimi-K2), or prompt_token_ids prompts") from exc

    def get_tokenizer(self):
        return self.tokenizer

    # ------------------------------------------------------------------ public API

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        single = isinstance(prompts, (str, dict))
        prompts = [prompts] if single else list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ConfigError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        from tqdm import tqdm

        bar = tqdm(zip(prompts, params), total=len(prompts), desc="generating", unit="req",
                   disable=not use_tqdm or len(prompts) < 2, leave=False)
        return [self._generate_one(prompt, sp) for prompt, sp in bar]

    def chat(self, messages, sampling_params: SamplingParams | None = None, *, tools: list[dict] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """vLLM-style chat: one conversation (a list of {"role", "content"} dicts) or a list of
        conversations, rendered with the checkpoint's chat template (tools included)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"{self.config.tokenizer or self.config.model} has no chat template; use generate()")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in convs:
            text = self.tokenizer.apply_chat_template(conv, tools=tools, add_generation_prompt=True, tokenize=False)
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # ------------------------------------------------------------------ internals

    def _encode(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            prompt = prompt["prompt"]
        if self.tokenizer is None:
            raise ConfigError(f"{self.config.tokenizer or self.config.model} has no tokenizer files: pass "
                              "tokenizer=DIR or prompts as {'prompt_token_ids': [...]}")
        return prompt, list(self.tokenizer(prompt).input_ids)

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
    def _generate_one(self, prompt, sp: SamplingParams) -> RequestOutput:
        text_prompt, ids = self._encode(prompt)
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
        rid = str(self._next_id)
        self._next_id += 1
        completion = CompletionOutput(0, text, out_ids, cum, out_lps, finish, stop_reason)
        return RequestOutput(rid, text_prompt, ids, prompt_lps, [completion])
