"""A compact training twin of transformers' DeepseekV3ForCausalLM plus one DeepSeek-V3 MTP
layer. Parameter names equal the checkpoint's (model.layers.L.self_attn.q_a_proj.weight, ...),
so export is a rename-free state dict except the routed experts, which train fused
([E, 2I, H] gate|up and [E, H, I], transformers' layout) and are written per expert.

Why not train transformers' module directly: its MoE loops over experts with a host sync per
expert and its attention path is generic; here routed experts run as two grouped GEMMs
(torch._grouped_mm) over tokens sorted by expert, attention is one SDPA call with MLA's
q/k/v head dims all 64 (flash-attention eligible). tests/tiny and the exporter's self-check
compare logits with transformers on the exported weights.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Shape:
    vocab_size: int = 8192
    hidden_size: int = 384
    num_hidden_layers: int = 6           # main stack; the MTP layer is model.layers.{this}
    first_k_dense_replace: int = 1
    intermediate_size: int = 1024        # dense MLP of the first layer
    moe_intermediate_size: int = 256
    n_routed_experts: int = 16
    n_shared_experts: int = 1
    num_experts_per_tok: int = 4
    n_group: int = 4
    topk_group: int = 2
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    num_attention_heads: int = 6
    q_lora_rank: int = 192
    kv_lora_rank: int = 128
    qk_nope_head_dim: int = 48
    qk_rope_head_dim: int = 16
    v_head_dim: int = 64
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    num_nextn_predict_layers: int = 1


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


def rope_tables(s: Shape, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n, rope/2] for positions 0..n-1 (transformers' default rope, fp32)."""
    d = s.qk_rope_head_dim
    inv = 1.0 / (s.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    f = torch.arange(n, dtype=torch.float32, device=device)[:, None] * inv[None, :]
    return f.cos(), f.sin()


def apply_rope(x, cos, sin):
    """transformers' apply_rotary_pos_emb_interleave: pairs (x0,x1),(x2,x3).. rotate together and
    the output is de-interleaved (evens then odds). x [B, T, heads, d]; cos/sin [T, d/2]."""
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3), names as in transformers."""

    def __init__(self, s: Shape):
        super().__init__()
        self.s = s
        nh, dqk = s.num_attention_heads, s.qk_nope_head_dim + s.qk_rope_head_dim
        self.q_a_proj = nn.Linear(s.hidden_size, s.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(s.q_lora_rank, 1e-6)  # transformers builds these with eps=1e-6
        self.q_b_proj = nn.Linear(s.q_lora_rank, nh * dqk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(s.hidden_size, s.kv_lora_rank + s.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(s.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(s.kv_lora_rank, nh * (s.qk_nope_head_dim + s.v_head_dim), bias=False)
        self.o_proj = nn.Linear(nh * s.v_head_dim, s.hidden_size, bias=False)

    def forward(self, x, cos, sin):
        s, (b, t, _) = self.s, x.shape
        nh, nope, rope = s.num_attention_heads, s.qk_nope_head_dim, s.qk_rope_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, t, nh, nope + rope)
        q_nope, q_rot = q.split([nope, rope], dim=-1)
        kv_c, k_rot = self.kv_a_proj_with_mqa(x).split([s.kv_lora_rank, rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_c)).view(b, t, nh, nope + s.v_head_dim)
        k_nope, v = kv.split([nope, s.v_head_dim], dim=-1)
        q_rot = apply_rope(q_rot, cos, sin)
        k_rot = apply_rope(k_rot.view(b, t, 1, rope), cos, sin).expand(b, t, nh, rope)
        q = torch.cat([q_nope, q_rot], dim=-1).transpose(1, 2)
        k = torch.cat([k_nope, k_rot], dim=-1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True,
                                           scale=(nope + rope) ** -0.5)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, nh * s.v_head_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Sigmoid scores; the correction bias steers the choice only (aux-loss-free balancing);
    group-limited top-k as in DeepSeek-V3. Runs in fp32 like transformers' router."""

    def __init__(self, s: Shape):
        super().__init__()
        self.s = s
        self.weight = nn.Parameter(torch.empty(s.n_routed_experts, s.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(s.n_routed_experts))
        self.register_buffer("load", torch.zeros(s.n_routed_experts), persistent=False)

    def forward(self, x):  # x [N, H]
        s = self.s
        with torch.autocast(x.device.type, enabled=False):
            scores = F.linear(x.float(), self.weight.float()).sigmoid()
            choice = scores + self.e_score_correction_bias
            per_group = s.n_routed_experts // s.n_group
            group_scores = choice.view(-1, s.n_group, per_group).topk(2, dim=-1).values.sum(-1)
            group_idx = group_scores.topk(s.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
            mask = group_mask.repeat_interleave(per_group, dim=1).bool()
            idx = choice.masked_fill(~mask, float("-inf")).topk(s.num_experts_per_tok, dim=-1).indices
            w = scores.gather(1, idx)
            if s.norm_topk_prob:
                w = w / (w.sum(-1, keepdim=True) + 1e-20)
            w = w * s.routed_scaling_factor
        if self.training:
            self.load += expert_counts(idx, s.n_routed_experts).float()
        return idx, w


def expert_counts(idx, n: int):
    # scatter_add, not bincount: a static output shape keeps torch.compile graphs whole.
    flat = idx.flatten()
    return torch.zeros(n, dtype=torch.int64, device=idx.device).scatter_add_(0, flat, torch.ones_like(flat))


def grouped_mm(x, w, offs):
    """x [M, K] rows sorted by expert, w [E, N, K] (transformers' expert layout), offs int32
    [E] cumulative row ends -> [M, N]."""
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)


class MoE(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.s = s
        e, h, i = s.n_routed_experts, s.hidden_size, s.moe_intermediate_size
        self.gate = Router(s)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.experts.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.shared_experts = MLP(h, i * s.n_shared_experts)
        self.calib: dict[str, torch.Tensor] | None = None  # set by calibrate(): per-expert input amax

    def _observe(self, key: str, rows, offs) -> None:
        ends = offs.tolist()
        for e, (a, b) in enumerate(zip([0] + ends[:-1], ends)):
            if b > a:
                self.calib[key][e] = torch.maximum(self.calib[key][e], rows[a:b].abs().max().float())

    def forward(self, x):
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        idx, w = self.gate(flat)
        k = idx.shape[1]
        order = idx.flatten().argsort(stable=True)
        offs = expert_counts(idx, self.s.n_routed_experts).cumsum(0).to(torch.int32)
        dt = torch.bfloat16 if torch.is_autocast_enabled(x.device.type) or x.dtype == torch.bfloat16 else x.dtype
        xs = flat.index_select(0, order // k).to(dt)
        gu = grouped_mm(xs, self.experts.gate_up_proj.to(dt), offs)
        g, u = gu.chunk(2, dim=-1)
        act = F.silu(g) * u
        if self.calib is not None:
            self._observe("gate_up", xs, offs)
            self._observe("down", act, offs)
        ys = grouped_mm(act, self.experts.down_proj.to(dt), offs)
        y = ys.index_select(0, order.argsort())  # back to (token, slot) order: a gather, no atomics
        routed = (y.view(-1, k, h) * w.to(y.dtype).unsqueeze(-1)).sum(1)
        return routed.view(b, t, h).to(x.dtype) + self.shared_experts(x)


class DecoderLayer(nn.Module):
    def __init__(self, s: Shape, moe: bool):
        super().__init__()
        self.self_attn = Attention(s)
        self.mlp = MoE(s) if moe else MLP(s.hidden_size, s.intermediate_size)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class MTPLayer(DecoderLayer):
    """DeepSeek-V3 multi-token prediction module, checkpoint layout model.layers.{L}:
    enorm(embed(t+1)) and hnorm(h_t) -> eh_proj(concat, in that order) -> decoder layer ->
    shared_head.norm -> the shared output head predicts token t+2. h_t is the main model's
    final (post-norm) hidden state, as vLLM and transformers' MTP pass it."""

    def __init__(self, s: Shape):
        super().__init__(s, moe=True)
        self.enorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.hnorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * s.hidden_size, s.hidden_size, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(self, emb_next, h, cos, sin):
        x = self.eh_proj(torch.cat([self.enorm(emb_next), self.hnorm(h)], dim=-1))
        return self.shared_head.norm(super().forward(x, cos, sin))


class Inner(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        layers = [DecoderLayer(s, moe=i >= s.first_k_dense_replace) for i in range(s.num_hidden_layers)]
        layers += [MTPLayer(s) for _ in range(s.num_nextn_predict_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)


class TinyDeepseekV3(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.s = s
        self.model = Inner(s)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)

    @property
    def main_layers(self):
        return self.model.layers[: self.s.num_hidden_layers]

    @property
    def mtp_layer(self) -> MTPLayer:
        return self.model.layers[self.s.num_hidden_layers]

    def moe_routers(self) -> list[Router]:
        return [m for m in self.modules() if isinstance(m, Router)]

    def init_weights(self, seed: int) -> None:
        """N(0, 0.02) like transformers' DeepseekV3 init; output projections of residual
        branches scaled by 1/sqrt(2 * layers) (GPT-2) so the residual stream starts calm."""
        g = torch.Generator().manual_seed(seed)
        depth_scale = 1 / math.sqrt(2 * (self.s.num_hidden_layers + 1))
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.data.fill_(1.0)  # norms
                continue
            std = 0.02 * (depth_scale if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")) else 1.0)
            p.data.copy_(torch.randn(p.shape, generator=g) * std)

    def forward(self, ids, cos, sin):
        """ids [B, T+2] -> (main logits for tokens 1..T, MTP logits for tokens 2..T+1)."""
        t = ids.shape[1] - 2
        x = self.model.embed_tokens(ids[:, :t])
        for layer in self.main_layers:
            x = layer(x, cos[:t], sin[:t])
        h = self.model.norm(x)
        # The MTP layer sees token t+1, at position t+1 (its rope positions are shifted by one).
        hm = self.mtp_layer(self.model.embed_tokens(ids[:, 1:t + 1]), h, cos[1:t + 1], sin[1:t + 1])
        return self.lm_head(h), self.lm_head(hm)


def loss_fn(model: TinyDeepseekV3, ids, cos, sin, mtp_weight: float, ignore_index: int):
    t = ids.shape[1] - 2
    logits, mtp_logits = model(ids, cos, sin)
    main = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:t + 1].flatten(), ignore_index=ignore_index)
    mtp = F.cross_entropy(mtp_logits.float().flatten(0, 1), ids[:, 2:t + 2].flatten(), ignore_index=ignore_index)
    return main + mtp_weight * mtp, main.detach(), mtp.detach()


@torch.no_grad()
def update_bias(model: TinyDeepseekV3, rate: float) -> torch.Tensor:
    """DeepSeek-V3's aux-loss-free balancing: after each step push every expert's bias up if it
    was under-loaded and down if over-loaded, by a fixed rate. Returns the max/mean load ratio
    (a balance figure for the log) without a host sync."""
    worst = []
    for r in model.moe_routers():
        load = r.load
        r.e_score_correction_bias += rate * torch.sign(load.mean() - load)
        worst.append(load.max() / load.mean().clamp_min(1))
        load.zero_()
    return torch.stack(worst).max()


@torch.no_grad()
def calibrate(model: TinyDeepseekV3, batches, cos, sin) -> dict[str, float]:
    """Max |input| of every routed-expert linear over a few batches (modelopt's input_scale
    calibration). -> {"model.layers.L.mlp.experts.E.gate_proj": amax, ...}"""
    moes = {name: m for name, m in model.named_modules() if isinstance(m, MoE)}
    for m in moes.values():
        n = m.s.n_routed_experts
        m.calib = {"gate_up": torch.zeros(n, device=cos.device), "down": torch.zeros(n, device=cos.device)}
    was = model.training
    model.eval()
    for ids in batches:
        with torch.autocast(cos.device.type, dtype=torch.bfloat16, enabled=cos.device.type == "cuda"):
            model(ids, cos, sin)
    model.train(was)
    out = {}
    for name, m in moes.items():
        for e in range(m.s.n_routed_experts):
            gu, dn = float(m.calib["gate_up"][e]), float(m.calib["down"][e])
            out[f"{name}.experts.{e}.gate_proj"] = out[f"{name}.experts.{e}.up_proj"] = gu
            out[f"{name}.experts.{e}.down_proj"] = dn
        m.calib = None
    return out


def count_params(s: Shape) -> dict[str, int]:
    with torch.device("meta"):
        m = TinyDeepseekV3(s)
    routed = sum(p.numel() for n, p in m.named_parameters() if ".experts." in n)
    total = sum(p.numel() for p in m.parameters())
    return {"total": total, "routed_experts": routed, "dense": total - routed}
