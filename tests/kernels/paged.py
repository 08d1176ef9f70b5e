"""Random paged-cache metadata for the kernel tests: every call draws fresh pages in a random
order, so sequences' pages interleave and no test can pass by reading memory contiguously."""
from __future__ import annotations

import math

import torch


def random_block_tables(lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator,
                        extra_cols: int = 2) -> torch.Tensor:
    """int32 [B, max_blocks + extra_cols]: distinct random pages per sequence; unused entries hold
    random valid-looking ids (kernels must never read them for the result)."""
    need = [math.ceil(n / block_size) for n in lens]
    assert sum(need) <= num_blocks, "test asks for more pages than the cache has"
    perm = torch.randperm(num_blocks, generator=gen)
    cols = max(need) + extra_cols
    table = torch.randint(0, num_blocks, (len(lens), cols), generator=gen, dtype=torch.int32)
    at = 0
    for b, k in enumerate(need):
        table[b, :k] = perm[at:at + k].to(torch.int32)
        at += k
    return table


def slots_for(table: torch.Tensor, b: int, positions: range, block_size: int) -> torch.Tensor:
    """slot = block_id * block_size + offset for sequence b's tokens at `positions`."""
    pos = torch.tensor(list(positions), dtype=torch.int64)
    return table[b, pos // block_size].long() * block_size + pos % block_size
