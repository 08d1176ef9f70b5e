"""POST /v1/completions: raw prompts (text, token ids, or lists of either) -> text, as one JSON
response or as server-sent events. Choice index = prompt index x n + sample index."""
from __future__ import annotations

from typing import AsyncIterator

from moet.outputs import PositionLogprobs
from moet.serve.errors import APIError, BadRequest
from moet.serve.generation import ChoiceDelta, Generation
from moet.serve.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from moet.serve.sampling import check_unsupported, sampling_params
from moet.serve.server_state import ServerState
from moet.serve.sse import SSE_DONE, EventStream, clamp_logprob, sse_event


class CompletionPlan:
    def __init__(self, state: ServerState, req: CompletionRequest):
        self.state, self.req = state, req
        state.check_model(req.model)
        check_unsupported(req)
        tok = state.tokenizer
        p = req.prompt
        raw: list[str | list[int]] = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        self.prompts: list[list[int]] = []
        self.prompt_texts: list[str] = []
        vocab = getattr(tok, "vocab_size", None) if tok is not None else None
        for i, item in enumerate(raw):
            if isinstance(item, str):
                if tok is None:
                    raise BadRequest("this model has no tokenizer; send prompts as token ids", param="prompt")
                if not item:
                    raise BadRequest(f"prompt[{i}] is empty", param="prompt")
                ids = list(tok(item).input_ids)
                self.prompt_texts.append(item)
            else:
                ids = [int(t) for t in item]
                if vocab is not None and any(t < 0 or t >= len(tok) for t in ids):
                    raise BadRequest(f"prompt[{i}] has a token id outside the vocabulary (0..{len(tok) - 1})",
                                     param="prompt")
                self.prompt_texts.append(tok.decode(ids) if tok is not None else "")
            self.prompts.append(ids)
        self.logprobs = req.logprobs
        longest = max(self.prompts, key=len)
        self.params = sampling_params(req, prompt_len=len(longest), max_model_len=state.engine.max_model_len,
                                      defaults=state.sampling_defaults, logprobs=req.logprobs)

    def generation(self, request_id: str) -> Generation:
        return Generation(self.state.engine, self.state.metrics, request_id, self.prompts, self.params, self.req.n,
                          self.state.config.request_timeout_s)

    def echo_text(self, index: int) -> str:
        return self.prompt_texts[index // self.req.n] if self.req.echo else ""


def completion_logprobs_dict(tok, token_ids: list[int], positions: list[PositionLogprobs] | None, k: int,
                            offset: int) -> dict | None:
    """The legacy completions shape (CompletionLogprobs' fields, in order): parallel lists,
    top_logprobs as {token text: logprob}."""
    if positions is None:
        return None
    offsets, token_lps, tokens, tops = [], [], [], []
    for tid, pos in zip(token_ids, positions):
        lp = pos.get(tid)
        text = lp.decoded_token if lp is not None and lp.decoded_token is not None else tok.decode([tid])
        tokens.append(text)
        token_lps.append(clamp_logprob(lp.logprob) if lp else None)
        if k:
            top = sorted(((i, p) for i, p in pos.items() if p.rank is not None and p.rank <= k),
                         key=lambda x: x[1].rank)
            tops.append({(p.decoded_token if p.decoded_token is not None else tok.decode([i])):
                         clamp_logprob(p.logprob) for i, p in top})
        else:
            tops.append(None)
        offsets.append(offset)
        offset += len(text)
    return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}


def completion_logprobs(tok, token_ids: list[int], positions: list[PositionLogprobs] | None, k: int,
                        offset: int) -> CompletionLogprobs | None:
    d = completion_logprobs_dict(tok, token_ids, positions, k, offset)
    return CompletionLogprobs(**d) if d is not None else None


async def completion_response(plan: CompletionPlan, request_id: str) -> CompletionResponse:
    gen = plan.generation(request_id)
    tok = plan.state.tokenizer
    choices = []
    for i, whole in enumerate(await gen.collect(with_logprobs=plan.logprobs is not None)):
        echo = plan.echo_text(i)
        lp = completion_logprobs(tok, whole.token_ids, whole.logprobs, plan.logprobs or 0, len(echo))
        choices.append(CompletionChoice(index=i, text=echo + whole.text, logprobs=lp,
                                        finish_reason=whole.finish_reason, stop_reason=whole.stop_reason))
    usage = gen.usage()
    plan.usage = usage
    return CompletionResponse(id=request_id, model=plan.state.model_name, choices=choices, usage=usage)


class CompletionStream(EventStream):
    object = "text_completion"

    def __init__(self, plan: CompletionPlan, request_id: str):
        super().__init__(plan, request_id)
        self.offsets = [len(plan.echo_text(i)) for i in range(self.gen.num_choices)]

    async def events(self, deltas_iter: AsyncIterator[list[ChoiceDelta]]) -> AsyncIterator[str]:
        tok = self.plan.state.tokenizer
        k = self.plan.logprobs or 0
        offsets = self.offsets
        if self.plan.req.echo:
            yield self.chunk([{"index": i, "text": self.plan.echo_text(i)} for i in range(self.gen.num_choices)])
        try:
            async for deltas in deltas_iter:
                choices = []
                for d in deltas:
                    c = {"index": d.index, "text": d.text}
                    if d.logprobs is not None:
                        c["logprobs"] = completion_logprobs_dict(tok, d.token_ids, d.logprobs, k, offsets[d.index])
                    offsets[d.index] += len(d.text)
                    if d.finish_reason is not None:
                        c["finish_reason"] = d.finish_reason
                    if d.stop_reason is not None:
                        c["stop_reason"] = d.stop_reason
                    choices.append(c)
                yield self.chunk(choices, usage=self.continuous_usage)
        except APIError as exc:
            yield sse_event(exc.response())
        if self.include_usage:
            yield self.chunk([], usage=True)
        yield SSE_DONE
