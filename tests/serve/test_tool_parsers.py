"""Tool-call parsers: complete parsing per format, and streaming that (1) equals the complete
parse under any chunking of the text and (2) never emits half a call or markup as content."""
from __future__ import annotations

import json
import random

import pytest

from moet.serve.tool_parsers import TOOL_PARSERS, default_tool_parser, get_tool_parser
from moet.errors import ConfigError

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "zip": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "search", "parameters": {
             "type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object"}}}}}]

GLM = ("I'll check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>São Paulo</arg_value>\n"
       "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>metric</arg_key>\n<arg_value>true</arg_value>\n"
       "<arg_key>zip</arg_key>\n<arg_value>01000</arg_value>\n</tool_call>\n<tool_call>search\n"
       "<arg_key>query</arg_key>\n<arg_value>a <b> c</arg_value>\n<arg_key>filters</arg_key>\n"
       "<arg_value>{\"lang\": \"pt\"}</arg_value>\n</tool_call>")
GLM_CALLS = [("get_weather", {"city": "São Paulo", "days": 3, "metric": True, "zip": "01000"}),
             ("search", {"query": "a <b> c", "filters": {"lang": "pt"}})]

HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
          '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>')
HERMES_CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("search", {"query": "x"})]

DSV3 = ("Sure<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Oslo", "days": 1}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n'
        '```json\n{"query": "fjords"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
DSV3_CALLS = [("get_weather", {"city": "Oslo", "days": 1}), ("search", {"query": "fjords"})]
DSV31 = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Lima"}<｜tool▁call▁end｜>'
         '<｜tool▁calls▁end｜>')

KIMI = ('Checking<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
        '{"city": "Kyiv"}<|tool_call_end|><|tool_call_begin|>functions.search:1<|tool_call_argument_begin|>'
        '{"query": "borscht"}<|tool_call_end|><|tool_calls_section_end|>')
KIMI_CALLS = [("get_weather", {"city": "Kyiv"}), ("search", {"query": "borscht"})]

GLM47 = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key><arg_value>4</arg_value></tool_call>"

MINIMAX = ('Let me check.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">São Paulo'
           '</parameter>\n<parameter name="days">3</parameter>\n<parameter name="metric">true</parameter>\n</invoke>\n'
           '<invoke name="search">\n<parameter name="query">a <b> c</parameter>\n<parameter name="filters">'
           '{"lang": "pt"}</parameter>\n</invoke>\n</minimax:tool_call>')
MINIMAX_CALLS = [("get_weather", {"city": "São Paulo", "days": 3, "metric": True}),
                 ("search", {"query": "a <b> c", "filters": {"lang": "pt"}})]

# gpt-oss: a harmony message to functions.NAME, as the harmony reasoning parser hands it on
OPENAI = 'to=functions.get_weather<|message|>{"city": "Oslo", "days": 2}<|call|>'

CASES = [("openai", OPENAI, "", [("get_weather", {"city": "Oslo", "days": 2})]),
         ("minimax_m2", MINIMAX, "Let me check.", MINIMAX_CALLS), ("glm45", GLM, "I'll check.", GLM_CALLS), ("glm47", GLM47, "", [("get_weather", {"city": "Oslo", "days": 4})]), ("hermes", HERMES, "Let me look.", HERMES_CALLS),
         ("deepseek_v3", DSV3, "Sure", DSV3_CALLS), ("deepseek_v3", DSV31, "", [("get_weather", {"city": "Lima"})]),
         ("kimi_k2", KIMI, "Checking", KIMI_CALLS)]


def _calls(delta):
    return [(c.name, json.loads(c.arguments)) for c in delta.calls]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_complete_parse(name, text, content, calls):
    out = get_tool_parser(name)(TOOLS).parse(text)
    assert out.content == content
    assert _calls(out) == calls


def test_kimi_keeps_its_call_ids():
    out = get_tool_parser("kimi_k2")(TOOLS).parse(KIMI)
    assert [c.id for c in out.calls] == ["functions.get_weather:0", "functions.search:1"]


def _chunkings(text: str, rng: random.Random):
    yield list(text)                                   # one character at a time
    yield [text]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(1, min(12, len(text) - 1))))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_stream_equals_complete_and_never_emits_half_a_call(name, text, content, calls):
    parser_cls = get_tool_parser(name)
    markers = ["<tool_call", "<arg_", "<｜", "<|tool", "</tool_call"]
    for chunks in _chunkings(text, random.Random(hash(name) % 1000)):
        s = parser_cls(TOOLS).stream()
        got_content, got_calls = "", []
        for ch in chunks:
            d = s.feed(ch)
            for c in d.calls:  # each call arrives whole: complete JSON, a name from the text
                assert isinstance(json.loads(c.arguments), dict)
            got_content += d.content
            got_calls += _calls(d)
            assert not any(m in got_content for m in markers), got_content
        d = s.finish()
        got_content += d.content
        got_calls += _calls(d)
        assert got_content == content and got_calls == calls


@pytest.mark.parametrize("name", sorted(set(TOOL_PARSERS) - {"glm47", "deepseek_v31"}))
def test_unterminated_call_comes_back_as_text(name):
    p = get_tool_parser(name)(TOOLS)
    opener = p.call_prefix("get_weather")
    text = "Answer: " + opener + "half"
    out = p.parse(text)
    assert out.calls == [] and out.content == text


def test_malformed_block_is_content_and_later_calls_still_parse():
    p = get_tool_parser("hermes")(TOOLS)
    text = '<tool_call>{not json}</tool_call>\n<tool_call>{"name": "search", "arguments": {"query": "q"}}</tool_call>'
    out = p.parse(text)
    assert out.content == "<tool_call>{not json}</tool_call>"
    assert _calls(out) == [("search", {"query": "q"})]
    bad_glm = get_tool_parser("glm45")(TOOLS).parse("<tool_call>get weather\n</tool_call>")
    assert bad_glm.calls == [] and "<tool_call>" in bad_glm.content


def test_plain_text_passes_through_and_keeps_inner_whitespace():
    p = get_tool_parser("glm45")(TOOLS)
    out = p.parse("  Hello,\n\nworld <tool not a call>  \n")
    assert out.content == "Hello,\n\nworld <tool not a call>" and out.calls == []
    mixed = p.parse("Before\n<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>q</arg_value>\n</tool_call>\nAfter")
    assert mixed.content == "Before\n\nAfter" and _calls(mixed) == [("search", {"query": "q"})]


def test_glm_values_follow_the_schema():
    p = get_tool_parser("glm45")(TOOLS)
    out = p.parse("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>123</arg_value>\n"
                  "<arg_key>days</arg_key>\n<arg_value>seven</arg_value>\n<arg_key>other</arg_key>\n"
                  "<arg_value>42</arg_value>\n</tool_call>")
    # string-typed stays a string even if it looks numeric; an unparsable integer stays text;
    # an argument the schema does not know stays text
    assert _calls(out) == [("get_weather", {"city": "123", "days": "seven", "other": "42"})]


def test_forced_prefix_then_model_continuation_parses():
    for name, cont in [("glm45", "<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call>"),
                       ("hermes", '{"city": "Rome"}}\n</tool_call>'),
                       ("deepseek_v3", '{"city": "Rome"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
                       ("kimi_k2", '{"city": "Rome"}<|tool_call_end|><|tool_calls_section_end|>'),
                       ("minimax_m2", '<parameter name="city">Rome</parameter>\n</invoke>\n</minimax:tool_call>')]:
        p = get_tool_parser(name)(TOOLS)
        out = p.parse(p.call_prefix("get_weather") + cont)
        assert _calls(out) == [("get_weather", {"city": "Rome"})], name


def test_registry_and_defaults():
    with pytest.raises(ConfigError, match="unknown"):
        get_tool_parser("nope")
    from transformers import AutoTokenizer

    from moet.assets import default_model
    tok = AutoTokenizer.from_pretrained(default_model())
    assert default_tool_parser(tok.chat_template, "DeepseekV3ForCausalLM") == "glm45"   # markup decides
    assert default_tool_parser("{{ '<tool_call>' }}", None) == "hermes"
    assert default_tool_parser("<｜tool▁calls▁begin｜>", "DeepseekV3ForCausalLM") == "deepseek_v3"
    assert default_tool_parser(None, "Glm4MoeForCausalLM") == "glm45"
    assert default_tool_parser(None, "GlmMoeDsaForCausalLM") == "glm45"
    assert default_tool_parser(None, "DeepseekV3ForCausalLM") is None                  # ambiguous: Kimi or DeepSeek
    assert default_tool_parser(None, "MiniMaxM2ForCausalLM") == "minimax_m2"
    assert default_tool_parser("{{ '<minimax:tool_call>' }}{{ '<tool_call>' }}", None) == "minimax_m2"


def test_minimax_invoke_with_stray_text_is_content():
    p = get_tool_parser("minimax_m2")(TOOLS)
    out = p.parse('<minimax:tool_call>\n<invoke name="search">oops<parameter name="query">q</parameter></invoke>\n'
                  '<invoke name="search"><parameter name="query">ok</parameter></invoke>\n</minimax:tool_call>')
    assert _calls(out) == [("search", {"query": "ok"})] and "oops" in out.content


@pytest.mark.parametrize("name", ["minimax_m2", "glm45"])
def test_forced_call_grammar_accepts_what_the_parser_reads(name):
    """tool_choice required (serve/structured.py): the grammar built from the parser's call pieces
    accepts a reply the parser reads back as the same calls, and refuses one with an argument of
    the wrong type or a function the tools do not have."""
    xgr = pytest.importorskip("xgrammar")
    from moet.serve.structured import tool_reply_constraint
    p = get_tool_parser(name)(TOOLS)
    grammar = xgr.Grammar.from_ebnf(tool_reply_constraint(p, TOOLS, None, parallel=True).grammar)
    accepts = lambda text: xgr.testing._is_grammar_accept_string(grammar, text)  # noqa: E731
    if name == "minimax_m2":
        good = ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
                '<parameter name="days">3</parameter>\n</invoke>\n<invoke name="search">\n'
                '<parameter name="query">q</parameter>\n</invoke>\n</minimax:tool_call>')
        bad = [good.replace(">3<", ">three<"), good.replace('"search"', '"browse"')]
    else:
        good = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>"
                "\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>search\n<arg_key>query</arg_key>\n"
                "<arg_value>q</arg_value>\n</tool_call>")
        bad = [good.replace(">3<", ">three<"), good.replace(">search\n", ">browse\n")]
    assert accepts(good) and not any(accepts(b) for b in bad)
    assert _calls(p.parse(good)) == [("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": "q"})]


def test_forced_harmony_call_grammar_accepts_what_the_parser_reads():
    """gpt-oss (openai): one call a reply (<|call|> ends the turn); JSON arguments of the schema."""
    xgr = pytest.importorskip("xgrammar")
    from moet.serve.structured import tool_reply_constraint
    p = get_tool_parser("openai")(TOOLS)
    grammar = xgr.Grammar.from_ebnf(tool_reply_constraint(p, TOOLS, None, parallel=False).grammar)
    accepts = lambda text: xgr.testing._is_grammar_accept_string(grammar, text)  # noqa: E731
    good = ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}'
            '<|call|>')
    bad = [good.replace("3}", '"three"}'), good.replace("get_weather", "browse")]
    assert accepts(good) and not any(accepts(b) for b in bad)
    assert _calls(p.parse(good)) == [("get_weather", {"city": "Paris", "days": 3})]
