"""Structured outputs (engine/structured_output.py) through moet's engine on moet-tiny (CPU):

  * the mask: apply_bitmask against xgrammar's own apply_token_bitmask_inplace on random logits
    and random bitmasks;
  * outputs: JSON-schema, regex, choice and EBNF outputs always satisfy their constraint, greedy
    and sampled, for FP4, W2 and W2 + gate experts, with async decoding on and with MTP drafts
    (whose greedy tokens equal the drafts-off engine's);
  * a grammar left with no token finishes its sequence with finish_reason "grammar_dead_end";
  * bad constraints: RequestError naming the field at add_request (nothing queued);
  * admits_a_string on grammars with and without a finite derivation.
"""
import json
import re

import pytest
import torch

from moet.assets import MOET_TINY
from moet.config import EngineConfig
from moet.engine.llm_engine import LLMEngine
from moet.engine.structured_output import DEAD_END, admits_a_string, apply_bitmask
from moet.errors import RequestError
from moet.sampling_params import SamplingParams, StructuredOutputsParams as SO

xgr = pytest.importorskip("xgrammar")

PROMPTS = ["The capital of France is", "What is 345 + 278?", "Describe the sea.", "List three prime numbers:"]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "rank": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["city", "rank"], "additionalProperties": False}


def engine(fmt="fp4", **kw):
    kw = {"expert_format": fmt, "dtype": "float32", "device": "cpu", **kw}
    return LLMEngine.from_config(EngineConfig(model=str(MOET_TINY), **kw))


def texts(eng, sp, prompts=PROMPTS):
    done = eng.generate_all([(str(i), p, sp) for i, p in enumerate(prompts)])
    return [done[str(i)].outputs[0] for i in range(len(prompts))]


def follows_schema(text: str) -> bool:
    obj = json.loads(text)
    return (set(obj) <= {"city", "rank", "tags"} and isinstance(obj["city"], str) and len(obj["city"]) <= 12
            and isinstance(obj["rank"], int) and 0 <= obj["rank"] <= 999
            and all(t in ("a", "b") for t in obj.get("tags", [])) and len(obj.get("tags", [])) <= 3)


def test_bitmask_application_matches_xgrammar():
    g = torch.Generator().manual_seed(3)
    for vocab in (8192, 8193, 31):
        logits = torch.randn(5, vocab, generator=g)
        words = (vocab + 31) // 32
        mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, words), generator=g, dtype=torch.int64).to(torch.int32)
        rows = [4, 0, 2]
        ours = logits.clone()
        apply_bitmask(ours, rows, mask)
        ref = logits.clone()
        full = torch.full((5, words), -1, dtype=torch.int32)   # rows left out: everything allowed
        full[rows] = mask
        xgr.apply_token_bitmask_inplace(ref, full, backend="torch_native" if vocab % 32 else "cpu")
        assert torch.equal(ours, ref)
        assert torch.isinf(ours[rows]).any() and not torch.isinf(ours[[1, 3]]).any()


@pytest.mark.parametrize("fmt,kw", [("fp4", {}), ("w2", {"fp4_gate": False}), ("w2", {})],
                         ids=["fp4", "w2", "w2+gate"])
def test_outputs_satisfy_their_constraints(fmt, kw):
    eng = engine(fmt, **kw)
    cases = [
        (SO(json=SCHEMA), follows_schema),
        (SO(regex=r"(yes|no), [0-9]{2,3}!"), lambda t: re.fullmatch(r"(yes|no), [0-9]{2,3}!", t) is not None),
        (SO(choice=["Paris", "Berlin", "Warsaw"]), lambda t: t in ("Paris", "Berlin", "Warsaw")),
        (SO(grammar='root ::= "x=" [1-9] [0-9]* (";" root)?'),
         lambda t: re.fullmatch(r"x=[1-9][0-9]*(;x=[1-9][0-9]*)*", t) is not None),
        (SO(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    ]
    for so, ok in cases:
        for sp, prompts in ((SamplingParams(temperature=0.0, max_tokens=32, structured_outputs=so), PROMPTS),
                            (SamplingParams(temperature=1.0, max_tokens=32, seed=7, structured_outputs=so), PROMPTS[:2])):
            for out in texts(eng, sp, prompts):
                if out.finish_reason == "length":      # cut short: the prefix must still be one
                    continue
                assert out.finish_reason == "stop" and ok(out.text), (so.kind, out.text)
    # the whole budget on one JSON object is rare: most greedy answers close theirs
    outs = texts(eng, SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=SO(json=SCHEMA)))
    assert sum(o.finish_reason == "stop" for o in outs) >= 2, [o.text for o in outs]


def test_async_decode_and_mtp_drafts_keep_the_constraint():
    so = SO(json=SCHEMA)
    sp = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=so)
    want = [o.token_ids for o in texts(engine(async_scheduling=False), sp)]
    assert [o.token_ids for o in texts(engine(async_scheduling=True), sp)] == want
    spec = engine(speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert [o.token_ids for o in texts(spec, sp)] == want
    assert spec.stats().extra["spec_draft_tokens_total"] > 0


def test_dead_end_finishes_with_its_reason():
    eng = engine()
    # the choice is complete after one word; with EOS ignored nothing else is allowed
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, structured_outputs=SO(choice=["yes", "no"]))
    (out,) = texts(eng, sp, PROMPTS[:1])
    assert out.finish_reason == DEAD_END and out.text in ("yes", "no"), out
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks      # nothing held


@pytest.mark.parametrize("so,field", [
    (dict(json={"type": "objectx"}), "structured_outputs.json"),
    (dict(regex="(unclosed"), "structured_outputs.regex"),
    (dict(grammar='root ::= "a" root'), "structured_outputs.grammar"),
    (dict(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
])
def test_bad_constraints_are_refused_at_admission(so, field):
    eng = engine()
    with pytest.raises(RequestError) as err:
        eng.add_request("r", "hi", SamplingParams(max_tokens=4, structured_outputs=SO(**so)))
    assert err.value.param == field and field in str(err.value)
    assert not eng.requests and not eng.has_unfinished_requests()


def test_structured_outputs_params_take_one_constraint():
    with pytest.raises(RequestError, match="exactly one"):
        SO(regex="a", choice=["b"])
    with pytest.raises(RequestError, match="exactly one"):
        SO()
    with pytest.raises(RequestError, match="non-empty list"):
        SO(choice="ab")


@pytest.mark.parametrize("ebnf,admits", [
    ('root ::= "a" root', False),
    ('root ::= "a" root | "b"', True),
    ('root ::= a\na ::= b "x"\nb ::= a', False),
    ('root ::= a{0,3}\na ::= a "z"', True),
    ('root ::= ("x" [a-z]* "y"?)+ b{2,3}\nb ::= "q" | c\nc ::= c "z"', True),
    ('root ::= b+\nb ::= "q" b', False),
    ('root ::= ""', True),
])
def test_admits_a_string(ebnf, admits):
    assert admits_a_string(str(xgr.Grammar.from_ebnf(ebnf))) is admits
