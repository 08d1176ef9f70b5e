"""The offline API: LLM(...).generate(prompts, SamplingParams(...)) with vLLM's shapes."""

import pytest
import torch

from moet.config import EngineConfig
from moet.errors import ConfigError
from moet.llm import LLM
from moet.outputs import Logprob
from moet.sampling_params import SamplingParams
from moet.testing.tiny_checkpoint import EOS, cached_checkpoint, reference_model

PROMPT = "The quick brown fox jumps"
# An explicit KV cache size for every engine here: left to gpu_memory_utilization, each engine on a
# GPU claims 90% of the card, and this module holds several at once (the module's `llm` beside the
# one a test builds; pytest-xdist workers on the same GPU besides). Plenty for these prompts, on CPU too.
KV_GB = 0.05


@pytest.fixture(scope="module")
def path():
    return cached_checkpoint("glm4_moe")


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, expert_format="bf16", dtype="float32", kv_cache_memory_gb=KV_GB)


def test_string_and_token_prompts_agree(llm):
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    a = llm.generate(PROMPT, sp)[0]
    b = llm.generate([{"prompt_token_ids": a.prompt_token_ids}], sp)[0]
    assert a.prompt_token_ids == list(PROMPT.encode())  # byte-level tokenizer: ids are the bytes
    assert a.prompt == PROMPT and b.prompt is None
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) == 8
    assert a.outputs[0].text == llm.tokenizer.decode(a.outputs[0].token_ids)
    assert a.outputs[0].finish_reason == "length"


def test_prompt_logprobs_follow_vllm_semantics(llm, path):
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3))[0]
    ids = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    ref = reference_model(path)
    with torch.no_grad():
        lp = ref(torch.tensor([ids])).logits[0].log_softmax(-1)
    for i in range(1, len(ids)):
        d = out.prompt_logprobs[i]
        assert ids[i] in d and all(isinstance(v, Logprob) for v in d.values())
        top = torch.topk(lp[i - 1], 3)
        assert set(top.indices.tolist()) <= set(d) and len(d) in (3, 4)
        for tid, v in d.items():
            assert abs(v.logprob - lp[i - 1, tid].item()) < 1e-4
            assert v.decoded_token == llm.tokenizer.decode([tid])
        ranks = sorted(v.rank for t, v in d.items() if t in top.indices.tolist())
        assert ranks == [1, 2, 3]
        if ids[i] not in top.indices.tolist():
            assert d[ids[i]].rank > 3


def test_generated_logprobs_contain_the_sampled_token_and_top_k(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=5, logprobs=2, ignore_eos=True))[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 5
    for tok, d in zip(comp.token_ids, comp.logprobs):
        assert tok in d and len(d) == 2  # greedy: the sampled token is the top-1
        assert d[tok].rank == 1 and d[tok].logprob == max(v.logprob for v in d.values())
    assert comp.cumulative_logprob == pytest.approx(sum(d[t].logprob for t, d in zip(comp.token_ids, comp.logprobs)))


def test_seeded_sampling_is_reproducible(llm):
    sp = SamplingParams(temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    a, b = llm.generate(PROMPT, sp)[0].outputs[0].token_ids, llm.generate(PROMPT, sp)[0].outputs[0].token_ids
    assert a == b
    outs = {tuple(llm.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=12, seed=s,
                                                      ignore_eos=True))[0].outputs[0].token_ids) for s in range(4)}
    assert len(outs) > 1  # the seed matters
    top1 = llm.generate(PROMPT, SamplingParams(temperature=1.0, top_k=1, max_tokens=6, seed=3, ignore_eos=True))[0]
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert top1.outputs[0].token_ids == greedy.outputs[0].token_ids


def test_stop_strings_stop_tokens_and_eos(llm):
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    third = greedy.token_ids[2]
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[third],
                                              ignore_eos=True))[0].outputs[0]
    assert out.token_ids == greedy.token_ids[:3] and out.finish_reason == "stop" and out.stop_reason == third
    # a stop string: the first generated character that is new to the text (random bytes
    # decode to U+FFFD often); generation stops at it and the text excludes it
    texts = [llm.tokenizer.decode(greedy.token_ids[:k]) for k in range(1, 11)]
    k, t = next((k, t) for k, t in enumerate(texts, 1) if t and t[-1] != "\ufffd" and t[-1] not in t[:-1])
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=10, stop=[t[-1]], ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == t[-1]
    assert out.outputs[0].token_ids == greedy.token_ids[:k] and out.outputs[0].text == t[:-1]
    # EOS: make the tiny model's greedy token an EOS by remapping the checkpoint's eos id
    saved = llm.eos_token_ids
    try:
        llm.eos_token_ids = {greedy.token_ids[1]}
        out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=10))[0].outputs[0]
        assert out.token_ids == greedy.token_ids[:2] and out.finish_reason == "stop"
    finally:
        llm.eos_token_ids = saved
    assert llm.eos_token_ids == {EOS}


def test_max_model_len_caps_generation(path):
    small = LLM(path, expert_format="w2", dtype="float32", max_model_len=len(PROMPT) + 3, kv_cache_memory_gb=KV_GB)
    out = small.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
    with pytest.raises(ConfigError):
        small.generate(PROMPT + " and more words", SamplingParams(max_tokens=1))


def test_every_engine_config_field_is_an_llm_keyword(path, tmp_path):
    fields = {f.name: f for f in EngineConfig.knob_fields()}
    assert set(fields) >= {"model", "expert_format", "dtype", "device", "max_model_len"}
    kwargs = dict(tokenizer=path, expert_format="fp4", dtype="float32", device="cpu", max_model_len=64,
                  allow_long_max_model_len=False, seed=3, w2_zero_mode="sign", w2_scale_rule="mse", load_mtp=False, trust_remote_code=False,
                  block_size=8, kv_cache_dtype="bf16", gpu_memory_utilization=0.5, kv_cache_memory_gb=0.01,
                  num_kv_blocks=20, max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=False,
                  enable_chunked_prefill=False, enforce_eager=True, overlap_shared_experts=True, async_scheduling=True,
                  small_kernel_pdl=True, compile_warmup=True, attention_fused_merge=True,
                  # expert store: pack_dir set turns it on; 1 GiB holds every expert of the tiny model
                  pack_dir=str(tmp_path), expert_cache_slots=None, expert_cache_gb=1.0, expert_cache_policy="lru",
                  host_arena_gb=0.01, miss_tolerance=2, pack_verify="full", rebuild_pack=True, o_direct=False,
                  expert_prefetch=False, expert_demand_fetch=False, expert_decode_mode="graph",
                  expert_stats_interval_s=0.0,
                  # fp4 experts: the gate has nothing to repair (it is off, whatever these say)
                  fp4_gate=True, gate_tau=0.5, gate_reach=4, gate_refresh=8, fp4_prefill=False, fp4_pool_gb="auto",
                  # the MTP layer is not loaded (load_mtp=False), so no speculation
                  speculative_config=None)
    assert set(kwargs) == set(fields) - {"model"}  # a new field must be added here too
    llm = LLM(path, **kwargs)
    assert llm.config == EngineConfig(model=path, **kwargs)
    assert len(llm.model.mtp) == 0 and llm.max_model_len == 64 and llm.engine.gate is None
    assert llm.engine.runner.num_blocks == 20 and llm.engine.block_manager.block_size == 8
    res = llm.engine.residency
    assert res.pack.meta.tag == "fp4" and res.pack.built_layers == len(res.pack.meta.layers)   # rebuild_pack
    assert res.cache.policy == "lru" and res.cache.num_slots == res.total_rows and res.miss_tolerance == 2
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert len(out.outputs[0].token_ids) >= 1
    llm.close()


def test_w2_generation_runs_and_differs_from_reference_precision(llm, path):
    w2llm = LLM(path, expert_format="w2", dtype="float32", kv_cache_memory_gb=KV_GB)
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    a, b = w2llm.generate(PROMPT, sp)[0], llm.generate(PROMPT, sp)[0]
    diffs = [abs(a.prompt_logprobs[i][t].logprob - b.prompt_logprobs[i][t].logprob)
             for i, t in enumerate(a.prompt_token_ids) if i]
    assert 0 < max(diffs) < 5


def test_cli_flags_map_one_to_one_to_engine_config(path):
    import argparse

    from moet.config import add_cli_arguments, from_cli_args

    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    args = parser.parse_args([path, "--expert-format", "fp4", "--max-model-len", "99", "--no-load-mtp",
                              "--w2-zero-mode", "alt"])
    cfg = from_cli_args(args)
    assert cfg == EngineConfig(model=path, expert_format="fp4", max_model_len=99, load_mtp=False, w2_zero_mode="alt")
    assert from_cli_args(parser.parse_args([path])) == EngineConfig(model=path)
    with pytest.raises(SystemExit):
        parser.parse_args([path, "--expert-format", "int3"])


def test_token_prompts_work_without_tokenizer_files(tmp_path):
    import shutil

    src = cached_checkpoint("mixtral")
    dst = tmp_path / "notok"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("tokenizer*"))
    llm = LLM(str(dst), expert_format="w2", dtype="float32", kv_cache_memory_gb=KV_GB)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0.0, max_tokens=3,
                                                                       ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].text == ""
    with pytest.raises(ConfigError) as e:
        llm.generate("hello")
    assert "no tokenizer files" in str(e.value)


def test_min_tokens_blocks_eos_until_reached(llm):
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    saved = llm.eos_token_ids
    try:
        llm.eos_token_ids = {greedy.token_ids[0]}  # the very first greedy token is now EOS
        stopped = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0]
        held = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=4, min_tokens=2))[0].outputs[0]
    finally:
        llm.eos_token_ids = saved
    assert stopped.token_ids == greedy.token_ids[:1] and stopped.finish_reason == "stop"
    assert len(held.token_ids) >= 2 and held.token_ids[0] != greedy.token_ids[0]


def test_generate_subcommand_matches_the_api(path, capsys):
    import argparse
    import json

    from moet.generate_cli import add_subcommand

    parser = argparse.ArgumentParser()
    add_subcommand(parser.add_subparsers())
    args = parser.parse_args(["generate", path, "--prompt", PROMPT, "--max-tokens", "5", "--ignore-eos",
                              "--expert-format", "bf16", "--dtype", "float32", "--kv-cache-memory-gb", str(KV_GB),
                              "--json"])
    assert args.func(args) == 0
    got = json.loads(capsys.readouterr().out.strip())
    want = LLM(path, expert_format="bf16", dtype="float32", kv_cache_memory_gb=KV_GB).generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert got["token_ids"] == want.token_ids and got["text"] == want.text and got["prompt"] == PROMPT
