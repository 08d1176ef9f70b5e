"""AttentionBatch: what one forward step over a paged KV cache needs to know about its tokens.

The engine flattens every scheduled sequence's new tokens into one token-major batch
(no padding, vLLM's "varlen" shape): sequence b owns rows cu_seqlens_q[b]..cu_seqlens_q[b+1]
of the step's input_ids / hidden states. Decode steps have one row per sequence; prefill and
chunked-prefill steps have several; a mixed step has both (decodes first, by convention of the
scheduler, so `num_decode_seqs` rows at the front are one-token sequences).

This is the only contract between the engine (which builds it: model_runner) and the model's
attention layers (which read it). The KV cache itself is a list with one layer object per
attention layer (kernels/kv_cache.GQALayerKV / MLALayerKV); layers never see sequences.

Shapes (B sequences, N = total new tokens this step):
  positions     int64 [N]         absolute position of each new token (rope)
  slot_mapping  int64 [N]         KV slot each new token's K/V (latent) is written to;
                                  slot = block * block_size + offset, -1 = do not write
  block_tables  int32 [B, M]      pages of each sequence in order (entries past its last page:
                                  any value, never read)
  seq_lens      int32 [B]         tokens in the cache for each sequence AFTER this step's writes
  cu_seqlens_q  int32 [B + 1]     row offsets of each sequence's new tokens
  max_seqlen_q  int               max new tokens of any sequence (a host int: grid sizes, no sync)
  num_decode_seqs int             leading sequences with exactly one new token
  logits_indices int64 [L]        rows whose logits the step needs (each sequence's last row,
                                  only for sequences that sample this step)
Host copies (`seq_lens_host`, `cu_seqlens_q_host`) let the CPU references loop without a sync.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def _to_device(a: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A host int array on `device`: through pinned memory and an async copy on a GPU (torch's
    caching host allocator keeps the pinned block until the copy has run), as is on the CPU."""
    t = torch.from_numpy(a)
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class AttentionBatch:
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    num_decode_seqs: int
    logits_indices: torch.Tensor
    seq_lens_host: list[int]
    cu_seqlens_q_host: list[int]
    # per sequence: its slot of the recurrent-state pools (Qwen3.5's gated DeltaNet; the model
    # runner's StateSlots); None for models without per-sequence state
    state_slots: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens_q_host[-1]

    @property
    def is_pure_decode(self) -> bool:
        return self.num_decode_seqs == self.num_seqs

    @classmethod
    def build(cls, *, block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
              block_size: int, device: torch.device | str, sample: list[bool] | None = None,
              pad_blocks_to: int | None = None, read_only_rows: list[int] | None = None,
              padding_rows: list[int] | None = None) -> "AttentionBatch":
        """From per-sequence host lists: sequence b already has context_lens[b] tokens in the
        cache and adds query_lens[b] new ones (positions context..context+q-1). `sample[b]`
        (default all True) says whether its last row needs logits (False for a prefill chunk
        that does not reach the end of its prompt). `read_only_rows[b]`: how many of sequence b's
        leading rows write no KV (slot -1): positions already in the cache that a fixed-width step
        computes again only to keep its shape (engine/confidence_gate.py); the rows after them
        attend to those positions' cached KV, as they would with the rows left out.
        `padding_rows[b]`: how many of sequence b's trailing rows write no KV either: rows that only
        fill a fixed-width step (engine/speculative.py), whose outputs nobody reads; the rows
        before them never attend to them (causal)."""
        b = len(query_lens)
        if not (len(block_tables) == len(context_lens) == b):
            raise ValueError("block_tables, context_lens and query_lens must have one entry per sequence")
        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        for tbl, n in zip(block_tables, seq_lens):
            if len(tbl) * block_size < n:
                raise ValueError(f"a sequence of {n} tokens needs {-(-n // block_size)} blocks, has {len(tbl)}")
        cu = [0]
        for q in query_lens:
            cu.append(cu[-1] + q)
        n = cu[-1]
        sample = [True] * b if sample is None else sample
        logits_rows = [cu[i + 1] - 1 for i in range(b) if sample[i] and query_lens[i] > 0]
        num_decode = 0
        for q in query_lens:
            if q != 1:
                break
            num_decode += 1
        # Every integer the step needs goes to the device in two copies (one int64, one int32
        # buffer; views below), not one small pageable copy per tensor: on a GPU each of those
        # is a host-blocking staging copy, and a decode step is short enough for them to show.
        width = max([len(t) for t in block_tables] + [1, pad_blocks_to or 0])
        i64 = np.empty(2 * n + len(logits_rows), dtype=np.int64)
        pos, slots = i64[:n], i64[n:2 * n]
        row = 0
        for tbl, c, q in zip(block_tables, context_lens, query_lens):
            if q == 1:                                   # decode rows: plain ints are fastest
                pos[row] = c
                slots[row] = tbl[c // block_size] * block_size + c % block_size
            elif q:
                p = np.arange(c, c + q, dtype=np.int64)
                pos[row:row + q] = p
                slots[row:row + q] = np.asarray(tbl, dtype=np.int64)[p // block_size] * block_size + p % block_size
            row += q
        if read_only_rows is not None or padding_rows is not None:
            lead, tail = read_only_rows or [0] * b, padding_rows or [0] * b
            if len(lead) != b or len(tail) != b or any(r < 0 or t < 0 or r + t >= q
                                                       for r, t, q in zip(lead, tail, query_lens)):
                raise ValueError("read_only_rows and padding_rows must leave each sequence a row that writes")
            for start, end, r, t in zip(cu, cu[1:], lead, tail):
                slots[start:start + r] = -1
                slots[end - t:end] = -1
        i64[2 * n:] = logits_rows
        i32 = np.zeros(b * width + b + b + 1, dtype=np.int32)
        table = i32[:b * width].reshape(b, width)
        for i, t in enumerate(block_tables):
            table[i, :len(t)] = t
        i32[b * width:b * width + b] = seq_lens
        i32[b * width + b:] = cu
        d64, d32 = _to_device(i64, device), _to_device(i32, device)
        return cls(
            positions=d64[:n],
            slot_mapping=d64[n:2 * n],
            block_tables=d32[:b * width].view(b, width),
            seq_lens=d32[b * width:b * width + b],
            cu_seqlens_q=d32[b * width + b:],
            max_seqlen_q=max(query_lens, default=0),
            num_decode_seqs=num_decode,
            logits_indices=d64[2 * n:],
            seq_lens_host=seq_lens,
            cu_seqlens_q_host=cu,
        )
