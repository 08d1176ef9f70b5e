"""Slot alignment of the (token, expert) pairs (vLLM's fused_moe layout, addressed through the slot
table), the torch form the grouped MoE (moe_triton.py) runs in the prefill regime.

The grouped-GEMM kernels want every (token, expert) pair of one resident expert in consecutive
rows, padded so that each BLOCK_M-row tile belongs to exactly one slot. moe_align_block_size (the
prefill regime) builds that layout in torch, with no host synchronisation (fixed output sizes, so
it is CUDA-graph friendly) and deterministically:

  pair p = t * k + j  (row-major flatten of topk_ids [T, k]),  s = slot_table[topk_ids[t, j]]
  * pairs with s < 0 (expert not resident) are dropped and counted (`num_misses`);
  * the remaining pairs are stably sorted by slot, so within a slot they keep ascending p;
  * slot s's list is padded with the sentinel P (= T * k) to a multiple of block_m, and the
    lists are laid out in ascending slot order;
  * block_slot[b] is the slot of tile b (rows b*block_m .. (b+1)*block_m - 1), -1 for the tiles
    past the end of the used region (the arrays are sized for the worst case).

Worst-case length: each used slot wastes at most block_m - 1 rows and at most min(P, S) slots
are used, so P + min(P, S) * (block_m - 1), rounded up to a multiple of block_m.

The decode regime's form, one Triton launch, is moe_align_triton.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AlignedPairs:
    sorted_ids: torch.Tensor          # int32 [num_blocks * block_m]: pair ids, P = padding
    block_slot: torch.Tensor          # int32 [num_blocks]: slot of each tile, -1 = unused tile
    num_rows_post_padded: torch.Tensor  # int32 [1]: rows actually used (sum of padded lists)
    num_misses: torch.Tensor          # int64 [1]: pairs whose expert is not resident
    num_pairs: int                    # P = T * k (the padding sentinel)
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_slot.shape[0]


def max_padded_rows(num_pairs: int, num_slots: int, block_m: int) -> int:
    bound = num_pairs + min(num_pairs, num_slots) * (block_m - 1)
    return -(-bound // block_m) * block_m


def moe_align_block_size(topk_ids: torch.Tensor, slot_table: torch.Tensor, num_slots: int,
                         block_m: int) -> AlignedPairs:
    """topk_ids [T, k] int (expert ids), slot_table int [num_experts] (-1 = not resident)."""
    if block_m < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")
    dev = topk_ids.device
    p = topk_ids.numel()
    slots = slot_table.long()[topk_ids.reshape(-1).long()]                       # [P]
    missed = slots < 0
    key = torch.where(missed, torch.full_like(slots, num_slots), slots)          # misses sort last
    order = torch.sort(key, stable=True).indices                                 # ascending p within a slot
    # scatter_add, not bincount: bincount sizes its output from key.max() (a host sync, which
    # CUDA-graph capture refuses); integer adds give the same counts in any order
    counts = torch.zeros(num_slots + 1, dtype=torch.long, device=dev).scatter_add_(
        0, key, torch.ones_like(key))[:num_slots]                                 # [S]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)                                         # inclusive
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts                                     # exclusive, unpadded

    size = max_padded_rows(p, num_slots, block_m)
    sorted_ids = torch.full((size,), p, dtype=torch.int32, device=dev)
    skey = key[order]
    valid = skey < num_slots
    skey_c = skey.clamp(max=num_slots - 1) if num_slots > 0 else skey
    if p > 0 and num_slots > 0:
        rank = torch.arange(p, device=dev) - start[skey_c]
        pos = padded_start[skey_c] + rank
        # misses go to a scratch index past the end, then get cut off
        pos = torch.where(valid, pos, torch.full_like(pos, size))
        buf = torch.full((size + 1,), p, dtype=torch.int32, device=dev)
        buf.scatter_(0, pos, order.to(torch.int32))      # positions are distinct for valid pairs
        sorted_ids = buf[:size].contiguous()

    num_blocks = size // block_m
    block_starts = torch.arange(num_blocks, device=dev, dtype=torch.long) * block_m
    if num_slots > 0:
        bslot = torch.searchsorted(padded_end, block_starts, right=True)         # first s: start < end[s]
        block_slot = torch.where(bslot < num_slots, bslot, torch.full_like(bslot, -1)).to(torch.int32)
        used = padded_end[-1:].to(torch.int32)
    else:
        block_slot = torch.full((num_blocks,), -1, dtype=torch.int32, device=dev)
        used = torch.zeros(1, dtype=torch.int32, device=dev)
    return AlignedPairs(sorted_ids, block_slot, used, missed.sum().reshape(1), p, block_m)
