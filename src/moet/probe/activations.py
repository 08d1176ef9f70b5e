"""Expert-activation number formats for the probes: what the routed experts' matmuls read.

  bf16  unquantized: the activations stay in the model's dtype (float32 on CPU, bfloat16 on
        CUDA) -- transformers' own forward, today's behaviour.
  e4m3  the two activation points of the PTX W2 kernel (docs/kernels.md, MoE) are
        fake-quantized to float8 e4m3 inside the routed experts' forward:
          1. the hidden state, once per token, before gate/up;
          2. the SwiGLU output silu(gate) * up, per (token, expert) pair, before down.
        Rule (emulate_moe.quantize_rows, the kernel's div.rn.f32 + cvt.rn.satfinite.e4m3x2.f32):
        scale = amax(|row|) / 448 in float32 (1 for an all-zero row), code = e4m3 round-to-
        nearest-even of row / scale saturated to +-448; the matmul then reads code * scale.

The shared expert, the router (it sees the unquantized hidden state, as in the kernel path)
and attention are untouched. The patch is an instance-level forward on each
DeepseekV3Experts module: the same loop as transformers' eager forward with the two
quantization points added (`apply_expert_activations`).
"""
from __future__ import annotations

import types
from typing import Literal

import torch
from torch import nn

ExpertActivations = Literal["bf16", "e4m3"]
EXPERT_ACTIVATIONS: tuple[str, ...] = ("bf16", "e4m3")
E4M3_MAX = 448.0


def e4m3_rne_satfinite(v: torch.Tensor) -> torch.Tensor:
    """float32 -> float8_e4m3fn: round to nearest even, saturate finite values and +-inf to +-448
    (torch's cast alone turns values beyond 448 into NaN; NaN stays NaN)."""
    return v.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_e4m3_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (codes float8_e4m3fn [..., K], scale float32 [..., 1]), one scale per row
    (last dimension): scale = amax / 448 in float32 (1 for an all-zero row)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return e4m3_rne_satfinite(xf / scale), scale


def fake_quantize_e4m3_rows(x: torch.Tensor) -> torch.Tensor:
    """x with every row replaced by its e4m3 codes times its scale (computed in float32,
    returned in x's dtype)."""
    if x.numel() == 0:
        return x
    q, scale = quantize_e4m3_rows(x)
    return (q.float() * scale).to(x.dtype)


def e4m3_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' DeepseekV3Experts eager forward with e4m3 activations at the kernel's
    two points (bound to a DeepseekV3Experts instance by `apply_expert_activations`)."""
    final_hidden_states = torch.zeros_like(hidden_states)
    xq = fake_quantize_e4m3_rows(hidden_states)  # 1. per token, shared by its top-k experts
    with torch.no_grad():
        expert_mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        gate, up = nn.functional.linear(xq[token_idx], self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
        act = fake_quantize_e4m3_rows(self.act_fn(gate) * up)  # 2. per (token, expert) pair
        out = nn.functional.linear(act, self.down_proj[expert_idx])
        out = out * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, out.to(final_hidden_states.dtype))
    return final_hidden_states


def apply_expert_activations(modules: list[nn.Module] | nn.Module, activations: str) -> int:
    """Set the routed experts' activation format on every DeepseekV3Experts inside `modules`
    (in place); returns how many expert modules were patched (0 for bf16)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts
    if activations not in EXPERT_ACTIVATIONS:
        raise ValueError(f"unknown expert activations {activations!r}; use one of {', '.join(EXPERT_ACTIVATIONS)}")
    if isinstance(modules, nn.Module):
        modules = [modules]
    n = 0
    for root in modules:
        for mod in root.modules():
            if not isinstance(mod, DeepseekV3Experts):
                continue
            if activations == "bf16":
                mod.__dict__.pop("forward", None)  # back to the class's (transformers') forward
            else:
                mod.forward = types.MethodType(e4m3_experts_forward, mod)
                n += 1
    return n
