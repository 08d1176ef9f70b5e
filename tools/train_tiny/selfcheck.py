"""Check that the training forward and transformers' DeepseekV3ForCausalLM (+ the probe's MTP
head) compute the same function on the exported weights. Run before a long training run
(on the initial weights) and in tests/tiny at a micro shape: a mismatch in rope layout,
head split, router or expert layout shows up as a logit difference far above rounding."""
from __future__ import annotations

import torch

from moet.probe.loader import build
from tools.train_tiny.export import bf16_state_dict, hf_config
from tools.train_tiny.model import TinyDeepseekV3, rope_tables


@torch.no_grad()
def max_logit_diff(model: TinyDeepseekV3, ids: torch.Tensor) -> tuple[float, float]:
    """ids [B, T+2] on CPU. -> (max |main logits diff|, max |MTP logits diff|) in fp32."""
    from transformers import DeepseekV3Config
    was_training = model.training
    model = model.eval()
    cfg = DeepseekV3Config.from_dict(hf_config(model.s, 1, 2, 0))
    cfg._attn_implementation = "sdpa"
    sd = bf16_state_dict(model, torch.float32)
    hf, mtp = build(cfg, sd, "bf16", torch.device("cpu"), torch.float32)
    dev = next(model.parameters()).device
    t = ids.shape[1] - 2
    cos, sin = rope_tables(model.s, t + 1, dev)
    with torch.autocast(dev.type, enabled=False):
        ours, ours_mtp = model(ids.to(dev), cos, sin)
    out = hf.model(ids[:, : t + 1])
    h = out.last_hidden_state
    ref = hf.lm_head(h)[:, :t]
    ref_mtp = mtp(hf, ids[:, : t + 1], h)
    model.train(was_training)
    return float((ours.cpu() - ref).abs().max()), float((ours_mtp.cpu() - ref_mtp).abs().max())
