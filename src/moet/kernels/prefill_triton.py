"""Triton paged prefill/extend attention for GQA; signature equal to
attention_reference.paged_prefill_gqa (plus keyword-only tuning knobs). Importing this module
needs triton (an optional dependency: moet.kernels never imports it on its own).

paged_prefill_gqa: causal, variable length (cu_seqlens_q), every key read from the paged cache
  (prior context and this step's own tokens alike, which the caller has written first).
  Grid (B, Hkv, ceil(max_q_len / BLOCK_M)): one program = one sequence, one KV head, a tile of
  BLOCK_M query tokens times all G query heads of that KV head, packed as BLOCK_M * BLOCK_G rows
  (row r = token r // BLOCK_G, head r % BLOCK_G), so each K/V page is read once per group and tile.
  The program walks the keys from the first one any of its queries can see (sliding window) to
  its last query's position in tiles of BLOCK_N keys (several pages; each key's page gathered from
  the block table), online softmax in fp32, and writes the normalised output directly (no
  split-K: a prefill tile already has enough parallelism). No atomics and a fixed tile order:
  bit-identical run to run. Formats: auto, fp8_e4m3 per-tensor and per-token-group scales.

Status: matches the torch reference under TRITON_INTERPRET=1 at small shapes
(tests/kernels/test_prefill_triton.py) and compiles for sm_90 (tests/kernels/aot_compile.py).
The first form (one 16-key page per step, 64 rows, 4 warps, every tile converted to fp32 and
back) ran at a fraction of a bf16 GEMM's rate on the H200, far behind SDPA (docs/kernels.md, GQA
prefill). Now: 128 rows x 64 keys, 8 warps,
queries and K/V in the dot operand dtype (bf16 tensor cores for bf16 queries, exact fp32 for fp32
ones), fp8 per-tensor scales folded into the softmax scale and the output and one scale per
token and head onto score / P columns (attention_triton._gqa_load_operand); sm_90 AOT (GLM-4.5
shape, G 12): wgmma, 254 registers, no spills (fp8 block 56 B). Known costs: K/V re-read by
every query tile of a sequence; the grid's third axis comes from max_seqlen_q, which costs a host
sync when the caller does not pass it.
Under TRITON_INTERPRET=1 the key loop is a while loop (see INTERPRET in the kernel): the tests
run that form; the compiled form is the range() loop with the same bounds and the same body.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from moet.errors import ConfigError
from moet.kernels.attention_triton import (RESCALE_SLACK, _SCALE_BLOCK, _SCALE_NVFP4, _bf16_dots, _gqa_load_operand,
                                           _lazy_rescale, _mma, _pow2, _slack, scale_kind)
from moet.kernels.kv_cache import GQALayerKV

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"   # read at import, as triton does
# Tile shape: 256 (query token, head) rows x 64 keys per step (several pages); bf16 and fp8
# per-tensor caches 16 warps and 2 stages, block-scaled fp8 8 warps (its scale loads and
# converts are per warp: 16 warps were slower there). On the H200 (8K causal prompt,
# Qwen3-30B-A3B and GLM-4.5-Air heads) this beat the earlier 128 rows x 8 warps on every cache
# format (docs/kernels.md, GQA prefill), though sm_90 AOT of 256 x 16 warps spills a few ops (one in
# the loop); 128 rows x 16 warps and 512 rows were slower.
# Head dims over 128 keep the earlier 128 rows x 8 warps (not timed at 256 rows). The launch
# depends on the cache format and head dim only, never on the batch (the tile changes the last
# bits, so a grid-size rule for short prompts would make a prompt's output depend on what else
# is in the step).
PREFILL_BLOCK_N = 64
PREFILL_ROWS = 256
PREFILL_NUM_WARPS = 16
PREFILL_NUM_STAGES = 2
PREFILL_BLOCK_SCALED_NUM_WARPS = 8
PREFILL_WIDE_D_ROWS, PREFILL_WIDE_D_NUM_WARPS = 128, 8
# fp32 queries (fp32 dots: a float32 model on a GPU) keep the earlier 128 x 8 launch: at 256 rows
# their [256, 128] fp32 query tile and fp32 K / V stages need 263,168 B of shared memory against
# the H200's 232,448 (the launch fails with OutOfResources)
PREFILL_FP32_ROWS, PREFILL_FP32_NUM_WARPS = 128, 8


def prefill_launch(block_scaled: bool, head_dim: int, fp32_queries: bool = False) -> tuple[int, int, int | None]:
    """(rows of (query token, head) a program, num_warps, num_stages or None for Triton's) of the
    default launch for a cache (block-scaled fp8 or not), head dim and query dtype (fp32 or not)."""
    if _pow2(head_dim) > 128:
        return PREFILL_WIDE_D_ROWS, PREFILL_WIDE_D_NUM_WARPS, None
    if fp32_queries:
        return PREFILL_FP32_ROWS, PREFILL_FP32_NUM_WARPS, None
    if block_scaled:
        return PREFILL_ROWS, PREFILL_BLOCK_SCALED_NUM_WARPS, None
    return PREFILL_ROWS, PREFILL_NUM_WARPS, PREFILL_NUM_STAGES


@triton.jit
def _prefill_tile(q, m_i, l_i, acc, k0, qpos, last, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row_ptr, h, d, dv, j,
                  s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, ss_kb, ss_kt, ss_kh, ss_vb, ss_vt, ss_vh, qk_scale,
                  D: tl.constexpr, DV: tl.constexpr, BLOCK_SIZE: tl.constexpr, WINDOW: tl.constexpr,
                  SCALE_KIND: tl.constexpr, GROUP_K: tl.constexpr, GROUP_V: tl.constexpr, BF16_DOT: tl.constexpr,
                  SLACK: tl.constexpr):
    """Keys k0 .. k0 + BLOCK_N (several pages: each key's page gathered from the block table) for
    all rows of the tile: the online-softmax update. Tiles of BLOCK_N keys, not one page: the
    fp32 rescale of the [rows, Dv] accumulator and the exp run once per BLOCK_N keys (one 16-key
    page per step left the first form far below a bf16 GEMM's rate)."""
    kpos = k0 + j
    tmask = kpos <= last
    blk = tl.load(bt_row_ptr + kpos // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
    off = kpos % BLOCK_SIZE
    # K/V tiles in the operand dtype, fp8 scales outside the dots where the math allows (as the
    # decode kernel: per-tensor ones in qk_scale / the output, one per token and head on columns)
    k = _gqa_load_operand(k_ptr, ks_ptr, blk[:, None], off, tmask, h, d, s_kb, s_kt, s_kh, ss_kb, ss_kt, ss_kh,
                          D, SCALE_KIND, GROUP_K, BF16_DOT, False)   # prefill: bf16 operands (f16 not measured)
    s = _mma(q, tl.trans(k), BF16_DOT) * qk_scale                         # [rows, BLOCK_N]
    if (SCALE_KIND == 2) & (GROUP_K == D):
        s = s * tl.load(ks_ptr + blk * ss_kb + off * ss_kt + h * ss_kh, mask=tmask, other=0.0)[None, :]
    vis = kpos[None, :] <= qpos[:, None]
    if WINDOW > 0:
        vis = vis & (kpos[None, :] > qpos[:, None] - WINDOW)
    s = tl.where(vis, s, float("-inf"))
    if SLACK > 0:                           # lazy (attention_triton._lazy_rescale): chunked prompts still
        m_new, l_i, acc = _lazy_rescale(m_i, l_i, acc, tl.max(s, axis=1), SLACK, False)  # sum the same
    else:                                   # eager: rescale at every tile (by 1 where the max stays)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # a row that has seen no visible key yet (window, padding rows) keeps m = -inf: shift by 0
    # instead, so exp gives 0 rather than NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)                # eager only (lazy rescaled above)
    p = tl.exp(s - m_safe[:, None])
    v = _gqa_load_operand(v_ptr, vs_ptr, blk[:, None], off, tmask, h, dv, s_vb, s_vt, s_vh, ss_vb, ss_vt, ss_vh,
                          DV, SCALE_KIND, GROUP_V, BF16_DOT, False)
    if SLACK > 0:
        l_i = l_i + tl.sum(p, axis=1)
    else:
        l_i = l_i * alpha + tl.sum(p, axis=1)
    if (SCALE_KIND == 2) & (GROUP_V == DV):
        p = p * tl.load(vs_ptr + blk * ss_vb + off * ss_vt + h * ss_vh, mask=tmask, other=0.0)[None, :]
    if SLACK > 0:
        acc = acc + _mma(p.to(v.dtype), v, BF16_DOT)
    else:
        acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, BF16_DOT)
    return m_new, l_i, acc


@triton.jit
def _gqa_prefill_kernel(
        q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, cu_ptr, lens_ptr, out_ptr, s2_ptr,
        s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh,
        ss_kb, ss_kt, ss_kh, ss_vb, ss_vt, ss_vh, s_btb, s_ot, s_oh, scale,
        G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr,
        D: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
        SCALE_KIND: tl.constexpr, GROUP_K: tl.constexpr, GROUP_V: tl.constexpr, INTERPRET: tl.constexpr,
        BF16_DOT: tl.constexpr, SLACK: tl.constexpr = RESCALE_SLACK, sinks_ptr=None, HAS_SINKS: tl.constexpr = False):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mt = tl.program_id(2)
    q_lo = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_lo
    n = tl.load(lens_ptr + b)
    ctx = n - q_len                                   # tokens cached before this step's queries
    t0 = mt * BLOCK_M                                 # first query token (within the sequence's q) of the tile
    if t0 < q_len:
        r = tl.arange(0, BLOCK_M * BLOCK_G)
        t = t0 + r // BLOCK_G                         # query token index within this sequence's rows
        g = r % BLOCK_G
        rmask = (t < q_len) & (g < G)
        qpos = ctx + t                                # its position in the sequence
        d = tl.arange(0, BLOCK_D)
        dv = tl.arange(0, BLOCK_DV)
        j = tl.arange(0, BLOCK_N)
        qh = h * G + g
        q_row = (q_lo + t).to(tl.int64)
        q = tl.load(q_ptr + q_row[:, None] * s_qt + qh[:, None] * s_qh + d[None, :],
                    mask=rmask[:, None] & (d[None, :] < D), other=0.0).to(tl.bfloat16 if BF16_DOT else tl.float32)
        qk_scale = scale
        if SCALE_KIND == 1:
            qk_scale = scale * tl.load(ks_ptr)
        if SCALE_KIND == 3:                       # nvfp4: K's scale_2, outside the dots
            qk_scale = scale * tl.load(s2_ptr)

        m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_DV], tl.float32)
        last = tl.minimum(ctx + t0 + BLOCK_M, n) - 1  # the tile's last query position = its last key
        lo_key = 0
        if WINDOW > 0:
            lo_key = tl.maximum(ctx + t0 - WINDOW + 1, 0)   # first key the tile's first query sees
        # key tiles at multiples of BLOCK_N from position 0, whatever the chunking: a row skips
        # wholly masked tiles exactly (alpha = 1, p = 0), so a chunked prompt computes the same sums
        lo_tile = (lo_key // BLOCK_N) * BLOCK_N
        if INTERPRET:
            # TRITON_INTERPRET=1 (triton 3.6, numpy 2.4) holds a loaded scalar as a shape-[1] array,
            # and range() bounds made from it fail int() ("only 0-dimensional arrays can be
            # converted to Python scalars"); a while loop runs the same pages. Compiled builds use
            # range(): the while form compiles for sm_90 with 32 registers and a 5 kB spill stack.
            k0 = lo_tile
            while k0 <= last:
                m_i, l_i, acc = _prefill_tile(
                    q, m_i, l_i, acc, k0, qpos, last, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr + b * s_btb, h, d, dv,
                    j, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, ss_kb, ss_kt, ss_kh, ss_vb, ss_vt, ss_vh, qk_scale,
                    D, DV, BLOCK_SIZE, WINDOW, SCALE_KIND, GROUP_K, GROUP_V, BF16_DOT, SLACK)
                k0 += BLOCK_N
        else:
            for k0 in range(lo_tile, last + 1, BLOCK_N):
                m_i, l_i, acc = _prefill_tile(
                    q, m_i, l_i, acc, k0, qpos, last, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr + b * s_btb, h, d, dv,
                    j, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, ss_kb, ss_kt, ss_kh, ss_vb, ss_vt, ss_vh, qk_scale,
                    D, DV, BLOCK_SIZE, WINDOW, SCALE_KIND, GROUP_K, GROUP_V, BF16_DOT, SLACK)
        if SCALE_KIND == 1:                       # V's per-tensor scale, folded out of P @ V
            acc = acc * tl.load(vs_ptr)
        if SCALE_KIND == 3:                       # nvfp4: V's scale_2
            acc = acc * tl.load(s2_ptr + 1)
        if HAS_SINKS:   # gpt-oss: the head's sink logit in the denominator (acc and l_i are against m_i)
            sink = tl.load(sinks_ptr + qh, mask=rmask, other=0.0).to(tl.float32)
            l_i = l_i + tl.exp(sink - tl.where(m_i == float("-inf"), 0.0, m_i))
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + q_row[:, None] * s_ot + qh[:, None] * s_oh + dv[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & (dv[None, :] < DV))


def paged_prefill_gqa(q: torch.Tensor, cache: GQALayerKV, block_tables: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                      sliding_window: int | None = None, *, max_seqlen_q: int | None = None,
                      block_m: int | None = None, out: torch.Tensor | None = None,
                      rescale_slack: float | None = None, block_n: int | None = None,
                      num_warps: int | None = None, num_stages: int | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """As attention_reference.paged_prefill_gqa: q [Tq, Hq, D] -> [Tq, Hq, Dv] in q.dtype (sinks
    [Hq]: gpt-oss's, in each row's denominator at the end).
    max_seqlen_q: an upper bound on any sequence's query count (grid size; computed from
    cu_seqlens_q with a host sync when None). block_m: query tokens per program (a power of two;
    default: prefill_launch's rows of (token, head) per program, at least one token). out:
    optional [Tq, Hq, Dv] tensor to write into. rescale_slack: attention_triton.RESCALE_SLACK
    unless given (0: the eager online softmax). block_n (keys a step, default PREFILL_BLOCK_N),
    num_warps, num_stages (default prefill_launch's): the launch (block_n and num_warps change
    the last bits)."""
    q = q.contiguous()
    tq, hq, d = q.shape
    nb, bs, hkv, _ = cache.k.shape
    dv = cache.v_head_dim
    if hq % hkv:
        raise ConfigError(f"paged prefill: {hq} query heads are not a multiple of {hkv} kv heads")
    if bs < 16 or bs & (bs - 1):
        raise ConfigError(f"paged prefill (triton): block_size must be a power of two >= 16, got {bs}")
    g = hq // hkv
    block_g = triton.next_power_of_2(g)
    # nvfp4 decodes every element in registers, as block-scaled fp8 applies its scales: its launch
    # (not timed for nvfp4)
    rows, warps, stages = prefill_launch(cache.fmt.block_scaled or cache.fmt.is_nvfp4, max(d, dv), not _bf16_dots(q))
    if block_m is None:
        block_m = max(1, rows // block_g)
    if block_m < 1 or block_m & (block_m - 1):
        raise ConfigError(f"paged prefill (triton): block_m must be a power of two, got {block_m}")
    block_m = max(block_m, 16 // block_g if block_g < 16 else 1)     # tl.dot needs >= 16 rows
    out = torch.empty(tq, hq, dv, dtype=q.dtype, device=q.device) if out is None else out
    b = block_tables.shape[0]
    if tq == 0 or b == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_seqlen_q <= 0:
        return out.zero_()
    fmt = cache.fmt
    kind = scale_kind(fmt)
    ks = cache.k_scale if cache.k_scale is not None else out     # any pointer; never read
    vs = cache.v_scale if cache.v_scale is not None else out
    s2 = cache.scale_2 if cache.scale_2 is not None else out     # nvfp4's scale_2; else never read
    sk = ks.stride() if kind in (_SCALE_BLOCK, _SCALE_NVFP4) else (0, 0, 0)
    sv = vs.stride() if kind in (_SCALE_BLOCK, _SCALE_NVFP4) else (0, 0, 0)
    _gqa_prefill_kernel[(b, hkv, triton.cdiv(max_seqlen_q, block_m))](
        q, cache.k, cache.v, ks, vs, block_tables, cu_seqlens_q, seq_lens, out, s2,
        q.stride(0), q.stride(1), *cache.k.stride()[:3], *cache.v.stride()[:3],
        *sk[:3], *sv[:3], block_tables.stride(0), out.stride(0), out.stride(1), float(scale),
        G=g, BLOCK_G=block_g, BLOCK_M=block_m, D=d, BLOCK_D=_pow2(d), DV=dv, BLOCK_DV=_pow2(dv),
        BLOCK_SIZE=bs, BLOCK_N=block_n or PREFILL_BLOCK_N, WINDOW=sliding_window or 0, SCALE_KIND=kind,
        GROUP_K=min(fmt.group, d), GROUP_V=min(fmt.group, dv), INTERPRET=_INTERPRET, BF16_DOT=_bf16_dots(q),
        SLACK=_slack(rescale_slack), num_warps=num_warps or warps,
        sinks_ptr=sinks.contiguous() if sinks is not None else out, HAS_SINKS=sinks is not None,
        **({"num_stages": num_stages or stages} if num_stages or stages else {}))
    return out
