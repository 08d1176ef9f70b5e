"""POST /tokenize and /detokenize in vLLM's shapes, so tools written for vLLM (prompt-length
checks, evaluation harnesses, agents that budget their context) work unchanged:

    /tokenize    {"prompt": str, "add_special_tokens": true}                        -> the prompt's ids
                 {"messages": [...], "tools"?, "add_generation_prompt": true, ...}   -> the chat prompt's ids
                 either with "return_token_strs": true adds each token's string
                 -> {"count", "max_model_len", "tokens", "token_strs"}
    /detokenize  {"tokens": [ids]} -> {"prompt": str}

A chat body is rendered exactly as /v1/chat/completions renders it (same template, same guards),
so the count is the prompt length a chat request would have. Both run in a worker thread.
"""
from __future__ import annotations

import functools

from moet.serve.chat_template import render_chat
from moet.serve.errors import BadRequest
from moet.serve.protocol import (
    DetokenizeRequest, DetokenizeResponse, TokenizeChatRequest, TokenizeCompletionRequest, TokenizeResponse)
from moet.serve.request_body import parse_json, validate


def _tokenizer(state):
    tok = state.tokenizer
    if tok is None:
        raise BadRequest("this model has no tokenizer")
    return tok


def tokenize(state, body: bytes) -> TokenizeResponse:
    data = parse_json(body)
    req = validate(TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest, data)
    state.check_model(req.model)
    tok = _tokenizer(state)
    if isinstance(req, TokenizeChatRequest):
        kwargs = dict(req.chat_template_kwargs or {})
        template = req.chat_template if req.chat_template is not None else kwargs.pop("chat_template", None)
        if template is not None and not isinstance(template, str):
            raise BadRequest("chat_template must be a string (a Jinja template)", param="chat_template")
        text = render_chat(functools.partial(state.render_template, template), req.messages, req.tools,
                           add_generation_prompt=req.add_generation_prompt,
                           continue_final_message=req.continue_final_message, template_kwargs=kwargs)
    else:
        text = req.prompt
    ids = list(tok.encode(text, add_special_tokens=req.add_special_tokens))
    strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=state.engine.max_model_len, tokens=ids, token_strs=strs)


def detokenize(state, req: DetokenizeRequest) -> DetokenizeResponse:
    state.check_model(req.model)
    tok = _tokenizer(state)
    vocab = len(tok)
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise BadRequest(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="tokens")
    return DetokenizeResponse(prompt=tok.decode(req.tokens))
