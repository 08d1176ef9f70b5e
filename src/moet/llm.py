"""The offline API, shaped like vLLM's:

    from moet import LLM, SamplingParams
    llm = LLM("/models/GLM-4.5-Air", expert_format="w2")
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    out[0].outputs[0].text

Every EngineConfig knob is an LLM keyword (flat: `LLM(path, max_num_seqs=8)`), and so is each
sub-config (`LLM(path, cache=CacheConfig(block_size=32))`). A thin wrapper over moet.engine.LLMEngine
(continuous batching over a paged KV cache): all prompts are submitted together and stepped
until each finishes; outputs come back in prompt order. The pre-engine one-sequence loop lives
on as the test oracle in moet/testing/reference_loop.py.
"""
from __future__ import annotations

from typing import Any

from moet.config import EngineConfig
from moet.errors import ConfigError
from moet.outputs import RequestOutput
from moet.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **kwargs: Any):
        self.config = EngineConfig(model=model, **kwargs)     # an unknown keyword: ConfigError naming the closest
        from moet.engine.llm_engine import LLMEngine

        self.engine = LLMEngine.from_config(self.config)
        self.checkpoint = self.engine.checkpoint
        self.spec = self.checkpoint.spec
        self.model = self.engine.model
        self.tokenizer = self.engine.tokenizer
        self.device = self.engine.device
        self.dtype = self.model.dtype
        self.max_model_len = self.engine.max_model_len
        self._next_id = 0

    def close(self) -> None:
        """Release the expert store when routed experts come through it (hot set saved beside the
        pack, pack closed); idempotent. Also `with LLM(...) as llm:`."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def eos_token_ids(self) -> set[int]:
        return self.engine.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: set[int]) -> None:
        self.engine.set_eos_token_ids(ids)

    def get_tokenizer(self):
        return self.tokenizer

    # ------------------------------------------------------------------ public API

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order. A request that can never run on this
        model raises RequestError (a ConfigError naming the field) before anything runs. A
        request that fails inside the engine is returned, as vLLM returns one that finished with
        FinishReason.ERROR: finished, its unfinished completions with finish_reason "error", and
        `error` set (RequestFailed, or a MoetError when its whole step failed); the other prompts'
        outputs are unaffected. Check `out.error` when that matters."""
        single = isinstance(prompts, (str, dict))
        prompts = [prompts] if single else list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ConfigError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        from tqdm import tqdm

        ids = [str(self._next_id + i) for i in range(len(prompts))]
        self._next_id += len(prompts)
        bar = tqdm(total=len(prompts), desc="generating", unit="req", disable=not use_tqdm or len(prompts) < 2,
                   leave=False)
        try:
            done = self.engine.generate_all(list(zip(ids, prompts, params)), progress=bar)
        except BaseException:
            for rid in ids:                       # leave the engine clean for the next call
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[rid] for rid in ids]

    def chat(self, messages, sampling_params: SamplingParams | None = None, *, tools: list[dict] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """vLLM-style chat: one conversation (a list of {"role", "content"} dicts) or a list of
        conversations, rendered with the checkpoint's chat template (tools included)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"{self.config.load.tokenizer or self.config.model} has no chat template; "
                              "use generate()")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in convs:
            text = self.tokenizer.apply_chat_template(conv, tools=tools, add_generation_prompt=True, tokenize=False)
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
