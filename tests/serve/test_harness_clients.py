"""Evaluation harnesses as real clients of `moet serve`: lm-eval (EleutherAI's lm-evaluation-harness)
runs its `local-completions` and `local-chat-completions` models against the real server (moet-tiny
on CPU, float32, the default experts: W2 with the FP4 gate, prompts computed with FP4 experts) on
small tasks the test writes into tmp_path (a task YAML over a local JSONL file).

- Log-likelihood (multiple choice): lm-eval scores each choice through /v1/completions with
  `echo: true, logprobs: 1, max_tokens: 1` over token-id prompts, four prompts to a request, and
  sums the echoed logprobs of the continuation. The questions are ones moet-tiny answers (capitals,
  one digit step of its addition scratchpad; MODEL_CARD.md), the right choice at every position, so
  the accuracy must be 1.0 where chance is 0.25; and every log-likelihood lm-eval computed must equal
  moet's own engine's (moet.LLM with the same config, prompt_logprobs over the same token ids).
- Generation (generate_until + exact_match): through /v1/completions (token ids, stop strings,
  batched) and /v1/chat/completions (lm-eval renders nothing: the server's chat template, with the
  reasoning split off so the answer is the content).

Every request lm-eval made is recorded at the server and must have been answered 200."""
from __future__ import annotations

import json
import math

import httpx
import lm_eval
import pytest
import yaml
from lm_eval.tasks import TaskManager

from moet import LLM, SamplingParams
from tests.serve.tiny_server import MODEL, tiny_server

pytestmark = pytest.mark.slow

ENGINE = dict(dtype="float32", max_model_len=512, max_num_seqs=8, kv_cache_memory_gb=0.25)
BATCH = 4          # prompts per /v1/completions request (lm-eval's batch_size)

CAPITALS = [("Poland", "Warsaw"), ("Japan", "Tokyo"), ("France", "Paris"), ("Chile", "Santiago"),
            ("Kenya", "Nairobi"), ("Egypt", "Cairo")]
CITIES = [c for _, c in CAPITALS]
# (a, b): the first line of moet-tiny's addition scratchpad, "ones: x + y =", answered by one digit
SUMS = [(12, 35), (56, 31)]


def _mc_docs() -> list[dict]:
    """Multiple-choice questions in moet-tiny's chat format, up to the answer's first word; the
    right choice at a different position each time."""
    docs = []
    for i, (country, city) in enumerate(CAPITALS):
        wrong = [c for c in CITIES if c != city][i % 3:i % 3 + 3]
        docs.append({"question": f"What is the capital of {country}?",
                     "lead": f"<think></think>\nThe capital city of {country} is", "right": city, "wrong": wrong})
    for a, b in SUMS:
        x, y = a % 10, b % 10
        docs.append({"question": f"{a} + {b} = ?",
                     "lead": f"<think>Add {a} and {b} digit by digit from the right.\nones: {x} + {y} =",
                     "right": str(x + y), "wrong": [str(x + y + 1), str(x + y - 1), str(x + y + 2)]})
    for i, d in enumerate(docs):
        label = i % 4
        d["choices"] = d["wrong"][:label] + [d["right"]] + d["wrong"][label:]
        d["label"] = label
    return docs


def _write_task(tmp_path, name: str, docs: list[dict], **config) -> None:
    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    task = {"task": name, "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(tmp_path / "hf_datasets")},
            "test_split": "test", **config}
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(task, sort_keys=False))


def _completions_args(url: str, concurrent: int = 1) -> str:
    # add_bos_token: moet-tiny's chat template starts every conversation with <|bos|>
    return (f"model=moet-tiny,base_url={url}/v1/completions,tokenizer_backend=huggingface,tokenizer={MODEL},"
            f"num_concurrent={concurrent},max_retries=1,batch_size={BATCH},add_bos_token=True,"
            f"max_length={ENGINE['max_model_len']}")


def _all_answered(records, path: str, expected: int) -> None:
    assert [r.path for r in records] == [path] * expected, [(r.method, r.path, r.status) for r in records]
    assert all(r.status == 200 for r in records), [r.status for r in records]


@pytest.fixture(scope="module")
def server():
    with tiny_server(**ENGINE) as s:
        yield s


@pytest.fixture(scope="module")
def mc_run(server, tmp_path_factory):
    """The multiple-choice task through local-completions, once: (results, docs, the requests)."""
    srv, recorder = server
    tmp = tmp_path_factory.mktemp("lm_eval_mc")
    docs = _mc_docs()
    _write_task(tmp, "moet_tiny_mc", docs, output_type="multiple_choice",
                doc_to_text="<|user|>\n{{question}}<|assistant|>\n{{lead}}", doc_to_choice="{{choices}}",
                doc_to_target="label", metric_list=[{"metric": "acc"}])
    mark = len(recorder)
    results = lm_eval.simple_evaluate(model="local-completions", model_args=_completions_args(srv.url),
                                      tasks=["moet_tiny_mc"], task_manager=TaskManager(include_path=str(tmp),
                                                                                       include_defaults=False),
                                      log_samples=True, bootstrap_iters=0)
    return results, docs, recorder.since(mark)


def test_lm_eval_loglikelihood_multiple_choice_scores_what_moet_tiny_knows(mc_run):
    results, docs, records = mc_run
    choices = sum(len(d["choices"]) for d in docs)
    _all_answered(records, "/v1/completions", math.ceil(choices / BATCH))
    r = results["results"]["moet_tiny_mc"]
    assert r["sample_len"] == len(docs)
    assert r["acc,none"] == 1.0, results["samples"]["moet_tiny_mc"]        # chance: 0.25
    for s in results["samples"]["moet_tiny_mc"]:
        lls = [ll for ll, _ in s["filtered_resps"]]
        right = lls[s["doc"]["label"]]
        assert right > -1.0 and all(ll < right - 3.0 for i, ll in enumerate(lls) if i != s["doc"]["label"]), s


def test_what_lm_eval_sends_for_loglikelihood(mc_run, server):
    """Token-id prompts, BATCH to a request, echo + logprobs 1 + max_tokens 1; the answer has the
    prompt's tokens with their logprobs (None for the first: nothing predicts it), a top-1 dict per
    position, then the generated token. max_tokens 0 scores the same prompt identically."""
    _, _, records = mc_run
    bodies = [r.json() for r in records]
    for b in bodies:
        assert b["echo"] is True and b["logprobs"] == 1 and b["max_tokens"] == 1 and b["temperature"] == 0
        assert isinstance(b["prompt"], list) and all(isinstance(p, list) and all(isinstance(t, int) for t in p)
                                                     for p in b["prompt"])
    assert max(len(b["prompt"]) for b in bodies) == BATCH
    body = bodies[0]
    url = server[0].url + "/v1/completions"
    one = httpx.post(url, json=body, timeout=120).json()
    zero = httpx.post(url, json={**body, "max_tokens": 0}, timeout=120).json()
    assert zero["usage"]["completion_tokens"] == 0 and one["usage"]["completion_tokens"] == len(body["prompt"])
    for c1, c0, prompt in zip(one["choices"], zero["choices"], body["prompt"]):
        lp1, lp0 = c1["logprobs"], c0["logprobs"]
        assert len(lp1["token_logprobs"]) == len(prompt) + 1 and len(lp0["token_logprobs"]) == len(prompt)
        assert lp1["token_logprobs"][0] is None and lp1["top_logprobs"][0] is None
        assert all(isinstance(t, dict) and len(t) == 1 for t in lp1["top_logprobs"][1:])
        assert lp0["tokens"] == lp1["tokens"][:-1] and lp0["token_logprobs"][0] is None
        assert lp0["token_logprobs"][1:] == pytest.approx(lp1["token_logprobs"][1:-1], abs=1e-6)


def test_lm_eval_loglikelihoods_equal_the_engines_own(mc_run):
    """Every (context, continuation) lm-eval scored, over the token ids it sent, against moet.LLM
    with the server's engine config: prompt_logprobs summed over the continuation, and whether
    each continuation token was the most likely one (lm-eval's is_greedy)."""
    results, _, records = mc_run
    sent = {tuple(p) for r in records for p in r.json()["prompt"]}
    pairs = [(args, resp) for s in results["samples"]["moet_tiny_mc"]
             for args, resp in zip(s["arguments"], s["filtered_resps"])]
    assert len(pairs) == sum(len(s["doc"]["choices"]) for s in results["samples"]["moet_tiny_mc"])
    with LLM(MODEL, device="cpu", **ENGINE) as llm:
        tok = llm.tokenizer
        prompts, ctx_lens = [], []
        for (context, continuation), _ in pairs:
            ctx = tok(context).input_ids                       # with <|bos|>, as add_bos_token asks
            whole = tok(context + continuation).input_ids
            assert whole[:len(ctx)] == ctx and len(whole) > len(ctx)
            prompts.append(whole)
            ctx_lens.append(len(ctx))
        assert {tuple(p) for p in prompts} == sent             # the same token ids went over the wire
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    for ((context, continuation), (ll, greedy)), out, ids, n in zip(pairs, outs, prompts, ctx_lens):
        positions = [out.prompt_logprobs[i][ids[i]] for i in range(n, len(ids))]
        ref = sum(p.logprob for p in positions)
        # float32 both sides; the server's steps batch other prompts than the reference's, so the
        # sums may differ in the last bits, not more
        assert abs(ll - ref) <= 1e-5 * max(1.0, abs(ref)), (context, continuation, ll, ref)
        assert greedy == all(p.rank == 1 for p in positions), (context, continuation)


def test_lm_eval_generate_until_through_completions(server, tmp_path):
    """Token-id prompts in batches, `until` stop strings (lm-eval adds the eos text), exact_match;
    two requests in flight at once (lm-eval's asynchronous client)."""
    srv, recorder = server
    docs = [{"country": c, "answer": a} for c, a in CAPITALS]
    _write_task(tmp_path, "moet_tiny_gen", docs, output_type="generate_until",
                doc_to_text="<|user|>\nWhat is the capital of {{country}}?<|assistant|>\n<think></think>\n"
                            "The capital city of {{country}} is",
                doc_to_target="{{answer}}", generation_kwargs={"until": ["."], "max_gen_toks": 8},
                filter_list=[{"name": "strip", "filter": [{"function": "remove_whitespace"},
                                                          {"function": "take_first"}]}],
                metric_list=[{"metric": "exact_match"}])
    mark = len(recorder)
    results = lm_eval.simple_evaluate(model="local-completions", model_args=_completions_args(srv.url, 2),
                                      tasks=["moet_tiny_gen"], task_manager=TaskManager(include_path=str(tmp_path),
                                                                                        include_defaults=False),
                                      log_samples=True, bootstrap_iters=0)
    records = recorder.since(mark)
    _all_answered(records, "/v1/completions", math.ceil(len(docs) / BATCH))
    for b in (r.json() for r in records):
        assert b["max_tokens"] == 8 and "." in b["stop"] and all(isinstance(p, list) for p in b["prompt"])
    assert results["results"]["moet_tiny_gen"]["exact_match,strip"] == 1.0, results["samples"]["moet_tiny_gen"]


def test_lm_eval_generate_until_through_chat_completions(server, tmp_path):
    """local-chat-completions with apply_chat_template: messages go to the server, whose template
    renders them; moet-tiny reasons in <think> for arithmetic, which comes back as
    reasoning_content, so the content lm-eval reads is the answer line alone."""
    srv, recorder = server
    docs = [{"question": f"What is the capital of {c}?", "answer": a} for c, a in CAPITALS[:3]]
    docs += [{"question": f"{a} + {b} = ?", "answer": str(a + b)} for a, b in SUMS]
    _write_task(tmp_path, "moet_tiny_chat", docs, output_type="generate_until", doc_to_text="{{question}}",
                doc_to_target="{{answer}}", generation_kwargs={"until": ["\n\n"], "max_gen_toks": 80},
                filter_list=[{"name": "answer", "filter": [{"function": "regex", "regex_pattern": r"(?:is|=) (\w+)"},
                                                           {"function": "take_first"}]}],
                metric_list=[{"metric": "exact_match"}])
    mark = len(recorder)
    results = lm_eval.simple_evaluate(
        model="local-chat-completions",
        model_args=f"model=moet-tiny,base_url={srv.url}/v1/chat/completions,num_concurrent=1,max_retries=1",
        tasks=["moet_tiny_chat"], task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        apply_chat_template=True, log_samples=True, bootstrap_iters=0)
    records = recorder.since(mark)
    _all_answered(records, "/v1/chat/completions", len(docs))
    for b in (r.json() for r in records):
        assert b["messages"][-1]["role"] == "user" and b["max_tokens"] == 80
    samples = results["samples"]["moet_tiny_chat"]
    assert results["results"]["moet_tiny_chat"]["exact_match,answer"] == 1.0, samples
    for s in samples:
        content = s["resps"][0][0]
        assert "think>" not in content and "ones:" not in content, s     # the scratchpad stayed out
