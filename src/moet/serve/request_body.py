"""A request body, from the socket to a validated pydantic model, without letting one client
hurt the others.

- The byte limit (--max-request-bytes) is enforced while reading: a Content-Length over it is
  refused before a byte of the body is read, and a body sent without one (chunked) is dropped the
  moment it passes the limit. A client cannot make the server buffer more than the limit.
- Parsing and validation run off the event loop (the caller hands `parse_request` to a worker
  thread): a 10 MB body takes json.loads and pydantic tens of milliseconds, which every stream
  would otherwise wait through.
- What is not JSON as RFC 8259 defines it is a 400 naming the problem: bytes that are not UTF-8,
  NaN / Infinity literals, strings with lone UTF-16 surrogates (which JSON's \\uD800 escapes can
  smuggle in and which no tokenizer can encode), and nesting deeper than MAX_DEPTH.
- Validation failures are 400s (OpenAI's and vLLM's status), naming the field.
"""
from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ValidationError

from moet.serve.errors import BadRequest, TooLarge

MAX_DEPTH = 64     # far beyond any OpenAI request's shape; deep enough for nested JSON-schema tools

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


async def read_body(receive_stream, content_length: str | None, max_bytes: int) -> bytes:
    """The body of a request whose chunks `receive_stream` yields (Starlette's request.stream()),
    refusing anything over max_bytes before reading past it."""
    if content_length is not None:
        try:
            declared = int(content_length)
        except ValueError:
            raise BadRequest(f"Content-Length {content_length!r} is not a number") from None
        if declared > max_bytes:
            raise TooLarge(f"request body of {declared} bytes is over the limit of {max_bytes} (--max-request-bytes)")
    parts, size = [], 0
    async for chunk in receive_stream:
        size += len(chunk)
        if size > max_bytes:
            raise TooLarge(f"request body is over the limit of {max_bytes} bytes (--max-request-bytes)")
        parts.append(chunk)
    return b"".join(parts)


def _reject_constant(name: str):
    raise BadRequest(f"the request body is not valid JSON: {name} is not a JSON number")


def _check_tree(value: Any, depth: int, path: str, surrogates: bool) -> None:
    """Depth and (when the body had surrogate escapes) string encodability, iteratively in the
    common flat case and recursively only as deep as MAX_DEPTH allows."""
    if depth > MAX_DEPTH:
        raise BadRequest(f"the request body nests deeper than {MAX_DEPTH} levels (at {path or 'the top'})")
    if isinstance(value, dict):
        for k, v in value.items():
            if surrogates:
                _check_string(k, f"{path}.{k}" if path else str(k))
            if isinstance(v, (dict, list)) or (surrogates and isinstance(v, str)):
                _check_tree(v, depth + 1, f"{path}.{k}" if path else str(k), surrogates)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if isinstance(v, (dict, list)) or (surrogates and isinstance(v, str)):
                _check_tree(v, depth + 1, f"{path}[{i}]", surrogates)
    elif isinstance(value, str) and surrogates:
        _check_string(value, path)


def _check_string(s: str, path: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"{path}: the string holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
                         "which is not text", param=path.split(".")[0].split("[")[0] or None) from None


def parse_json(body: bytes) -> dict:
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON ({exc})") from None
    except RecursionError:
        raise BadRequest(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    _check_tree(data, 1, "", surrogates=_SURROGATE_ESCAPE.search(body) is not None)
    return data


def _validation_message(err: ValidationError) -> tuple[str, str | None]:
    parts, first = [], None
    for e in err.errors()[:5]:
        loc = ".".join(str(x) for x in e["loc"] if not str(x).startswith("function-after"))
        first = first or (str(e["loc"][0]) if e["loc"] else None)
        parts.append(f"{loc or 'body'}: {e['msg']}")
    return "; ".join(parts), first


def validate(model: type[BaseModel], data: dict) -> BaseModel:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        msg, param = _validation_message(exc)
        raise BadRequest(msg, param=param) from None


def parse_request(body: bytes, model: type[BaseModel]) -> BaseModel:
    """Bytes -> a validated request model; every failure a BadRequest."""
    return validate(model, parse_json(body))
