"""What the two streaming endpoints (chat and completions) share: the server-sent-event
framing, the closing [DONE], and the usage that stream_options asks for. Kept in one place so
the two streams cannot drift apart in what a client parsing either one sees.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from moet.serve.protocol import UsageInfo

SSE_DONE = "data: [DONE]\n\n"


def sse_event(obj: BaseModel) -> str:
    return f"data: {obj.model_dump_json(exclude_none=True)}\n\n"


class EventStream:
    """The part of a streamed response that does not depend on its chunk shape. `plan` is a
    ChatPlan or a CompletionPlan: anything with `req.stream_options` and `generation()`."""

    def __init__(self, plan: Any, request_id: str):
        self.plan, self.request_id = plan, request_id
        self.gen = plan.generation(request_id)
        opts = plan.req.stream_options
        self.include_usage = bool(opts and opts.include_usage)
        self.continuous_usage = bool(opts and opts.continuous_usage_stats)
        self.usage = UsageInfo()

    def current_usage(self) -> UsageInfo:
        self.usage = self.gen.usage()
        return self.usage
