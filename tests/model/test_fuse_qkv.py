"""CausalLM.fuse_projections: one [q; k; v] GEMV per GQA layer (what the CUDA runner uses).
The fused model computes the same logits, stores nothing twice, and the per-projection
parameters stay live views of the fused weight (a later in-place load still lands)."""
from __future__ import annotations

import torch

from moet.bench import shapes as eb

GLM_TINY = dict(eb.GLM45_AIR, vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                n_routed_experts=8, num_experts_per_tok=2, eos_token_id=257)


def _logits(m, x):
    return m.forward(x, 0, m.new_cache(len(x) + 1, "cpu")).float()


def test_fused_qkv_same_logits_and_shared_storage():
    for cfg in (eb.MICRO, GLM_TINY):                   # no bias / qkv bias (GLM attention_bias)
        m = eb.random_model(cfg, torch.device("cpu"), seed=int(torch.seed() % 2**31))
        x = torch.randint(0, 250, (9,))
        ref = _logits(m, x)
        n_params = sum(p.numel() for p in m.parameters())
        n_fused = m.fuse_projections()
        assert n_fused == cfg["num_hidden_layers"] + (cfg is GLM_TINY) * (1 + 1)   # GLM: dense layer 0 + shared expert
        assert m.fuse_projections() == n_fused                             # idempotent
        got = _logits(m, x)
        assert torch.allclose(got, ref, rtol=0, atol=1e-2 * float(ref.abs().max()))
        assert sum(p.numel() for p in m.parameters()) == n_params
        attn = m.model.layers[0].self_attn
        w, b = attn.qkv
        assert attn.k_proj.weight.data_ptr() == w[attn.q_proj.weight.shape[0]:].data_ptr()
        assert (b is not None) == (cfg is GLM_TINY)
        # an in-place write through a projection's parameter changes the fused weight
        attn.v_proj.weight.data.mul_(0.5)
        assert torch.equal(w[-attn.v_proj.weight.shape[0]:], attn.v_proj.weight)
        assert not torch.equal(_logits(m, x), got)
