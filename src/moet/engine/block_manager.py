"""BlockManager: a fixed pool of KV blocks, a free list, reference counts and the prefix cache.

Block b holds tokens [i * block_size, (i + 1) * block_size) of every sequence whose block_table[i]
is b. A block is shared (ref_count > 1) only when it is full and identical for all its users:
the prefix cache hands a full block to a new sequence whose first tokens, block by block, hash
the same. Sequences only ever write into blocks they allocated themselves and that are not
yet full, so sharing never needs copy-on-write.

Prefix cache: a full, computed block is registered under a chained hash, SHA-256(parent hash
|| its token ids), so a hit on block i implies blocks 0..i-1 match too. A freed block keeps its
hash and stays findable until the free list hands it out again (LRU: freed blocks go to the
tail, allocation pops the head, and a sequence's blocks are freed last-block-first so its tail
is evicted before its prefix). Hashes are SHA-256 rather than Python's hash(): a collision
would silently serve another prompt's KV.

Nothing here knows devices or ranks: with tensor / pipeline parallelism every rank holds the
same block ids for its own shard of the heads / layers, so one manager drives them all.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from moet.engine.sequence import Sequence

_ROOT = b"moet-kv-v1"


def chain_hash(parent: bytes, token_ids: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        # free blocks in eviction order (head = least recently freed); values unused
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        # prefix-cache statistics, in tokens
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free) / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def new_blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def _seq_block_hash(self, seq: Sequence, i: int) -> bytes:
        """Chained hash of full block i of seq's tokens (cached on the sequence)."""
        while len(seq.block_hashes) <= i:
            j = len(seq.block_hashes)
            parent = seq.block_hashes[j - 1] if j else _ROOT
            seq.block_hashes.append(chain_hash(parent, seq.token_ids[j * self.block_size:(j + 1) * self.block_size]))
        return seq.block_hashes[i]

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks matching seq's leading full blocks. At least one token is always left
        to compute (its logits are what the step samples from), hence (num_tokens - 1) // bs."""
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return []
        hits = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            b = self.hash_to_block.get(self._seq_block_hash(seq, i))
            if b is None:
                break
            hits.append(b)
        return hits

    def admission_cost(self, cached: list[int], new_blocks: int) -> int:
        """Free-list entries that admitting with these cached hits + new blocks consumes."""
        return new_blocks + sum(1 for b in cached if self.ref_count[b] == 0)

    # ------------------------------------------------------------------ changes

    def _take_free(self) -> int:
        b, _ = self.free.popitem(last=False)
        h = self.block_hash[b]
        if h is not None:                    # evict: the block's old contents are about to go
            if self.hash_to_block.get(h) == b:
                del self.hash_to_block[h]
            self.block_hash[b] = None
        self.ref_count[b] = 1
        return b

    def allocate_prefix(self, seq: Sequence, cached: list[int]) -> None:
        """Give seq the cached blocks found by lookup_prefix (called at admission, seq empty)."""
        assert not seq.block_table and seq.num_computed_tokens == 0, seq
        for b in cached:
            if self.ref_count[b] == 0:
                del self.free[b]
            self.ref_count[b] += 1
            seq.block_table.append(b)
        seq.num_computed_tokens = seq.num_cached_tokens = len(cached) * self.block_size
        if self.enable_prefix_caching and not seq.needs_prompt_logprobs:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += seq.num_computed_tokens

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq's block table to hold num_tokens tokens. The caller checked the free count."""
        need = self.new_blocks_needed(seq, num_tokens)
        if need > len(self.free):
            raise RuntimeError(f"{need} blocks needed, {len(self.free)} free: the scheduler must check first")
        for _ in range(need):
            seq.block_table.append(self._take_free())

    def free_seq(self, seq: Sequence) -> None:
        """Drop seq's references, last block first (its tail is evicted before its prefix)."""
        for b in reversed(seq.block_table):
            self.ref_count[b] -= 1
            assert self.ref_count[b] >= 0, (b, seq)
            if self.ref_count[b] == 0:
                self.free[b] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0
        seq.repaired_upto = -1

    def commit_full_blocks(self, seq: Sequence, upto: int | None = None) -> None:
        """Register seq's full, computed blocks in the prefix cache (after a step wrote them), those
        within its first `upto` tokens only when given (the confidence gate's FP4 prefill: a prompt
        computes every position with FP4 experts, so only prompt blocks hold what a fresh prompt
        would). A block whose hash is already registered (same tokens computed twice in one step)
        stays unregistered and is simply freed later."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens, seq.num_tokens, seq.num_tokens if upto is None else upto) // self.block_size
        for i in range(seq.num_committed_blocks, full):
            b = seq.block_table[i]
            if self.block_hash[b] is not None:
                continue
            h = self._seq_block_hash(seq, i)
            if h not in self.hash_to_block:
                self.hash_to_block[h] = b
                self.block_hash[b] = h
        seq.num_committed_blocks = max(seq.num_committed_blocks, full)

    def unregister_rewritten(self, seq: Sequence, first: int, last: int) -> int:
        """seq's positions first..last were computed again (the confidence gate's repair,
        engine/confidence_gate.py) into blocks it holds alone: drop those blocks from the prefix
        cache index, which promises KV as a fresh computation of their tokens writes it.
        -> blocks dropped."""
        n = 0
        for i in range(first // self.block_size, last // self.block_size + 1):
            b = seq.block_table[i]
            assert self.ref_count[b] == 1, (b, seq)
            h = self.block_hash[b]
            if h is not None:
                if self.hash_to_block.get(h) == b:
                    del self.hash_to_block[h]
                self.block_hash[b] = None
                n += 1
        return n

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache); only when no block is held,
        so that the next identical request recomputes exactly as the first time. False if
        blocks are in use."""
        if len(self.free) != self.num_blocks:
            return False
        self.hash_to_block.clear()
        self.block_hash = [None] * self.num_blocks
        self.free = OrderedDict((b, None) for b in range(self.num_blocks))
        return True

    # ------------------------------------------------------------------ invariants (tests)

    def check(self, live: list[Sequence]) -> None:
        """Raise AssertionError unless ref counts equal the live block tables' references, the
        free list holds exactly the unreferenced blocks and the hash table points at blocks
        that carry that hash."""
        counts = [0] * self.num_blocks
        for s in live:
            for b in s.block_table:
                counts[b] += 1
        assert counts == self.ref_count, "ref counts disagree with live block tables"
        assert set(self.free) == {b for b in range(self.num_blocks) if counts[b] == 0}, "free list wrong"
        for h, b in self.hash_to_block.items():
            assert self.block_hash[b] == h, "hash table points at a block with another hash"
