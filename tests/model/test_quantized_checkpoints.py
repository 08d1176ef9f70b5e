"""FP8 block-128, NVFP4 (modelopt) and MXFP4 checkpoints:
- expert_format="bf16" equals transformers run on the exactly dequantized weights (1e-4);
- expert_format="w2" equals a float64 transformers run whose routed experts are the W2 values
  (the W2 math done independently: moet.formats.w2 quantize -> dequantize in float64);
- expert_format="fp4" on an NVFP4 checkpoint keeps the checkpoint's bytes (equals "bf16")."""
import pytest
import torch

from moet.checkpoint import open_checkpoint
from moet.formats import w2
from moet.model import load_model
from moet.testing.tiny_checkpoint import FAMILIES, cached_checkpoint, reference_model

# GLM-5 as published: NVFP4 (modelopt) and FP8 block-128 (its indexer's wq_b / wk in e4m3 too)
# and DeepSeek-V3.2 as DeepSeek publishes it (FP8 block-128)
DSA = ([("glm_moe_dsa", "nvfp4"), ("glm_moe_dsa", "fp8"), ("deepseek_v32", "fp8")] if "glm_moe_dsa" in FAMILIES
       else [])

PROMPT = torch.tensor(list(range(60, 60 + 24)))


def _moet_logprobs(path, expert_format):
    model = load_model(open_checkpoint(path), expert_format=expert_format, dtype=torch.float32)
    with torch.no_grad():
        return model(PROMPT, 0, model.new_cache(32, "cpu")).log_softmax(-1)


def _ref_logprobs(path, **kw):
    ref = reference_model(path, **kw)
    with torch.no_grad():
        return ref(PROMPT[None]).logits[0].log_softmax(-1)


@pytest.mark.parametrize("family,fmt", [(f, x) for f in ["deepseek_v3", "glm4_moe", "qwen3_moe", "mixtral"]
                                        for x in ["fp8", "nvfp4", "mxfp4"]] + DSA
                         + [("minimax_m2", x) for x in ("fp8", "mxfp4") if "minimax_m2" in FAMILIES]
                         + [("gpt_oss", "mxfp4")] * ("gpt_oss" in FAMILIES))
def test_bf16_experts_equal_transformers_on_dequantized(family, fmt):
    path = cached_checkpoint(family, fmt)
    assert open_checkpoint(path).weight_format == {"fp8": "fp8_block", "nvfp4": "nvfp4", "mxfp4": "mxfp4"}[fmt]
    got, want = _moet_logprobs(path, "bf16"), _ref_logprobs(path)
    assert (got - want).abs().max() < 1e-4


def _w2_round_trip(w64):
    return w2.dequantize(w2.quantize(w64, zero_mode="auto"), dtype=torch.float64)


@pytest.mark.parametrize("family,fmt", [("deepseek_v3", "nvfp4"), ("deepseek_v3", "fp8"),
                                        ("glm4_moe", "bf16"), ("qwen3_moe", "mxfp4"), ("mixtral", "nvfp4")] + DSA[:1]
                         + [("gpt_oss", "mxfp4")] * ("gpt_oss" in FAMILIES))
def test_w2_experts_equal_float64_w2_reference(family, fmt):
    path = cached_checkpoint(family, fmt)
    got = _moet_logprobs(path, "w2")
    want = _ref_logprobs(path, dtype=torch.float64, expert_fn=_w2_round_trip).float()
    assert (got - want).abs().max() < 1e-4
    # and W2 is really in use: it differs from the checkpoint-precision experts
    assert (got - _moet_logprobs(path, "bf16")).abs().max() > 1e-3


def test_fp4_experts_keep_nvfp4_bytes():
    path = cached_checkpoint("glm4_moe", "nvfp4")
    ckpt = open_checkpoint(path)
    model = load_model(ckpt, expert_format="fp4", dtype=torch.float32)
    pool = model.model.layers[1].mlp.experts.pool
    name = "model.layers.1.mlp.experts.3.up_proj"
    assert torch.equal(pool.gate_up_weight[3, 32:], ckpt.reader.get(name + ".weight"))
    assert torch.equal(pool.gate_up_scale[3, 32:].view(torch.uint8), ckpt.reader.get(name + ".weight_scale").view(torch.uint8))
    assert pool.gate_up_scale_2[3, 1] == ckpt.reader.get(name + ".weight_scale_2")
    assert torch.equal(_moet_logprobs(path, "fp4"), _moet_logprobs(path, "bf16"))


def test_dense_fp8_weights_are_decoded_exactly():
    path = cached_checkpoint("deepseek_v3", "fp8")
    ckpt = open_checkpoint(path)
    model = load_model(ckpt, expert_format="bf16", dtype=torch.float32)
    from moet.formats import fp8_block
    name = "model.layers.0.self_attn.kv_b_proj"
    want = fp8_block.dequantize(ckpt.reader.get(name + ".weight"), ckpt.reader.get(name + ".weight_scale_inv"),
                                dtype=torch.float64).float()
    assert torch.equal(model.model.layers[0].self_attn.kv_b_proj.weight, want)


def _nvfp4_round_trip(w64):
    from moet.formats import nvfp4
    q = nvfp4.quantize(w64.float())
    return nvfp4.dequantize(q.weight, q.weight_scale, q.weight_scale_2, dtype=torch.float64)


@pytest.mark.parametrize("family,fmt", [("qwen3_moe", "bf16"), ("deepseek_v3", "mxfp4")]
                         + [("gpt_oss", "mxfp4")] * ("gpt_oss" in FAMILIES))
def test_fp4_experts_from_other_formats_equal_float64_nvfp4_reference(family, fmt):
    """expert_format="fp4" on a non-NVFP4 checkpoint: experts quantized to NVFP4 per projection."""
    path = cached_checkpoint(family, fmt)
    got = _moet_logprobs(path, "fp4")
    want = _ref_logprobs(path, dtype=torch.float64, expert_fn=_nvfp4_round_trip).float()
    assert (got - want).abs().max() < 1e-4
    assert (got - _moet_logprobs(path, "bf16")).abs().max() > 1e-3


def test_w2_scale_rule_mse_is_used_when_asked():
    path = cached_checkpoint("mixtral", "bf16")
    ckpt = open_checkpoint(path)
    a = load_model(ckpt, expert_format="w2", dtype=torch.float32)
    b = load_model(ckpt, expert_format="w2", dtype=torch.float32, scale_rule="mse")
    w = ckpt.reader.get("model.layers.0.block_sparse_moe.experts.1.w3.weight")
    want = w2.quantize(w, scale_rule="mse")
    assert b.model.layers[0].mlp.experts.pool.layout == "nb8"          # the kernels' code layout (formats.md)
    assert torch.equal(w2.from_nb8(b.model.layers[0].mlp.experts.pool.gate_up_codes[1, 32:]), want.codes)
    assert torch.equal(b.model.layers[0].mlp.experts.pool.gate_up_scales[1, 32:], want.scales)
    pa, pb = a.model.layers[0].mlp.experts.pool, b.model.layers[0].mlp.experts.pool
    assert not torch.equal(pa.gate_up_codes, pb.gate_up_codes)
