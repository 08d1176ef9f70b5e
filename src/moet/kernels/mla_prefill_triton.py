"""Triton paged prefill/extend for weight-absorbed MLA; signature equal to
attention_reference.paged_prefill_mla (plus keyword-only tuning knobs). Importing this module
needs triton.

Absorbed MLA is MQA over the cached rows: one shared key row [latent (R) | rope (P)] per token,
values = latent, `score = scale * (q_latent . latent + q_rope . k_rope)`; the output stays in the
latent space ([Tq, H, R]; mla_output applies W_UV).
Grid (ceil(H / BLOCK_H), B, ceil(max_q_len / BLOCK_M)): one program = one sequence, a block of
BLOCK_H heads (default mla_decode_triton.mla_block_h: 64, 32 for fp32 queries) and a tile of BLOCK_M query tokens
(default 1), packed as BLOCK_M * BLOCK_H rows (row r = token r // BLOCK_H, head r % BLOCK_H), so
every latent tile is read once per program for all of them; the head blocks of one query tile are
adjacent in launch order (the second reads from L2). The program walks the keys from 0 to its
tile's last query position in tiles of 32 or 64 keys (the tile form's) across pages (causal per row;
DeepSeek-V3 and Kimi-K2 have no sliding window), online softmax in fp32, and writes the normalised
output once: no split-K, no atomics, a fixed tile order -> bit-identical run to run. Two tile
forms, as the decode's: the rows as the MMAs' M over 64 keys a step (_mla_prefill_tile, both
dots on wgmma; the default where mla_decode_triton.mla_decode_form takes it), or transposed
(scores^T = tile @ q^T, out^T += tile^T @ P^T over 32 keys: the queries are the dots'
shared-memory operand; sm_90 AOT at 64 heads, 8 warps: bf16 219 registers, no spills).
Scores are the sum of two dots (latent, rope), so the 576-wide row is never padded to 1024.
Formats: auto, fp8 per-tensor (one scale for latent and rope, folded into the softmax scale and
the output), fp8 block (fp8_ds_mla: group scales loaded once per tile, rope in the model dtype).
The first form (16 rows per program, one page per step, per-element scale gathers) reached only
a small fraction of a bf16 GEMM's rate on the H200, less still over fp8_ds_mla (docs/kernels.md,
MLA prefill). The absorbed form does ~3.4x the expanded form's FLOPs at
DeepSeek-V3's dims; expanding through kv_b_proj per chunk (vLLM) is the next lever.
Numerics: dots as attention_triton._mma: bf16 queries (serving) -> bf16 tensor-core operands,
fp32 accumulation; fp32 queries -> exact fp32 (FFMA; equal to the fp32 reference on CPU).
Under TRITON_INTERPRET=1 the key loop is a while loop (as prefill_triton.py, same reason).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from moet.errors import ConfigError
from moet.kernels.attention_triton import (RESCALE_SLACK, _SCALE_BLOCK, _SCALE_NVFP4, _bf16_dots, _mma, _pow2,
                                           _slack, scale_kind)
from moet.kernels.mla_decode_triton import (MLA_BLOCK_N, MLA_HM_BLOCK_N, MLA_NUM_STAGES, MLA_NUM_WARPS,
                                            _check_nvfp4_rank, _mla_load_tile, _mla_rope_query, _mla_softmax_pv,
                                            check_heads_m_fits, mla_block_h, mla_decode_form)
from moet.kernels.kv_cache import MLALayerKV

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"   # read at import, as triton does


@triton.jit
def _mla_prefill_tile(ql, qr, m_i, l_i, acc, k0, qpos, last, lat_ptr, rope_ptr, ls_ptr, bt_row_ptr, r, p_, j,
                      s_lb, s_lt, s_rb, s_rt, ss_b, ss_t, qk_scale,
                      R: tl.constexpr, BLOCK_R: tl.constexpr, P: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, SCALE_KIND: tl.constexpr, GROUP: tl.constexpr,
                      NG: tl.constexpr, BF16_DOT: tl.constexpr, SLACK: tl.constexpr, HEADS_M: tl.constexpr):
    """Keys k0 .. k0 + BLOCK_N (several pages; masked past `last`, the tile's last query position)
    for all rows of the program, in the decode kernel's two forms (mla_decode_triton._mla_decode_tile):
    HEADS_M scores [rows, keys] = q @ tile^T, out [rows, R] += P @ tile; else transposed, scores^T
    [keys, rows] = tile @ q^T, out^T [R, rows] += tile^T @ P^T; causal per row."""
    kpos = k0 + j
    tmask = kpos <= last
    blk = tl.load(bt_row_ptr + kpos // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
    off = (kpos % BLOCK_SIZE).to(tl.int64)
    lat, rope = _mla_load_tile(lat_ptr, rope_ptr, ls_ptr, blk, off, tmask, r, p_, s_lb, s_lt, s_rb, s_rt, ss_b, ss_t,
                               R, BLOCK_R, P, BLOCK_N, SCALE_KIND, GROUP, NG, BF16_DOT)
    if HEADS_M:
        s = (_mma(ql, tl.trans(lat), BF16_DOT) + _mma(qr, tl.trans(rope), BF16_DOT)) * qk_scale   # [rows, BLOCK_N]
        s = tl.where(kpos[None, :] <= qpos[:, None], s, float("-inf"))
    else:
        s = (_mma(lat, tl.trans(ql), BF16_DOT) + _mma(rope, tl.trans(qr), BF16_DOT)) * qk_scale   # [BLOCK_N, rows]
        s = tl.where(kpos[:, None] <= qpos[None, :], s, float("-inf"))
    # lazy or eager (mla_decode_triton._mla_softmax_pv; lazily, chunked prompts still sum the same);
    # padding rows see no key
    return _mla_softmax_pv(s, m_i, l_i, acc, lat, SLACK, True, BF16_DOT, not HEADS_M)


@triton.jit
def _mla_prefill_kernel(
        ql_ptr, qr_ptr, lat_ptr, rope_ptr, ls_ptr, bt_ptr, cu_ptr, lens_ptr, out_ptr, s2_ptr,
        s_qlt, s_qlh, s_qrt, s_qrh, s_lb, s_lt, s_rb, s_rt, ss_b, ss_t, s_btb, s_ot, s_oh, scale,
        H: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
        P: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        SCALE_KIND: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr, INTERPRET: tl.constexpr,
        BF16_DOT: tl.constexpr, SLACK: tl.constexpr = RESCALE_SLACK, HEADS_M: tl.constexpr = False):
    # grid (head blocks, B, query tiles): the head blocks of one query tile are adjacent in launch
    # order, so all but the first read the latent tiles from L2
    hb = tl.program_id(0)
    b = tl.program_id(1)
    mt = tl.program_id(2)
    q_lo = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_lo
    n = tl.load(lens_ptr + b)
    ctx = n - q_len
    t0 = mt * BLOCK_M
    if t0 < q_len:
        rows = tl.arange(0, BLOCK_M * BLOCK_H)
        t = t0 + rows // BLOCK_H
        hh = hb * BLOCK_H + rows % BLOCK_H
        rmask = (t < q_len) & (hh < H)
        qpos = ctx + t
        r = tl.arange(0, BLOCK_R)
        p_ = tl.arange(0, BLOCK_P)
        j = tl.arange(0, BLOCK_N)
        q_row = (q_lo + t).to(tl.int64)
        qd = tl.bfloat16 if BF16_DOT else tl.float32
        ql = tl.load(ql_ptr + q_row[:, None] * s_qlt + hh[:, None] * s_qlh + r[None, :],
                     mask=rmask[:, None] & (r[None, :] < R), other=0.0).to(qd)
        qr = tl.load(qr_ptr + q_row[:, None] * s_qrt + hh[:, None] * s_qrh + p_[None, :],
                     mask=rmask[:, None] & (p_[None, :] < P), other=0.0)
        qr = _mla_rope_query(qr, s2_ptr, SCALE_KIND).to(qd)
        qk_scale = scale
        if SCALE_KIND == 1:                       # fp8 per tensor: one scale for latent and rope
            qk_scale = scale * tl.load(ls_ptr)
        if SCALE_KIND == 3:                       # nvfp4: the latent's scale_2 (the rope's is in qr)
            qk_scale = scale * tl.load(s2_ptr)
        m_i = tl.full([BLOCK_M * BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M * BLOCK_H], tl.float32)
        last = tl.minimum(ctx + t0 + BLOCK_M, n) - 1          # the tile's last query position = its last key
        bt_row = bt_ptr + b * s_btb
        if HEADS_M:                               # rows as the MMAs' M
            acc = tl.zeros([BLOCK_M * BLOCK_H, BLOCK_R], tl.float32)
        else:                                     # transposed
            acc = tl.zeros([BLOCK_R, BLOCK_M * BLOCK_H], tl.float32)
        if INTERPRET:
            k0 = 0
            while k0 <= last:
                m_i, l_i, acc = _mla_prefill_tile(
                    ql, qr, m_i, l_i, acc, k0, qpos, last, lat_ptr, rope_ptr, ls_ptr, bt_row, r, p_, j,
                    s_lb, s_lt, s_rb, s_rt, ss_b, ss_t, qk_scale,
                    R, BLOCK_R, P, BLOCK_N, BLOCK_SIZE, SCALE_KIND, GROUP, NG, BF16_DOT, SLACK, HEADS_M)
                k0 += BLOCK_N
        else:
            for k0 in range(0, last + 1, BLOCK_N):
                m_i, l_i, acc = _mla_prefill_tile(
                    ql, qr, m_i, l_i, acc, k0, qpos, last, lat_ptr, rope_ptr, ls_ptr, bt_row, r, p_, j,
                    s_lb, s_lt, s_rb, s_rt, ss_b, ss_t, qk_scale,
                    R, BLOCK_R, P, BLOCK_N, BLOCK_SIZE, SCALE_KIND, GROUP, NG, BF16_DOT, SLACK, HEADS_M)
        if SCALE_KIND == 1:                       # the values' per-tensor scale, folded out of P @ V
            acc = acc * tl.load(ls_ptr)
        if SCALE_KIND == 3:                       # nvfp4: the values are the latent (its scale_2)
            acc = acc * tl.load(s2_ptr)
        if HEADS_M:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + q_row[:, None] * s_ot + hh[:, None] * s_oh + r[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & (r[None, :] < R))
        else:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[None, :]
            tl.store(out_ptr + q_row[None, :] * s_ot + hh[None, :] * s_oh + r[:, None],
                     out.to(out_ptr.dtype.element_ty), mask=rmask[None, :] & (r[:, None] < R))


def paged_prefill_mla(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: MLALayerKV, block_tables: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                      max_seqlen_q: int | None = None, block_h: int | None = None, block_m: int = 1,
                      out: torch.Tensor | None = None, rescale_slack: float | None = None,
                      heads_m: bool | None = None, block_n: int | None = None, num_warps: int | None = None,
                      num_stages: int | None = None) -> torch.Tensor:
    """As attention_reference.paged_prefill_mla: q_latent [Tq, H, R], q_rope [Tq, H, P] ->
    [Tq, H, R] in q_latent.dtype. max_seqlen_q: an upper bound on any sequence's query count (grid
    size; a host sync computes it when None). block_h, block_m: heads and query tokens per program
    (powers of two, block_h * block_m >= 16 for tl.dot; default mla_block_h heads, clipped to the
    heads rounded up to a power of two, x 1 token). out: optional [Tq, H, R] tensor to write into.
    rescale_slack: attention_triton.RESCALE_SLACK unless given (0: the eager online softmax).
    heads_m: the rows as the MMAs' M (the decode's heads-as-M tile; ~216 KiB of shared memory at
    64 keys a step) or the transposed tile. By
    default the decode's choice (mla_decode_triton.mla_decode_form) unless a rescale_slack > 0 is
    given: faster than the transposed tile on the H200 over bf16 and fp8_ds_mla caches
    (docs/kernels.md, MLA prefill).
    block_n: keys a step (default MLA_HM_BLOCK_N with heads_m, else MLA_BLOCK_N). num_warps,
    num_stages: the launch (default the decode's MLA_NUM_WARPS / MLA_NUM_STAGES; for probes)."""
    q_latent, q_rope = q_latent.contiguous(), q_rope.contiguous()
    tq, h, r = q_latent.shape
    p = q_rope.shape[-1]
    bs = cache.block_size
    if bs < 16 or bs & (bs - 1):
        raise ConfigError(f"paged prefill (triton): block_size must be a power of two >= 16, got {bs}")
    block_h = block_h or mla_block_h(q_latent, h)
    fmt = cache.fmt
    group = min(fmt.group, r)
    if fmt.block_scaled and (group & (group - 1) or (r // group) * group != _pow2(r)):
        raise ConfigError(f"paged MLA prefill (triton): an fp8-block cache needs a power-of-two kv_lora_rank and "
                          f"scale group, got {r} and {group}")
    for name, v in (("block_h", block_h), ("block_m", block_m)):
        if v < 1 or v & (v - 1):
            raise ConfigError(f"paged MLA prefill (triton): {name} must be a power of two, got {v}")
    if block_h * block_m < 16:
        raise ConfigError(f"paged MLA prefill (triton): block_h * block_m must be >= 16 (tl.dot), got "
                          f"{block_h} * {block_m}")
    out = torch.empty(tq, h, r, dtype=q_latent.dtype, device=q_latent.device) if out is None else out
    b = block_tables.shape[0]
    if tq == 0 or b == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_seqlen_q <= 0:
        return out.zero_()
    kind = scale_kind(fmt)
    _check_nvfp4_rank(cache, r, "paged MLA prefill")
    slack = _slack(rescale_slack)
    heads_m = (mla_decode_form(q_latent, cache).heads_m and slack == 0) if heads_m is None else heads_m
    block_n = block_n or (MLA_HM_BLOCK_N if heads_m else MLA_BLOCK_N)
    if heads_m:
        check_heads_m_fits(q_latent.device, block_h * block_m, r, p, block_n, "paged MLA prefill")
    ls = cache.latent_scale if cache.latent_scale is not None else out     # any pointer; never read
    ss = ls.stride()[:2] if kind in (_SCALE_BLOCK, _SCALE_NVFP4) else (0, 0)
    s2 = cache.scale_2 if cache.scale_2 is not None else out      # nvfp4's scale_2; else never read
    _mla_prefill_kernel[(triton.cdiv(h, block_h), b, triton.cdiv(max_seqlen_q, block_m))](
        q_latent, q_rope, cache.latent, cache.rope, ls, block_tables, cu_seqlens_q, seq_lens, out, s2,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        *cache.latent.stride()[:2], *cache.rope.stride()[:2], *ss, block_tables.stride(0),
        out.stride(0), out.stride(1), float(scale),
        H=h, BLOCK_H=block_h, BLOCK_M=block_m, R=r, BLOCK_R=_pow2(r), P=p, BLOCK_P=_pow2(p), BLOCK_N=block_n,
        BLOCK_SIZE=bs, SCALE_KIND=kind, GROUP=group, NG=r // group, INTERPRET=_INTERPRET,
        BF16_DOT=_bf16_dots(q_latent), SLACK=slack, HEADS_M=heads_m, num_warps=num_warps or MLA_NUM_WARPS,
        num_stages=num_stages or MLA_NUM_STAGES)
    return out
