"""Triton paged decode for weight-absorbed MLA; signature equal to
attention_reference.paged_decode_mla (plus keyword-only tuning knobs). Importing this module needs
triton.

The same split-K as attention_triton.paged_decode_gqa (its _split_pages partition and split merge)
over the latent rows: absorbed MLA is MQA over one shared key row [latent (R) | rope (P)] per
token, values = latent. Grid (ceil(H / BLOCK_H), B, splits), BLOCK_H = 64 heads per program
(DeepSeek-V3's 128 heads: two programs per page, adjacent in launch order, the second reading the
page from L2). A program walks its split in steps of BLOCK_N tokens (several pages, each token's
page gathered from the block table), loads and dequantizes each tile once for all its heads, and
runs one of two tile forms (_mla_decode_tile):
  heads as the MMAs' M (the default where mla_decode_form takes it; FlashMLA's form): scores
    [heads, tokens] = q_latent @ latent^T + q_rope @ rope^T, acc [heads, R] += P @ latent, both
    dots on Hopper's wgmma with the tile in shared memory and P in registers, 8 warps = two warp
    groups each holding half of the [64, 512] fp32 accumulator; 64 tokens a step, eager softmax.
    Faster than the transposed form on the H200 over both bf16 and fp8_ds_mla caches, at every
    batch (docs/kernels.md, MLA decode).
  transposed (tokens as M): scores^T [tokens, heads] = tile @ q^T, out^T [R, heads] += tile^T @ P^T,
    the queries the dots' shared-memory operand; 32 tokens a step, so the score dot is mma.sync.
    Devices with under MLA_HM_MIN_SHARED of shared memory per block, fp32 queries and per-tensor
    fp8 caches keep it.
Scores are the sum of two dots (latent, rope), so the 576-wide row is never padded to 1024.
Formats: auto; fp8 per-tensor (one scale for latent and rope, folded into the softmax scale and the
output); fp8 block (fp8_ds_mla: per-token group scales loaded once per tile as [BLOCK_N, groups]
and broadcast over the group, rope in the model dtype). The MLA prefill (mla_prefill_triton.py)
shares the tile loader and the softmax step. At 128 heads the absorbed decode does ~240 FLOP per
bf16 latent byte: it is compute-bound, its useful figure is TFLOP/s (docs/perf.md).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moet.errors import ConfigError
from moet.kernels.attention_triton import (_INTERPRET, _SCALE_BLOCK, _SCALE_NVFP4, RESCALE_SLACK, _bf16_dots,
                                           _lazy_rescale, _merge_blocks, _merge_splits_kernel, _mma, _nvfp4_tile,
                                           _pow2, _slack, _split_pages, _splits, scale_kind)
from moet.kernels.kv_cache import MLALayerKV
from moet.kernels.launch_tables import device_shared_memory
from moet.kernels.pdl import pdl_enter, pdl_launch

# MLA decode tiling (see _mla_decode_split_kernel): heads per program, tokens per tile, and the
# launch shape; chosen from sm_90 AOT register / shared-memory counts (tests/kernels/aot_compile.py).
# MLA_BLOCK_N is the transposed form's step (and the MLA prefill's); the decode's default form
# (mla_decode_form) is the heads-as-M tile over MLA_HM_BLOCK_N tokens with the eager softmax:
# on the H200 (DeepSeek-V3 heads, long context) it beat the transposed 32-token form on a bf16
# cache and by more on fp8_ds_mla, at batch 1 / 8 / 32 (docs/kernels.md, MLA decode). It needs
# ~217 KiB of shared memory (the queries and one 64-token tile), so devices with less (A100 163
# KiB, sm_86 / sm_89 99 KiB) and fp32 queries keep the transposed form (~112 KiB at 2 stages); so
# does the per-tensor fp8 cache, not timed in it.
MLA_BLOCK_H = 64
# fp32 queries (the dots in fp32) take half the heads a program: their [64, 576] fp32 query tile
# alone is 147 KB, and with two 32-token stages the transposed decode needs ~256 KB of shared
# memory (sm_90 AOT), over any GPU's 227 KB (the launch fails on the H200 with out of resources);
# 32 heads: 164-180 KB. A function of the query dtype only, like the form.
MLA_BLOCK_H_FP32 = 32
MLA_BLOCK_N = 32
MLA_HM_BLOCK_N = 64
MLA_HM_MIN_SHARED = 222 * 1024
MLA_NUM_WARPS = 8
MLA_NUM_STAGES = 2
# the transposed bf16 decode's lazy-rescale slack (why only there: RESCALE_SLACK's comment)
MLA_DECODE_BF16_SLACK = 8.0


@triton.jit
def _mla_load_tile(lat_ptr, rope_ptr, ls_ptr, blk, off, tmask, r, p_, s_lb, s_lt, s_rb, s_rt, ss_b, ss_t,
                   R: tl.constexpr, BLOCK_R: tl.constexpr, P: tl.constexpr, BLOCK_N: tl.constexpr,
                   SCALE_KIND: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr, BF16_DOT: tl.constexpr):
    """(latent [BLOCK_N, BLOCK_R], rope [BLOCK_N, BLOCK_P]) of BLOCK_N tokens at (page blk, row
    off), masked by tmask, in the dot operand dtype; shared by MLA decode and prefill. nvfp4
    (SCALE_KIND 3): the latent's codes and e4m3 block scales decoded in registers
    (attention_triton._nvfp4_tile), the rope e4m3; both scale_2 folded in by the caller."""
    if SCALE_KIND == 3:
        lat = _nvfp4_tile(lat_ptr, ls_ptr, (blk * s_lb + off * s_lt)[:, None], (blk * ss_b + off * ss_t)[:, None],
                          tmask[:, None], BLOCK_N, R, BLOCK_R)
    else:
        lat = tl.load(lat_ptr + (blk * s_lb + off * s_lt)[:, None] + r[None, :],
                      mask=tmask[:, None] & (r[None, :] < R), other=0.0)
    rope = tl.load(rope_ptr + (blk * s_rb + off * s_rt)[:, None] + p_[None, :],
                   mask=tmask[:, None] & (p_[None, :] < P), other=0.0)
    if SCALE_KIND == 2:
        # fp8_ds_mla: NG per-token group scales, loaded once per tile as [BLOCK_N, NG] and
        # broadcast over each group (no per-element scale gather); e4m3 * scale in fp32, then the
        # operand dtype. BLOCK_R == NG * GROUP (checked by the launchers)
        g = tl.arange(0, NG)
        sc = tl.load(ls_ptr + (blk * ss_b + off * ss_t)[:, None] + g[None, :], mask=tmask[:, None], other=0.0)
        lat = tl.reshape(tl.reshape(lat.to(tl.float32), [BLOCK_N, NG, GROUP]) * sc[:, :, None], [BLOCK_N, BLOCK_R])
    # operands: bf16 (e4m3 -> bf16 is exact; a per-tensor fp8 scale is folded into qk_scale and
    # into the output, outside the dots) or fp32 for the exact path
    if BF16_DOT:
        return lat.to(tl.bfloat16), rope.to(tl.bfloat16)
    else:
        return lat.to(tl.float32), rope.to(tl.float32)


@triton.jit
def _mla_rope_query(qr, s2_ptr, SCALE_KIND: tl.constexpr):
    """The rope queries as loaded; nvfp4 (SCALE_KIND 3): times scale_2[1] / scale_2[0], so that one
    softmax scale (times the latent's scale_2[0]) serves both dots, the tiles unchanged."""
    if SCALE_KIND == 3:
        return qr.to(tl.float32) * (tl.load(s2_ptr + 1) / tl.load(s2_ptr))
    else:
        return qr


@triton.jit
def _mla_decode_tile(ql, qr, m_i, l_i, acc, t0, t_end, b, lat_ptr, rope_ptr, ls_ptr, bt_ptr, r, p_, j,
                     s_lb, s_lt, s_rb, s_rt, ss_b, ss_t, s_btb, qk_scale,
                     R: tl.constexpr, BLOCK_R: tl.constexpr, P: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, SCALE_KIND: tl.constexpr, GROUP: tl.constexpr,
                     NG: tl.constexpr, BF16_DOT: tl.constexpr, SLACK: tl.constexpr, HEADS_M: tl.constexpr):
    """BLOCK_N consecutive tokens (t0 .. t0 + BLOCK_N, masked at t_end; they may span several
    pages: the page of each token is gathered from the block table) for all BLOCK_H heads of the
    program: scores = q_latent . latent + q_rope . rope, the online-softmax update, P @ latent.
    The tile is loaded and dequantized once and feeds every head of the program.
    HEADS_M (FlashMLA's form): scores [BLOCK_H, BLOCK_N] = q_latent @ latent^T + q_rope @ rope^T,
    acc [BLOCK_H, BLOCK_R] += P @ latent; both dots can run on Hopper's wgmma with the tile read
    from shared memory and P from registers; 8 warps = two warp groups, each holding half of acc's
    latent columns. Else transposed: tokens are M and heads N (scores [BLOCK_N, BLOCK_H], acc
    [BLOCK_R, BLOCK_H]) with the queries as the shared-memory operand; at 32 tokens the score dot
    is too short for wgmma."""
    pos = t0 + j
    tmask = pos < t_end
    blk = tl.load(bt_ptr + b * s_btb + pos // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
    off = (pos % BLOCK_SIZE).to(tl.int64)
    lat, rope = _mla_load_tile(lat_ptr, rope_ptr, ls_ptr, blk, off, tmask, r, p_, s_lb, s_lt, s_rb, s_rt, ss_b, ss_t,
                               R, BLOCK_R, P, BLOCK_N, SCALE_KIND, GROUP, NG, BF16_DOT)
    if HEADS_M:
        s = (_mma(ql, tl.trans(lat), BF16_DOT) + _mma(qr, tl.trans(rope), BF16_DOT)) * qk_scale
        s = tl.where(tmask[None, :], s, float("-inf"))
    else:
        s = (_mma(lat, tl.trans(ql), BF16_DOT) + _mma(rope, tl.trans(qr), BF16_DOT)) * qk_scale
        s = tl.where(tmask[:, None], s, float("-inf"))
    return _mla_softmax_pv(s, m_i, l_i, acc, lat, SLACK, False, BF16_DOT, not HEADS_M)


@triton.jit
def _mla_softmax_pv(s, m_i, l_i, acc, lat, SLACK: tl.constexpr, EMPTY_ROWS: tl.constexpr,
                    BF16_DOT: tl.constexpr, ROWS_LAST: tl.constexpr = True):
    """The online-softmax step of the MLA tiles (decode and prefill): scores s [keys, rows] and acc
    [R, rows] += lat^T @ P (ROWS_LAST, the transposed tiles), or s [rows, keys] and acc [rows, R] +=
    P @ lat (the rows-as-M tiles); masked keys -inf; lazily (SLACK > 0: _lazy_rescale) or eagerly.
    EMPTY_ROWS: some rows may have seen no key yet (prefill padding rows): their exps are taken
    against 0 instead of -inf, which gives 0 rather than NaN. -> (m, l, acc)."""
    KEYS: tl.constexpr = 0 if ROWS_LAST else 1          # the keys' axis of s
    if SLACK > 0:                           # lazy: the accumulator rescaled in few tiles
        m_new, l_i, acc = _lazy_rescale(m_i, l_i, acc, tl.max(s, axis=KEYS), SLACK, ROWS_LAST)
    else:                                   # eager: rescale at every tile (by 1 where the max stays)
        m_new = tl.maximum(m_i, tl.max(s, axis=KEYS))
    if EMPTY_ROWS:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    if ROWS_LAST:
        pr = tl.exp(s - m_ref[None, :])
    else:
        pr = tl.exp(s - m_ref[:, None])
    if SLACK > 0:
        l_i = l_i + tl.sum(pr, axis=KEYS)
    else:
        alpha = tl.exp(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(pr, axis=KEYS)
        if ROWS_LAST:
            acc = acc * alpha[None, :]
        else:
            acc = acc * alpha[:, None]
    if ROWS_LAST:
        acc = acc + _mma(tl.trans(lat), pr.to(lat.dtype), BF16_DOT)
    else:
        acc = acc + _mma(pr.to(lat.dtype), lat, BF16_DOT)
    return m_new, l_i, acc


@triton.jit
def _mla_decode_split_kernel(
        ql_ptr, qr_ptr, lat_ptr, rope_ptr, ls_ptr, bt_ptr, lens_ptr, acc_ptr, m_ptr, l_ptr, s2_ptr,
        s_qlb, s_qlh, s_qrb, s_qrh, s_lb, s_lt, s_rb, s_rt, ss_b, ss_t, s_btb, scale, pages_min,
        H: tl.constexpr, BLOCK_H: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
        P: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        MAX_SPLITS: tl.constexpr, SCALE_KIND: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr,
        BF16_DOT: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr, SLACK: tl.constexpr = RESCALE_SLACK,
        HEADS_M: tl.constexpr = False):
    pdl_enter(PDL)
    # grid (head blocks, B, splits): the head blocks of one (sequence, split) are adjacent in
    # launch order, so they run together and all but the first read its latent rows from L2
    hb = tl.program_id(0)
    b = tl.program_id(1)
    sp = tl.program_id(2)
    n = tl.load(lens_ptr + b)
    n_pages, pps, used = _split_pages(n, pages_min, MAX_SPLITS, BLOCK_SIZE)
    if sp < used:                                 # other splits write nothing; merge skips them
        hh = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        r = tl.arange(0, BLOCK_R)
        p_ = tl.arange(0, BLOCK_P)
        j = tl.arange(0, BLOCK_N)
        hmask = hh < H
        # queries in the operand dtype once, outside the token loop
        qd = tl.bfloat16 if BF16_DOT else tl.float32
        ql = tl.load(ql_ptr + b * s_qlb + hh[:, None] * s_qlh + r[None, :],
                     mask=hmask[:, None] & (r[None, :] < R), other=0.0).to(qd)
        qr = tl.load(qr_ptr + b * s_qrb + hh[:, None] * s_qrh + p_[None, :],
                     mask=hmask[:, None] & (p_[None, :] < P), other=0.0)
        qr = _mla_rope_query(qr, s2_ptr, SCALE_KIND).to(qd)
        qk_scale = scale
        if SCALE_KIND == 1:                       # fp8 per tensor: one scale for latent and rope
            qk_scale = scale * tl.load(ls_ptr)
        if SCALE_KIND == 3:                       # nvfp4: the latent's scale_2 (the rope's is in qr)
            qk_scale = scale * tl.load(s2_ptr)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        t_lo = sp * pps * BLOCK_SIZE
        t_end = tl.minimum(t_lo + pps * BLOCK_SIZE, n)
        row = (b * H + hh) * tl.num_programs(2) + sp
        if HEADS_M:                               # heads as the MMAs' M
            acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
        else:                                     # transposed
            acc = tl.zeros([BLOCK_R, BLOCK_H], tl.float32)
        if INTERPRET:                             # loaded-scalar loop bounds: see prefill_triton.py
            t0 = t_lo
            while t0 < t_end:
                m_i, l_i, acc = _mla_decode_tile(
                    ql, qr, m_i, l_i, acc, t0, t_end, b, lat_ptr, rope_ptr, ls_ptr, bt_ptr, r, p_, j,
                    s_lb, s_lt, s_rb, s_rt, ss_b, ss_t, s_btb, qk_scale,
                    R, BLOCK_R, P, BLOCK_N, BLOCK_SIZE, SCALE_KIND, GROUP, NG, BF16_DOT, SLACK, HEADS_M)
                t0 += BLOCK_N
        else:
            for t0 in range(t_lo, t_end, BLOCK_N):
                m_i, l_i, acc = _mla_decode_tile(
                    ql, qr, m_i, l_i, acc, t0, t_end, b, lat_ptr, rope_ptr, ls_ptr, bt_ptr, r, p_, j,
                    s_lb, s_lt, s_rb, s_rt, ss_b, ss_t, s_btb, qk_scale,
                    R, BLOCK_R, P, BLOCK_N, BLOCK_SIZE, SCALE_KIND, GROUP, NG, BF16_DOT, SLACK, HEADS_M)
        if SCALE_KIND == 1:                       # the values' per-tensor scale, folded out of P @ V
            acc = acc * tl.load(ls_ptr)
        if SCALE_KIND == 3:                       # nvfp4: the values are the latent (its scale_2)
            acc = acc * tl.load(s2_ptr)
        if HEADS_M:
            tl.store(acc_ptr + row[:, None] * R + r[None, :], acc, mask=hmask[:, None] & (r[None, :] < R))
        else:
            tl.store(acc_ptr + row[None, :] * R + r[:, None], acc, mask=hmask[None, :] & (r[:, None] < R))
        tl.store(m_ptr + row, m_i, mask=hmask)
        tl.store(l_ptr + row, l_i, mask=hmask)


class MLADecodeForm(NamedTuple):
    heads_m: bool         # the heads-as-M tile (else the transposed one)
    block_n: int          # tokens a loop step
    slack: float          # the lazy-rescale slack (0: eager)


def _check_nvfp4_rank(cache: MLALayerKV, r: int, what: str) -> None:
    """nvfp4 MLA kernels: the queries' kv_lora_rank is the cache's, a multiple of 16."""
    if cache.fmt.is_nvfp4 and (r != cache.kv_lora_rank or r % 16):
        raise ConfigError(f"{what} (triton): an nvfp4 cache of kv_lora_rank {cache.kv_lora_rank} read with "
                          f"{r}-wide latent queries (must match, a multiple of 16)")


def mla_heads_m_fits(device: torch.device) -> bool:
    """Whether the heads-as-M 64-token tile's ~217 KiB of shared memory fits one block of this
    device (MLA_HM_MIN_SHARED: H100 / H200 227 KiB; not A100's 163 or sm_86 / sm_89's 99). Devices
    other than CUDA (the interpreter) take the GPU's form."""
    return device.type != "cuda" or device_shared_memory(device) >= MLA_HM_MIN_SHARED


def check_heads_m_fits(device: torch.device, rows: int, r: int, p: int, block_n: int, what: str) -> None:
    """A clear error instead of Triton's out-of-resources at launch when an explicit heads_m tile
    does not fit this device's shared memory. Estimate (within ~4% of sm_90 AOT builds): the
    [rows, R + P] queries and two [block_n, R + P] tiles, all 16-bit."""
    if device.type != "cuda" or _INTERPRET:
        return
    need, have = 2 * (rows + 2 * block_n) * (_pow2(r) + _pow2(p)), device_shared_memory(device)
    if need > have:
        raise ConfigError(f"{what} (triton): heads_m with {rows} rows and {block_n}-token steps needs ~{need // 1024} "
                          f"KiB of shared memory per block, this GPU has {have // 1024} KiB; pass heads_m=False "
                          "(the transposed tile, the default there) or a smaller block_n")


def mla_block_h(q_latent: torch.Tensor, h: int) -> int:
    """Heads per program by default (MLA decode and prefill): MLA_BLOCK_H, MLA_BLOCK_H_FP32 for
    fp32 queries, at most the heads rounded up to a power of two."""
    return min(MLA_BLOCK_H if _bf16_dots(q_latent) else MLA_BLOCK_H_FP32, _pow2(h))


def mla_decode_form(q_latent: torch.Tensor, cache: MLALayerKV) -> MLADecodeForm:
    """The MLA decode's default form for these queries, this cache and device (see MLA_HM_BLOCK_N):
    a function of the query dtype, the cache format and the device, never of the batch, so a
    model's bits do not depend on the batch. The interpreter takes the GPU's form."""
    fmt = cache.fmt
    roomy = _INTERPRET or mla_heads_m_fits(q_latent.device)
    if roomy and _bf16_dots(q_latent) and not (fmt.is_fp8 and not fmt.block_scaled):
        return MLADecodeForm(True, MLA_HM_BLOCK_N, RESCALE_SLACK)
    bf16_cache = cache.latent.dtype == torch.bfloat16
    return MLADecodeForm(False, MLA_BLOCK_N, MLA_DECODE_BF16_SLACK if bf16_cache else RESCALE_SLACK)


def paged_decode_mla(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: MLALayerKV,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     *, split_tokens: int | None = None, max_splits: int | None = None,
                     block_h: int | None = None, out: torch.Tensor | None = None,
                     rescale_slack: float | None = None, heads_m: bool | None = None, block_n: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """As attention_reference.paged_decode_mla (split_tokens, max_splits, out: as paged_decode_gqa).
    block_h: heads per program (default mla_block_h: MLA_BLOCK_H, MLA_BLOCK_H_FP32 for fp32 queries,
    at most the heads rounded up to a power of two); like the splits it must be fixed per model
    (the dot shapes change the last bits).
    heads_m: the heads as the MMAs' M (_mla_decode_tile: both dots on wgmma on Hopper) or the
    transposed tile; block_n: tokens a step; rescale_slack: the lazy rescale's slack (0: the eager
    online softmax). Each defaults to mla_decode_form (heads_m, 64 tokens, eager where the device
    has the shared memory); like block_h they change the last bits and are fixed per model.
    num_warps / num_stages (default MLA_NUM_WARPS / MLA_NUM_STAGES): the launch."""
    q_latent, q_rope = q_latent.contiguous(), q_rope.contiguous()
    b, h, r = q_latent.shape
    p = q_rope.shape[-1]
    bs = cache.block_size
    if bs < 16 or bs & (bs - 1):
        raise ConfigError(f"paged decode (triton): block_size must be a power of two >= 16, got {bs}")
    fmt = cache.fmt
    kind = scale_kind(fmt)
    block_r = _pow2(r)
    group = min(fmt.group, r)
    ng = r // group
    if kind == _SCALE_BLOCK and (group & (group - 1) or ng * group != block_r):
        raise ConfigError(f"paged decode mla (triton): an fp8-block cache needs a power-of-two kv_lora_rank and "
                          f"scale group, got {r} and {group}")
    _check_nvfp4_rank(cache, r, "paged decode mla")
    form = mla_decode_form(q_latent, cache)
    slack = _slack(rescale_slack, form.slack)
    heads_m = form.heads_m if heads_m is None else heads_m
    pages_min, max_splits, num_splits = _splits(block_tables, bs, split_tokens, max_splits)
    block_h = min(block_h, _pow2(h)) if block_h else mla_block_h(q_latent, h)
    if block_h < 16 or block_h & (block_h - 1):
        raise ConfigError(f"paged decode mla (triton): block_h must be a power of two >= 16, got {block_h}")
    block_n = block_n or (form.block_n if heads_m == form.heads_m else MLA_HM_BLOCK_N if heads_m else MLA_BLOCK_N)
    if block_n < 16 or block_n & (block_n - 1):
        raise ConfigError(f"paged decode mla (triton): block_n must be a power of two >= 16, got {block_n}")
    if heads_m:
        check_heads_m_fits(q_latent.device, block_h, r, p, block_n, "paged decode mla")
    acc = torch.empty(b, h, num_splits, r, dtype=torch.float32, device=q_latent.device)
    m = torch.empty(b, h, num_splits, dtype=torch.float32, device=q_latent.device)
    l_ = torch.empty_like(m)
    out = torch.empty(b, h, r, dtype=q_latent.dtype, device=q_latent.device) if out is None else out
    ls = cache.latent_scale if cache.latent_scale is not None else m
    ss = ls.stride()[:2] if kind in (_SCALE_BLOCK, _SCALE_NVFP4) else (0, 0)
    s2 = cache.scale_2 if cache.scale_2 is not None else m      # nvfp4's scale_2; else never read
    _mla_decode_split_kernel[(triton.cdiv(h, block_h), b, num_splits)](
        q_latent, q_rope, cache.latent, cache.rope, ls, block_tables, seq_lens, acc, m, l_, s2,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        *cache.latent.stride()[:2], *cache.rope.stride()[:2], *ss, block_tables.stride(0), float(scale), pages_min,
        H=h, BLOCK_H=block_h, R=r, BLOCK_R=block_r, P=p, BLOCK_P=_pow2(p), BLOCK_N=block_n, BLOCK_SIZE=bs,
        MAX_SPLITS=max_splits, SCALE_KIND=kind, GROUP=group, NG=ng, BF16_DOT=_bf16_dots(q_latent),
        INTERPRET=_INTERPRET, SLACK=slack, HEADS_M=heads_m,
        num_warps=num_warps or MLA_NUM_WARPS, num_stages=num_stages or MLA_NUM_STAGES, **pdl_launch(q_latent))
    _merge_splits_kernel[(b, h)](acc, m, l_, seq_lens, out, out.stride(0), out.stride(1), num_splits, pages_min,
                                 HQ=h, DV=r, BLOCK_DV=_pow2(r), MAX_SPLITS=max_splits, BLOCK_SIZE=bs,
                                 **_merge_blocks(max_splits, r), **pdl_launch(q_latent))
    return out
