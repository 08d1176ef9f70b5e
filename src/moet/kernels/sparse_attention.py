"""DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5) over the paged cache: the indexer's key
cache, its top-k selection, and MLA attention restricted to the selected positions. Torch on
every device for now (no Triton kernel yet): the model only takes this path in a step where some
sequence is longer than the indexer's top-k; below that every position is selected and the
dense MLA kernels give the same attention (model/layers/dsa.py).

Index keys (one [index_head_dim] vector per token, normed and rotated) live in one flat tensor
per layer that runs an indexer, `[num_blocks * block_size + 1, Di]`: token slot s at row s, as
the MLA rows are addressed, and the last row a sink for slot -1 (a token not cached), so a write
is one index_copy_ with no host sync, capturable in a CUDA graph. In the KV's data dtype for an
"auto" cache; with a quantized cache (fp8, nvfp4) as DeepSeek's serving keeps them: e4m3 with one
fp32 scale per token (amax / 448), Di + 4 bytes.

Selection, as transformers' GlmMoeDsaIndexer computes it (float32): for a query at position p
with indexer queries q [Hi, Di] and head weights w [Hi] (already times Hi ** -0.5),
    score(j) = sum_h w_h * relu(scale * q_h . k_j)   for j <= p
and the query keeps the min(top_k, p + 1) best positions (torch.topk over the sequence).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moet.kernels.attention_reference import attend_latent
from moet.kernels.kv_cache import (KVFormat, MLALayerKV, dequantize_fp8, dequantize_mla_rows, quantize_fp8,
                                   read_mla_kv, read_mla_positions)


@dataclass(slots=True)
class IndexKeys:
    data: torch.Tensor                 # [NB * BS + 1, Di]: the KV's data dtype, or e4m3
    scale: torch.Tensor | None         # e4m3 keys: fp32 [NB * BS + 1, 1], one per token; else None


def _quantized(fmt: KVFormat) -> bool:
    return fmt.is_fp8 or fmt.is_nvfp4


def new_index_keys(num_blocks: int, block_size: int, head_dim: int, fmt: KVFormat,
                   device: torch.device | str) -> IndexKeys:
    rows = num_blocks * block_size + 1
    if _quantized(fmt):
        return IndexKeys(torch.zeros(rows, head_dim, dtype=torch.float8_e4m3fn, device=device),
                         torch.ones(rows, 1, dtype=torch.float32, device=device))
    return IndexKeys(torch.zeros(rows, head_dim, dtype=fmt.dtype, device=device), None)


def index_key_bytes_per_token(head_dim: int, fmt: KVFormat) -> int:
    return head_dim + 4 if _quantized(fmt) else head_dim * fmt.dtype.itemsize


def index_key_bytes_of(spec, fmt: KVFormat, num_mtp_layers: int) -> int:
    """Index-key bytes per token of a ModelSpec (its full-indexer layers and `num_mtp_layers` MTP
    layers, which run their own indexer); 0 without sparse attention."""
    dsa = getattr(spec, "sparse_attention", None)
    if dsa is None:
        return 0
    layers = sum(t == "full" for t in dsa.layer_types) + num_mtp_layers
    return layers * index_key_bytes_per_token(dsa.head_dim, fmt)


def write_index_keys(keys: IndexKeys, k: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k [T, Di] into rows slot_mapping [T] of `keys` (-1: the sink row, never read)."""
    sink = keys.data.shape[0] - 1
    rows = torch.where(slot_mapping >= 0, slot_mapping, torch.full_like(slot_mapping, sink))
    if keys.scale is None:
        keys.data.index_copy_(0, rows, k.to(keys.data.dtype))
        return
    q, s = quantize_fp8(k, None, k.shape[-1])
    keys.data.view(torch.uint8).index_copy_(0, rows, q.view(torch.uint8))    # no e4m3 index_copy_ on CPU
    keys.scale.index_copy_(0, rows, s)


def read_index_keys(keys: IndexKeys, block_size: int, blocks: torch.Tensor, n: int) -> torch.Tensor:
    """One sequence's first n index keys: [n, Di] (float32 where they are stored in e4m3)."""
    pos = torch.arange(n, device=keys.data.device)
    slots = blocks.to(keys.data.device).long()[pos // block_size] * block_size + pos % block_size
    if keys.scale is None:
        return keys.data[slots]
    return dequantize_fp8(keys.data[slots], keys.scale[slots])


def select_top_k(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, top_k: int,
                 scale: float) -> torch.Tensor:
    """q [t, Hi, Di], weights [t, Hi] (float32), keys [n, Di]: the t queries are the last t of
    n positions -> keep [t, n] bool: the positions each query attends to (top-k and causal)."""
    t, n = q.shape[0], keys.shape[0]
    scores = torch.matmul(q.float(), keys.float().t()) * scale          # [t, Hi, n]
    scores = torch.relu(scores)
    index = torch.matmul(weights.float()[:, None, :], scores)[:, 0]     # [t, n]
    qpos = torch.arange(n - t, n, device=q.device)[:, None]
    causal = torch.arange(n, device=q.device)[None, :] <= qpos
    index = index.masked_fill(~causal, float("-inf"))
    top = index.topk(min(top_k, n), dim=-1).indices
    keep = torch.zeros(t, n, dtype=torch.bool, device=q.device).scatter_(1, top, True)
    return keep & causal


# Bytes the [rows, heads, positions] float32 intermediates of one sequence may take at a time: a
# long prompt's chunk is split into row groups under it (8K rows x 32 index heads x 32K positions
# would be 32 GiB at once).
ROW_CHUNK_BYTES = 256 << 20


def _row_groups(t: int, bytes_per_row: int):
    step = max(1, ROW_CHUNK_BYTES // max(1, bytes_per_row))
    return [(r, min(t, r + step)) for r in range(0, t, step)]


def top_k_positions(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, top_k: int,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """select_top_k as positions: q [t, Hi, Di], weights [t, Hi], keys [n, Di] (the t queries are
    the last t of n positions) -> (index [t, K] int64, valid [t, K] bool), K = min(top_k, n): each
    query's K best positions, valid where the position is not in its future (a query with fewer
    than K positions before it fills the rest with future ones, invalid). The same scores and
    torch.topk as select_top_k, computed for row groups under ROW_CHUNK_BYTES."""
    t, n = q.shape[0], keys.shape[0]
    k = min(top_k, n)
    kf = keys.float().t()
    index = torch.empty(t, k, dtype=torch.long, device=q.device)
    valid = torch.empty(t, k, dtype=torch.bool, device=q.device)
    for lo, hi in _row_groups(t, 4 * q.shape[1] * n):
        scores = torch.relu(torch.matmul(q[lo:hi].float(), kf) * scale)               # [c, Hi, n]
        score = torch.matmul(weights[lo:hi].float()[:, None, :], scores)[:, 0]       # [c, n]
        qpos = torch.arange(n - t + lo, n - t + hi, device=q.device)[:, None]
        score = score.masked_fill(torch.arange(n, device=q.device)[None, :] > qpos, float("-inf"))
        top = score.topk(k, dim=-1).indices
        index[lo:hi] = top
        valid[lo:hi] = top <= qpos
    return index, valid


def _decode_rows(cu_seqlens_q: list[int], seq_lens: list[int], top_k: int) -> list[int]:
    """The sequences of a step that bring one query row and are longer than top_k: decode rows,
    selected and attended as one batch (the other sequences one at a time)."""
    return [b for b, n in enumerate(seq_lens) if n > top_k and cu_seqlens_q[b + 1] - cu_seqlens_q[b] == 1]


def _slots(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of positions [B, L] of the sequences whose pages are block_tables [B, W]."""
    pages = block_tables.long().gather(1, (positions // block_size).clamp(max=block_tables.shape[1] - 1))
    return pages * block_size + positions % block_size


@dataclass(slots=True)
class DecodeSelection:
    """The positions the B rows of an all-decode step keep (batched_top_k_positions): index and
    valid [B, K], row b the last position of sequence b. Device tensors only, so a decode step
    past top-k is capturable in a CUDA graph."""
    index: torch.Tensor
    valid: torch.Tensor


def batched_top_k_positions(q: torch.Tensor, weights: torch.Tensor, keys: IndexKeys, block_size: int,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, longest: int, top_k: int,
                            scale: float) -> DecodeSelection:
    """top_k_positions for B decode rows at once: q [B, Hi, Di], weights [B, Hi], each row the last
    position of its sequence (block_tables [B, W]; seq_lens int [B] on the device) -> K = min(top_k,
    L) positions a row, L = `longest` (a host bound on seq_lens, e.g. a graph capture's worst case)
    rounded up to whole pages and at most the table's width. Every sequence's keys are read up to
    L, masked past its own length; no host sync and static shapes (capturable). Row groups under
    ROW_CHUNK_BYTES."""
    bsz = q.shape[0]
    length = min(-(-longest // block_size) * block_size, block_tables.shape[1] * block_size)
    k = min(top_k, length)
    pos = torch.arange(length, device=q.device)
    lens = seq_lens.to(torch.long)
    index = torch.empty(bsz, k, dtype=torch.long, device=q.device)
    valid = torch.empty(bsz, k, dtype=torch.bool, device=q.device)
    for lo, hi in _row_groups(bsz, 4 * length * (q.shape[1] + keys.data.shape[1] + 2)):
        slots = _slots(block_tables[lo:hi], pos.expand(hi - lo, length), block_size)
        kk = keys.data[slots].float() if keys.scale is None else dequantize_fp8(keys.data[slots], keys.scale[slots])
        scores = torch.relu(torch.einsum("bhd,bld->bhl", q[lo:hi].float(), kk) * scale)    # [c, Hi, L]
        score = torch.einsum("bh,bhl->bl", weights[lo:hi].float(), scores)
        score = score.masked_fill(pos[None, :] >= lens[lo:hi, None], float("-inf"))
        top = score.topk(k, dim=-1).indices
        index[lo:hi] = top
        valid[lo:hi] = top < lens[lo:hi, None]
    return DecodeSelection(index, valid)


def decode_sparse_mla(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: MLALayerKV, block_tables: torch.Tensor,
                      sel: DecodeSelection, scale: float) -> torch.Tensor:
    """Absorbed MLA of B decode rows over their selected positions: q_latent [B, H, R], q_rope
    [B, H, P] -> [B, H, R] float32; one gather of the B x K selected rows (only those are read),
    static shapes, no host sync."""
    q = torch.cat([q_latent.float(), q_rope.float()], dim=-1)
    bs = cache.latent.shape[1]

    def rows_of(a, z):
        pages = block_tables[a:z].long().gather(1, sel.index[a:z] // bs)
        offsets = sel.index[a:z] % bs
        return torch.cat(dequantize_mla_rows(cache, lambda t: t[pages, offsets]), dim=-1)
    return _attend_rows(q, rows_of, q_latent.shape[-1], sel.index.shape[1], sel.valid, scale)


def paged_select_top_k(q: torch.Tensor, weights: torch.Tensor, keys: IndexKeys, block_size: int,
                       block_tables: torch.Tensor, cu_seqlens_q: list[int], seq_lens: list[int],
                       top_k: int, scale: float) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """top_k_positions per sequence of a varlen batch (host cu_seqlens_q / seq_lens) -> one
    (index [q_b, K], valid [q_b, K]) per sequence, or None where n_b <= top_k (every position kept).
    The decode rows (_decode_rows) are selected as one batch (their K is the batch's; a shorter
    sequence's extra positions are invalid)."""
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(seq_lens)
    dec = _decode_rows(cu_seqlens_q, seq_lens, top_k)
    if dec:
        rows = torch.tensor([cu_seqlens_q[b] for b in dec], device=q.device)
        lens = [seq_lens[b] for b in dec]
        sel = batched_top_k_positions(q[rows], weights[rows], keys, block_size, block_tables[dec],
                                      torch.tensor(lens, device=q.device), max(lens), top_k, scale)
        for i, b in enumerate(dec):
            out[b] = (sel.index[i:i + 1], sel.valid[i:i + 1])
    for b, n in enumerate(seq_lens):
        lo, hi = cu_seqlens_q[b], cu_seqlens_q[b + 1]
        if n <= top_k or hi == lo or out[b] is not None:
            continue
        k = read_index_keys(keys, block_size, block_tables[b], n)
        out[b] = top_k_positions(q[lo:hi], weights[lo:hi], k, top_k, scale)
    return out


def attend_selected(q: torch.Tensor, lat: torch.Tensor, rope: torch.Tensor, scale: float,
                    index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Latent-space MQA of one sequence over each query's own positions: q [t, H, R + P], its cached
    rows lat [n, R] and rope [n, P] (float32), index / valid [t, K] (top_k_positions) -> [t, H, R]
    float32. Reads K rows a query, not n; row groups under ROW_CHUNK_BYTES."""
    rows = torch.cat([lat, rope], dim=-1)                                        # [n, R + P]
    return _attend_rows(q, lambda lo, hi: rows[index[lo:hi]], lat.shape[1], index.shape[1], valid, scale)


def _attend_rows(q: torch.Tensor, rows_of, r: int, k: int, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """q [t, H, R + P] over rows_of(lo, hi) [c, K, R + P] (float32) per row group, masked by valid."""
    t, h = q.shape[0], q.shape[1]
    out = torch.empty(t, h, r, dtype=torch.float32, device=q.device)
    for lo, hi in _row_groups(t, 4 * k * (q.shape[2] + 2 * h)):
        sel = rows_of(lo, hi)
        s = torch.einsum("chd,ckd->chk", q[lo:hi].float(), sel) * scale
        s = s.masked_fill(~valid[lo:hi, None, :], float("-inf"))
        out[lo:hi] = torch.einsum("chk,ckr->chr", torch.softmax(s, dim=-1), sel[..., :r])
    return out


def paged_sparse_mla(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: MLALayerKV, block_tables: torch.Tensor,
                     cu_seqlens_q: list[int], seq_lens: list[int], scale: float,
                     selected: list[tuple[torch.Tensor, torch.Tensor] | None]) -> torch.Tensor:
    """Absorbed MLA (attention_reference.paged_prefill_mla) where query rows of sequence b see
    only the positions selected[b] names (paged_select_top_k; None: all, causal). -> [Tq, H, R]
    in q_latent.dtype. A sequence with fewer query rows x K than positions (decode) reads only
    the selected rows from the cache; a long chunk reads the sequence once and indexes it."""
    out = torch.empty(q_latent.shape, dtype=torch.float32, device=q_latent.device)
    q = torch.cat([q_latent.float(), q_rope.float()], dim=-1)
    r = q_latent.shape[-1]
    dec = [b for b in _decode_rows(cu_seqlens_q, seq_lens, 0) if selected[b] is not None]
    if dec:                 # decode rows: one batched gather of their selected rows and one attention
        rows = torch.tensor([cu_seqlens_q[b] for b in dec], device=q.device)
        sel = DecodeSelection(torch.cat([selected[b][0] for b in dec]),    # [B, K]: K = top_k for each
                              torch.cat([selected[b][1] for b in dec]))
        out[rows] = decode_sparse_mla(q_latent[rows], q_rope[rows], cache, block_tables[dec], sel, scale)
    for b, n in enumerate(seq_lens):
        lo, hi = cu_seqlens_q[b], cu_seqlens_q[b + 1]
        if hi == lo or b in dec:
            continue
        if selected[b] is not None and (hi - lo) * selected[b][0].shape[1] < n:
            index, valid = selected[b]

            def rows_of(a, z, index=index, blocks=block_tables[b]):
                return torch.cat(read_mla_positions(cache, blocks, index[a:z]), dim=-1)
            out[lo:hi] = _attend_rows(q[lo:hi], rows_of, r, index.shape[1], valid, scale)
            continue
        lat, rope = read_mla_kv(cache, block_tables[b], n)
        if selected[b] is None:
            out[lo:hi] = attend_latent(q[lo:hi], lat, rope, scale)
        else:
            out[lo:hi] = attend_selected(q[lo:hi], lat, rope, scale, *selected[b])
    return out.to(q_latent.dtype)
