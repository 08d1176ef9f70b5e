"""An OpenAI request's sampling fields -> moet.SamplingParams, with the checks that need the
model (context length) or that moet cannot honour yet (400 with the reason).

Fields the request leaves out take the checkpoint's generation_config.json (temperature,
top_p, top_k; do_sample false means greedy; max_new_tokens caps the default max_tokens), then
OpenAI's defaults - as vLLM does with `--generation-config auto`.
"""
from __future__ import annotations

from typing import Any

from moet.errors import ConfigError
from moet.sampling_params import SamplingParams, StructuredOutputsParams
from moet.serve.errors import BadRequest, TooLarge
from moet.serve.protocol import ChatCompletionRequest, CompletionRequest
from moet.serve.structured import request_structured_outputs

def generation_defaults(generation_config: dict[str, Any] | None) -> dict[str, Any]:
    """The sampling defaults a checkpoint's generation_config.json asks for."""
    g = generation_config or {}
    out: dict[str, Any] = {}
    if g.get("do_sample") is False:
        out["temperature"] = 0.0
    elif isinstance(g.get("temperature"), (int, float)):
        out["temperature"] = float(g["temperature"])
    if isinstance(g.get("top_p"), (int, float)) and not isinstance(g.get("top_p"), bool):
        out["top_p"] = float(g["top_p"])
    top_k = g.get("top_k")
    if isinstance(top_k, (int, float)) and not isinstance(top_k, bool) and float(top_k).is_integer():
        out["top_k"] = int(top_k)     # some checkpoints write 20.0; SamplingParams takes integers
    if isinstance(g.get("max_new_tokens"), int) and g["max_new_tokens"] > 0:
        out["max_tokens"] = g["max_new_tokens"]
    return out


def check_unsupported(req: ChatCompletionRequest | CompletionRequest) -> None:
    if req.logit_bias:
        raise BadRequest("logit_bias is not supported by moet yet", param="logit_bias")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise BadRequest("suffix (fill-in-the-middle) is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise BadRequest("best_of other than n is not supported", param="best_of")


def check_sequences(state, prompts: int, n: int) -> None:
    """One request's sequences (prompts x n) within --max-sequences-per-request."""
    cap = state.config.max_sequences_per_request
    if prompts * n > cap:
        raise BadRequest(f"this request asks for {prompts * n} sequences ({prompts} prompt(s) x n={n}); this server "
                         f"allows at most {cap} per request (--max-sequences-per-request)",
                         param="n" if prompts == 1 else "prompt")


def sampling_params(req: ChatCompletionRequest | CompletionRequest, *, prompt_len: int, max_model_len: int,
                    defaults: dict[str, Any], logprobs: int | None,
                    structured: StructuredOutputsParams | None = None) -> SamplingParams:
    """One engine request's parameters (n is set per engine request by Generation). structured:
    the reply's constraint when the caller made it (chat's forced tool calls), else the request's
    own (serve/structured.py), checked here."""
    if structured is None:
        found = request_structured_outputs(req)
        structured = found[0] if found is not None else None
    if prompt_len >= max_model_len:
        raise TooLarge(f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                       f"{prompt_len} tokens, which leaves no room to generate. Shorten the prompt.",
                       param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                       code="context_length_exceeded")
    room = max_model_len - prompt_len
    budget = req.token_budget
    if budget is not None and budget > room:
        raise BadRequest(f"this model's maximum context length is {max_model_len} tokens; you asked for "
                         f"{prompt_len + budget} ({prompt_len} in the prompt, {budget} to generate). "
                         f"Ask for at most {room} tokens.", param="max_tokens", code="context_length_exceeded")
    if budget is None:
        budget = min(defaults.get("max_tokens", room), room)
    temperature = req.temperature if req.temperature is not None else defaults.get("temperature", 1.0)
    top_p = req.top_p if req.top_p is not None else defaults.get("top_p", 1.0)
    top_k = req.top_k if req.top_k is not None else defaults.get("top_k", 0)
    kwargs: dict[str, Any] = dict(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=req.min_p,
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=req.repetition_penalty, max_tokens=budget, min_tokens=req.min_tokens,
        stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output, logprobs=logprobs, seed=req.seed,
        skip_special_tokens=req.skip_special_tokens, structured_outputs=structured)
    if req.min_tokens > budget:
        raise BadRequest(f"min_tokens={req.min_tokens} exceeds max_tokens={budget}", param="min_tokens")
    try:
        return SamplingParams(**kwargs)
    except ConfigError as exc:
        raise BadRequest(str(exc), param=getattr(exc, "param", None)) from None
