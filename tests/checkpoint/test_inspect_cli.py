"""`moet inspect`: counts agree with transformers' model, bytes per format follow the bit
widths, and the placement answer moves with --gpu-memory."""
import argparse
import json

import pytest

from moet.checkpoint import inspect_cli
from moet.testing.tiny_checkpoint import cached_checkpoint, reference_model


def _run(capsys, *argv):
    p = argparse.ArgumentParser()
    inspect_cli.add_subcommand(p.add_subparsers())
    args = p.parse_args(["inspect", *argv])
    assert args.func(args) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("family,fmt", [("deepseek_v3", "nvfp4"), ("mixtral", "mxfp4"), ("glm4_moe", "fp8")])
def test_counts_match_transformers(capsys, family, fmt):
    path = cached_checkpoint(family, fmt)
    out = json.loads(_run(capsys, path, "--json"))["summary"]
    ref = reference_model(path)
    total = sum(t.numel() for t in ref.state_dict().values())
    experts = sum(t.numel() for n, t in ref.state_dict().items() if ".experts." in n)
    assert out["dense_params"] + out["expert_params"] == total
    assert out["expert_params"] == experts
    cfg = ref.config
    per_expert = 3 * cfg.hidden_size * (getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)
    assert out["active_params"] == out["dense_params"] + out["moe_layers"] * cfg.num_experts_per_tok * per_expert
    assert out["w2_expert_bytes"] == out["expert_params"] * 9 // 32
    assert out["fp4_expert_bytes"] == out["expert_params"] * 9 // 16
    assert out["family"] == family
    assert (out["mtp_params"] > 0) == (family != "mixtral")


def test_placement_depends_on_gpu_memory(capsys):
    path = cached_checkpoint("deepseek_v3", "bf16")
    s = inspect_cli.summarize(path)
    gib = 2**30
    roomy = inspect_cli.placement(s, (s.dense_loaded_bytes + s.fp4_expert_bytes) / gib + 0.001, 0)
    assert roomy["dense_fits"] and roomy["w2_all_resident"] and roomy["fp4_all_resident"]
    tight = inspect_cli.placement(s, (s.dense_loaded_bytes + s.w2_expert_bytes / 2) / gib, 0)
    assert tight["dense_fits"] and not tight["w2_all_resident"]
    assert tight["w2_resident_fraction"] == pytest.approx(0.5, abs=0.01)
    assert inspect_cli.placement(s, s.dense_loaded_bytes / gib / 2, 0)["dense_fits"] is False
    assert tight["min_slots"] == s.moe_layers * s.top_k == 2 * 2  # tiny DeepSeek: 2 MoE layers, top-2
    assert tight["w2_expert_slots"] == (s.moe_layers * s.experts) // 2
    text = _run(capsys, path, "--gpu-memory", "80")
    assert "deepseek_v3" in text and "W2 all resident: yes" in text


@pytest.mark.parametrize("family,fmt", [("deepseek_v3", "fp8"), ("deepseek_v3", "nvfp4"), ("deepseek_v3", "bf16")])
def test_dense_bytes_on_a_gpu_keep_fp8_and_nvfp4(family, fmt):
    """On a GPU, FP8 / NVFP4 dense weights keep their stored bytes (model/kept_dense.py; MLA's
    kv_b_proj is decoded): the summary's dense_gpu_bytes is what the kept model holds, tensor by
    tensor, and `moet plan`'s dense stack is that."""
    import torch

    from moet.checkpoint import open_checkpoint
    from moet.model import load_weights
    from moet.model.model import CausalLM
    from moet.store.plan import facts_from_summary

    path = cached_checkpoint(family, fmt)
    s = inspect_cli.summarize(path)
    ckpt = open_checkpoint(path)
    dtype = torch.bfloat16 if s.dense_loaded_bytes == 2 * s.dense_params else torch.float32   # as inspect assumes
    model = CausalLM(ckpt.spec, dtype, load_mtp=False)
    load_weights(model, ckpt, expert_format="bf16", keep_quantized_dense=True, routed_experts=False)
    mtp = sum(t.numel() * t.element_size() for n, t in model.state_dict().items() if n.startswith("mtp."))
    held = sum(t.numel() * t.element_size() for n, t in model.state_dict().items()) - mtp
    # inspect counts every float tensor at the serving dtype; the model keeps its router in fp32
    fp32_extra = sum(t.numel() * 2 for n, t in model.state_dict().items()
                     if dtype == torch.bfloat16 and t.dtype == torch.float32 and not n.startswith("mtp.")
                     and not n.endswith(("weight_scale_inv", "weight_scale_2")))        # (stored fp32 scales)
    assert s.dense_gpu_bytes + fp32_extra == held
    if fmt == "bf16":
        assert s.dense_gpu_bytes == s.dense_loaded_bytes
    else:
        assert s.dense_gpu_bytes < s.dense_loaded_bytes
    assert facts_from_summary(s, spec=ckpt.spec).dense_bytes == s.dense_gpu_bytes
    assert facts_from_summary(s, spec=ckpt.spec, dtype="bfloat16").dense_bytes == 2 * s.dense_params
