"""POST /v1/chat/completions: messages -> prompt (chat template) -> engine -> reasoning /
content / tool calls, as one JSON response or as server-sent events.

tool_choice:
  none      tools are left out of the prompt and nothing is parsed as a call;
  auto      (default with tools) calls the model writes are parsed into tool_calls;
  required  the reply is one or more calls (one with parallel_tool_calls false), under a
            grammar in the parser's syntax whose arguments follow each tool's parameters schema
            (serve/structured.py), so they always parse; the model picks the functions;
  named     the same, to the named function only.
Forced replies are rendered with enable_thinking=False (the think block is skipped).
"""
from __future__ import annotations

import functools
from typing import AsyncIterator

from moet.outputs import PositionLogprobs
from moet.serve.chat_output import ChoiceDeltaParts, ChoiceOutputParser
from moet.serve.chat_template import render_chat
from moet.serve.errors import APIError, BadRequest
from moet.serve.generation import ChoiceDelta, Generation
from moet.serve.protocol import (
    AssistantMessage, ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, NamedToolChoice,
    ResponseFunctionCall, ResponseToolCall)
from moet.serve.sampling import check_sequences, check_unsupported, sampling_params
from moet.serve.server_state import ServerState
from moet.serve.structured import request_structured_outputs, tool_reply_constraint
from moet.serve.sse import SSE_DONE, EventStream, clamp_logprob, sse_event


class ChatPlan:
    """Everything decided before the engine runs: prompt, parameters, parsers."""

    def __init__(self, state: ServerState, req: ChatCompletionRequest):
        self.state, self.req = state, req
        state.check_model(req.model)
        self.model_name = state.response_model_name(req.model)
        check_unsupported(req)
        check_sequences(state, 1, req.n)
        tok = state.tokenizer
        choice = req.tool_choice or ("auto" if req.tools else "none")
        self.parse_tools = bool(req.tools) and choice != "none"
        parser_cls = state.tool_parser
        if self.parse_tools and parser_cls is None:
            raise BadRequest("this server has no tool-call parser; restart it with --tool-call-parser NAME "
                             "(glm45, hermes, deepseek_v3, kimi_k2)", param="tools")
        names = [t.function.name for t in req.tools or []]
        if len(set(names)) != len(names):
            raise BadRequest("two tools have the same function name", param="tools")
        forced_name: str | None = None
        if isinstance(choice, NamedToolChoice):
            forced_name = choice.function.name
            if forced_name not in names:
                raise BadRequest(f"tool_choice names '{forced_name}', which is not among the tools "
                                 f"({', '.join(names)})", param="tool_choice")
        template_kwargs = dict(req.chat_template_kwargs or {})
        request_template = req.chat_template if req.chat_template is not None else template_kwargs.pop("chat_template", None)
        if request_template is not None and not isinstance(request_template, str):
            raise BadRequest("chat_template must be a string (a Jinja template)", param="chat_template")
        tool_parser = parser_cls([t.model_dump() for t in req.tools]) if self.parse_tools else None
        self.prefix = ""
        structured = None
        if self.parse_tools and (forced_name or choice == "required"):
            template_kwargs.setdefault("enable_thinking", False)
            other = request_structured_outputs(req)
            if other is not None:
                raise BadRequest(f"tool_choice {'required' if forced_name is None else 'naming a function'} makes the "
                                 f"reply tool calls; it cannot also follow {other[1]}", param="tool_choice")
            structured = tool_reply_constraint(tool_parser, [t.model_dump() for t in req.tools], forced_name,
                                               req.parallel_tool_calls is not False)
        prompt_text = render_chat(functools.partial(state.render_template, request_template), req.messages,
                                  req.tools if self.parse_tools else None,
                                  add_generation_prompt=req.add_generation_prompt,
                                  continue_final_message=req.continue_final_message,
                                  template_kwargs=template_kwargs) + self.prefix
        self.prompt_text = prompt_text
        self.prompt_ids = list(tok.encode(prompt_text, add_special_tokens=False))
        self.logprobs = (req.top_logprobs or 0) if req.logprobs else None
        self.params = sampling_params(req, prompt_len=len(self.prompt_ids), max_model_len=state.engine.max_model_len,
                                      defaults=state.sampling_defaults, logprobs=self.logprobs,
                                      structured=structured)
        reasoning = state.reasoning_parser
        self.keep_special = bool(tool_parser is not None and tool_parser.needs_special_tokens
                                 or reasoning is not None and reasoning.needs_special_tokens)
        if self.keep_special:
            self.params.skip_special_tokens = False
        self.starts_in_reasoning = bool(reasoning and reasoning.starts_in_reasoning(prompt_text))
        self.tool_parser = tool_parser

    def choice_parser(self) -> ChoiceOutputParser:
        eos_texts: tuple[str, ...] = ()
        if self.keep_special:
            tok = self.state.tokenizer
            eos_texts = tuple(tok.decode([e], skip_special_tokens=False) for e in sorted(self.state.engine.eos_token_ids))
            # an end-of-turn text a parser reads (harmony's <|call|>) stays in the text
            kept = set(getattr(self.tool_parser, "keeps_end_markers", ()))
            kept |= set(self.state.reasoning_parser.keeps_end_markers if self.state.reasoning_parser else ())
            eos_texts = tuple(t for t in eos_texts if t not in kept)
        p = ChoiceOutputParser(self.state.reasoning_parser, self.starts_in_reasoning,
                               type(self.tool_parser)([t.model_dump() for t in self.req.tools])
                               if self.tool_parser is not None else None, eos_texts)
        return p

    def generation(self, request_id: str) -> Generation:
        return Generation(self.state.engine, self.state.metrics, request_id, [self.prompt_ids], self.params,
                          self.req.n, self.state.config.request_timeout_s)


def _token_text(tok, tid: int, lp) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tok.decode([tid], skip_special_tokens=False) if tok is not None else str(tid)


def chat_logprobs_dict(tok, token_ids: list[int], positions: list[PositionLogprobs] | None, k: int) -> dict | None:
    """ChatLogprobs' shape as plain dicts (TokenLogprob / TopLogprob fields, in order)."""
    if positions is None:
        return None
    content = []
    for tid, pos in zip(token_ids, positions):
        lp = pos.get(tid)
        text = _token_text(tok, tid, lp)
        tops = []
        if k:
            for i, p in sorted(((i, p) for i, p in pos.items() if p.rank is not None and p.rank <= k),
                               key=lambda x: x[1].rank):
                t = _token_text(tok, i, p)
                tops.append({"token": t, "logprob": clamp_logprob(p.logprob), "bytes": list(t.encode())})
        content.append({"token": text, "logprob": clamp_logprob(lp.logprob) if lp else -9999.0,
                        "bytes": list(text.encode()), "top_logprobs": tops})
    return {"content": content}


def chat_logprobs(tok, token_ids: list[int], positions: list[PositionLogprobs] | None, k: int) -> ChatLogprobs | None:
    d = chat_logprobs_dict(tok, token_ids, positions, k)
    return ChatLogprobs.model_validate(d) if d is not None else None


def _finish_reason(reason: str | None, made_calls: bool) -> str | None:
    return "tool_calls" if made_calls and reason == "stop" else reason


async def chat_response(plan: ChatPlan, request_id: str) -> ChatCompletionResponse:
    gen = plan.generation(request_id)
    tok = plan.state.tokenizer
    choices = []
    for i, whole in enumerate(await gen.collect(with_logprobs=plan.logprobs is not None)):
        parts = plan.choice_parser().feed(plan.prefix + whole.text, final=True)
        calls = [ResponseToolCall(id=c.id, function=ResponseFunctionCall(name=c.name, arguments=c.arguments))
                 for c in parts.calls]
        msg = AssistantMessage(content=parts.content if parts.content or not calls else None,
                               reasoning_content=parts.reasoning or None, tool_calls=calls)
        choices.append(ChatChoice(index=i, message=msg,
                                  logprobs=chat_logprobs(tok, whole.token_ids, whole.logprobs, plan.logprobs or 0),
                                  finish_reason=_finish_reason(whole.finish_reason, bool(calls)),
                                  stop_reason=whole.stop_reason))
    usage = gen.usage()
    plan.usage = usage
    return ChatCompletionResponse(id=request_id, model=plan.model_name, choices=choices, usage=usage)


class ChatStream(EventStream):
    """Turns a Generation's per-step deltas into chat.completion.chunk events."""
    object = "chat.completion.chunk"

    def __init__(self, plan: ChatPlan, request_id: str):
        super().__init__(plan, request_id)
        n = self.gen.num_choices
        self.parsers = [plan.choice_parser() for _ in range(n)]
        self.calls_made = [0] * n
        self.started = False

    def _choice(self, d: ChoiceDelta, parts: ChoiceDeltaParts) -> dict | None:
        """A ChatStreamChoice as model_dump(exclude_none=True) gives it. Tool calls arrive whole
        from the parser (name and complete arguments), never half a call."""
        i = d.index
        logprobs = chat_logprobs_dict(self.plan.state.tokenizer, d.token_ids, d.logprobs, self.plan.logprobs or 0) \
            if d.logprobs is not None and d.token_ids else None
        if not parts and d.finish_reason is None and logprobs is None:
            return None
        delta: dict = {}
        if parts.content:
            delta["content"] = parts.content
        if parts.reasoning:
            delta["reasoning_content"] = parts.reasoning
        if parts.calls:
            calls = []
            for c in parts.calls:
                call = {"index": self.calls_made[i]}
                if c.id is not None:
                    call["id"] = c.id
                call["type"] = "function"
                call["function"] = {k: v for k, v in (("name", c.name), ("arguments", c.arguments)) if v is not None}
                calls.append(call)
                self.calls_made[i] += 1
            delta["tool_calls"] = calls
        choice = {"index": i, "delta": delta}
        if logprobs is not None:
            choice["logprobs"] = logprobs
        reason = _finish_reason(d.finish_reason, self.calls_made[i] > 0)
        if reason is not None:
            choice["finish_reason"] = reason
        if d.stop_reason is not None:
            choice["stop_reason"] = d.stop_reason
        return choice

    async def events(self, deltas_iter: AsyncIterator[list[ChoiceDelta]]) -> AsyncIterator[str]:
        n = self.gen.num_choices
        usage = self.continuous_usage
        # the role comes first, once per choice, as OpenAI sends it
        yield self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}} for i in range(n)], usage=usage)
        if self.plan.prefix:
            for i in range(n):  # the forced call opener is part of each reply
                self.parsers[i].feed(self.plan.prefix)
        try:
            async for deltas in deltas_iter:
                choices = []
                for d in deltas:
                    parts = self.parsers[d.index].feed(d.text, final=d.finish_reason is not None)
                    c = self._choice(d, parts)
                    if c is not None:
                        choices.append(c)
                if choices:
                    yield self.chunk(choices, usage=usage)
        except APIError as exc:  # headers are gone: report in-band, then end the stream properly
            yield sse_event(exc.response())
        if self.include_usage:
            yield self.chunk([], usage=True)
        yield SSE_DONE
