"""POST /v1/completions: raw prompts (text, token ids, or lists of either) -> text, as one JSON
response or as server-sent events. Choice index = prompt index x n + sample index."""
from __future__ import annotations

from typing import AsyncIterator

from moet.outputs import PositionLogprobs
from moet.serve.errors import APIError, BadRequest
from moet.serve.generation import ChoiceDelta, Generation
from moet.serve.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from moet.serve.sampling import check_sequences, check_unsupported, sampling_params
from moet.serve.server_state import ServerState
from moet.serve.sse import SSE_DONE, EventStream, clamp_logprob, sse_event


class CompletionPlan:
    def __init__(self, state: ServerState, req: CompletionRequest):
        self.state, self.req = state, req
        state.check_model(req.model)
        self.model_name = state.response_model_name(req.model)
        check_unsupported(req)
        tok = state.tokenizer
        p = req.prompt
        raw: list[str | list[int]] = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        check_sequences(state, len(raw), req.n)
        self.prompts: list[list[int]] = []
        self.prompt_texts: list[str] = []
        vocab = len(tok) if tok is not None else None
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
                if vocab is not None and any(t < 0 or t >= vocab for t in ids):
                    raise BadRequest(f"prompt[{i}] has a token id outside the vocabulary (0..{vocab - 1})",
                                     param="prompt")
                self.prompt_texts.append(tok.decode(ids) if tok is not None else "")
            self.prompts.append(ids)
        self.logprobs = req.logprobs
        # max_tokens 0 (with echo): one token is computed, as a prefill must end in a sample, and dropped
        self.score_only = req.max_tokens == 0
        if self.score_only and req.min_tokens:
            raise BadRequest("min_tokens must be 0 when max_tokens is 0", param="min_tokens")
        longest = max(self.prompts, key=len)
        scored = req.model_copy(update={"max_tokens": 1}) if self.score_only else req
        self.params = sampling_params(scored, prompt_len=len(longest), max_model_len=state.engine.max_model_len,
                                      defaults=state.sampling_defaults, logprobs=req.logprobs)
        # echo + logprobs: the prompt's own tokens are scored too (what evaluation harnesses read)
        self.prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        if self.prompt_logprobs is not None:
            self.params.prompt_logprobs = self.prompt_logprobs

    def generation(self, request_id: str) -> Generation:
        return Generation(self.state.engine, self.state.metrics, request_id, self.prompts, self.params, self.req.n,
                          self.state.config.request_timeout_s, keep_output=not self.score_only)

    def echo_text(self, index: int) -> str:
        return self.prompt_texts[index // self.req.n] if self.req.echo else ""

    def echo_logprobs(self, gen: Generation, index: int) -> dict | None:
        """The prompt's part of choice `index`'s logprobs (tokens, their logprobs, the top-k), in
        the legacy shape: the first token has no logprob (nothing predicts it)."""
        if self.prompt_logprobs is None:
            return None
        p = index // self.req.n
        positions = gen.prompt_logprobs.get(p)
        if positions is None:
            return None
        ids = self.prompts[p]
        return completion_logprobs_dict(self.state.tokenizer, ids, positions, self.prompt_logprobs, 0)


def completion_logprobs_dict(tok, token_ids: list[int], positions: list[PositionLogprobs | None] | None, k: int,
                            offset: int) -> dict | None:
    """The legacy completions shape (CompletionLogprobs' fields, in order): parallel lists,
    top_logprobs as {token text: logprob}. A position without logprobs (the prompt's first token)
    has None in both lists."""
    if positions is None:
        return None
    offsets, token_lps, tokens, tops = [], [], [], []
    for tid, pos in zip(token_ids, positions):
        lp = pos.get(tid) if pos is not None else None
        text = lp.decoded_token if lp is not None and lp.decoded_token is not None else tok.decode([tid])
        tokens.append(text)
        token_lps.append(clamp_logprob(lp.logprob) if lp else None)
        if k and pos is not None:
            top = sorted(((i, p) for i, p in pos.items() if p.rank is not None and p.rank <= k),
                         key=lambda x: x[1].rank)
            tops.append({(p.decoded_token if p.decoded_token is not None else tok.decode([i])):
                         clamp_logprob(p.logprob) for i, p in top})
        else:
            tops.append(None)
        offsets.append(offset)
        offset += len(text)
    return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}


def _end(block: dict) -> int:
    """The text offset just past a logprob block's last token. Offsets count the token strings,
    special tokens included, as vLLM counts them; with echo they start at the prompt's first token."""
    return block["text_offset"][-1] + len(block["tokens"][-1]) if block["tokens"] else 0


def _joined(first: dict | None, rest: dict | None) -> dict | None:
    """Two logprob blocks one after the other (the echoed prompt, then the completion)."""
    if first is None:
        return rest
    if rest is None:
        return first
    return {"text_offset": first["text_offset"] + rest["text_offset"],
            "token_logprobs": first["token_logprobs"] + rest["token_logprobs"],
            "tokens": first["tokens"] + rest["tokens"], "top_logprobs": first["top_logprobs"] + rest["top_logprobs"]}


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
        echo_lp = plan.echo_logprobs(gen, i)
        lp = completion_logprobs_dict(tok, whole.token_ids, whole.logprobs, plan.logprobs or 0,
                                      _end(echo_lp) if echo_lp is not None else len(echo))
        lp = _joined(echo_lp, lp)
        choices.append(CompletionChoice(index=i, text=echo + whole.text,
                                        logprobs=CompletionLogprobs(**lp) if lp is not None else None,
                                        finish_reason=whole.finish_reason, stop_reason=whole.stop_reason))
    usage = gen.usage()
    plan.usage = usage
    return CompletionResponse(id=request_id, model=plan.model_name, choices=choices, usage=usage)


class CompletionStream(EventStream):
    object = "text_completion"

    def __init__(self, plan: CompletionPlan, request_id: str):
        super().__init__(plan, request_id)
        self.offsets = [len(plan.echo_text(i)) for i in range(self.gen.num_choices)]

    async def events(self, deltas_iter: AsyncIterator[list[ChoiceDelta]]) -> AsyncIterator[str]:
        tok = self.plan.state.tokenizer
        k = self.plan.logprobs or 0
        offsets = self.offsets
        # The echo goes first. With the prompt's logprobs it rides on each choice's first delta: they
        # come with the engine's first output for that prompt (the prompt is scored before the first
        # token is sampled).
        with_prompt_lps = self.plan.prompt_logprobs is not None
        echo_pending = [self.plan.req.echo and with_prompt_lps] * self.gen.num_choices
        if self.plan.req.echo and not with_prompt_lps:
            yield self.chunk([{"index": i, "text": self.plan.echo_text(i)} for i in range(self.gen.num_choices)])
        try:
            async for deltas in deltas_iter:
                choices = []
                for d in deltas:
                    c = {"index": d.index, "text": d.text}
                    echo_lp = None
                    if echo_pending[d.index]:
                        echo_pending[d.index] = False
                        c["text"] = self.plan.echo_text(d.index) + d.text
                        echo_lp = self.plan.echo_logprobs(self.gen, d.index)
                        if echo_lp is not None:
                            offsets[d.index] = _end(echo_lp)
                    lp = completion_logprobs_dict(tok, d.token_ids, d.logprobs, k, offsets[d.index]) \
                        if d.logprobs is not None else None
                    lp = _joined(echo_lp, lp)
                    if lp is not None:
                        c["logprobs"] = lp
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
