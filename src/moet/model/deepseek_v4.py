"""DeepSeek-V4 (DeepseekV4ForCausalLM): hyper-connected residual streams, sliding-window attention
with compressed keys (CSA: one key per `csa_rate` tokens from two overlapping windows, chosen per
query by a lightning indexer; HCA: one per `hca_rate` tokens, all of them), a grouped low-rank
output projection, and MoE layers routed by sqrt(softplus) scores or, in the first layers, by a
token-id table; experts are clamped SwiGLUs (checkpoint/spec.py CompressedAttentionSpec,
HyperConnectionSpec). Numerics follow transformers' deepseek_v4 op for op (fp32 norms, mixing,
pooling and softmax), so float32 logits match it.

What is here is the contiguous forward: a whole sequence from position 0, every compressed key
recomputed from the tokens (no cache). It is the model's reference and what the parity tests run;
the routed experts go through the same MoE block, pools and formats (bf16 / W2 / FP4) as every
other family. Serving needs the paged form of this attention (the sliding keys, the compressed
keys and indexer keys at one slot per window, the open window's projections per sequence), which
is not built yet: the engine refuses the model with a message saying so.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moet.checkpoint.spec import HyperConnectionSpec, ModelSpec, RopeSpec
from moet.model.layers.linear import MLP, Linear
from moet.model.layers.moe import MoE
from moet.model.layers.norm import RMSNorm
from moet.model.layers.rope import inv_freq_and_scaling
from moet.model.layers.router import route


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight, in fp32 (the hyper-connections' input norm, q's per-head norm)."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class TailRope:
    """Rope on the last `dim` dims of a vector, in interleaved pairs (2i, 2i + 1) kept in place (the
    values carry rope here, K = V, so the layout must be the checkpoint's); sign -1 rotates back."""

    def __init__(self, rope: RopeSpec, max_position_embeddings: int):
        self.inv_freq, _ = inv_freq_and_scaling(rope, max_position_embeddings)   # attention_factor 1
        self.dim = rope.dim

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
        """x [T, ..., d]; positions [T]."""
        ang = positions.float()[:, None] * self.inv_freq.to(x.device)[None, :]     # [T, dim / 2]
        shape = (ang.shape[0],) + (1,) * (x.dim() - 2) + (ang.shape[1],)
        c, s = ang.cos().view(shape).to(x.dtype), (sign * ang.sin()).view(shape).to(x.dtype)
        head, r = x[..., :-self.dim], x[..., -self.dim:]
        x0, x1 = r[..., 0::2], r[..., 1::2]
        return torch.cat([head, torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], dim=-1).flatten(-2)], dim=-1)


class HyperConnection(nn.Module):
    """The mixing around one sublayer of the N residual streams X [T, N, D]: weights from the
    unweighted-RMS-normed concatenation of the streams -> pre (how the streams collapse into the
    sublayer's input), post (how its output spreads back), comb (an N x N mix of the streams,
    Sinkhorn-normalised towards doubly stochastic). All in fp32."""

    def __init__(self, hc: HyperConnectionSpec, hidden: int, norm_eps: float):
        super().__init__()
        n = hc.streams
        self.hc, self.norm_eps = hc, norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, N, D] -> (post [T, N], comb [T, N, N], collapsed [T, D] in x's dtype)."""
        t, n, d = x.shape
        eps = self.hc.eps
        mix = _rms(x.reshape(t, n * d).float(), self.norm_eps) @ self.fn.t()
        pre = torch.sigmoid(mix[:, :n] * self.scale[0] + self.base[:n]) + eps
        post = 2 * torch.sigmoid(mix[:, n:2 * n] * self.scale[1] + self.base[n:2 * n])
        comb = torch.softmax(mix[:, 2 * n:].view(t, n, n) * self.scale[2] + self.base[2 * n:].view(n, n), dim=-1) + eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(self.hc.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        collapsed = (pre[..., None] * x.float()).sum(dim=1)
        return post, comb, collapsed.to(x.dtype)

    @staticmethod
    def spread(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The streams after the sublayer: X'[k] = post[k] * out + sum_j comb[j, k] * X[j]."""
        return (post[..., None] * out.float()[:, None, :] + torch.einsum("tjk,tjd->tkd", comb, x.float())).to(x.dtype)


class HyperHead(nn.Module):
    """The streams' final collapse (pre weights only) before the last norm and the LM head."""

    def __init__(self, hc: HyperConnectionSpec, hidden: int, norm_eps: float):
        super().__init__()
        n = hc.streams
        self.hc, self.norm_eps = hc, norm_eps
        self.fn = nn.Parameter(torch.empty(n, n * hidden, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.empty(n, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, n, d = x.shape
        flat = _rms(x.reshape(t, n * d).float(), self.norm_eps)
        pre = torch.sigmoid(flat @ self.fn.t() * self.scale + self.base) + self.hc.eps
        return (pre[..., None] * x.float()).sum(dim=1).to(x.dtype)


class Compressor(nn.Module):
    """One compressed key per `rate` tokens (windows [e * rate, (e + 1) * rate)): the window's
    projections pooled by a per-channel softmax over its slots of gate + ape, RMS-normed, rotated
    at the window's first position. overlap (CSA): projections of width 2 * dim, the first half
    of each token going to the next window's key and the second to its own, so key e pools 2 *
    rate slots over windows e - 1 and e (key 0 only its own). Only complete windows give a key."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float, dtype: torch.dtype):
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.wkv = Linear(hidden, width, False, dtype)
        self.wgate = Linear(hidden, width, False, dtype)
        self.ape = nn.Parameter(torch.empty(rate, width, dtype=torch.float32), requires_grad=False)
        self.norm = RMSNorm(dim, eps, dtype)

    def forward(self, x: torch.Tensor, rope: TailRope) -> torch.Tensor:
        """x [T, hidden] (positions 0 .. T - 1) -> keys [T // rate, dim]."""
        m, d = self.rate, self.dim
        n = x.shape[0] // m
        if n == 0:                       # no window complete yet
            return x.new_zeros(0, d)
        kv = self.wkv(x[:n * m]).float().view(n, m, -1)
        gate = self.wgate(x[:n * m]).float().view(n, m, -1) + self.ape
        if self.overlap:
            pooled_kv = kv.new_zeros(n, 2 * m, d)
            pooled_gate = gate.new_full((n, 2 * m, d), float("-inf"))
            pooled_kv[:, m:], pooled_gate[:, m:] = kv[..., d:], gate[..., d:]
            pooled_kv[1:, :m], pooled_gate[1:, :m] = kv[:-1, :, :d], gate[:-1, :, :d]
            kv, gate = pooled_kv, pooled_gate
        keys = self.norm((kv * torch.softmax(gate, dim=1)).sum(dim=1).to(x.dtype))
        return rope(keys, torch.arange(n, device=x.device) * m)


class Indexer(nn.Module):
    """CSA's lightning indexer: its own overlapping compressor (index keys, one per window), queries
    from the attention's q_a output, per-head weights from the layer input; a query at position p
    keeps the `top_k` best of the keys whose window ended by p (score sum_h w_h relu(q_h . k) / sqrt(Di))."""

    def __init__(self, spec: ModelSpec, eps: float, dtype: torch.dtype):
        super().__init__()
        c = spec.compressed_attention
        self.heads, self.dim, self.top_k = c.index_heads, c.index_head_dim, c.index_top_k
        self.compressor = Compressor(spec.hidden_size, c.index_head_dim, c.csa_rate, True, eps, dtype)
        self.wq_b = Linear(spec.attention.q_lora_rank, c.index_heads * c.index_head_dim, False, dtype)
        self.weights_proj = Linear(spec.hidden_size, c.index_heads, False, dtype)

    def select(self, x: torch.Tensor, q_res: torch.Tensor, rope: TailRope, visible: torch.Tensor) -> torch.Tensor:
        """-> [T, n] bool: the compressed keys each query attends to (visible [T, n]: causal)."""
        t, n = visible.shape
        keep = torch.zeros(t, n, dtype=torch.bool, device=x.device)
        if n == 0:
            return keep
        keys = self.compressor(x, rope).float()                                          # [n, Di]
        q = rope(self.wq_b(q_res).view(t, self.heads, self.dim), torch.arange(t, device=x.device)).float()
        scores = torch.relu(torch.einsum("thd,nd->thn", q, keys)) * self.dim ** -0.5
        w = self.weights_proj(x).float() * self.heads ** -0.5
        score = (scores * w[..., None]).sum(dim=1).masked_fill(~visible, float("-inf"))
        top = score.topk(min(self.top_k, n), dim=-1).indices
        return keep.scatter_(1, top, torch.gather(visible, 1, top))


class V4Attention(nn.Module):
    """One layer's attention (names as DeepSeek's checkpoints): q = rope(rms(wq_b(q_norm(wq_a(x)))))
    per head, one shared head kv = rope(norm(wkv(x))) that is both key and value, softmax over the
    sliding window (and the compressed keys) with a per-head sink logit, the output de-rotated at
    the query's position, then wo_a per group of heads and wo_b."""

    def __init__(self, spec: ModelSpec, layer: int, ropes: dict[str, TailRope], dtype: torch.dtype):
        super().__init__()
        a, c, eps = spec.attention, spec.compressed_attention, spec.rms_norm_eps
        self.kind = c.layer_types[layer]
        self.rope = ropes["main" if self.kind == "sliding" else "compress"]
        self.heads, self.head_dim, self.window, self.eps = a.num_heads, a.head_dim, c.window, eps
        self.groups, self.rank = c.o_groups, c.o_lora_rank
        self.attn_sink = nn.Parameter(torch.empty(a.num_heads, dtype=torch.float32), requires_grad=False)
        self.wq_a = Linear(spec.hidden_size, a.q_lora_rank, False, dtype)
        self.q_norm = RMSNorm(a.q_lora_rank, eps, dtype)
        self.wq_b = Linear(a.q_lora_rank, a.num_heads * a.head_dim, False, dtype)
        self.wkv = Linear(spec.hidden_size, a.head_dim, False, dtype)
        self.norm = RMSNorm(a.head_dim, eps, dtype)
        self.wo_a = Linear(a.num_heads * a.head_dim // c.o_groups, c.o_groups * c.o_lora_rank, False, dtype)
        self.wo_b = Linear(c.o_groups * c.o_lora_rank, spec.hidden_size, False, dtype)
        self.rate = {"csa": c.csa_rate, "hca": c.hca_rate}.get(self.kind, 0)
        self.compressor = (Compressor(spec.hidden_size, a.head_dim, self.rate, self.kind == "csa", eps, dtype)
                           if self.rate else None)
        self.indexer = Indexer(spec, eps, dtype) if self.kind == "csa" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (the normed collapse of the streams, positions 0 .. T - 1) -> [T, hidden]."""
        t, h, d = x.shape[0], self.heads, self.head_dim
        pos = torch.arange(t, device=x.device)
        q_res = self.q_norm(self.wq_a(x))
        q = self.rope(_rms(self.wq_b(q_res).view(t, h, d), self.eps), pos)
        kv = self.rope(self.norm(self.wkv(x)), pos)                                       # [T, D]
        near = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - self.window)
        keys, allowed = kv, near
        if self.compressor is not None:
            entries = self.compressor(x, self.rope)                                       # [n, D]
            visible = torch.arange(entries.shape[0], device=x.device)[None, :] < ((pos + 1) // self.rate)[:, None]
            if self.indexer is not None:
                visible = self.indexer.select(x, q_res, self.rope, visible)
            keys, allowed = torch.cat([kv, entries]), torch.cat([near, visible], dim=1)
        kf = keys.float()
        scores = torch.einsum("thd,nd->htn", q.float(), kf) * d ** -0.5
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        sink = self.attn_sink[:, None, None].expand(h, t, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out = torch.einsum("htn,nd->thd", probs, kf).to(x.dtype)
        out = self.rope(out, pos, sign=-1.0).reshape(t, self.groups, -1)                  # [T, G, H * D / G]
        w = self.wo_a.weight.view(self.groups, self.rank, -1)
        grouped = torch.einsum("tgi,gri->tgr", out, w).reshape(t, self.groups * self.rank)
        return self.wo_b(grouped)


class HashRouter(nn.Module):
    """The router of a hash-routed layer: scores from `weight` as a learned layer's, but the experts
    are the token's row of `tid2eid` (no bias, no top-k)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        r = spec.router
        self.weight = nn.Parameter(torch.empty(r.num_experts, spec.hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        self.tid2eid = nn.Parameter(torch.zeros(spec.vocab_size, r.top_k, dtype=torch.int64), requires_grad=False)
        self.e_score_correction_bias = None


class V4MoE(MoE):
    """The MoE block of a DeepSeek-V4 layer: learned (sqrtsoftplus scores + correction bias) or
    hash-routed; the shared expert is a clamped SwiGLU as the routed ones. A hash-routed block
    reads the step's token ids, set by the layer before it runs (`token_ids`)."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, hashed: bool):
        super().__init__(spec, dtype)
        self.hashed = hashed
        if hashed:
            self.gate = HashRouter(spec)
        self.shared_experts = MLP(spec.hidden_size, spec.shared_intermediate_size, dtype,
                                  swiglu_limit=spec.swiglu_limit)
        self.token_ids: torch.Tensor | None = None

    def select_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.hashed:
            return route(x, self.gate.weight, self.spec.router, self.gate.e_score_correction_bias)
        ids = self.gate.tid2eid[self.token_ids]
        scores = F.softplus(F.linear(x.float(), self.gate.weight.float())).sqrt()
        w = scores.gather(1, ids)
        return ids, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.spec.router.routed_scaling_factor


class V4Layer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, ropes: dict[str, TailRope], dtype: torch.dtype):
        super().__init__()
        hc, eps = spec.hyper_connections, spec.rms_norm_eps
        self.attn_hc = HyperConnection(hc, spec.hidden_size, eps)
        self.ffn_hc = HyperConnection(hc, spec.hidden_size, eps)
        self.input_layernorm = RMSNorm(spec.hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps, dtype)
        self.attn = V4Attention(spec, layer, ropes, dtype)
        self.mlp = V4MoE(spec, dtype, layer in spec.compressed_attention.hash_layers)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """x [T, N, hidden] streams -> the streams after attention and MoE."""
        post, comb, h = self.attn_hc(x)
        x = HyperConnection.spread(x, self.attn(self.input_layernorm(h)), post, comb)
        post, comb, h = self.ffn_hc(x)
        self.mlp.token_ids = token_ids
        routed, shared = self.mlp.forward_parts(self.post_attention_layernorm(h))
        return HyperConnection.spread(x, routed.to(h.dtype) + shared, post, comb)


class V4Backbone(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype):
        super().__init__()
        c = spec.compressed_attention
        ropes = {"main": TailRope(spec.rope, spec.max_position_embeddings),
                 "compress": TailRope(c.compress_rope, spec.max_position_embeddings)}
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(V4Layer(spec, i, ropes, dtype) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.hc_head = HyperHead(spec.hyper_connections, spec.hidden_size, spec.rms_norm_eps)


class DeepseekV4LM(nn.Module):
    """The whole model, contiguous forward only (module docstring). Names follow the checkpoint's
    after ModelSpec.renames; the loader fills it as it fills CausalLM (load_weights)."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, *, load_mtp: bool = True):
        super().__init__()
        if spec.compressed_attention is None or spec.hyper_connections is None:
            raise ValueError(f"{spec.architecture} is not a DeepSeek-V4 spec")
        self.spec, self.dtype = spec, dtype
        self.model = V4Backbone(spec, dtype)
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size, False, dtype)
        self.mtp = nn.ModuleList()      # the checkpoint's MTP layer is not read yet

    def moe_blocks(self) -> dict[str, MoE]:
        return {n: m for n, m in self.named_modules() if isinstance(m, MoE)}

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] (positions 0 .. T - 1) -> the final normed hidden states [T, hidden]."""
        n = self.spec.hyper_connections.streams
        x = self.model.embed_tokens(input_ids)[:, None, :].expand(-1, n, -1)
        for layer in self.model.layers:
            x = layer(x, input_ids)
        return self.model.norm(self.model.hc_head(x))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.logits(self.hidden_states(input_ids))
