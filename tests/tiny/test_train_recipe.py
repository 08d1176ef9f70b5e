"""tools/train_tiny's training forward equals transformers' DeepseekV3ForCausalLM (+ the
probe's MTP head) on the exported weights, at a micro shape; and the export writes the
documented NVFP4 layout."""
from __future__ import annotations

import torch

from tools.train_tiny.export import bf16_state_dict, nvfp4_state_dict, quant_configs
from tools.train_tiny.model import Shape, TinyDeepseekV3, update_bias
from tools.train_tiny.selfcheck import max_logit_diff

MICRO = Shape(vocab_size=512, hidden_size=64, num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32,
              n_routed_experts=8, num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32, num_experts_per_tok=2)


def _model() -> TinyDeepseekV3:
    m = TinyDeepseekV3(MICRO)
    m.init_weights(0)
    for r in m.moe_routers():  # exercise the correction bias and group-limited routing
        r.e_score_correction_bias.normal_(0, 0.05)
    for _, p in m.named_parameters():
        if p.dim() == 1:
            p.data.normal_(1, 0.1)
    return m


def test_training_forward_matches_transformers():
    main, mtp = max_logit_diff(_model(), torch.randint(0, 512, (2, 34)))
    assert main < 1e-4 and mtp < 1e-4


def test_export_layout():
    sd = nvfp4_state_dict(bf16_state_dict(_model()))
    w = sd["model.layers.1.mlp.experts.3.down_proj.weight"]
    assert w.dtype == torch.uint8 and w.shape == (64, 16)
    assert sd["model.layers.3.mlp.experts.0.gate_proj.weight_scale"].shape == (32, 4)  # MTP layer experts too
    qc, hq = quant_configs(sd)
    assert "model.layers.3.shared_head.head" in qc["exclude_modules"] and "lm_head" in qc["exclude_modules"]


def test_bias_update_pushes_against_load():
    m = _model()
    r = m.moe_routers()[0]
    r.e_score_correction_bias.zero_()
    r.load.copy_(torch.tensor([10.0, 0, 0, 0, 0, 0, 0, 6]))
    update_bias(m, 0.01)
    b = r.e_score_correction_bias
    assert b[0] < 0 and b[7] < 0 and (b[1:7] > 0).all()
