"""What the two streaming endpoints (chat and completions) share: the server-sent-event
framing, the closing [DONE], and the usage that stream_options asks for. Kept in one place so
the two streams cannot drift apart in what a client parsing either one sees.

Chunks are written without pydantic: each stream renders the fixed head of its chunks once
(id, object, created, model: the same on every chunk of a stream, as OpenAI sends them) and a
chunk is that head, the choices as plain dicts through one json encoder, and the usage when
asked for. The dicts are what the protocol models' model_dump(exclude_none=True) gives, field
order included (tests/serve/test_stream_coalescing.py holds the two to the same JSON).
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from moet.serve.protocol import UsageInfo, now

SSE_DONE = "data: [DONE]\n\n"


def _compact_json_encoder():
    """json.dumps(obj, ensure_ascii=False, separators=(",", ":")), pydantic's compact form, with
    the C encoder built once instead of on every call (building it was over half of a small
    chunk's encoding time)."""
    enc = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
    from json.encoder import c_make_encoder, encode_basestring
    if c_make_encoder is None:       # no C accelerator: the pure-Python encoder, same output
        return enc.encode
    fast = c_make_encoder(None, enc.default, encode_basestring, None, ":", ",", False, False, True)
    return lambda obj: "".join(fast(obj, 0))


encode_json = _compact_json_encoder()


def sse_event(obj: BaseModel) -> str:
    return f"data: {obj.model_dump_json(exclude_none=True)}\n\n"


def clamp_logprob(x: float) -> float:
    """OpenAI's floor for a logprob (-inf and NaN become -9999.0: JSON has neither)."""
    return x if x > -9999.0 else -9999.0


class EventStream:
    """The part of a streamed response that does not depend on its chunk shape. `plan` is a
    ChatPlan or a CompletionPlan: anything with `req.stream_options`, `model_name` and
    `generation()`. Subclasses name their chunks' `object`."""
    object = ""

    def __init__(self, plan: Any, request_id: str):
        self.plan, self.request_id = plan, request_id
        self.gen = plan.generation(request_id)
        opts = plan.req.stream_options
        self.include_usage = bool(opts and opts.include_usage)
        self.continuous_usage = bool(opts and opts.continuous_usage_stats)
        self.usage = UsageInfo()
        self.created = now()
        self._head = (f'data: {{"id":{encode_json(request_id)},"object":{encode_json(self.object)},'
                      f'"created":{self.created},"model":{encode_json(plan.model_name)},"choices":')

    def chunk(self, choices: list[dict], usage: bool = False) -> str:
        """One event: `choices` (dicts in the protocol's shape), with the usage so far if asked."""
        if usage:
            g = self.gen
            return (f'{self._head}{encode_json(choices)},"usage":{{"prompt_tokens":{g.prompt_tokens},'
                    f'"completion_tokens":{g.completion_tokens},'
                    f'"total_tokens":{g.prompt_tokens + g.completion_tokens}}}}}\n\n')
        return f"{self._head}{encode_json(choices)}}}\n\n"

    def current_usage(self) -> UsageInfo:
        self.usage = self.gen.usage()
        return self.usage
