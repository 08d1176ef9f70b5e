"""Torch reference of the routed-expert MoE computation: the one function every MoE layer
calls on CPU, and the signature the Triton kernels (moe_w2.py, moe_fp4.py) implement.

Experts are addressed through a slot table, never by expert id directly:
  slot_table  int32 [num_experts]   slot of each expert in the pool, -1 = not resident
  pool        one of W2Pool / FP4Pool / DensePool (plain tensors, leading dim = slots), or a
              DecodedPool: a W2 / FP4 pool decoded once (decoded_pool), the CPU runs' fast path
A (token, expert) pair whose expert is not resident contributes zero and adds one to
`miss_counter` (int32/int64 [1]); the runner fetches the missing experts and replays.

Math per pair (t, j), e = topk_ids[t, j], s = slot_table[e]:
  gate, up = split(W_gate_up[s] @ x[t])         fused [2I, H] weight: gate rows first
  y[t, j] = W_down[s] @ act(gate, up)            ExpertActivation: silu(gate) * up, or a clamped
                                                 / gpt-oss form, with gate_up biases by expert id
  out[t] = sum_j topk_weights[t, j] * y[t, j]    fixed order j = 0..k-1 (deterministic)
Accumulation is in fp32 for the quantized pools and their DecodedPool (as the kernels do) and in the input dtype
for DensePool (as transformers does, so the bf16 reference matches it bit for bit in fp32).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moet.formats import w2
from moet.kernels.pools import ROW_TILED_FIELDS, DecodedPool, DensePool, FP4Pool, W2Pool, untile_field

@dataclass(frozen=True)
class ExpertActivation:
    """What runs between an expert's two GEMMs. Default SiLU(gate) * up. limit (DeepSeek-V4,
    gpt-oss): gate clamped above and up to +-limit, in fp32. alpha (gpt-oss): gate *
    sigmoid(alpha gate) * (up + 1) instead. gate_up_bias [E, 2I] (gpt-oss; gate biases, then up):
    added to the first GEMM's output by expert id, so it stays put while weights move slots."""
    limit: float | None = None
    alpha: float | None = None
    gate_up_bias: torch.Tensor | None = None

    def __call__(self, gate_up: torch.Tensor, experts: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """gate_up [..., 2I] (gate half first); experts: int64 [rows], the expert of each row of a
        [rows, 2I] gate_up, or bias: the rows' biases already gathered (slot_bias) -> [..., I] in
        gate_up's dtype."""
        dt = gate_up.dtype
        if bias is None and self.gate_up_bias is not None:
            bias = self.gate_up_bias[experts]
        if bias is not None:
            gate_up = gate_up + bias.to(dt)
        gate, up = gate_up.chunk(2, dim=-1)
        if self.limit is not None:
            gate = gate.float().clamp(max=self.limit)
            up = up.float().clamp(-self.limit, self.limit)
        if self.alpha is not None:
            return (gate * torch.sigmoid(gate * self.alpha) * (up + 1)).to(dt)
        return (F.silu(gate) * up).to(dt)

    def slot_bias(self, slot_table: torch.Tensor, num_slots: int) -> torch.Tensor | None:
        """gate_up_bias by slot [num_slots, 2I] (zero for an empty slot), for forms that compute
        every slot; built on the device without a host sync."""
        if self.gate_up_bias is None:
            return None
        b = self.gate_up_bias
        out = torch.zeros(num_slots + 1, b.shape[1], dtype=b.dtype, device=b.device)
        idx = torch.where(slot_table >= 0, slot_table.long(), num_slots)     # absent experts: the spare row
        out.index_copy_(0, idx, b)
        return out[:num_slots]


SILU = ExpertActivation()
W2_LEVELS = (-4.0, -1.0, 1.0, 4.0)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


_W2_LUTS: dict[tuple[str, torch.device], torch.Tensor] = {}


def _w2_lut(layout: str, device: torch.device) -> torch.Tensor:
    """Level table of one code unit: v1 byte -> 4 levels [256, 4]; nb8 16-bit unit -> 8 levels
    [65536, 8] (element order), built once per device from the format's own converters."""
    key = (layout, device)
    if key not in _W2_LUTS:
        levels = torch.tensor(W2_LEVELS, dtype=torch.float32)
        if layout == "v1":
            v = torch.arange(256, dtype=torch.int32)
            lut = levels[torch.stack([(v >> (2 * i)) & 3 for i in range(4)], dim=-1).long()]
        elif layout == "nb8":
            u = torch.arange(65536, dtype=torch.int32)
            nb = torch.stack((u & 0xFF, u >> 8), dim=-1).to(torch.uint8)            # little-endian unit
            v1 = w2.from_nb8(nb).to(torch.int32)
            v = v1[:, 0] | (v1[:, 1] << 8)
            lut = levels[torch.stack([(v >> (2 * i)) & 3 for i in range(8)], dim=-1).long()]
        else:
            raise ValueError(f"unknown W2 pool layout {layout!r}")
        _W2_LUTS[key] = lut.to(device)
    return _W2_LUTS[key]


def decode_w2(codes: torch.Tensor, scales: torch.Tensor, layout: str = "v1") -> torch.Tensor:
    """codes uint8 [N, K/4] + scales uint8 [N, K/32] -> float32 [N, K] (exact).
    v1: element k = 4j + i sits in bits 2i..2i+1 of byte j; nb8: the kernels' layout
    (moet.formats.w2.to_nb8). Value = level * 2**(scale - 127): one table gather per byte (v1)
    or 16-bit unit (nb8), times the group's power of two (exact: a product of powers of two,
    rounding only where ldexp would, at overflow to inf or into subnormals exactly)."""
    n, kq = codes.shape
    if layout == "v1":
        vals = _w2_lut("v1", codes.device)[codes.long()]                           # [N, K/4, 4]
    else:
        units = codes.view(n, kq // 2, 2).to(torch.int32)
        vals = _w2_lut(layout, codes.device)[(units[..., 0] | (units[..., 1] << 8)).long()]   # [N, K/8, 8]
    pow2 = torch.ldexp(torch.ones(scales.shape, dtype=torch.float32, device=codes.device), scales.to(torch.int32) - 127)
    return (vals.reshape(n, kq * 4 // 32, 32) * pow2.unsqueeze(-1)).reshape(n, kq * 4)


def decode_fp4(weight: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """NVFP4 layout: weight uint8 [N, K/2] (low nibble first) + scale e4m3 [N, K/16] + scale_2
    fp32 (scalar or one per row [N]) -> float32 [N, K]."""
    n, kh = weight.shape
    codes = torch.stack((weight & 0x0F, weight >> 4), dim=-1).reshape(n, kh * 2).long()
    vals = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=weight.device)[codes]
    s = scale.to(torch.float32).repeat_interleave(16, dim=1)
    s2 = scale_2.to(torch.float32).reshape(-1, 1) if scale_2.numel() > 1 else scale_2.to(torch.float32).reshape(())
    return vals * s * s2


def _slot_fields(pool, slot: int) -> dict[str, torch.Tensor]:
    """One slot's tensors of a W2 / FP4 pool, row-major (a row-tiled layout untiled, per slot)."""
    tiled = ROW_TILED_FIELDS.get(pool.layout, {})
    return {f: untile_field(getattr(pool, f)[slot], tiled[f]) if f in tiled else getattr(pool, f)[slot]
            for f in pool.__slots__ if f != "layout"}


def _slot_weights(pool, slot: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [2I, H], down [H, I]) of one slot, decoded."""
    if isinstance(pool, (DensePool, DecodedPool)):
        return pool.gate_up[slot], pool.down[slot]
    if isinstance(pool, W2Pool):
        f = _slot_fields(pool, slot)
        layout = "nb8" if pool.layout == "nb8t" else pool.layout
        return (decode_w2(f["gate_up_codes"], f["gate_up_scales"], layout),
                decode_w2(f["down_codes"], f["down_scales"], layout))
    if isinstance(pool, FP4Pool):
        two_i = pool.gate_up_weight.shape[1]
        # gate rows use scale_2[slot, 0], up rows scale_2[slot, 1]: checkpoints quantize gate
        # and up as separate tensors, each with its own per-tensor scale.
        s2 = pool.gate_up_scale_2[slot].repeat_interleave(two_i // 2)
        f = _slot_fields(pool, slot)
        return (decode_fp4(f["gate_up_weight"], f["gate_up_scale"], s2),
                decode_fp4(f["down_weight"], f["down_scale"], pool.down_scale_2[slot]))
    raise TypeError(f"unknown expert pool type {type(pool).__name__}")


def decoded_pool(pool: W2Pool | FP4Pool) -> DecodedPool:
    """Every slot of a W2 / FP4 pool decoded as moe_experts_reference decodes it per call (the
    same function, so the same float32 values and, through the same F.linear calls, the same
    outputs bit for bit)."""
    pairs = [_slot_weights(pool, s, torch.float32) for s in range(pool.num_slots)]
    return DecodedPool(torch.stack([g for g, _ in pairs]), torch.stack([d for _, d in pairs]))


def moe_experts_reference(
    hidden: torch.Tensor,            # [T, H]
    topk_ids: torch.Tensor,          # [T, k] int, expert ids
    topk_weights: torch.Tensor,      # [T, k] float, router weights (already scaled)
    slot_table: torch.Tensor,        # int32 [num_experts], -1 = not resident
    pool: W2Pool | FP4Pool | DensePool | DecodedPool,
    miss_counter: torch.Tensor,      # int [1], incremented by the number of missed pairs
    *,
    act: ExpertActivation = SILU,
) -> torch.Tensor:
    t, k = topk_ids.shape
    dense = isinstance(pool, DensePool)
    cdtype = hidden.dtype if dense else torch.float32
    slots = slot_table.long()[topk_ids.long()]                       # [T, k]
    missed = slots < 0
    if bool(missed.any()):
        miss_counter += missed.sum().to(miss_counter.dtype)
    y = torch.zeros(t, k, hidden.shape[1], dtype=cdtype, device=hidden.device)
    for slot in torch.unique(slots[~missed]).tolist():               # ascending slot order
        rows, cols = torch.where(slots == slot)
        w_gate_up, w_down = _slot_weights(pool, slot, cdtype)
        x = hidden[rows].to(cdtype)
        a = act(F.linear(x, w_gate_up.to(cdtype)), topk_ids[rows, cols].long())
        y[rows, cols] = F.linear(a, w_down.to(cdtype)) * topk_weights[rows, cols, None].to(cdtype)
    out = y[:, 0]
    for j in range(1, k):                                             # fixed-order combine
        out = out + y[:, j]
    return out.to(hidden.dtype)
