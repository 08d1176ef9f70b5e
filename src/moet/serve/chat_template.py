"""OpenAI chat messages -> the prompt text, through the checkpoint's own chat template
(transformers apply_chat_template).

OpenAI and chat templates disagree on a few shapes, fixed here:
  - content given as a list of parts becomes one string (text parts only);
  - the assistant's earlier tool calls carry `arguments` as a JSON string in OpenAI's API, but
    templates iterate them as a mapping (GLM-4.5, moet-tiny, Qwen3) - they are parsed to dicts,
    as vLLM does; a template that concatenates them as text (DeepSeek-V3) is retried with the
    strings when the dicts make it fail;
  - `developer` is OpenAI's newer name for `system`.
"""
from __future__ import annotations

import json
from typing import Any

from moet.serve.errors import BadRequest
from moet.serve.protocol import ChatMessage, ChatTool


def _text(content, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    parts = []
    for p in content:
        if p.type != "text" or p.text is None:
            raise BadRequest(f"{where}: content part of type {p.type!r} is not supported (text only)",
                             param="messages")
        parts.append(p.text)
    return "".join(parts)


def template_messages(messages: list[ChatMessage], *, arguments_as_dicts: bool = True) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                             "content": _text(m.content, f"messages[{i}]")}
        if m.role != "assistant" and d["content"] is None:
            raise BadRequest(f"messages[{i}] ({m.role}) has no content", param="messages")
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning_content:
            # under both names templates read it by: reasoning_content (GLM, Qwen3, DeepSeek) and
            # thinking (gpt-oss's harmony template renders it as the turn's analysis message)
            d["reasoning_content"] = d["thinking"] = m.reasoning_content
        if m.tool_calls:
            calls = []
            for j, tc in enumerate(m.tool_calls):
                args: Any = tc.function.arguments
                if arguments_as_dicts:
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError as exc:
                        raise BadRequest(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON "
                                         f"({exc.msg})", param="messages") from None
                    if not isinstance(args, dict):
                        raise BadRequest(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object",
                                         param="messages")
                calls.append({"id": tc.id, "type": "function",
                              "function": {"name": tc.function.name, "arguments": args}})
            d["tool_calls"] = calls
        out.append(d)
    return out


def render_chat(render, messages: list[ChatMessage], tools: list[ChatTool] | None, *,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text. `render(**kwargs)` is apply_chat_template(tokenize=False, **kwargs) with the
    template and the guards the server chose (ServerState.render_template)."""
    if continue_final_message and add_generation_prompt:
        raise BadRequest("continue_final_message and add_generation_prompt cannot both be true")
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    kwargs = dict(template_kwargs or {})
    for reserved in ("messages", "conversation", "tools", "tokenize", "add_generation_prompt",
                     "continue_final_message", "chat_template", "return_dict", "return_assistant_tokens_mask"):
        kwargs.pop(reserved, None)
    last_exc: Exception | None = None
    for as_dicts in (True, False):
        try:
            return render(conversation=template_messages(messages, arguments_as_dicts=as_dicts), tools=tool_dicts,
                          add_generation_prompt=add_generation_prompt,
                          continue_final_message=continue_final_message, **kwargs)
        except BadRequest:
            raise
        except Exception as exc:  # jinja2 raises many types (TemplateError, TypeError, ...)
            last_exc = exc
            if not any(m.tool_calls for m in messages):
                break
    raise BadRequest(f"the chat template rejected these messages: {type(last_exc).__name__}: {last_exc}",
                     param="messages")
