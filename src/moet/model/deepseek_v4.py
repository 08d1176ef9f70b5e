"""DeepSeek-V4 (DeepseekV4ForCausalLM): hyper-connected residual streams, sliding-window attention
with compressed keys (CSA: one key per `csa_rate` tokens from two overlapping windows, chosen per
query by a lightning indexer; HCA: one per `hca_rate` tokens, all of them), a grouped low-rank
output projection, and MoE layers routed by sqrt(softplus) scores or, in the first layers, by a
token-id table; experts are clamped SwiGLUs (checkpoint/spec.py CompressedAttentionSpec,
HyperConnectionSpec). Numerics follow transformers' deepseek_v4 op for op (fp32 norms, mixing,
pooling and softmax), so float32 logits match it.

Two forwards: the contiguous one (a whole sequence from position 0, every compressed key
recomputed from the tokens; the reference the parity tests hold to transformers) and the paged
one the engine runs (V4LayerKV: keys and the compressors' projections by token slot, windows
pooled as they end), in torch: prompt steps loop over their sequences on the host, decode steps
run batched on the device (CUDA graphs capture them); correct, not fast (no Triton kernels; the
cache keeps the model dtype). The routed experts go through
the same MoE block, pools and formats (bf16 / W2 / FP4), the expert store and the FP4 gate's
repair tier as every other family's. Not yet: the checkpoint's MTP layer, FP8 / FP4 dense weights
as the released checkpoints store them (`*.scale` names).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moet.checkpoint.spec import HyperConnectionSpec, ModelSpec, RopeSpec
from moet.errors import ConfigError
from moet.kernels.kv_cache import KVFormat
from moet.model.attention_batch import AttentionBatch
from moet.model.layers.linear import MLP, Linear
from moet.model.layers.moe import MoE
from moet.model.layers.norm import RMSNorm
from moet.model.layers.rope import inv_freq_and_scaling
from moet.model.layers.router import route
from moet.model.moe_model import MoEModel


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


@dataclass
class V4LayerKV:
    """One DeepSeek-V4 layer's paged cache, every tensor addressed by token slot (block * block_size
    + offset, as the other families' KV; the last row a sink for slot -1): "kv" the sliding keys
    [D]; with a compressor, "entries_kv" / "entries_gate" its per-token projections and "entries"
    the compressed keys at each window's first position; with an indexer the same three for it
    ("index_entries*"). Keeping the projections of every token (not only the open window's) costs
    memory but makes the cache a pure function of the tokens in each block: prefix caching,
    chunked prefill and preemption need nothing else."""
    block_size: int
    tensors: dict[str, torch.Tensor]

    @staticmethod
    def slots(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
        return table.long()[positions // block_size] * block_size + positions % block_size

    def write(self, name: str, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        t = self.tensors[name]
        sink = torch.full_like(slot_mapping, t.shape[0] - 1)
        t.index_copy_(0, torch.where(slot_mapping >= 0, slot_mapping, sink), rows.to(t.dtype))

    def read(self, name: str, table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
        return self.tensors[name][self.slots(table, positions, block_size)]

    @staticmethod
    def batch_slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
        """Slots of positions [B, L] of the sequences whose pages are tables [B, W] (positions >= 0)."""
        return tables.long().gather(1, positions // block_size) * block_size + positions % block_size

    def read_batch(self, name: str, tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
        """[B, L, width]: sequence b's rows at positions[b] (clamped to 0: mask the negative ones)."""
        return self.tensors[name][self.batch_slots(tables, positions.clamp(min=0), block_size)]


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

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token inputs of the pooling (what a paged cache keeps per token): (kv, gate)."""
        return self.wkv(x), self.wgate(x)

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, first: int, rope: TailRope) -> torch.Tensor:
        """Keys of windows first, first + 1, ... from their tokens' projections (kv / gate rows,
        whole windows; with overlap and first > 0 led by window first - 1's rows) -> [n, dim]."""
        m, d = self.rate, self.dim
        prev = self.overlap and first > 0
        if prev:
            prev_kv, prev_gate = kv[:m].float(), gate[:m].float() + self.ape
            kv, gate = kv[m:], gate[m:]
        n = kv.shape[0] // m
        if n == 0:
            return kv.new_zeros(0, d)
        kv = kv.float().view(n, m, -1)
        gate = gate.float().view(n, m, -1) + self.ape
        if self.overlap:
            pooled_kv = kv.new_zeros(n, 2 * m, d)
            pooled_gate = gate.new_full((n, 2 * m, d), float("-inf"))
            pooled_kv[:, m:], pooled_gate[:, m:] = kv[..., d:], gate[..., d:]
            pooled_kv[1:, :m], pooled_gate[1:, :m] = kv[:-1, :, :d], gate[:-1, :, :d]
            if prev:
                pooled_kv[0, :m], pooled_gate[0, :m] = prev_kv[:, :d], prev_gate[:, :d]
            kv, gate = pooled_kv, pooled_gate
        keys = self.norm((kv * torch.softmax(gate, dim=1)).sum(dim=1).to(self.norm.weight.dtype))
        return rope(keys, (first + torch.arange(n, device=keys.device)) * m)

    def pool_windows(self, kv: torch.Tensor, gate: torch.Tensor, window: torch.Tensor, rope: TailRope) -> torch.Tensor:
        """One key per row b, of window window[b] >= 0 (static shapes: a decode step's B windows):
        kv / gate [B, S, width] the projections of its tokens, S = rate (overlap: 2 * rate, window
        - 1's tokens first, ignored where window is 0) -> [B, dim]. The same arithmetic as pool."""
        m, d = self.rate, self.dim
        kv, gate = kv.float(), gate.float()
        if self.overlap:
            prev_gate = (gate[:, :m, :d] + self.ape[:, :d]).masked_fill((window == 0)[:, None, None], float("-inf"))
            kv = torch.cat([kv[:, :m, :d], kv[:, m:, d:]], dim=1)
            gate = torch.cat([prev_gate, gate[:, m:, d:] + self.ape[:, d:]], dim=1)
        else:
            gate = gate + self.ape
        keys = self.norm((kv * torch.softmax(gate, dim=1)).sum(dim=1).to(self.norm.weight.dtype))
        return rope(keys, window * m)

    def forward(self, x: torch.Tensor, rope: TailRope) -> torch.Tensor:
        """x [T, hidden] (positions 0 .. T - 1) -> keys [T // rate, dim]."""
        n = x.shape[0] // self.rate
        kv, gate = self.project(x[:n * self.rate])
        return self.pool(kv, gate, 0, rope)


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

    def select(self, x: torch.Tensor, q_res: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
               rope: TailRope, visible: torch.Tensor) -> torch.Tensor:
        """Rows x / q_res at `positions`, index keys [n, Di] -> [T, n] bool: the compressed keys each
        query attends to (visible [T, n]: the causal ones)."""
        t, n = visible.shape
        keep = torch.zeros(t, n, dtype=torch.bool, device=x.device)
        if n == 0:
            return keep
        q = rope(self.wq_b(q_res).view(t, self.heads, self.dim), positions).float()
        scores = torch.relu(torch.einsum("thd,nd->thn", q, keys.float())) * self.dim ** -0.5
        w = self.weights_proj(x).float() * self.heads ** -0.5
        score = (scores * w[..., None]).sum(dim=1).masked_fill(~visible, float("-inf"))
        top = score.topk(min(self.top_k, n), dim=-1).indices
        return keep.scatter_(1, top, torch.gather(visible, 1, top))

    def select_rows(self, x: torch.Tensor, q_res: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
                    rope: TailRope, visible: torch.Tensor) -> torch.Tensor:
        """select with each row's own index keys [B, n, Di] (a decode step's B sequences)."""
        b, n = visible.shape
        q = rope(self.wq_b(q_res).view(b, self.heads, self.dim), positions).float()
        scores = torch.relu(torch.einsum("bhd,bnd->bhn", q, keys.float())) * self.dim ** -0.5
        w = self.weights_proj(x).float() * self.heads ** -0.5
        score = (scores * w[..., None]).sum(dim=1).masked_fill(~visible, float("-inf"))
        top = score.topk(min(self.top_k, n), dim=-1).indices
        keep = torch.zeros(b, n, dtype=torch.bool, device=x.device)
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

    def _project(self, x: torch.Tensor, pos: torch.Tensor):
        """(q_res [T, q_lora], q [T, H, D], kv [T, D]) of rows x at positions pos."""
        t = x.shape[0]
        q_res = self.q_norm(self.wq_a(x))
        q = self.rope(_rms(self.wq_b(q_res).view(t, self.heads, self.head_dim), self.eps), pos)
        return q_res, q, self.rope(self.norm(self.wkv(x)), pos)

    def _attend(self, q: torch.Tensor, pos: torch.Tensor, kv: torch.Tensor, kv_pos: torch.Tensor,
                entries: torch.Tensor | None, chosen: torch.Tensor | None) -> torch.Tensor:
        """Queries q [t, H, D] at positions pos over the sliding keys kv [L, D] (at kv_pos, the window
        masked here) and compressed keys entries [n, D] where chosen [t, n] -> the output rows [t, hidden]."""
        t, h, d = q.shape
        keys = kv
        allowed = (kv_pos[None, :] <= pos[:, None]) & (kv_pos[None, :] > pos[:, None] - self.window)
        if entries is not None:
            keys, allowed = torch.cat([kv, entries]), torch.cat([allowed, chosen], dim=1)
        kf = keys.float()
        scores = torch.einsum("thd,nd->htn", q.float(), kf) * d ** -0.5
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        sink = self.attn_sink[:, None, None].expand(h, t, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        return self._output(torch.einsum("htn,nd->thd", probs, kf).to(q.dtype), pos)

    def _attend_rows(self, q: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """_attend with each query row's own keys [B, L, D] and mask [B, L] (a decode step)."""
        b, h, d = q.shape
        kf = keys.float()
        scores = torch.einsum("bhd,bld->bhl", q.float(), kf) * d ** -0.5
        scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
        sink = self.attn_sink[None, :, None].expand(b, h, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        return self._output(torch.einsum("bhl,bld->bhd", probs, kf).to(q.dtype), pos)

    def _output(self, out: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Attention output [t, H, D] -> de-rotated at the query positions, wo_a per group, wo_b."""
        t = out.shape[0]
        out = self.rope(out, pos, sign=-1.0).reshape(t, self.groups, -1)                  # [t, G, H * D / G]
        w = self.wo_a.weight.view(self.groups, self.rank, -1)
        return self.wo_b(torch.einsum("tgi,gri->tgr", out, w).reshape(t, self.groups * self.rank))

    def _visible(self, n: int, pos: torch.Tensor) -> torch.Tensor:
        """[t, n]: compressed key e is visible to a query at p once its window has ended by p."""
        return torch.arange(n, device=pos.device)[None, :] < ((pos + 1) // self.rate)[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (the normed collapse of the streams, positions 0 .. T - 1) -> [T, hidden]."""
        pos = torch.arange(x.shape[0], device=x.device)
        q_res, q, kv = self._project(x, pos)
        entries = chosen = None
        if self.compressor is not None:
            entries = self.compressor(x, self.rope)
            chosen = self._visible(entries.shape[0], pos)
            if self.indexer is not None:
                keys = self.indexer.compressor(x, self.rope)
                chosen = self.indexer.select(x, q_res, pos, keys, self.rope, chosen)
        return self._attend(q, pos, kv, pos, entries, chosen)

    def forward_paged(self, x: torch.Tensor, batch: AttentionBatch, kv: V4LayerKV) -> torch.Tensor:
        """x [N, hidden]: a flat varlen batch (AttentionBatch). Writes the rows' keys and the
        compressors' per-token projections by slot, makes the compressed keys of every window
        that ends in this step, then attends per sequence over its cached rows. Torch, eager."""
        pos = batch.positions
        q_res, q, rows = self._project(x, pos)
        kv.write("kv", rows, batch.slot_mapping)
        if self.compressor is not None:
            for name, comp in self._compressors():
                proj_kv, proj_gate = comp.project(x)
                kv.write(name + "_kv", proj_kv, batch.slot_mapping)
                kv.write(name + "_gate", proj_gate, batch.slot_mapping)
        if batch.is_pure_decode:
            return self._decode_paged(x, q_res, q, batch, kv)
        out = torch.empty_like(x)
        bs = kv.block_size
        for b in range(batch.num_seqs):
            lo, hi = batch.cu_seqlens_q_host[b], batch.cu_seqlens_q_host[b + 1]
            if hi == lo:
                continue
            n = batch.seq_lens_host[b]
            first = n - (hi - lo)
            table = batch.block_tables[b]
            entries = chosen = None
            if self.compressor is not None:
                done = n // self.rate
                for name, comp in self._compressors():
                    self._compress(kv, name, comp, table, first // self.rate, done)
                entries = kv.read("entries", table, torch.arange(done, device=x.device) * self.rate, bs)
                chosen = self._visible(done, pos[lo:hi])
                if self.indexer is not None:
                    keys = kv.read("index_entries", table, torch.arange(done, device=x.device) * self.rate, bs)
                    chosen = self.indexer.select(x[lo:hi], q_res[lo:hi], pos[lo:hi], keys, self.rope, chosen)
            kv_pos = torch.arange(max(0, first - self.window + 1), n, device=x.device)
            out[lo:hi] = self._attend(q[lo:hi], pos[lo:hi], kv.read("kv", table, kv_pos, bs), kv_pos, entries, chosen)
        return out

    def _decode_paged(self, x: torch.Tensor, q_res: torch.Tensor, q: torch.Tensor, batch: AttentionBatch,
                      kv: V4LayerKV) -> torch.Tensor:
        """An all-decode step (row b: sequence b's last position), on the device only: the windows
        that end at these tokens pooled, every sequence's sliding window and compressed keys read up
        to a host bound (the longest sequence; a graph capture's worst case), masked by its own
        length. Static shapes, no host sync: a CUDA graph captured at the worst case replays it."""
        bsz, dev, bs = x.shape[0], x.device, kv.block_size
        pos, tables = batch.positions, batch.block_tables
        kv_pos = pos[:, None] - (self.window - 1) + torch.arange(self.window, device=dev)[None, :]   # [B, W]
        keys, allowed = kv.read_batch("kv", tables, kv_pos, bs), kv_pos >= 0
        if self.compressor is not None:
            m = self.rate
            window = (pos + 1) // m - 1                                  # the window ending here, if any
            ends = (pos + 1) % m == 0
            for name, comp in self._compressors():
                span = 2 * m if comp.overlap else m
                src = (window - (1 if comp.overlap else 0))[:, None] * m + torch.arange(span, device=dev)[None, :]
                made = comp.pool_windows(kv.read_batch(name + "_kv", tables, src, bs),
                                         kv.read_batch(name + "_gate", tables, src, bs), window.clamp(min=0), self.rope)
                at = V4LayerKV.batch_slots(tables, (window.clamp(min=0) * m)[:, None], bs)[:, 0]
                kv.write(name, made, torch.where(ends, at, torch.full_like(at, -1)))
            n = max(1, max(batch.seq_lens_host) // m)
            e_pos = (torch.arange(n, device=dev) * m).expand(bsz, n)
            chosen = torch.arange(n, device=dev)[None, :] < ((pos + 1) // m)[:, None]
            if self.indexer is not None:
                chosen = self.indexer.select_rows(x, q_res, pos, kv.read_batch("index_entries", tables, e_pos, bs),
                                                  self.rope, chosen)
            keys = torch.cat([keys, kv.read_batch("entries", tables, e_pos, bs)], dim=1)
            allowed = torch.cat([allowed, chosen], dim=1)
        return self._attend_rows(q, pos, keys, allowed)

    def _compressors(self):
        yield "entries", self.compressor
        if self.indexer is not None:
            yield "index_entries", self.indexer.compressor

    def _compress(self, kv: V4LayerKV, name: str, comp: Compressor, table: torch.Tensor, e0: int, e1: int) -> None:
        """The keys of windows e0 .. e1 - 1 (those that ended in this step) from the projections
        cached by slot, written at each window's first position."""
        if e1 <= e0:
            return
        m, bs = self.rate, kv.block_size
        start = (e0 - 1) * m if comp.overlap and e0 > 0 else e0 * m
        src = torch.arange(start, e1 * m, device=table.device)
        keys = comp.pool(kv.read(name + "_kv", table, src, bs), kv.read(name + "_gate", table, src, bs), e0, self.rope)
        kv.write(name, keys, kv.slots(table, torch.arange(e0, e1, device=table.device) * m, bs))


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

    def forward_paged(self, x: torch.Tensor, token_ids: torch.Tensor, batch: AttentionBatch,
                      kv: V4LayerKV) -> torch.Tensor:
        post, comb, h = self.attn_hc(x)
        x = HyperConnection.spread(x, self.attn.forward_paged(self.input_layernorm(h), batch, kv), post, comb)
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


class DeepseekV4LM(MoEModel):
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

    # decode steps run on the device only (V4Attention._decode_paged: host lengths only as an upper
    # bound), so the runner may capture its decode graphs at the worst case; the other steps loop
    # over sequences on the host and run eager (the only graphs a V4 model gets are decode graphs:
    # it has no MTP verify or gate repair passes yet)
    graph_safe = True

    def fuse_projections(self) -> int:
        return 0

    def prepare_cpu(self, expert_bytes: int) -> int:
        return 0

    def moe_blocks(self) -> dict[str, MoE]:
        """{decoder layer's module name: its MoE block} (every layer is MoE)."""
        return {f"model.layers.{i}": layer.mlp for i, layer in enumerate(self.model.layers)}

    def _streams(self, input_ids: torch.Tensor) -> torch.Tensor:
        n = self.spec.hyper_connections.streams
        return self.model.embed_tokens(input_ids)[:, None, :].expand(-1, n, -1)

    def new_cache(self, max_len: int, device: torch.device | str) -> list[torch.Tensor]:
        """The contiguous forward's "cache": the sequence's tokens so far (it recomputes from
        position 0 each call), so callers of CausalLM's incremental interface (the reference loop)
        run unchanged."""
        return [torch.empty(0, dtype=torch.long, device=device)]

    def hidden_states(self, input_ids: torch.Tensor, start: int = 0, cache: list | None = None) -> torch.Tensor:
        """input_ids [T] at positions start .. start + T - 1 -> hidden states [T, hidden] before the
        final norm; `cache` (new_cache) holds the tokens before `start`, and then these too."""
        ids = input_ids
        if cache is not None:
            ids = torch.cat([cache[0][:start], input_ids])
            cache[0] = ids
        elif start:
            raise ValueError("a start past 0 needs the cache of the tokens before it")
        x = self._streams(ids)
        for layer in self.model.layers:
            x = layer(x, ids)
        return self.model.hc_head(x)[start:]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden))

    def forward(self, input_ids: torch.Tensor, start: int = 0, cache: list | None = None) -> torch.Tensor:
        return self.logits(self.hidden_states(input_ids, start, cache))

    # ------------------------------------------------------------------ paged cache

    def _layer_widths(self, layer: int) -> dict[str, int]:
        return self.spec.compressed_attention.cache_widths(layer, self.spec.attention.head_dim)

    def kv_bytes_per_token(self, kv_format: KVFormat) -> int:
        """Cache bytes one token occupies across every layer (V4LayerKV's rows)."""
        _check_format(kv_format)
        return kv_format.dtype.itemsize * self.spec.compressed_attention.cache_elements_per_token(
            self.spec.attention.head_dim)

    def decode_cache_bytes(self, context: int) -> int:
        """Cache bytes a decode step of one sequence at `context` tokens reads: each layer's sliding
        window of keys, and its compressed keys (CSA: with their index keys). The compressors'
        per-token projections are read only when a window ends."""
        a, c = self.spec.attention, self.spec.compressed_attention
        d, total = a.head_dim, 0
        for kind in c.layer_types:
            total += min(c.window, context) * d
            if kind == "hca":
                total += context // c.hca_rate * d
            elif kind == "csa":
                total += context // c.csa_rate * (d + c.index_head_dim)
        return total * self.dtype.itemsize

    def new_kv_cache(self, num_blocks: int, block_size: int, kv_format: KVFormat,
                     device: torch.device | str) -> list[V4LayerKV]:
        _check_format(kv_format)
        rows = num_blocks * block_size + 1
        return [V4LayerKV(block_size, {name: torch.zeros(rows, w, dtype=kv_format.dtype, device=device)
                                       for name, w in self._layer_widths(i).items()})
                for i in range(self.spec.num_layers)]

    def forward_paged(self, input_ids: torch.Tensor, batch: AttentionBatch, kv: list[V4LayerKV]) -> torch.Tensor:
        """input_ids [N]: a flat varlen batch of several sequences' new tokens (AttentionBatch) ->
        hidden states [N, hidden] before the final norm; logits: self.logits(hidden[logits_indices])."""
        x = self._streams(input_ids)
        for layer, cache in zip(self.model.layers, kv):
            x = layer.forward_paged(x, input_ids, batch, cache)
        return self.model.hc_head(x)


def _check_format(kv_format: KVFormat) -> None:
    if kv_format.name != "auto":
        raise ConfigError(f"--kv-cache-dtype {kv_format.name}: DeepSeek-V4's cache keeps the model dtype for now "
                          "(auto or bf16)")
