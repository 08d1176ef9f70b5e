"""Which routed-expert implementation a MoE layer runs: the Triton grouped kernels
(moet.kernels.moe_triton) for W2 pools in the nb8 / nb8t layouts and FP4 pools whose tensors live on a
CUDA device, the torch reference (moet.kernels.reference) for everything else (CPU, bf16
DensePool, a W2 pool still in the file layout v1). Same signature and semantics either way.
"""
from __future__ import annotations

import importlib.util
from functools import lru_cache

import torch

from moet.kernels.pools import FP4Pool, W2Pool
from moet.kernels.reference import moe_experts_reference


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
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    if uses_triton(pool):
        from moet.kernels.moe_triton import moe_experts_triton
        return moe_experts_triton(hidden, topk_ids, topk_weights, slot_table, pool, miss_counter,
                                  swiglu_limit=swiglu_limit)
    return moe_experts_reference(hidden, topk_ids, topk_weights, slot_table, pool, miss_counter,
                                 swiglu_limit=swiglu_limit)
