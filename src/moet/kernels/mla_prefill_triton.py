"""Triton paged prefill/extend for weight-absorbed MLA; signature equal to
attention_reference.paged_prefill_mla (plus keyword-only tuning knobs). Importing this module
needs triton.

Absorbed MLA is MQA over the cached rows: one shared key row [latent (R) | rope (P)] per token,
values = latent, `score = scale * (q_latent . latent + q_rope . k_rope)`; the output stays in the
latent space ([Tq, H, R]; mla_output applies W_UV).
Grid (B, ceil(H / BLOCK_H), ceil(max_q_len / BLOCK_M)): one program = one sequence, a block of
BLOCK_H heads and a tile of BLOCK_M query tokens, packed as BLOCK_M * BLOCK_H rows (row r = token
r // BLOCK_H, head r % BLOCK_H), so every latent row of a page is read once per program for all
of them. The program walks the pages from 0 to its tile's last query position (causal; DeepSeek-V3
and Kimi-K2 have no sliding window), online softmax in fp32, and writes the normalised output once:
no split-K, no atomics, a fixed page order -> bit-identical run to run. Scores are the sum of two
dots (latent, rope), so the 576-wide row is never padded to 1024.
Formats: auto, fp8 per-tensor (one scale for latent and rope), fp8 block (fp8_ds_mla: per-group
latent scales, rope in the model dtype) -- the same dequantizing loads as the MLA decode kernel.

Rows per program: 16 by default (BLOCK_M * BLOCK_H): at R = 512 the fp32 accumulator and query of
16 rows are what the decode kernel fits without spills; more rows per program reuse each page
more but spill (to be measured on the H200, bench/attention_bench.py).
Numerics: dots as attention_triton._dot: bf16 queries (serving) -> bf16 tensor-core operands,
fp32 accumulation; fp32 queries -> exact fp32 (FFMA; equal to the fp32 reference on CPU).
Under TRITON_INTERPRET=1 the page loop is a while loop (as prefill_triton.py, same reason).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from moet.errors import ConfigError
from moet.kernels.attention_triton import _SCALE_BLOCK, _SCALE_NONE, _SCALE_TENSOR, _bf16_dots, _dot, _pow2
from moet.kernels.kv_cache import MLALayerKV

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"   # read at import, as triton does


@triton.jit
def _mla_prefill_page(ql, qr, m_i, l_i, acc, page, qpos, last, lat_ptr, rope_ptr, ls_ptr, bt_row_ptr,
                      r, p_, tok, s_lb, s_lt, s_rb, s_rt, ss_b, ss_t, scale,
                      R: tl.constexpr, P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      SCALE_KIND: tl.constexpr, GROUP: tl.constexpr, BF16_DOT: tl.constexpr):
    """One page of latent rows for all rows of the tile: the online-softmax update."""
    blk = tl.load(bt_row_ptr + page).to(tl.int64)
    kpos = page * BLOCK_SIZE + tok
    tmask = kpos <= last
    lm = tmask[:, None] & (r[None, :] < R)
    lat = tl.load(lat_ptr + blk * s_lb + tok[:, None] * s_lt + r[None, :], mask=lm, other=0.0).to(tl.float32)
    rm = tmask[:, None] & (p_[None, :] < P)
    rope = tl.load(rope_ptr + blk * s_rb + tok[:, None] * s_rt + p_[None, :], mask=rm, other=0.0).to(tl.float32)
    if SCALE_KIND == 1:
        sc = tl.load(ls_ptr)
        lat = lat * sc
        rope = rope * sc
    if SCALE_KIND == 2:
        lat = lat * tl.load(ls_ptr + blk * ss_b + tok[:, None] * ss_t + r[None, :] // GROUP, mask=lm, other=0.0)
    s = (_dot(ql, tl.trans(lat), BF16_DOT) + _dot(qr, tl.trans(rope), BF16_DOT)) * scale   # [rows, BLOCK_SIZE]
    s = tl.where(kpos[None, :] <= qpos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # padding rows see no key: shift by 0 so exp gives 0 rather than NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    pr = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(pr, axis=1)
    acc = acc * alpha[:, None] + _dot(pr, lat, BF16_DOT)
    return m_new, l_i, acc


@triton.jit
def _mla_prefill_kernel(
        ql_ptr, qr_ptr, lat_ptr, rope_ptr, ls_ptr, bt_ptr, cu_ptr, lens_ptr, out_ptr,
        s_qlt, s_qlh, s_qrt, s_qrh, s_lb, s_lt, s_rb, s_rt, ss_b, ss_t, s_btb, s_ot, s_oh, scale,
        H: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
        P: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, SCALE_KIND: tl.constexpr,
        GROUP: tl.constexpr, INTERPRET: tl.constexpr, BF16_DOT: tl.constexpr):
    b = tl.program_id(0)
    hb = tl.program_id(1)
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
        tok = tl.arange(0, BLOCK_SIZE)
        q_row = (q_lo + t).to(tl.int64)
        ql = tl.load(ql_ptr + q_row[:, None] * s_qlt + hh[:, None] * s_qlh + r[None, :],
                     mask=rmask[:, None] & (r[None, :] < R), other=0.0).to(tl.float32)
        qr = tl.load(qr_ptr + q_row[:, None] * s_qrt + hh[:, None] * s_qrh + p_[None, :],
                     mask=rmask[:, None] & (p_[None, :] < P), other=0.0).to(tl.float32)
        m_i = tl.full([BLOCK_M * BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M * BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_M * BLOCK_H, BLOCK_R], tl.float32)
        last = tl.minimum(ctx + t0 + BLOCK_M, n) - 1          # the tile's last query position = its last key
        hi_page = last // BLOCK_SIZE + 1
        bt_row = bt_ptr + b * s_btb
        if INTERPRET:
            page = 0
            while page < hi_page:
                m_i, l_i, acc = _mla_prefill_page(
                    ql, qr, m_i, l_i, acc, page, qpos, last, lat_ptr, rope_ptr, ls_ptr, bt_row, r, p_, tok,
                    s_lb, s_lt, s_rb, s_rt, ss_b, ss_t, scale, R, P, BLOCK_SIZE, SCALE_KIND, GROUP, BF16_DOT)
                page += 1
        else:
            for page in range(0, hi_page):
                m_i, l_i, acc = _mla_prefill_page(
                    ql, qr, m_i, l_i, acc, page, qpos, last, lat_ptr, rope_ptr, ls_ptr, bt_row, r, p_, tok,
                    s_lb, s_lt, s_rb, s_rt, ss_b, ss_t, scale, R, P, BLOCK_SIZE, SCALE_KIND, GROUP, BF16_DOT)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + q_row[:, None] * s_ot + hh[:, None] * s_oh + r[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & (r[None, :] < R))


def paged_prefill_mla(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: MLALayerKV, block_tables: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                      max_seqlen_q: int | None = None, block_h: int = 16, block_m: int = 1,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """As attention_reference.paged_prefill_mla: q_latent [Tq, H, R], q_rope [Tq, H, P] ->
    [Tq, H, R] in q_latent.dtype. max_seqlen_q: an upper bound on any sequence's query count (grid
    size; a host sync computes it when None). block_h, block_m: heads and query tokens per program
    (powers of two, block_h * block_m >= 16 for tl.dot). out: optional [Tq, H, R] tensor to write into."""
    q_latent, q_rope = q_latent.contiguous(), q_rope.contiguous()
    tq, h, r = q_latent.shape
    p = q_rope.shape[-1]
    bs = cache.block_size
    if bs < 16 or bs & (bs - 1):
        raise ConfigError(f"paged prefill (triton): block_size must be a power of two >= 16, got {bs}")
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
    fmt = cache.fmt
    kind = _SCALE_BLOCK if fmt.block_scaled else _SCALE_TENSOR if fmt.is_fp8 else _SCALE_NONE
    ls = cache.latent_scale if cache.latent_scale is not None else out     # any pointer; never read
    ss = ls.stride()[:2] if kind == _SCALE_BLOCK else (0, 0)
    _mla_prefill_kernel[(b, triton.cdiv(h, block_h), triton.cdiv(max_seqlen_q, block_m))](
        q_latent, q_rope, cache.latent, cache.rope, ls, block_tables, cu_seqlens_q, seq_lens, out,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        *cache.latent.stride()[:2], *cache.rope.stride()[:2], *ss, block_tables.stride(0),
        out.stride(0), out.stride(1), float(scale),
        H=h, BLOCK_H=block_h, BLOCK_M=block_m, R=r, BLOCK_R=_pow2(r), P=p, BLOCK_P=_pow2(p), BLOCK_SIZE=bs,
        SCALE_KIND=kind, GROUP=min(fmt.group, r), INTERPRET=_INTERPRET, BF16_DOT=_bf16_dots(q_latent))
    return out
