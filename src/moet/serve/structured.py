"""A request's constrained decoding -> one StructuredOutputsParams for the engine (engine/
structured_output.py), built and compiled here, before the request is admitted, so that a bad
schema, regex or grammar is a 400 naming the field and never reaches the engine.

Where a constraint can come from (at most one per request):
  response_format      OpenAI's {"type": "json_object"} / {"type": "json_schema", "json_schema":
                       {"name", "schema", "strict"}}
  guided_json / guided_regex / guided_choice / guided_grammar    vLLM's older fields
  structured_outputs   vLLM's newer object: {"json" | "regex" | "choice" | "grammar" | "json_object"}
  tool_choice          "required" or a named function: the reply is only tool calls, written in
                       the server's tool-call syntax (the parser's call_pieces), each to one of the
                       tools (or the named one) with arguments that match its parameters schema,
                       so they always parse. tool_choice "auto" stays free: the model may answer in
                       prose, and a call it writes is parsed as it is.
"""
from __future__ import annotations

import json
from typing import Any

from moet.engine.structured_output import build_grammar, ebnf_literal
from moet.errors import RequestError
from moet.sampling_params import StructuredOutputsParams
from moet.serve.errors import BadRequest
from moet.serve.tool_parsers import ToolParser

MAX_CALLS = 8          # calls in one constrained reply with parallel tool calls
_FIELDS = ("json", "json_object", "regex", "choice", "grammar")


def _so(param: str, **kw) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kw)
    except RequestError as exc:
        raise BadRequest(f"{param}: {exc}", param=param) from None


def request_structured_outputs(req) -> tuple[StructuredOutputsParams, str] | None:
    """(constraint, the request field it came from), or None; BadRequest naming the field when
    there are several or one does not compile."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", _so("response_format", json_object=True)))
    elif rf is not None and rf.type == "json_schema":
        spec = rf.json_schema or {}
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise BadRequest("response_format json_schema needs json_schema.schema (a JSON schema object)",
                             param="response_format.json_schema.schema")
        found.append(("response_format.json_schema.schema", _so("response_format", json=schema)))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        v = getattr(req, name, None)
        if v is not None:
            found.append((name, _so(name, **{key: v})))
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        unknown = sorted(set(so) - set(_FIELDS) - {"backend", "disable_any_whitespace"})
        if unknown:
            raise BadRequest(f"structured_outputs: unknown key {unknown[0]!r} (moet reads {', '.join(_FIELDS)})",
                             param="structured_outputs")
        given = {k: so[k] for k in _FIELDS if so.get(k) not in (None, False)}
        found.append(("structured_outputs", _so("structured_outputs", **given)))
    if not found:
        return None
    if len(found) > 1:
        raise BadRequest(f"a request takes one output constraint; this one has {', '.join(f for f, _ in found)}",
                         param=found[1][0])
    field, so = found[0]
    check(so, field)
    return so, field


def check(so: StructuredOutputsParams, param: str) -> None:
    try:
        build_grammar(so, param=param)
    except RequestError as exc:
        raise BadRequest(str(exc), param=param) from None


# ---------------------------------------------------------------------------- tool calls

def tool_reply_constraint(parser: ToolParser, tools: list[dict[str, Any]], forced: str | None,
                          parallel: bool) -> StructuredOutputsParams:
    """The grammar of a reply that is only tool calls (module doc), as EBNF text."""
    import xgrammar as xgr

    funcs = [t.get("function", t) for t in tools]
    if forced is not None:
        funcs = [f for f in funcs if f["name"] == forced]

    def call(i: int):
        return xgr.Grammar.union(*[_pieces(xgr, parser.call_pieces(f["name"], f.get("parameters") or
                                                                    {"type": "object"}, i)) for f in funcs])

    calls = None
    for i in reversed(range(MAX_CALLS if parallel else 1)):
        if calls is None:
            calls = call(i)
        else:
            more = [_literal(xgr, parser.call_separator)] if parser.call_separator else []
            calls = xgr.Grammar.concat(call(i), _optional(xgr, xgr.Grammar.concat(*more, calls)))
    parts = [g for g in (_literal(xgr, parser.reply_open) if parser.reply_open else None, calls,
                         _literal(xgr, parser.reply_close) if parser.reply_close else None) if g is not None]
    try:
        grammar = xgr.Grammar.concat(*parts) if len(parts) > 1 else parts[0]
    except RuntimeError as exc:
        raise BadRequest(f"the tools' parameters schemas do not compile: {exc}", param="tools") from None
    so = StructuredOutputsParams(grammar=str(grammar))
    check(so, "tools")
    return so


def _literal(xgr, text: str):
    return xgr.Grammar.from_ebnf("root ::= " + ebnf_literal(text))


def _optional(xgr, g):
    return xgr.Grammar.union(g, xgr.Grammar.from_ebnf('root ::= ""'))


def _pieces(xgr, pieces: list):
    out = []
    for p in pieces:
        if isinstance(p, str):
            out.append(_literal(xgr, p))
            continue
        kind, arg = p
        if kind == "json":
            try:
                out.append(xgr.Grammar.from_json_schema(json.dumps(arg), any_whitespace=False, strict_mode=True))
            except RuntimeError as exc:
                raise BadRequest(f"a tool's parameters schema does not compile: {exc}", param="tools") from None
        elif kind == "text":
            if len(arg) != 2:
                raise ValueError(f"free text ends at a two-character marker, got {arg!r}")
            a, b = (json.dumps(c)[1:-1].replace("]", "\\]").replace("^", "\\^") for c in arg)
            out.append(xgr.Grammar.from_ebnf(f'root ::= ([^{a}] | "{a}" [^{b}])*'))
        elif kind == "choice":
            out.append(xgr.Grammar.from_ebnf("root ::= " + " | ".join(ebnf_literal(c) for c in arg)))
        elif kind == "optional":
            out.append(_optional(xgr, _pieces(xgr, arg)))
        else:
            raise ValueError(f"unknown grammar piece {kind!r}")
    return xgr.Grammar.concat(*out) if len(out) > 1 else out[0]
