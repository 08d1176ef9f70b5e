"""moet-tiny's chat format: one Jinja template (shipped in tokenizer_config.json) and a Python
renderer that produces the same text, plus the parser for the GLM-4.5 style tool calls.

Why two renderers: training renders ~10^6 conversations, and Jinja is ~10x slower than an
f-string; tests/tiny checks that both give identical text on random conversations.

Layout (GLM-4.5 flavoured; special tokens in <|...|>):
    <|bos|>[<|system|>\n{system}[\n\n]{tools block}]
    <|user|>\n{content}
    <|assistant|>\n<think>{reasoning}</think>\n{content}[\n]<tool_call>name\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n</tool_call><|end|>
    <|observation|>\n<tool_response>\n{result}\n</tool_response>
An assistant turn without reasoning renders an empty <think></think>, so the model learns
to open every answer with a (possibly empty) think block; add_generation_prompt with
enable_thinking=False pre-fills that empty block.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

BOS, EOS, PAD = "<|bos|>", "<|end|>", "<|pad|>"
SYSTEM, USER, ASSISTANT, OBSERVATION = "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"
# Control tokens: removed by decode(skip_special_tokens=True).
SPECIAL_TOKENS = [PAD, BOS, EOS, SYSTEM, USER, ASSISTANT, OBSERVATION]
# Markup tokens: single tokens, but kept by skip_special_tokens so that a server's reasoning
# and tool-call parsers see them in decoded text (as GLM-4.5's tokenizer does).
MARKUP_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                 "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>", "<tools>", "</tools>"]

TOOLS_HEADER = ("# Tools\nCall a function only when one fits the request; otherwise answer directly. "
                "Functions:\n<tools>\n")
TOOLS_FOOTER = "</tools>"

# Jinja twin of render(); whitespace is explicit ('\n' literals) so that it reads like the Python.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(sys=none) -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}{%- set ns.sys = messages[0]['content'] -%}{%- endif -%}"
    "{%- if ns.sys is not none or tools -%}"
    "{{- '<|system|>\\n' -}}"
    "{%- if ns.sys is not none -%}{{- ns.sys -}}{%- if tools -%}{{- '\\n\\n' -}}{%- endif -%}{%- endif -%}"
    "{%- if tools -%}"
    "{{- '" + TOOLS_HEADER.replace("\n", "\\n") + "' -}}"
    "{%- for t in tools -%}"
    "{%- if t['function'] is defined -%}{{- t['function'] | tojson -}}{%- else -%}{{- t | tojson -}}{%- endif -%}"
    "{{- '\\n' -}}"
    "{%- endfor -%}"
    "{{- '" + TOOLS_FOOTER + "' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}"
    "{{- '<|user|>\\n' + m['content'] -}}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{{- '<|assistant|>\\n<think>' -}}"
    "{%- if m['reasoning_content'] is defined and m['reasoning_content'] -%}{{- m['reasoning_content'] -}}{%- endif -%}"
    "{{- '</think>\\n' -}}"
    "{%- if m['content'] -%}{{- m['content'] -}}{%- endif -%}"
    "{%- if m['tool_calls'] is defined and m['tool_calls'] -%}"
    "{%- for tc in m['tool_calls'] -%}"
    "{%- if tc['function'] is defined -%}{%- set f = tc['function'] -%}{%- else -%}{%- set f = tc -%}{%- endif -%}"
    "{%- if not loop.first or m['content'] -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>' + f['name'] + '\\n' -}}"
    "{%- for k, v in f['arguments'].items() -%}"
    "{{- '<arg_key>' + k + '</arg_key>\\n<arg_value>' -}}"
    "{%- if v is string -%}{{- v -}}{%- else -%}{{- v | tojson -}}{%- endif -%}"
    "{{- '</arg_value>\\n' -}}"
    "{%- endfor -%}"
    "{{- '</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|end|>' -}}"
    "{%- elif m['role'] == 'tool' -%}"
    "{{- '<|observation|>\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|assistant|>\\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{- '<think></think>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)


@dataclass(slots=True)
class Conversation:
    """One chat example: messages in OpenAI/HF form, optional tool schemas, thinking switch."""
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    enable_thinking: bool = True
    meta: dict[str, Any] = field(default_factory=dict)  # what a probe checks (expected answer...)


def _tojson(x: Any) -> str:
    # transformers' Jinja `tojson` filter: json.dumps(ensure_ascii=False), default separators.
    return json.dumps(x, ensure_ascii=False)


def render_tool_call(name: str, arguments: dict[str, Any]) -> str:
    args = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else _tojson(v)}</arg_value>\n"
                   for k, v in arguments.items())
    return f"<tool_call>{name}\n{args}</tool_call>"


def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
           add_generation_prompt: bool = False, enable_thinking: bool = True) -> str:
    """Python twin of CHAT_TEMPLATE (same text, byte for byte)."""
    out = [BOS]
    sys = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    if sys is not None or tools:
        out.append(SYSTEM + "\n")
        if sys is not None:
            out.append(sys + ("\n\n" if tools else ""))
        if tools:
            out.append(TOOLS_HEADER)
            out.extend(_tojson(t.get("function", t)) + "\n" for t in tools)
            out.append(TOOLS_FOOTER)
    for m in messages:
        role = m["role"]
        if role == "user":
            out.append(USER + "\n" + m["content"])
        elif role == "assistant":
            out.append(ASSISTANT + "\n<think>" + (m.get("reasoning_content") or "") + "</think>\n")
            content = m.get("content") or ""
            out.append(content)
            for i, tc in enumerate(m.get("tool_calls") or []):
                f = tc.get("function", tc)
                out.append(("\n" if i or content else "") + render_tool_call(f["name"], f["arguments"]))
            out.append(EOS)
        elif role == "tool":
            out.append(OBSERVATION + "\n<tool_response>\n" + m["content"] + "\n</tool_response>")
    if add_generation_prompt:
        out.append(ASSISTANT + "\n" + ("" if enable_thinking else "<think></think>\n"))
    return "".join(out)


def render_conversation(conv: Conversation, *, add_generation_prompt: bool = False) -> str:
    return render(conv.messages, conv.tools, add_generation_prompt=add_generation_prompt,
                  enable_thinking=conv.enable_thinking)


# --- parsing what the model generated -------------------------------------------------------

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


@dataclass(slots=True)
class ParsedReply:
    reasoning: str | None
    content: str
    tool_calls: list[tuple[str, dict[str, str]]]
    valid: bool  # every <tool_call> block had a name and well-formed argument pairs


def parse_reply(text: str) -> ParsedReply:
    """Split generated assistant text (after the generation prompt) into reasoning, content and
    GLM-4.5 tool calls. Argument values stay strings (the probe compares them as strings)."""
    text = text.split(EOS)[0]
    reasoning = None
    if "</think>" in text:
        head, text = text.split("</think>", 1)
        reasoning = head.replace("<think>", "", 1).strip()
    calls, valid = [], True
    for block in _TOOL_CALL.findall(text):
        name, _, rest = block.partition("\n")
        name = name.strip()
        args = {k.strip(): v for k, v in _ARG.findall(rest)}
        leftover = _ARG.sub("", rest).strip()
        if not name or leftover:
            valid = False
        calls.append((name, args))
    if text.count("<tool_call>") != len(calls):
        valid = False  # an unterminated call
    content = _TOOL_CALL.sub("", text).split("<tool_call>")[0].strip()
    return ParsedReply(reasoning, content, calls, valid)
