"""Which routed-expert implementation a MoE layer runs: the Triton grouped kernels
(moet.kernels.moe_triton) for W2 pools in the nb8 / nb8t layouts and FP4 pools whose tensors live on a
CUDA device; for a bf16 DensePool on a CUDA device, moe_experts_dense_batched (every slot over every
row as two batched matmuls: no host sync, so a decode step with it can be captured in a CUDA graph)
while its intermediates stay under DENSE_BATCHED_MAX_ELEMENTS; the torch reference
(moet.kernels.reference) for everything else (longer DensePool batches on CUDA, a W2 pool still in the
file layout v1), except on the CPU: moe_experts_cpu (moet.kernels.moe_cpu) for the pools a CPU run
repacked (CpuPool, DecodedPool) and for CPU DensePools (the reference's own ops at one token, the
reference otherwise). Same signature and semantics either way.
"""
from __future__ import annotations

import importlib.util
from functools import lru_cache

import torch
import torch.nn.functional as F

from moet.kernels.moe_cpu import CpuPool, moe_experts_cpu
from moet.kernels.pools import DecodedPool, DensePool, FP4Pool, W2Pool
from moet.kernels.reference import SILU, ExpertActivation, moe_experts_reference

# The batched DensePool form's largest intermediate, slots x rows x max(2I, H) elements: it computes
# every slot for every row (S / k times the reference's expert work), which pays at decode sizes
# (a few launches, capturable; the reference syncs the host per layer) and not for long prefill
# batches, which keep the reference. 2^27 fp32 elements are 512 MiB.
DENSE_BATCHED_MAX_ELEMENTS = 1 << 27


@lru_cache(maxsize=1)
def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def uses_triton(pool) -> bool:
    """True when moe_experts runs the Triton kernels for this pool."""
    if isinstance(pool, W2Pool):
        lead = pool.gate_up_codes if pool.layout in ("nb8", "nb8t") else None
    elif isinstance(pool, FP4Pool):
        lead = pool.gate_up_weight
    else:
        return False
    return lead is not None and lead.is_cuda and _have_triton()


def moe_experts(
    hidden: torch.Tensor,            # [T, H]
    topk_ids: torch.Tensor,          # [T, k] int, expert ids
    topk_weights: torch.Tensor,      # [T, k] float, router weights (already scaled)
    slot_table: torch.Tensor,        # int32 [num_experts], -1 = not resident
    pool,
    miss_counter: torch.Tensor,      # int [1], incremented by the number of missed pairs
    *,
    act: ExpertActivation = SILU,
) -> torch.Tensor:
    if uses_triton(pool):
        from moet.kernels.moe_triton import moe_experts_triton
        return moe_experts_triton(hidden, topk_ids, topk_weights, slot_table, pool, miss_counter, act=act)
    if isinstance(pool, DensePool) and hidden.is_cuda and dense_batched_fits(pool, hidden.shape[0]):
        return moe_experts_dense_batched(hidden, topk_ids, topk_weights, slot_table, pool, miss_counter, act=act)
    if isinstance(pool, (CpuPool, DecodedPool)) or (isinstance(pool, DensePool) and not hidden.is_cuda):
        return moe_experts_cpu(hidden, topk_ids, topk_weights, slot_table, pool, miss_counter, act=act)
    return moe_experts_reference(hidden, topk_ids, topk_weights, slot_table, pool, miss_counter, act=act)


def dense_batched_fits(pool: DensePool, num_tokens: int) -> bool:
    two_i, h = pool.gate_up.shape[1], pool.gate_up.shape[2]
    return pool.num_slots * num_tokens * max(two_i, h) <= DENSE_BATCHED_MAX_ELEMENTS


def moe_experts_dense_batched(
    hidden: torch.Tensor,            # [T, H]
    topk_ids: torch.Tensor,          # [T, k] int, expert ids
    topk_weights: torch.Tensor,      # [T, k] float, router weights (already scaled)
    slot_table: torch.Tensor,        # int32 [num_experts], -1 = not resident
    pool: DensePool,
    miss_counter: torch.Tensor,      # int [1], incremented by the number of missed pairs
    *,
    act: ExpertActivation = SILU,
) -> torch.Tensor:
    """moe_experts_reference for a DensePool with no host sync: every slot's expert over every row
    ([S, T, 2I] and [S, T, H] batched matmuls), then each (row, choice) pair takes its slot's row;
    missed pairs give zero. The reference's math in the input dtype and its fixed-order combine;
    its GEMMs see other shapes, so the last bits may differ from it."""
    t, k = topk_ids.shape
    dt = hidden.dtype
    slots = slot_table.long()[topk_ids.long()]                                   # [T, k]
    missed = slots < 0
    miss_counter += missed.sum().to(miss_counter.dtype)       # + 0 when all are resident: no host check
    bias = act.slot_bias(slot_table, pool.num_slots)
    a = act(torch.matmul(hidden, pool.gate_up.to(dt).transpose(1, 2)),          # [S, T, I]
            bias=bias[:, None] if bias is not None else None)
    y_all = torch.matmul(a, pool.down.to(dt).transpose(1, 2))                   # [S, T, H]
    rows = torch.arange(t, device=hidden.device)[:, None].expand(t, k)
    y = y_all[slots.clamp(min=0), rows] * topk_weights[..., None].to(dt)         # [T, k, H]
    y = y.masked_fill(missed[..., None], 0)
    out = y[:, 0]
    for j in range(1, k):                                                        # fixed-order combine
        out = out + y[:, j]
    return out
