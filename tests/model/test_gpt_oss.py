"""gpt-oss beyond the family-parametrized parity tests (test_parity_transformers,
test_quantized_checkpoints, test_engine_greedy): the config's layer schedule and its refusals,
every gpt-oss part load-bearing (the logits move when any is dropped), W2 experts through the
expert store equal to resident, and the FP4 gate at tau 1 equal to FP4 experts."""
from __future__ import annotations

import json

import pytest
import torch

from moet.checkpoint import open_checkpoint
from moet.checkpoint.spec import spec_from_config
from moet.errors import CheckpointError
from moet.model import load_model
from moet.testing.tiny_checkpoint import FAMILIES, cached_checkpoint, reference_model

pytestmark = pytest.mark.skipif("gpt_oss" not in FAMILIES, reason="this transformers has no GptOssConfig")
PROMPTS = [list(range(40, 61)), list(range(100, 109)), list(range(7, 42))]


def _config(path) -> dict:
    with open(f"{path}/config.json") as f:
        return json.load(f)


def test_spec_reads_the_schedule_sinks_biases_and_activation():
    cfg = _config(cached_checkpoint("gpt_oss"))
    s = spec_from_config(cfg)
    a = s.attention
    assert a.sinks and a.qkv_bias and a.o_bias and a.sliding_window == 8
    assert [s.layer_attention(i).sliding_window for i in range(3)] == [8, None, 8]
    assert s.router.logit_bias and s.router.scoring == "softmax" and s.router.norm_topk_prob
    assert s.expert_bias and s.swiglu_alpha == pytest.approx(1.702) and s.swiglu_limit == 7.0
    assert s.fused_expert_layout == "gpt_oss" and s.rope.rope_type == "yarn" and not s.rope.truncate
    # without layer_types: transformers' default, sliding first then alternating
    s2 = spec_from_config({k: v for k, v in cfg.items() if k != "layer_types"})
    assert s2.attention.sliding_layers == (True, False, True)
    with pytest.raises(CheckpointError, match="layer type 'linear_attention' is not supported"):
        spec_from_config({**cfg, "layer_types": ["linear_attention", "full_attention", "sliding_attention"]})
    with pytest.raises(CheckpointError, match="layer_types"):
        spec_from_config({**cfg, "layer_types": ["full_attention"]})


def test_every_part_moves_the_logits():
    path = cached_checkpoint("gpt_oss")
    ids = torch.arange(40, 60)
    ref = reference_model(path)
    with torch.no_grad():
        want = ref(ids[None]).logits[0]

    def logits(edit=None):
        model = load_model(open_checkpoint(path), expert_format="bf16", dtype=torch.float32)
        if edit is not None:
            edit(model)
        with torch.no_grad():
            return model.logits(model.hidden_states(ids, 0, model.new_cache(32, "cpu")))
    assert (logits() - want).abs().max() < 1e-4
    layer = lambda m, i=0: m.model.layers[i]                                               # noqa: E731
    edits = {
        "sinks": lambda m: setattr(layer(m).self_attn, "sinks", None),
        "window": lambda m: setattr(layer(m).self_attn, "spec", layer(m, 1).self_attn.spec),   # full instead
        "router bias": lambda m: layer(m).mlp.gate.bias.data.zero_(),
        "gate_up bias": lambda m: layer(m).mlp.gate_up_bias.data.zero_(),
        "down bias": lambda m: layer(m).mlp.down_bias.data.zero_(),
        "gate/up order": lambda m: layer(m).mlp.gate_up_bias.data.copy_(layer(m).mlp.gate_up_bias.data.roll(32, 1)),
    }
    for name, edit in edits.items():
        assert (logits(edit) - want).abs().max() > 1e-3, name


def test_the_expert_store_serves_it_as_resident(tmp_path):
    """W2 experts through the expert store (pack file, host arena, a device cache of 12 of the 24
    expert rows): tokens and logprobs equal the resident engine's, rows really fetched."""
    from moet.sampling_params import SamplingParams
    from moet.testing.engine_runs import run_engine
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
    kw = dict(model=cached_checkpoint("gpt_oss", "mxfp4"), device="cpu", dtype="float32", expert_format="w2",
              max_num_seqs=2, max_num_batched_tokens=16, block_size=4)
    want = run_engine(PROMPTS, sp, **kw)
    got = run_engine(PROMPTS, sp, **kw, pack_dir=str(tmp_path), expert_cache_slots=12)
    assert (got.tokens, got.logprobs) == (want.tokens, want.logprobs)
    assert got.stats["expert_cache_slots"] == 12 and got.stats["expert_rows_fetched_total"] > 0


def test_the_fp4_gate_repairs_gpt_oss():
    """W2 experts, the FP4 repair tier and a gate firing at every step (tau 1): the tokens of an
    FP4-expert engine (and not bare W2's)."""
    from moet.sampling_params import SamplingParams
    from moet.testing.engine_runs import run_engine
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw = dict(model=cached_checkpoint("gpt_oss", "mxfp4"), device="cpu", dtype="float32", max_num_seqs=4,
              max_num_batched_tokens=16, block_size=4)
    fp4 = run_engine(PROMPTS, sp, **kw, expert_format="fp4").tokens
    w2 = run_engine(PROMPTS, sp, **kw, expert_format="w2", fp4_gate=False).tokens
    gated = run_engine(PROMPTS, sp, **kw, expert_format="w2", gate_tau=1.0)
    c = gated.gate_counters
    assert gated.tokens == fp4 != w2 and c.fires == c.rows_checked == 11 * len(PROMPTS)


def test_decode_roofline_counts_what_windowed_layers_read():
    """`moet bench`'s bytes a decode step must read: a sliding layer reads its window of keys, a
    full layer the whole context (windows 8, full, 8 at 40 tokens: 56 of 120 layer-tokens)."""
    from moet.bench.roofline import decode_step_bytes
    model = load_model(open_checkpoint(cached_checkpoint("gpt_oss")), expert_format="bf16", dtype=torch.float32)
    per_token = 3000
    short, long = (decode_step_bytes(model, per_token, n) for n in (8, 40))
    assert long - short == int(per_token * (8 + 40 + 8) / 3) - per_token * 8
