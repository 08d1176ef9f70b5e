"""Gated DeltaNet, the linear-attention layer of Qwen3.5-MoE, as transformers defines it.

Per token t (heads h of the value side; q / k heads repeated to match):
    qkv_t  = silu(causal depthwise conv over the last `conv_kernel` inputs of in_proj_qkv(x))
    q, k   = l2-normalised, q scaled by key_head_dim^-1/2;   beta = sigmoid(in_proj_b(x))
    g      = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)          (a log-decay, <= 0)
    S      = S * exp(g)                                               S: [key_head_dim, value_head_dim]
    S      = S + k (beta (v - S^T k))^T                                the delta rule
    o_t    = S^T q
    out    = out_proj(RMSNorm(o) * silu(in_proj_z(x)))                 (the gated norm, per head)
What a sequence carries from step to step is its state: the conv's last conv_kernel - 1 inputs
and S per value head, in float32 (RecurrentState). In torch, float32: a prompt of 64 tokens or more
runs the chunked (WY) form, a shorter one the recurrence token by token, and a decode step one step
for all its sequences at once; flash-linear-attention's Triton kernels are the fast path these
references are for, not yet wired in.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moet.checkpoint.spec import LinearAttentionSpec
from moet.model.layers.linear import Linear


@dataclass
class RecurrentState:
    """The states of one gated DeltaNet layer for `slots` sequences (a paged step's sequences
    index it by AttentionBatch.state_slots; the contiguous forward holds one slot)."""
    conv: torch.Tensor        # float32 [slots, conv_dim, conv_kernel - 1]: the conv's last inputs
    recurrent: torch.Tensor   # float32 [slots, value_heads, key_head_dim, value_head_dim]

    @classmethod
    def zeros(cls, spec: LinearAttentionSpec, slots: int, device) -> "RecurrentState":
        return cls(torch.zeros(slots, spec.conv_dim, spec.conv_kernel - 1, dtype=torch.float32, device=device),
                   torch.zeros(slots, spec.value_heads, spec.key_head_dim, spec.value_head_dim,
                               dtype=torch.float32, device=device))

    @staticmethod
    def bytes_per_slot(spec: LinearAttentionSpec) -> int:
        return 4 * (spec.conv_dim * (spec.conv_kernel - 1)
                    + spec.value_heads * spec.key_head_dim * spec.value_head_dim)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> torch.Tensor:
    """The recurrence over T tokens of one sequence, float32: q, k [T, H, Dk] (normalised, q
    scaled), v [T, H, Dv], g, beta [T, H]; state [H, Dk, Dv] is updated in place -> o [T, H, Dv]."""
    out = torch.empty_like(v)
    s = state
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        remembered = (s * k[t][:, :, None]).sum(dim=1)                     # S^T k: [H, Dv]
        s = s + k[t][:, :, None] * ((v[t] - remembered) * beta[t][:, None])[:, None, :]
        out[t] = (s * q[t][:, :, None]).sum(dim=1)
    state.copy_(s)
    return out


def chunked_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             state: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """gated_delta_rule's result (to float32 rounding) in chunks of `chunk` tokens: within a
    chunk the delta rule's corrections form a lower-triangular system, solved once for all chunks
    (the WY form: C row updates instead of T dependent steps); across chunks the state is carried
    as in the recurrence, one matrix product per chunk. Same arguments and in-place state."""
    t, h, dk = k.shape
    n = -(-t // chunk)
    pad = n * chunk - t
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))          # padded tokens: no decay, no write
    # [H, N, C, ...]
    q, k, v = (x.reshape(n, chunk, h, -1).permute(2, 0, 1, 3) for x in (q, k, v))
    g, beta = (x.reshape(n, chunk, h).permute(2, 0, 1) for x in (g, beta))
    gc = g.cumsum(-1)                                                     # decay from the chunk's start
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, float("-inf")).exp()   # i >= j
    kb, vb = k * beta[..., None], v * beta[..., None]
    # a[i, j] = -beta_i k_i . k_j decay(i, j) for j < i; then (I - a)^-1 row by row
    a = -(kb @ k.transpose(-1, -2) * decay).masked_fill(lower.triu(), 0.0)     # strictly below the diagonal
    for i in range(1, chunk):
        a[..., i, :i] = a[..., i, :i] + (a[..., i, :i, None] * a[..., :i, :i]).sum(-2)
    a = a + torch.eye(chunk, dtype=a.dtype, device=a.device)
    u = a @ vb                                                            # the chunk's corrected values
    w = a @ (kb * gc.exp()[..., None])                                    # what the carried state removes
    out = torch.empty_like(v)
    s = state
    for c in range(n):
        qc, kc, gcc = q[:, c], k[:, c], gc[:, c]
        intra = (qc @ kc.transpose(-1, -2)) * decay[:, c]
        v_new = u[:, c] - w[:, c] @ s
        out[:, c] = (qc * gcc.exp()[..., None]) @ s + intra @ v_new
        last = gcc[:, -1]
        s = s * last.exp()[:, None, None] + (kc * (last[:, None] - gcc).exp()[..., None]).transpose(-1, -2) @ v_new
    state.copy_(s)
    return out.permute(1, 2, 0, 3).reshape(n * chunk, h, -1)[:t]


# prompts at least this long run in chunks (chunked_gated_delta_rule); shorter ones token by token
CHUNK_FROM_TOKENS = 64


class _Conv(nn.Module):
    """conv1d.weight [conv_dim, 1, kernel] under the checkpoint's name (depthwise, no bias)."""

    def __init__(self, channels: int, kernel: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype), requires_grad=False)


class GatedRMSNorm(nn.Module):
    """RMSNorm over a head's values, then times silu(gate) in float32 (weights stored as is)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, spec: LinearAttentionSpec, hidden: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.spec = spec
        kd, vd = spec.key_heads * spec.key_head_dim, spec.value_heads * spec.value_head_dim
        self.in_proj_qkv = Linear(hidden, 2 * kd + vd, False, dtype)
        self.in_proj_z = Linear(hidden, vd, False, dtype)
        self.in_proj_b = Linear(hidden, spec.value_heads, False, dtype)
        self.in_proj_a = Linear(hidden, spec.value_heads, False, dtype)
        self.conv1d = _Conv(spec.conv_dim, spec.conv_kernel, dtype)
        self.dt_bias = nn.Parameter(torch.empty(spec.value_heads, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(spec.value_heads, dtype=dtype), requires_grad=False)
        self.norm = GatedRMSNorm(spec.value_head_dim, eps, dtype)
        self.out_proj = Linear(vd, hidden, False, dtype)

    def _mix(self, x: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """One sequence's T new tokens x [T, hidden] with its states (updated in place) ->
        the layer's output [T, hidden]."""
        s = self.spec
        qkv = self.in_proj_qkv(x)                                           # [T, C]
        # causal depthwise conv over [the previous K - 1 inputs, these T], in the weights' dtype
        w = self.conv1d.weight
        window = torch.cat([conv_state.to(qkv.dtype), qkv.transpose(0, 1)], dim=1)    # [C, K - 1 + T]
        conv = F.conv1d(window[None].to(w.dtype), w, groups=s.conv_dim)[0]             # [C, T]
        conv_state.copy_(window[:, -(s.conv_kernel - 1):].float())
        q, k, v, g, beta = self._heads(F.silu(conv).transpose(0, 1).to(x.dtype), x)
        rule = chunked_gated_delta_rule if x.shape[0] >= CHUNK_FROM_TOKENS else gated_delta_rule
        return self._out(rule(q, k, v, g, beta, state).to(x.dtype), x)

    def _heads(self, qkv: torch.Tensor, x: torch.Tensor):
        """The conv's output qkv [N, C] of N rows and their inputs x [N, hidden] -> float32 q, k
        [N, Hv, Dk] (repeated to the value heads, normalised, q scaled), v [N, Hv, Dv], the
        log-decay g and beta [N, Hv]."""
        s, n = self.spec, x.shape[0]
        kd = s.key_heads * s.key_head_dim
        q, k, v = qkv.split([kd, kd, s.value_heads * s.value_head_dim], dim=-1)
        rep = s.value_heads // s.key_heads
        q = q.reshape(n, s.key_heads, s.key_head_dim).repeat_interleave(rep, dim=1).float()
        k = k.reshape(n, s.key_heads, s.key_head_dim).repeat_interleave(rep, dim=1).float()
        v = v.reshape(n, s.value_heads, s.value_head_dim).float()
        beta = self.in_proj_b(x).sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        return _l2norm(q) * s.key_head_dim ** -0.5, _l2norm(k), v, g, beta

    def _out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The recurrence's output o [N, Hv, Dv] gated by in_proj_z(x), normed, projected."""
        s = self.spec
        z = self.in_proj_z(x).reshape(x.shape[0], s.value_heads, s.value_head_dim)
        return self.out_proj(self.norm(o, z).reshape(x.shape[0], -1))

    # the contiguous forward (one sequence): `cache` is (conv state, recurrent state) of one slot
    def new_state(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        st = RecurrentState.zeros(self.spec, 1, device)
        return st.conv[0], st.recurrent[0]

    def forward(self, x: torch.Tensor, cos, sin, cache: tuple[torch.Tensor, torch.Tensor], start: int) -> torch.Tensor:
        conv_state, state = cache
        if start == 0:
            conv_state.zero_()
            state.zero_()
        return self._mix(x, conv_state, state)

    def _decode(self, x: torch.Tensor, slots: torch.Tensor, states: RecurrentState) -> torch.Tensor:
        """One new token of each of B sequences, x [B, hidden], their states at `slots` (int64 [B]),
        all at once: the recurrence's one step batched over the sequences (what _mix does per
        sequence, the same ops)."""
        s = self.spec
        qkv = self.in_proj_qkv(x)                                           # [B, C]
        w = self.conv1d.weight
        window = torch.cat([states.conv[slots].to(qkv.dtype), qkv[:, :, None]], dim=2)    # [B, C, K]
        conv = F.conv1d(window.to(w.dtype), w, groups=s.conv_dim)[:, :, 0]              # [B, C]
        states.conv[slots] = window[:, :, 1:].float()
        q, k, v, g, beta = self._heads(F.silu(conv).to(x.dtype), x)
        st = states.recurrent[slots] * g.exp()[:, :, None, None]          # [B, Hv, Dk, Dv]
        remembered = (st * k[:, :, :, None]).sum(dim=2)
        st = st + k[:, :, :, None] * ((v - remembered) * beta[:, :, None])[:, :, None, :]
        states.recurrent[slots] = st
        return self._out((st * q[:, :, :, None]).sum(dim=2).to(x.dtype), x)

    def forward_paged(self, x: torch.Tensor, cos, sin, batch, states: RecurrentState, split_tokens: int) -> torch.Tensor:
        """Each sequence of the step from its own slot (batch.state_slots); a sequence whose
        first token this step holds starts from zero states. A step of one token per sequence
        runs the sequences together (_decode)."""
        if batch.is_pure_decode:
            fresh = [slot for slot, n in zip(batch.state_slots, batch.seq_lens_host) if n == 1]
            if fresh:
                idx = torch.tensor(fresh, dtype=torch.long, device=x.device)
                states.conv[idx] = 0.0
                states.recurrent[idx] = 0.0
            return self._decode(x, torch.tensor(batch.state_slots, dtype=torch.long, device=x.device), states)
        out = torch.empty_like(x)
        cu = batch.cu_seqlens_q_host
        for b, slot in enumerate(batch.state_slots):
            lo, hi = cu[b], cu[b + 1]
            if hi == lo:
                continue
            if batch.seq_lens_host[b] == hi - lo:                          # no earlier token: fresh state
                states.conv[slot].zero_()
                states.recurrent[slot].zero_()
            out[lo:hi] = self._mix(x[lo:hi], states.conv[slot], states.recurrent[slot])
        return out
