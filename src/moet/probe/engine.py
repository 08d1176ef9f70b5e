"""The probes' model: moet's own engine (`moet.LLM`) with the routed experts in one format.

    m = open_engine(ckpt, "w2", "cpu")        # bf16 | nvfp4 (the engine's fp4) | w2 | w2+gate@0.99
    run_all(m, "quick")

Every probe generates and scores through the engine, on its paged KV cache and scheduler:
  greedy text      LLM.generate with SamplingParams(temperature=0, max_tokens=N); the new token
                   ids are decoded with special tokens kept (the reply parser needs <|end|> and
                   the markup tokens)
  log-likelihood   SamplingParams(prompt_logprobs=K, max_tokens=1): per prompt position the
                   actual token's logprob and rank and the top-K (moet.probe.distributions)
  MTP next-next    the engine's scheduler has no MTP step yet, so the LLM's own model runs its
                   MTP layer teacher-forced: CausalLM.hidden_states, then mtp_forward, over a
                   contiguous KV cache (the path moet.testing.reference_loop drives). The same
                   loaded weights and expert pools as the engine; not transformers.

The activations run in float32 on CPU and bfloat16 on CUDA (transformers' path in
moet.probe.loader does the same), so the two can be compared item by item.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from moet.errors import ConfigError
from moet.probe.distributions import CodeScores, concat

# probe format name -> the engine's expert_format (the probe keeps its names: results, model
# card and the training recipe's summaries say "nvfp4")
ENGINE_FORMATS = {"bf16": "bf16", "nvfp4": "fp4", "w2": "w2"}
# W2 experts with the FP4 repair tier and the confidence gate at one tau: "w2+gate@0.99"
GATE_PREFIX = "w2+gate@"


def gate_variant(tau: float) -> str:
    return f"{GATE_PREFIX}{tau:g}"


def variant_options(experts: str) -> dict:
    """A probe variant's LLM keywords: the expert format and the gate (off unless the variant names
    it, so "w2" is bare W2 whatever the engine's default)."""
    if experts.startswith(GATE_PREFIX):
        text = experts[len(GATE_PREFIX):]
        try:
            tau = float(text)
        except ValueError:
            raise ConfigError(f"{experts}: the gate's tau {text!r} is not a number") from None
        return {"expert_format": "w2", "fp4_gate": True, "gate_tau": tau}
    if experts not in ENGINE_FORMATS:
        raise ConfigError(f"unknown expert format {experts!r}; use one of {', '.join(ENGINE_FORMATS)} or "
                          f"{GATE_PREFIX}TAU")
    return {"expert_format": ENGINE_FORMATS[experts], "fp4_gate": False}


def _no_tick(n: int) -> None:
    pass


@dataclass
class EngineModel:
    llm: object                  # moet.LLM
    tokenizer: object
    experts: str                 # bf16 | nvfp4 | w2 | w2+gate@TAU
    device: torch.device
    dtype: torch.dtype
    activations: str = "bf16"    # the engine's routed experts read the model's activations, unquantized
    backend: str = field(default="moet", init=False)

    @property
    def max_context(self) -> int:
        """The longest prompt + generation the engine serves (its max_model_len)."""
        return self.llm.engine.max_model_len

    def close(self) -> None:
        self.llm.close()

    def gate_snapshot(self) -> dict | None:
        """The confidence gate's counters and the generated tokens so far (None: no gate); the
        probes report the difference over each probe."""
        engine = self.llm.engine
        if getattr(engine, "gate", None) is None:
            return None
        c = engine.gate.counters
        return {"rows_checked": c.rows_checked, "fires": c.fires, "recomputed_rows": c.recomputed_rows,
                "generated_tokens": engine.stats().generation_tokens_total}

    def spec_snapshot(self) -> dict | None:
        """MTP speculative decoding's counters so far (None: not speculating); the probes report
        tokens per verifying step and acceptance over each probe."""
        drafter = getattr(self.llm.engine, "drafter", None)
        if drafter is None:
            return None
        c = drafter.counters
        return {"seq_steps": c.verify_seq_steps, "emitted": c.emitted, "drafts": sum(c.drafts),
                "accepted": sum(c.accepted)}

    def _chunks(self, n: int, batch: int):
        step = max(1, batch)
        return [(a, min(n, a + step)) for a in range(0, n, step)]

    def generate(self, prompts: list[list[int]], max_new_tokens: int, batch: int, tick=_no_tick,
                 structured: list | None = None) -> list[str]:
        """Greedy completions of token-id prompts, decoded with special tokens kept; tick(k)
        after each group of k prompts (the engine batches up to its max_num_seqs at once).
        structured: per prompt a StructuredOutputsParams (or None) constraining its output."""
        from moet.sampling_params import SamplingParams

        sps = [SamplingParams(temperature=0.0, max_tokens=max_new_tokens, skip_special_tokens=False,
                              structured_outputs=so) for so in (structured or [None] * len(prompts))]
        out: list[str] = []
        for a, b in self._chunks(len(prompts), batch):
            res = self.llm.generate([{"prompt_token_ids": p} for p in prompts[a:b]], sps[a:b], use_tqdm=False)
            for r in res:
                if r.error is not None:
                    raise r.error
                out.append(self.tokenizer.decode(r.outputs[0].token_ids, skip_special_tokens=False))
            tick(b - a)
        return out

    @torch.no_grad()
    def score(self, seqs: list[list[int]], k: int, batch: int, tick=_no_tick) -> CodeScores:
        """Teacher-forced scores of each sequence: the engine's prompt logprobs (position t
        predicts token t + 1) and the MTP layer's next-next top-1; tick(k) per group of k."""
        from moet.sampling_params import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k)
        parts = []
        for a, b in self._chunks(len(seqs), batch):
            res = self.llm.generate([{"prompt_token_ids": s} for s in seqs[a:b]], sp, use_tqdm=False)
            for s, r in zip(seqs[a:b], res):
                if r.error is not None:
                    raise r.error
                part = _from_prompt_logprobs(s, r.prompt_logprobs, k)
                part.mtp_hits, part.mtp_count = self._mtp(s)
                parts.append(part)
            tick(b - a)
        return concat(parts)

    def _mtp(self, ids: list[int]) -> tuple[int | None, int]:
        """(right drafts, drafts) of MTP layer 0 over one sequence; (None, 0) without MTP layers."""
        model = self.llm.model
        if not len(model.mtp) or len(ids) < 3:
            return None, 0
        x = torch.tensor(ids, dtype=torch.long, device=self.device)
        cache = model.new_cache(len(ids), self.device)
        hidden = model.model.norm(model.hidden_states(x, 0, cache))     # what the LM head sees
        _, logits = model.mtp_forward(0, x[1:], hidden[:-1], 0, cache)  # row t: hidden t, token t+1 -> t+2
        return int((logits[:-1].argmax(-1) == x[2:]).sum()), len(ids) - 2


def _from_prompt_logprobs(ids: list[int], plps, k: int) -> CodeScores:
    """The engine's per-position dicts (actual token + top-k) -> CodeScores arrays."""
    n = len(ids) - 1
    lp = np.empty(n)
    top1 = np.empty(n, bool)
    top_ids = np.empty((n, k), np.int64)
    top_lp = np.empty((n, k))
    for t in range(n):
        d = plps[t + 1]                         # position t + 1's entry: the logits at t
        actual = d[ids[t + 1]]
        lp[t], top1[t] = actual.logprob, actual.rank == 1
        # the top-k by logprob (the actual token, when not among them, is listed besides)
        best = sorted(d.items(), key=lambda kv: -kv[1].logprob)[:k]
        top_ids[t] = [i for i, _ in best]
        top_lp[t] = [v.logprob for _, v in best]
    return CodeScores(lp, top1, top_ids, top_lp)


def open_engine(ckpt: Path | str, experts: str = "nvfp4", device: str = "cpu", **engine_options) -> EngineModel:
    """moet.LLM on `ckpt` with the routed experts in `experts` (bf16 | nvfp4 | w2 | w2+gate@TAU);
    float32 activations on CPU, bfloat16 on CUDA. `engine_options`: further LLM keywords."""
    from moet.llm import LLM

    options = {**variant_options(experts), **engine_options}
    dev = torch.device(device)
    dtype = "float32" if dev.type == "cpu" else "bfloat16"
    llm = LLM(str(ckpt), device=str(dev), dtype=dtype, **options)
    if llm.tokenizer is None:
        llm.close()
        raise ConfigError(f"{ckpt}: no tokenizer files; the probes render chat prompts with the checkpoint's tokenizer")
    return EngineModel(llm, llm.tokenizer, experts, llm.device, llm.dtype)
