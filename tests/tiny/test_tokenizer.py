"""moet-tiny's tokenizer and chat template: offline AutoTokenizer, template == Python renderer,
tools rendered into the prompt, GLM-4.5 tool calls round-trip through the parser."""
from __future__ import annotations

import random

import pytest

from moet.probe import arithmetic, chat_format, facts, tools


@pytest.fixture(scope="module")
def tok(ckpt):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(ckpt))


def test_special_tokens_match_config(tok, config):
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (chat_format.BOS, chat_format.EOS, chat_format.PAD)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        config["bos_token_id"], config["eos_token_id"], config["pad_token_id"])
    assert len(tok) == config["vocab_size"]
    for t in chat_format.SPECIAL_TOKENS + chat_format.MARKUP_TOKENS:
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t


def test_text_round_trip_and_digit_split(tok):
    text = "def f(x):\n    return x * 12345  # ünïcode ok\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert [tok.decode([i]) for i in tok.encode("2025", add_special_tokens=False)] == ["2", "0", "2", "5"]


def test_template_equals_python_renderer_on_random_conversations(tok):
    rng = random.Random(7)
    for i in range(120):
        conv = (tools.sample, facts.sample, arithmetic.sample)[i % 3](rng)
        for gen in (False, True):
            msgs = conv.messages[:-1] if gen else conv.messages
            hf = tok.apply_chat_template(msgs, tools=conv.tools, tokenize=False, add_generation_prompt=gen,
                                         enable_thinking=conv.enable_thinking)
            assert hf == chat_format.render(msgs, conv.tools, add_generation_prompt=gen,
                                            enable_thinking=conv.enable_thinking)


def test_tools_are_rendered_into_the_prompt_and_calls_round_trip(tok):
    conv = tools.eval_cases(5)[0]
    assert conv.meta["kind"] == "call"
    prompt = tok.apply_chat_template(conv.messages, tools=conv.tools, tokenize=False, add_generation_prompt=True)
    for t in conv.tools:
        assert t["function"]["name"] in prompt
    assert prompt.startswith(chat_format.BOS + chat_format.SYSTEM) and prompt.endswith(chat_format.ASSISTANT + "\n")
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": conv.meta["name"], "arguments": conv.meta["arguments"]}}]}
    full = tok.apply_chat_template(conv.messages + [call], tools=conv.tools, tokenize=False)
    ids = tok.encode(full, add_special_tokens=False)
    reply = tok.decode(ids, skip_special_tokens=False).split(chat_format.ASSISTANT + "\n")[-1]
    parsed = chat_format.parse_reply(reply)
    assert parsed.valid and parsed.tool_calls == [(conv.meta["name"], {k: str(v) for k, v in conv.meta["arguments"].items()})]
    # markup survives skip_special_tokens (a server's tool parser needs it), role tokens do not
    kept = tok.decode(ids, skip_special_tokens=True)
    assert "<tool_call>" in kept and chat_format.ASSISTANT not in kept


def test_tokenized_template_equals_encoding_of_rendered_text(tok):
    conv = facts.sample(random.Random(1))
    ids = tok.apply_chat_template(conv.messages, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert list(ids) == tok.encode(chat_format.render_conversation(conv), add_special_tokens=False)
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id


def test_thinking_switch(tok):
    msgs = [{"role": "user", "content": "What is 12 + 30?"}]
    on = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    off = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert on.endswith("<|assistant|>\n") and off.endswith("<|assistant|>\n<think></think>\n")
    r = chat_format.parse_reply("<think>ones: 2 + 0 = 2</think>\n12 + 30 = 42<|end|>")
    assert r.reasoning == "ones: 2 + 0 = 2" and r.content == "12 + 30 = 42" and not r.tool_calls
