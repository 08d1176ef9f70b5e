"""Model math: layers and the causal LM built from a ModelSpec. Knows math, not where weights
live: MoE layers read routed experts through a slot table and a pool handed to them.

    model = load_model(open_checkpoint(path), expert_format="w2", dtype=torch.bfloat16)
"""
from __future__ import annotations

import torch

from moet.checkpoint import Checkpoint
from moet.model.loader import load_weights
from moet.model.model import CausalLM


def load_model(ckpt: Checkpoint, *, expert_format: str = "w2", dtype: torch.dtype = torch.bfloat16,
               device: torch.device | str = "cpu", zero_mode: str = "auto", scale_rule: str = "published",
               load_mtp: bool = True, progress: bool = False, routed_experts: bool = True,
               repair_tier: bool = False, repair_slots: int | None = None) -> CausalLM:
    with torch.device(device):
        if ckpt.spec.compressed_attention is not None:      # DeepSeek-V4: its own module tree
            from moet.model.deepseek_v4 import DeepseekV4LM
            model = DeepseekV4LM(ckpt.spec, dtype, load_mtp=load_mtp)
        else:
            model = CausalLM(ckpt.spec, dtype, load_mtp=load_mtp)
    load_weights(model, ckpt, expert_format=expert_format, zero_mode=zero_mode, scale_rule=scale_rule,
                 device=device, progress=progress, routed_experts=routed_experts, repair_tier=repair_tier,
                 repair_slots=repair_slots)
    return model.eval()


__all__ = ["CausalLM", "load_model"]
