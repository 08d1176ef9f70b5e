"""Routed experts on the CPU, fast: the experts repacked once for CPU GEMVs, then only the routed
ones computed, with none of the reference's per-call decoding and grouping machinery at one token.

The torch reference (moet.kernels.reference) decodes every routed expert's W2 / FP4 rows at
every call and groups rows by slot with several small ops: right as the Triton kernels' exact
reference, but most of a CPU decode step. A CPU run whose slots never change (every expert
resident, no expert store; CausalLM.prepare_cpu) repacks each pool once into a CpuPool:

  w2 ("int4")  the 2-bit levels -4, -1, 1, 4 are int4 codes 4, 7, 9, 12 minus torch's fixed
               zero point 8, and the UE8M0 group scale 2^(e - 127) is a bf16 power of two, so
               torch's CPU int4 weight-only GEMM (aten._weight_int4pack_mm_for_cpu, group 32)
               reads the exact W2 weights at 0.625 bytes per weight (codes + bf16 scale/zero).
  fp4 ("bf16") e2m1 * e4m3 (<= 6 significant bits) is exact in bf16; the per-tensor scale_2
               multiplies the fp32 output, as the Triton kernel applies it to its accumulator.
Both take bf16 activations and accumulate in fp32, as the GPU kernels do; unlike them the GEMM
outputs (gate/up, down) are rounded to bf16 before the float32 SwiGLU and the float32 weighted
sum. So against the reference they differ by float rounding only (tests/kernels/test_moe_cpu.py
bounds it as the Triton kernels' tests do). Only for bf16 models: a float32 model keeps the exact
float32 decode (reference.decoded_pool).

A bf16 DensePool (expert_format bf16) becomes a "dense" CpuPool: its weights oneDNN-packed (the
same matmul as F.linear, without re-laying the weight out at every call). moe_experts_cpu also
takes a DecodedPool or a DensePool as they are. For those three, at one token it runs the
reference's own ops for the routed experts only (bit for bit the reference's result), else the
reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moet.kernels.pools import DecodedPool, DensePool, FP4Pool, W2Pool
from moet.kernels.reference import _slot_fields, decode_fp4, decode_w2, moe_experts_reference

W2_GROUP = 32


@dataclass(slots=True)
class CpuPool:
    """A pool repacked for CPU GEMVs. kind "int4": W2; "bf16": FP4 (see the module doc); "dense": a
    bf16 DensePool whose weights are oneDNN-packed (computed as the reference computes it, same
    bits; `source` is the DensePool, for the reference itself at several tokens). gate_up / down
    are lists of per-slot oneDNN-packed weights where `packed` (see pack_bf16)."""
    kind: str
    gate_up: torch.Tensor | list         # int4: uint8 [S, 2I, H/2]; bf16 / dense: [S, 2I, H]
    down: torch.Tensor | list            # int4: uint8 [S, H, I/2];  bf16 / dense: [S, H, I]
    gate_up_sz: torch.Tensor | None      # int4: bf16 [S, H/32, 2I, 2] (scale, zero 0)
    down_sz: torch.Tensor | None         # int4: bf16 [S, I/32, H, 2]
    gate_up_scale: torch.Tensor | None   # bf16 kind: fp32 [S, 2I] per-row multiplier (FP4 scale_2)
    down_scale: torch.Tensor | None      # bf16 kind: fp32 [S]
    packed: bool = False
    source: DensePool | None = None

    @property
    def num_slots(self) -> int:
        return len(self.gate_up)

    def linear(self, x: torch.Tensor, w) -> torch.Tensor:
        """x @ w^T for a bf16 / dense pool's weight (F.linear's bits either way)."""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return F.linear(x, w)

    def gate_up_mm(self, x: torch.Tensor, s: int) -> torch.Tensor:
        """x bf16 [n, H] -> fp32 [n, 2I]."""
        if self.kind == "int4":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.gate_up[s], W2_GROUP, self.gate_up_sz[s]).float()
        return self.linear(x, self.gate_up[s]).float() * self.gate_up_scale[s]

    def down_mm(self, act: torch.Tensor, s: int) -> torch.Tensor:
        """act bf16 [n, I] -> fp32 [n, H]."""
        if self.kind == "int4":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(act, self.down[s], W2_GROUP, self.down_sz[s]).float()
        return self.linear(act, self.down[s]).float() * self.down_scale[s]


def have_onednn_packing() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack_bf16(ws: torch.Tensor) -> list | None:
    """bf16 weights [S, N, K] -> one oneDNN-packed weight per slot, or None where this torch cannot
    pack or the packed matmul does not give F.linear's bits on a probe input. F.linear on a plain
    bf16 CPU weight runs the same oneDNN matmul but re-lays the weight out at every call: most of a
    small GEMV's time."""
    if ws.dtype != torch.bfloat16 or not have_onednn_packing():
        return None
    try:
        out = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in ws]
        x = torch.randn(3, ws.shape[2], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        if not torch.equal(torch.ops.mkldnn._linear_pointwise(x, out[0], None, "none", [], ""), F.linear(x, ws[0])):
            return None
    except RuntimeError:
        return None
    return out


def have_int4_gemm() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


def _int4_pack(w: torch.Tensor, scale_bytes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One W2 projection decoded exactly (float32 [N, K]) and its UE8M0 bytes [N, K/32] -> (int4
    codes packed for the CPU GEMM, bf16 scale/zero [K/32, N, 2])."""
    scale = torch.ldexp(torch.ones(scale_bytes.shape), scale_bytes.to(torch.int32) - 127)       # [N, K/32]
    level = w / scale.repeat_interleave(W2_GROUP, dim=1)                                      # -4, -1, 1, 4
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu((level + 8).to(torch.int32).contiguous(), 1)
    sz = torch.stack([scale.t(), torch.zeros_like(scale.t())], dim=-1).to(torch.bfloat16).contiguous()
    return packed, sz


def _w2_int4(pool: W2Pool) -> CpuPool | None:
    """None where the int4 GEMM cannot read these weights exactly (an op missing from this torch,
    a scale byte outside bf16's normal powers of two, a shape the op refuses)."""
    if not have_int4_gemm():
        return None
    if int(pool.gate_up_scales.min()) < 1 or int(pool.down_scales.min()) < 1 \
            or int(pool.gate_up_scales.max()) > 254 or int(pool.down_scales.max()) > 254:
        return None
    layout = "nb8" if pool.layout == "nb8t" else pool.layout
    gu, gsz, dn, dsz = [], [], [], []
    try:
        for s in range(pool.num_slots):
            f = _slot_fields(pool, s)
            p, sz = _int4_pack(decode_w2(f["gate_up_codes"], f["gate_up_scales"], layout), f["gate_up_scales"])
            gu.append(p)
            gsz.append(sz)
            p, sz = _int4_pack(decode_w2(f["down_codes"], f["down_scales"], layout), f["down_scales"])
            dn.append(p)
            dsz.append(sz)
        out = CpuPool("int4", torch.stack(gu), torch.stack(dn), torch.stack(gsz), torch.stack(dsz), None, None)
        if not _self_check(out, pool):
            return None
    except RuntimeError:            # a shape or dtype this torch's kernel does not take
        return None
    return out


def _self_check(cpu: CpuPool, pool: W2Pool) -> bool:
    """Slot 0 through the int4 GEMM against the exact float32 decode, on a fixed input: guards the
    private op's semantics (zero point 8, scale and zero order) across torch versions."""
    f = _slot_fields(pool, 0)
    layout = "nb8" if pool.layout == "nb8t" else pool.layout
    w = decode_w2(f["gate_up_codes"], f["gate_up_scales"], layout)
    x = torch.randn(2, w.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    want = F.linear(x.float(), w)
    got = cpu.gate_up_mm(x, 0)
    # one bf16 rounding of each output (plus float32 summation-order noise); a wrong zero point,
    # scale or code order is far outside it
    return bool(((got - want).abs() <= 2 ** -8 * want.abs() + 1e-5 * want.abs().max()).all())


def _fp4_bf16(pool: FP4Pool) -> CpuPool:
    gu, dn = [], []
    i = pool.gate_up_weight.shape[1] // 2
    one = torch.ones(())
    for s in range(pool.num_slots):
        f = _slot_fields(pool, s)
        gu.append(decode_fp4(f["gate_up_weight"], f["gate_up_scale"], one).to(torch.bfloat16))
        dn.append(decode_fp4(f["down_weight"], f["down_scale"], one).to(torch.bfloat16))
    gu, dn = torch.stack(gu), torch.stack(dn)
    pgu, pdn = pack_bf16(gu), pack_bf16(dn)
    packed = pgu is not None and pdn is not None
    # gate rows take scale_2[slot, 0], up rows scale_2[slot, 1] (reference._slot_weights)
    row_scale = pool.gate_up_scale_2.float().repeat_interleave(i, dim=1)
    return CpuPool("bf16", pgu if packed else gu, pdn if packed else dn, None, None, row_scale,
                   pool.down_scale_2.float().clone(), packed=packed)


def _dense(pool: DensePool) -> CpuPool | None:
    gu, dn = pack_bf16(pool.gate_up), pack_bf16(pool.down)
    if gu is None or dn is None:
        return None
    return CpuPool("dense", gu, dn, None, None, None, None, packed=True, source=pool)


def cpu_pool_bytes(pool, dtype: torch.dtype) -> int:
    """Host bytes cpu_pool(pool, dtype) will add (0: it makes none), to check a memory budget first."""
    if dtype != torch.bfloat16:
        return 0
    if isinstance(pool, W2Pool):
        n = pool.num_slots * (pool.gate_up_codes.shape[1] * pool.gate_up_codes.shape[2]
                              + pool.down_codes.shape[1] * pool.down_codes.shape[2]) * 4    # weights
        return n * 5 // 8 if have_int4_gemm() else 0                    # int4 codes + bf16 scale/zero
    if isinstance(pool, FP4Pool):
        return 2 * pool.num_slots * (pool.gate_up_weight.shape[1] * pool.gate_up_weight.shape[2]
                                     + pool.down_weight.shape[1] * pool.down_weight.shape[2]) * 2
    if isinstance(pool, DensePool) and pool.gate_up.dtype == torch.bfloat16 and have_onednn_packing():
        return pool.gate_up.nbytes + pool.down.nbytes
    return 0


def cpu_pool(pool, dtype: torch.dtype) -> CpuPool | None:
    """The CpuPool of a pool for a model computing in `dtype`, or None: not bf16, W2 weights the
    int4 GEMM cannot take (the caller may keep an exact float32 decode instead), a DensePool this
    torch cannot pack (the reference's ops run it as well)."""
    if dtype != torch.bfloat16:
        return None
    if isinstance(pool, W2Pool):
        return _w2_int4(pool)
    if isinstance(pool, FP4Pool):
        return _fp4_bf16(pool)
    if isinstance(pool, DensePool) and pool.gate_up.dtype == torch.bfloat16:
        return _dense(pool)
    return None


def _one_token_like_reference(hidden, topk_ids, topk_weights, slot_table, pool, ref_pool, miss_counter,
                              swiglu_limit):
    """moe_experts_reference's ops at T = 1, for the routed slots only (each slot's rows are the one
    row, so every matmul sees what the reference's F.linear does, and a packed dense pool's matmul
    gives F.linear's bits): its result bit for bit. ref_pool: what the reference reads."""
    k = topk_ids.shape[1]
    slots = slot_table[topk_ids[0]].tolist()
    if len(set(slots)) < k:          # one slot for two pairs: the reference batches them; let it
        return moe_experts_reference(hidden, topk_ids, topk_weights, slot_table, ref_pool, miss_counter,
                                     swiglu_limit=swiglu_limit)
    cdtype = hidden.dtype if isinstance(ref_pool, DensePool) else torch.float32
    lin = pool.linear if isinstance(pool, CpuPool) else F.linear
    x = hidden.to(cdtype)
    tw = topk_weights.to(cdtype)
    ys, missed = [], 0
    for j, s in enumerate(slots):
        if s < 0:
            missed += 1
            ys.append(torch.zeros(1, hidden.shape[1], dtype=cdtype))
            continue
        gate, up = lin(x, pool.gate_up[s]).chunk(2, dim=-1)
        if swiglu_limit is not None:
            gate = gate.float().clamp(max=swiglu_limit)
            up = up.float().clamp(-swiglu_limit, swiglu_limit)
        act = (F.silu(gate) * up).to(cdtype)
        ys.append(lin(act, pool.down[s]) * tw[:, j:j + 1])
    if missed:
        miss_counter += missed
    out = ys[0]
    for y in ys[1:]:                                                  # fixed-order combine
        out = out + y
    return out.to(hidden.dtype)


def _expert(pool: CpuPool, x: torch.Tensor, s: int, swiglu_limit: float | None) -> torch.Tensor:
    gate, up = pool.gate_up_mm(x, s).chunk(2, dim=-1)
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(-swiglu_limit, swiglu_limit)
    return pool.down_mm((F.silu(gate) * up).to(torch.bfloat16), s)


def moe_experts_cpu(
    hidden: torch.Tensor,            # [T, H]
    topk_ids: torch.Tensor,          # [T, k] int, expert ids
    topk_weights: torch.Tensor,      # [T, k] float, router weights (already scaled)
    slot_table: torch.Tensor,        # int32 [num_experts], -1 = not resident
    pool: CpuPool | DecodedPool | DensePool,
    miss_counter: torch.Tensor,      # int [1], incremented by the number of missed pairs
    *,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """moe_experts_reference's signature and semantics (CPU tensors)."""
    if not isinstance(pool, CpuPool) or pool.kind == "dense":
        ref_pool = pool.source if isinstance(pool, CpuPool) else pool
        if topk_ids.shape[0] == 1:
            return _one_token_like_reference(hidden, topk_ids, topk_weights, slot_table, pool, ref_pool,
                                             miss_counter, swiglu_limit)
        return moe_experts_reference(hidden, topk_ids, topk_weights, slot_table, ref_pool, miss_counter,
                                     swiglu_limit=swiglu_limit)
    t, k = topk_ids.shape
    x = hidden.to(torch.bfloat16)
    tw = topk_weights.float()
    if t == 1:                       # the k routed experts in order, summed as they come (fixed order)
        out, missed = None, 0
        for j, s in enumerate(slot_table[topk_ids[0]].tolist()):
            if s < 0:
                missed += 1
                continue
            y = _expert(pool, x, s, swiglu_limit) * tw[:, j:j + 1]
            out = y if out is None else out + y
        if missed:
            miss_counter += missed
        return (out if out is not None else torch.zeros(1, hidden.shape[1])).to(hidden.dtype)
    slots = slot_table.long()[topk_ids.long()]                       # [T, k]
    y = torch.zeros(t, k, hidden.shape[1], dtype=torch.float32)
    missed = slots < 0
    if bool(missed.any()):
        miss_counter += missed.sum().to(miss_counter.dtype)
    for s in torch.unique(slots[~missed]).tolist():
        rows, cols = torch.where(slots == s)
        y[rows, cols] = _expert(pool, x[rows], s, swiglu_limit) * tw[rows, cols, None]
    out = y[:, 0]
    for j in range(1, k):                                             # fixed-order combine
        out = out + y[:, j]
    return out.to(hidden.dtype)
