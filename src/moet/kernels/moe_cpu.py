"""Routed experts on the CPU, fast and exact: the experts laid out once for CPU GEMVs, then only
the routed ones computed, with none of the reference's per-call decoding and grouping machinery at
one token.

The torch reference (moet.kernels.reference) decodes every routed expert's W2 / FP4 rows at
every call and groups rows by slot with several small ops: right as the Triton kernels' exact
reference, but most of a CPU decode step. A CPU run whose slots never change (every expert
resident, no expert store; CausalLM.prepare_cpu) lays each pool out once:

  w2 / fp4   an exact float32 decode of every slot (reference.decoded_pool): the numbers the
             reference decodes at every call, decoded once;
  bf16       a DensePool's weights oneDNN-packed (the same matmul as F.linear, without re-laying
             the weight out at every call): a "dense" CpuPool.

At one token moe_experts_cpu runs the reference's own ops for the routed experts only, so a CPU
run's outputs are bit for bit the reference's: the same as an expert-store run of the same model
(which runs the reference on its slots), and the same as before this layout. Faster repacks that
round (torch's int4 weight-only GEMM reads W2 exactly, but takes bf16 activations) were measured
and dropped for that reason: they changed greedy outputs and broke the store's bit-identity.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moet.kernels.pools import DecodedPool, DensePool
from moet.kernels.reference import SILU, ExpertActivation, moe_experts_reference


@dataclass(slots=True)
class CpuPool:
    """A bf16 DensePool whose weights are oneDNN-packed: computed as the reference computes it (same
    bits); `source` is the DensePool, for the reference itself at several tokens. gate_up / down are
    lists of per-slot packed weights."""
    kind: str                            # "dense"
    gate_up: list
    down: list
    packed: bool = True
    source: DensePool | None = None

    @property
    def num_slots(self) -> int:
        return len(self.gate_up)

    def linear(self, x: torch.Tensor, w) -> torch.Tensor:
        """x @ w^T for one slot's packed weight (F.linear's bits)."""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return F.linear(x, w)


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


def _dense(pool: DensePool) -> CpuPool | None:
    gu, dn = pack_bf16(pool.gate_up), pack_bf16(pool.down)
    if gu is None or dn is None:
        return None
    return CpuPool("dense", gu, dn, packed=True, source=pool)


def cpu_pool_bytes(pool, dtype: torch.dtype) -> int:
    """Host bytes cpu_pool(pool, dtype) will add (0: it makes none), to check a memory budget first."""
    if isinstance(pool, DensePool) and pool.gate_up.dtype == torch.bfloat16 and dtype == torch.bfloat16 \
            and have_onednn_packing():
        return pool.gate_up.nbytes + pool.down.nbytes
    return 0


def cpu_pool(pool, dtype: torch.dtype) -> CpuPool | None:
    """The packed CpuPool of a bf16 DensePool, or None: any other pool (W2 / FP4 pools get an exact
    float32 decode from the caller, reference.decoded_pool), or a torch that cannot pack."""
    if isinstance(pool, DensePool) and pool.gate_up.dtype == torch.bfloat16 and dtype == torch.bfloat16:
        return _dense(pool)
    return None


def _one_token_like_reference(hidden, topk_ids, topk_weights, slot_table, pool, ref_pool, miss_counter, act):
    """moe_experts_reference's ops at T = 1, for the routed slots only (each slot's rows are the one
    row, so every matmul sees what the reference's F.linear does, and a packed dense pool's matmul
    gives F.linear's bits): its result bit for bit. ref_pool: what the reference reads."""
    k = topk_ids.shape[1]
    slots = slot_table[topk_ids[0]].tolist()
    if len(set(slots)) < k:          # one slot for two pairs: the reference batches them; let it
        return moe_experts_reference(hidden, topk_ids, topk_weights, slot_table, ref_pool, miss_counter, act=act)
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
        a = act(lin(x, pool.gate_up[s]), topk_ids[0, j:j + 1].long())
        ys.append(lin(a, pool.down[s]) * tw[:, j:j + 1])
    if missed:
        miss_counter += missed
    out = ys[0]
    for y in ys[1:]:                                                  # fixed-order combine
        out = out + y
    return out.to(hidden.dtype)


def moe_experts_cpu(
    hidden: torch.Tensor,            # [T, H]
    topk_ids: torch.Tensor,          # [T, k] int, expert ids
    topk_weights: torch.Tensor,      # [T, k] float, router weights (already scaled)
    slot_table: torch.Tensor,        # int32 [num_experts], -1 = not resident
    pool: CpuPool | DecodedPool | DensePool,
    miss_counter: torch.Tensor,      # int [1], incremented by the number of missed pairs
    *,
    act: ExpertActivation = SILU,
) -> torch.Tensor:
    """moe_experts_reference's signature and semantics (CPU tensors), bit for bit its result."""
    ref_pool = pool.source if isinstance(pool, CpuPool) else pool
    if topk_ids.shape[0] == 1:
        return _one_token_like_reference(hidden, topk_ids, topk_weights, slot_table, pool, ref_pool,
                                         miss_counter, act)
    return moe_experts_reference(hidden, topk_ids, topk_weights, slot_table, ref_pool, miss_counter, act=act)
