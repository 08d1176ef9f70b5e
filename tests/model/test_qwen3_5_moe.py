"""Qwen3.5-MoE: gated DeltaNet layers (a per-sequence recurrent state) between gated GQA layers,
against transformers in float32; through the engine, whose recurrent-state slots follow each
sequence through chunked prefill, preemption and batching (greedy == the contiguous reference
loop); the multimodal checkpoint layout; W2 experts against the float64 W2 reference; and what
is off for these models, each said in one line."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from moet.checkpoint import open_checkpoint
from moet.checkpoint.spec import spec_from_config
from moet.errors import CheckpointError, ConfigError
from moet.model import load_model
from moet.sampling_params import SamplingParams
from moet.testing.reference_loop import ReferenceLoop
from moet.testing.tiny_checkpoint import LINEAR_FAMILIES, cached_checkpoint, reference_model

pytestmark = pytest.mark.skipif(not LINEAR_FAMILIES, reason="this transformers has no Qwen3_5MoeTextConfig")
PROMPTS = [list(range(40, 61)), list(range(100, 109)), [(7 * i + 3) % 250 for i in range(37)], [5]]


def _config(path) -> dict:
    with open(f"{path}/config.json") as f:
        return json.load(f)


def _logits(model, ids):
    with torch.no_grad():
        return model.logits(model.hidden_states(ids, 0, model.new_cache(ids.shape[0] + 1, "cpu")))


def test_spec_reads_the_layer_schedule_and_refuses_what_it_cannot_build():
    cfg = _config(cached_checkpoint("qwen3_5_moe"))
    s = spec_from_config(cfg)
    la = s.linear_attention
    assert la.layer_types == ("linear", "linear", "full", "linear") and la.conv_dim == 2 * 2 * 16 + 4 * 16
    assert s.attention.output_gate and s.attention.qk_norm and s.rope.dim == 8 and s.norm_offset == 1.0
    assert s.shared_expert_gate and s.shared_intermediate_size == 48 and s.router.norm_topk_prob
    with pytest.raises(CheckpointError, match="layer type 'mamba' is not supported"):
        spec_from_config({**cfg, "layer_types": ["mamba", "linear_attention", "full_attention", "linear_attention"]})
    with pytest.raises(CheckpointError, match="linear_num_value_heads=3 is not a multiple"):
        spec_from_config({**cfg, "linear_num_value_heads": 3})


@pytest.mark.parametrize("n", [1, 5, 23, 70])          # 70: past CHUNK_FROM_TOKENS, the chunked form
def test_logits_equal_transformers(n):
    path = cached_checkpoint("qwen3_5_moe")
    model = load_model(open_checkpoint(path), expert_format="bf16", dtype=torch.float32)
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n))
    with torch.no_grad():
        want = reference_model(path)(ids[None]).logits[0]
    got = _logits(model, ids)
    # transformers runs the delta rule in chunks for a prompt, moet token by token: float32 rounding
    assert (got - want).abs().max() < 1e-4


def test_every_part_moves_the_logits():
    path = cached_checkpoint("qwen3_5_moe")
    ids = torch.arange(30, 50)
    base = _logits(load_model(open_checkpoint(path), expert_format="bf16", dtype=torch.float32), ids)
    edits = {
        "conv": lambda m: m.model.layers[0].self_attn.conv1d.weight.data.roll(1, -1),
        "decay": lambda m: m.model.layers[0].self_attn.A_log.data.add_(1.0),
        "output gate": lambda m: setattr(m.model.layers[2].self_attn, "_gated", lambda out, gate: out),
        "shared expert gate": lambda m: m.model.layers[1].mlp.shared_expert_gate.weight.data.zero_(),
        "norm offset": lambda m: m.model.layers[1].input_layernorm.weight.data.sub_(1.0),
    }
    for name, edit in edits.items():
        model = load_model(open_checkpoint(path), expert_format="bf16", dtype=torch.float32)
        if name == "conv":
            model.model.layers[0].self_attn.conv1d.weight.data.copy_(edit(model))
        else:
            edit(model)
        assert (_logits(model, ids) - base).abs().max() > 1e-3, name


def test_the_multimodal_layout_loads_its_text_model(tmp_path, caplog):
    """Qwen3_5MoeForConditionalGeneration checkpoints: the text config under text_config, tensors
    under model.language_model., a vision tower and an MTP block moet does not build: the same
    text model, the rest left on disk."""
    from safetensors.torch import load_file, save_file
    path = cached_checkpoint("qwen3_5_moe")
    out = tmp_path / "mm"
    shutil.copytree(path, out)
    tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in load_file(out / "model.safetensors").items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3)
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.randn(64)
    (out / "model.safetensors").unlink()
    save_file(tensors, out / "model.safetensors")
    text = _config(path)
    (out / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5MoeForConditionalGeneration"],
                                                 "model_type": "qwen3_5_moe", "text_config": text,
                                                 "vision_config": {"depth": 2}}))
    ids = torch.arange(10, 30)
    want = _logits(load_model(open_checkpoint(path), expert_format="bf16", dtype=torch.float32), ids)
    with caplog.at_level("INFO"):
        got = _logits(load_model(open_checkpoint(str(out)), expert_format="bf16", dtype=torch.float32), ids)
    assert torch.equal(got, want)
    assert "2 tensors of parts moet does not build were left on disk" in caplog.text


CASES = {
    "default": dict(),
    "chunked-splits": dict(block_size=4, max_num_batched_tokens=8, max_num_seqs=4),
    "preemption": dict(block_size=4, num_kv_blocks=16, max_model_len=60, max_num_batched_tokens=16, max_num_seqs=6),
    "async": dict(async_scheduling=True, block_size=4),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("experts", ["bf16", "w2"])
def test_the_engine_decodes_as_the_reference_loop(case, experts):
    """Greedy through the engine equals the contiguous reference loop token for token, every
    sequence with its own recurrent state: prompts of mixed lengths batched together, split into
    chunks, preempted (recomputed from a fresh state) and decoded one step ahead."""
    from moet.config import EngineConfig
    from moet.engine.llm_engine import LLMEngine
    kw = dict(model=cached_checkpoint("qwen3_5_moe"), expert_format=experts, dtype="float32", device="cpu")
    eng = LLMEngine.from_config(EngineConfig(**kw, **CASES[case]))
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ref = ReferenceLoop(eng.model, None, eng.eos_token_ids, eng.max_model_len)
    want = [ref.generate(p, sp).outputs[0].token_ids for p in PROMPTS]
    for _ in range(2):                                   # again on the same engine: slots handed back
        done = eng.generate_all([(str(i), p, sp) for i, p in enumerate(PROMPTS)])
        assert [done[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == want
    st = eng.stats()
    assert not eng.block_manager.enable_prefix_caching and st.prefix_cache_hit_rate == 0
    if case == "preemption":
        assert st.num_preemptions > 0
    assert eng.gate is None


def test_w2_experts_equal_float64_w2_reference():
    from moet.formats import w2
    path = cached_checkpoint("qwen3_5_moe")
    rt = lambda w64: w2.dequantize(w2.quantize(w64, zero_mode="auto"), dtype=torch.float64)     # noqa: E731
    ids = torch.arange(50, 70)
    got = _logits(load_model(open_checkpoint(path), expert_format="w2", dtype=torch.float32), ids)
    with torch.no_grad():
        want = reference_model(path, dtype=torch.float64, expert_fn=rt)(ids[None]).logits[0].float()
    assert (got - want).abs().max() < 1e-4


def test_what_is_off_says_why():
    from moet.config import EngineConfig
    from moet.engine.confidence_gate import repair_tier_plan
    from moet.engine.llm_engine import LLMEngine
    path = cached_checkpoint("qwen3_5_moe")
    cfg = EngineConfig(model=path, expert_format="w2", dtype="float32", device="cpu")
    slots, why = repair_tier_plan(cfg, open_checkpoint(path), torch.device("cpu"), torch.float32, None)
    assert slots is None and "gated DeltaNet" in why
    with pytest.raises(ConfigError, match="MTP"):
        LLMEngine.from_config(EngineConfig(model=path, device="cpu", dtype="float32",
                                           speculative_config={"method": "mtp", "num_speculative_tokens": 2}))


def test_the_expert_store_serves_it_as_resident(tmp_path):
    """W2 experts through the expert store with a device cache of 16 of 32 rows: a step that
    misses is replayed after the fetch, and each replay starts from the recurrent states the step
    began with (not the ones its discarded pass left): tokens and logprobs equal resident ones."""
    from moet.testing.engine_runs import run_engine
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
    kw = dict(model=cached_checkpoint("qwen3_5_moe"), device="cpu", dtype="float32", expert_format="w2",
              max_num_seqs=2, max_num_batched_tokens=16, block_size=4)
    want = run_engine(PROMPTS, sp, **kw)
    got = run_engine(PROMPTS, sp, **kw, pack_dir=str(tmp_path), expert_cache_slots=16)
    assert (got.tokens, got.logprobs) == (want.tokens, want.logprobs)
    assert got.stats["expert_cache_slots"] == 16 and got.stats["expert_rows_fetched_total"] > 0


def test_a_replayed_step_starts_from_the_states_it_began_with():
    """What the expert store's replay relies on: save_states / restore_states give the pools of
    the step's slots back exactly, so running the step twice equals running it once."""
    from moet.model.attention_batch import AttentionBatch
    from moet.kernels.kv_cache import KVFormat
    model = load_model(open_checkpoint(cached_checkpoint("qwen3_5_moe")), expert_format="bf16", dtype=torch.float32)
    kv = model.new_kv_cache(8, 4, KVFormat("auto", dtype=torch.float32), "cpu", state_slots=3)
    first = AttentionBatch.build(block_tables=[[0, 1]], context_lens=[0], query_lens=[4], block_size=4, device="cpu")
    first.state_slots = [2]
    with torch.no_grad():
        model.forward_paged(torch.arange(20, 24), first, kv)         # a first chunk: the states move off zero
    ids = torch.arange(24, 27)                                        # the step under test continues it
    batch = AttentionBatch.build(block_tables=[[0, 1]], context_lens=[4], query_lens=[3], block_size=4, device="cpu")
    batch.state_slots = [2]
    saved = model.save_states(kv, [2])
    with torch.no_grad():
        once = model.forward_paged(ids, batch, kv)
        after = model.save_states(kv, [2])
        model.restore_states(kv, [2], saved)
        twice = model.forward_paged(ids, batch, kv)
    assert torch.equal(once, twice)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(after, model.save_states(kv, [2])))
    assert any(not torch.equal(a[1], b[1]) for a, b in zip(saved, after))          # the step did move them


def test_a_decode_step_of_several_sequences_equals_each_alone():
    """The batched decode step (all sequences' one token at once) against each sequence run by
    the per-sequence path, states included; a one-token prompt in the batch starts fresh."""
    from moet.kernels.kv_cache import KVFormat
    from moet.model.attention_batch import AttentionBatch
    model = load_model(open_checkpoint(cached_checkpoint("qwen3_5_moe")), expert_format="bf16", dtype=torch.float32)
    layer = model.model.layers[0].self_attn
    kv = model.new_kv_cache(4, 4, KVFormat("auto", dtype=torch.float32), "cpu", state_slots=4)
    st = kv[0]
    g = torch.Generator().manual_seed(3)
    st.conv.copy_(torch.randn(st.conv.shape, generator=g))
    st.recurrent.copy_(0.1 * torch.randn(st.recurrent.shape, generator=g))
    x = torch.randn(3, 64, generator=g)
    slots, lens = [3, 0, 2], [9, 1, 5]                # the second: a one-token prompt
    alone = []
    for i, (slot, n) in enumerate(zip(slots, lens)):
        conv, rec = st.conv[slot].clone(), st.recurrent[slot].clone()
        if n == 1:
            conv.zero_()
            rec.zero_()
        with torch.no_grad():
            alone.append((layer._mix(x[i:i + 1], conv, rec), conv, rec))
    batch = AttentionBatch.build(block_tables=[[0, 1, 2], [0], [0, 1]], context_lens=[n - 1 for n in lens],
                                 query_lens=[1, 1, 1], block_size=4, device="cpu")
    batch.state_slots = slots
    with torch.no_grad():
        out = layer.forward_paged(x, None, None, batch, st, 64)
    for i, slot in enumerate(slots):
        o, conv, rec = alone[i]
        torch.testing.assert_close(out[i:i + 1], o, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(st.conv[slot], conv, rtol=1e-6, atol=1e-6)      # (row-count GEMM rounding)
        torch.testing.assert_close(st.recurrent[slot], rec, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("t", [1, 2, 15, 16, 17, 50])
def test_the_chunked_delta_rule_is_the_recurrence(t):
    """chunked_gated_delta_rule (chunks of 16 here; partial last chunk, carried state) against the
    token-by-token recurrence: outputs and final states to float32 rounding, from a non-zero state."""
    from moet.model.layers.gated_deltanet import _l2norm, chunked_gated_delta_rule, gated_delta_rule
    g = torch.Generator().manual_seed(t)
    h, dk, dv = 4, 16, 8
    q = _l2norm(torch.randn(t, h, dk, generator=g)) * dk ** -0.5
    k = _l2norm(torch.randn(t, h, dk, generator=g))
    v = torch.randn(t, h, dv, generator=g)
    decay, beta = -torch.rand(t, h, generator=g), torch.rand(t, h, generator=g)
    s0 = 0.3 * torch.randn(h, dk, dv, generator=g)
    s1, s2 = s0.clone(), s0.clone()
    want = gated_delta_rule(q, k, v, decay, beta, s1)
    got = chunked_gated_delta_rule(q, k, v, decay, beta, s2, chunk=16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s2, s1, rtol=1e-5, atol=1e-6)
