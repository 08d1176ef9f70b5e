"""Triton paged attention kernels; signatures equal attention_reference's. Importing this module
needs triton (an optional dependency: moet.kernels never imports it on its own).

paged_decode_gqa: split-K ("flash-decoding") over the pages of each sequence.
  Stage 1, grid (B, Hkv, splits): one program = one sequence, one KV head with all its G query
  heads (K/V read once per group), one split of its pages. Online softmax in fp32; writes its
  unnormalised partial output, running max and sum to a workspace.
  Stage 2, grid (B, Hq): merges the splits (log-sum-exp rescale), all of one (sequence, head)'s
  splits loaded at once as [BLOCK_S] / [BLOCK_S, Dv] tiles and reduced with tl.max / tl.sum
  (_merge_head). It was two loops over the splits of dependent scalar loads, one global round
  trip per split and pass, from only B * Hq programs, which made the merge a large share of a
  long-context batch-1 call (docs/kernels.md, attention). No atomics and a
  reduction fixed by constexpr shapes, so the result is bit-identical run to run and
  batch-invariant (SPEC 3); it may differ in the last bits between two split settings, which is
  why they are explicit arguments.
How a sequence is split depends on its length alone (_split_pages): splits of split_tokens
(whole pages), fewer and longer ones when that would exceed max_splits. The grid's split axis is
min(max_splits, table width / split) -- no host sync, one launch shape for CUDA graphs; programs
past a sequence's last split write nothing and the merge reads only its used splits. So the
partials stay bounded (B * heads * max_splits) with a table padded to max_model_len, and a
sequence's output does not depend on the table's width or on the rest of the batch.
  Under PDL (EngineConfig.kernels.small_kernel_pdl) each split program first reads its length and block
  table and prefetches its first step's K / V rows into L2, then waits for the kernel before
  (_gqa_prefetch): the first step's chain of dependent DRAM reads, a visible part of a batch-1
  long-context call (docs/kernels.md, attention), overlaps that kernel; only where the grid fits
  the SMs.
  The page loop is software-pipelined by Triton: at num_stages >= 3 the next steps' K/V tiles are
  cp.async'ed into shared memory (one buffer at 3-4 stages, two at 5, three at 7). num_warps and
  num_stages come from a table keyed by device, KV format and shape (kernels/attention_configs.py;
  the stages may follow the batch size since they change no bits, the warps may not).

paged_decode_mla (the same split-K over MLA's latent rows) is in mla_decode_triton.py; it shares
this module's split partition, merge kernel and dot helpers.

Status: correct under TRITON_INTERPRET=1 at small shapes (tests/kernels); compiles for sm_90.
The MLA decode is not the first form: one with 16 heads per program, page-sized tiles and
per-element scale gathers reached only a small fraction of copy bandwidth (docs/kernels.md,
MLA decode).
Dot operands (`_mma`, all four kernels): fp32 queries -> fp32 operands with
input_precision="ieee" (FFMA; equal to the fp32 reference, what the exactness tests use); bf16
queries (serving) -> bf16 operands on the tensor cores with fp32 accumulation, P cast to bf16
for P@V as FlashAttention does. The decode kernels convert the queries once and the K/V tiles
once per tile. Why not fp32 everywhere: absorbed MLA does ~2 * (576 + 512) FLOPs per head per
cached token, ~240 FLOP per bf16 KV byte at 128 heads (~420 per fp8_ds_mla byte), far above
what FFMA sustains per byte of HBM bandwidth (~14 on an H200). Even bf16 tensor cores (~990
dense TFLOP/s) cap a 128-head absorbed decode near 4 TB/s of bf16 latent and 2.3 TB/s of
fp8_ds_mla: MLA decode at 128 heads is compute-bound, its useful figure is TFLOP/s.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from moet.errors import ConfigError
from moet.kernels.attention_configs import DEFAULT_GQA_DECODE, GQALaunch, gqa_shape_key, lookup_gqa_decode
from moet.kernels.grid_sync import COUNTERS, acquired, device_counters, signal
from moet.kernels.kv_cache import GQALayerKV
from moet.kernels.launch_tables import device_capability, sm_count
from moet.kernels.launch_tables import device_name as _device_name
from moet.kernels.pdl import pdl_enter, pdl_launch, prefetch_l2

_SCALE_NONE, _SCALE_TENSOR, _SCALE_BLOCK, _SCALE_NVFP4 = 0, 1, 2, 3


def scale_kind(fmt) -> int:
    """The kernels' SCALE_KIND of a KVFormat: 0 plain, 1 fp8 per tensor, 2 fp8 per group, 3 nvfp4."""
    if fmt.is_nvfp4:
        return _SCALE_NVFP4
    return _SCALE_BLOCK if fmt.block_scaled else _SCALE_TENSOR if fmt.is_fp8 else _SCALE_NONE


# TRITON_INTERPRET=1 (triton 3.6) multiplies bf16 tiles as their uint16 bit patterns in tl.dot;
# there the bf16 dot is emulated (operands rounded to bf16, fp32 dot), so interpreter tests check
# everything around it and the GPU tests check the tensor-core dot itself
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"    # read at import, as triton does
_EMULATE_BF16_DOT = tl.constexpr(_INTERPRET)
# Upper bound on the splits of one sequence (its split length grows past split_tokens beyond
# that): bounds the fp32 partials, B * heads * MAX_SPLITS * (Dv + 2), whatever the table width.
DEFAULT_MAX_SPLITS = 32
# GQA: with one 16-token page per loop step, 32 splits x 4 KV heads (128 programs of 4 warps on
# 132 SMs) could not keep loads in flight and 128 splits won. With 64-token steps (GQA_TILE_TOKENS)
# fewer, longer splits pipeline better: 32 splits of 256 tokens beat 128 at batch 1 and at batch
# 32 on the H200 (docs/kernels.md, attention).
GQA_DEFAULT_MAX_SPLITS = 32
# GQA decode keys per loop step (whole pages): see _gqa_decode_tile
GQA_TILE_TOKENS = 64
# GQA decode's long partition (paged_decode_gqa(long_splits), _split_pages' LONG_SPLITS; its LONG_TOKENS
# 1,024): a sequence past GQA_DEFAULT_MAX_SPLITS splits of 1,024 tokens (32K) gets up to long_splits
# splits of 1,024 tokens before its splits grow again, so the partition of any sequence up to 32K is
# as without it. Off by default (0). On the H200 it sped up batch 1 past 32K, but slowed batch 8 at
# 64K and batch 1 at 32K (where the partition is the same): the grid's empty programs waited for the
# kernel before, and the chunked merge's loads waited for the length. Both are since changed
# (SKIP_EMPTY; the merge folds later chunks in) and not yet timed on a GPU, so the default stays off
# (docs/kernels.md, attention)
GQA_LONG_SPLITS = 0
# GQA decode under PDL: loop steps of each split prefetched into L2 before the PDL wait (_gqa_prefetch),
# by default only where the whole grid fits on the GPU at once (one program an SM), so that every
# program's prefetch runs while the kernel before still does. One step is the default because on
# the H200 it was the fastest prefetch depth at batch 1 (two and four steps were slower), while
# batch 8 and 32 (grids of several waves, whose later waves prefetch what they are about to load
# anyway) only lost by it (docs/kernels.md, attention)
GQA_PREFETCH_STEPS = 1
# GQA decode launch: attention_configs (num_warps per device / format / shape, num_stages also per
# batch size; Triton's 4 warps and 3 stages where the table has no entry). sm_90 SASS at
# Qwen3-30B-A3B shapes (python -m tests.kernels.aot_compile --gqa-sass): num_stages 3 and 4
# cp.async the next step's K/V into a single shared buffer, issued after the current step's MMAs
# and waited for (DEPBAR.LE SB0, 0x0) at the top of the next step: no load is in flight during
# the math. num_stages 5 double-buffers it (one step in flight, DEPBAR.LE 0x3), 7 triple-buffers
# it. On the H200 at 32K, 7 stages won batch 1 bf16, 5 stages the fp8 cache, 3 stayed best at batch
# 32 bf16, and 8 warps at 3 stages lost on all four, hence a table rather than one launch. (A
# register-prefetch loop form, the next 1-2 steps' K/V loaded into registers before the current
# step's math, lost on every setting and was removed; docs/kernels.md, attention.)
# lazy online-softmax rescaling (the MLA decode and prefill, the GQA prefill; FlashAttention-4's
# conditional rescale): > 0 = the nats a tile's max may exceed a row's running max before the row's
# accumulator is rescaled, so most tiles skip the rescale (sm_90 AOT: the MLA decode step compiles to
# markedly fewer instructions); 0 = the eager form, rescaled at every tile. Timed on the H200
# (docs/kernels.md, attention): lazy (slack 8) won only in the MLA decode over a bf16 cache, by a little
# at every batch; it lost over an fp8-block cache (the dequantising step, not the rescale, is that
# loop's cost) and in the GQA prefill, and tied in the MLA prefill. So the launchers default to
# RESCALE_SLACK (eager) except the transposed bf16 MLA decode (MLA_DECODE_BF16_SLACK; only where
# mla_decode_form takes the transposed tile: the heads-as-M tile spills with it and was slower lazy);
# rescale_slack overrides both. Like the splits it must be fixed per model (it changes the last bits),
# and it is: a function of the query dtype, the cache format and the device
RESCALE_SLACK = 0.0


@triton.jit
def _mma(a, b, BF16: tl.constexpr):
    """a @ b with fp32 accumulation of tiles already in their operand dtype: bf16 (tensor cores)
    when BF16, else fp32 ("ieee", exact). Under the interpreter the bf16 dot is emulated
    (operands exact in bf16, fp32 dot): see _EMULATE_BF16_DOT."""
    if BF16:
        if _EMULATE_BF16_DOT:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(a, b)
    else:
        return tl.dot(a, b, input_precision="ieee")


def _bf16_dots(q: torch.Tensor) -> bool:
    """Tensor-core dots for bf16 queries (serving); exact fp32 dots otherwise (tests)."""
    return q.dtype == torch.bfloat16


@triton.jit
def _load_dequant(ptr, scale_ptr, blk, tok, tmask, h, d, s_b, s_t, s_h, ss_b, ss_t, ss_h,
                  DIM: tl.constexpr, SCALE_KIND: tl.constexpr, GROUP: tl.constexpr):
    """[BLOCK_SIZE, BLOCK_D] float32 of one page's tokens for head h."""
    m = tmask[:, None] & (d[None, :] < DIM)
    x = tl.load(ptr + blk * s_b + tok[:, None] * s_t + h * s_h + d[None, :], mask=m, other=0.0).to(tl.float32)
    if SCALE_KIND == 1:
        x = x * tl.load(scale_ptr)
    if SCALE_KIND == 2:
        s = tl.load(scale_ptr + blk * ss_b + tok[:, None] * ss_t + h * ss_h + d[None, :] // GROUP, mask=m, other=0.0)
        x = x * s
    return x


@triton.jit
def _split_pages(n, PAGES_MIN, MAX_SPLITS: tl.constexpr, BLOCK_SIZE: tl.constexpr, LONG_SPLITS: tl.constexpr = 0,
                 LONG_TOKENS: tl.constexpr = 1024):
    """(pages of the sequence, pages per split, splits used) for a sequence of n tokens: splits of
    PAGES_MIN pages, longer when that would need more than MAX_SPLITS. LONG_SPLITS (> MAX_SPLITS; 0 =
    none): a split stops growing at LONG_TOKENS and the splits multiply instead, up to LONG_SPLITS,
    and only then grow again -- so a sequence short enough for MAX_SPLITS splits of at most
    LONG_TOKENS is split as without it (the same bits), and a long one gets more programs. A function
    of n alone, so a sequence is split the same way whatever else is in the batch and however wide
    the table."""
    n_pages = (n + BLOCK_SIZE - 1) // BLOCK_SIZE
    pps = tl.maximum((n_pages + MAX_SPLITS - 1) // MAX_SPLITS, PAGES_MIN)
    if LONG_SPLITS > 0:
        LONG_PAGES: tl.constexpr = max(1, LONG_TOKENS // BLOCK_SIZE)
        pps = tl.maximum(tl.maximum(tl.minimum((n_pages + MAX_SPLITS - 1) // MAX_SPLITS, LONG_PAGES), PAGES_MIN),
                         (n_pages + LONG_SPLITS - 1) // LONG_SPLITS)
    return n_pages, pps, (n_pages + pps - 1) // pps


@triton.jit
def _e2m1_f32(code):
    """int32 e2m1 codes (0..15) -> their fp32 values, exact, built on the bits: magnitude index
    1 is 0.5, index 2e + m (e >= 1) is 2^(e-1) * (1 + m / 2); bit 3 the sign."""
    mag = code & 7
    e = mag >> 1
    bits = tl.where(mag == 0, 0, tl.where(e == 0, 126 << 23, ((e + 126) << 23) | ((mag & 1) << 22)))
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _nvfp4_tile(ptr, sc_ptr, row, srow, rmask, N: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr,
                JOIN: tl.constexpr = False):
    """[N, BLOCK] fp32 of N nvfp4 rows of DIM elements (DIM % 16 == 0, BLOCK = a power of two >= DIM):
    row / srow [N, 1] are each row's offsets of its code bytes (ptr) and e4m3 block scales (sc_ptr),
    rmask [N, 1] the rows to read (others and columns past DIM give 0). Decoded in registers; e2m1 x
    e4m3 is exact in fp32, and in bf16 (at most 5 significant bits); the layer's scale_2 is folded
    in by the caller. Two forms:
      JOIN   each code byte loaded once, its two nibbles joined into elements 2i, 2i + 1 (tl.join +
             tl.reshape), the [N, BLOCK / 16] scales broadcast by a reshape: vector loads. Compiled
             on Hopper (Triton 3.6), a tile built this way and fed to a bf16 tensor-core dot as its
             shared-memory operand gave wrong scores (the GQA prefill's K / V, the heads-as-M MLA
             decode's latent: tests/kernels/test_kv_nvfp4.py on the GPU), so only the GQA split-K
             decode, where it was right and faster, takes it.
      else   element d is nibble d % 2 of byte d // 2 times scale d // 16: each byte is read by its
             2 elements and each scale by its 16 (the repeats hit L1), byte-wide loads."""
    if JOIN:
        c = tl.arange(0, BLOCK // 2)
        byte = tl.load(ptr + row + c[None, :], mask=rmask & (c[None, :] < DIM // 2), other=0).to(tl.int32)
        x = tl.reshape(tl.join(_e2m1_f32(byte & 15), _e2m1_f32(byte >> 4)), [N, BLOCK])
        gi = tl.arange(0, BLOCK // 16)
        sc = tl.load(sc_ptr + srow + gi[None, :], mask=rmask & (gi[None, :] < DIM // 16), other=0.0).to(tl.float32)
        return tl.reshape(tl.reshape(x, [N, BLOCK // 16, 16]) * sc[:, :, None], [N, BLOCK])
    else:
        d = tl.arange(0, BLOCK)
        m = rmask & (d[None, :] < DIM)
        byte = tl.load(ptr + row + (d // 2)[None, :], mask=m, other=0).to(tl.int32)
        code = (byte >> ((d & 1) * 4)[None, :]) & 15
        sc = tl.load(sc_ptr + srow + (d // 16)[None, :], mask=m, other=0.0).to(tl.float32)
        return _e2m1_f32(code) * sc


@triton.jit
def _gqa_load_operand(ptr, scale_ptr, blk, tok, tmask, h, d, s_b, s_t, s_h, ss_b, ss_t, ss_h,
                      DIM: tl.constexpr, SCALE_KIND: tl.constexpr, GROUP: tl.constexpr, BF16_DOT: tl.constexpr,
                      OP_F16: tl.constexpr, NVFP4_JOIN: tl.constexpr = False):
    """[BLOCK_SIZE, BLOCK_D] of one page for head h in the dot operand dtype. Stored values as
    they are (e4m3 -> bf16 is exact) except a per-group scale finer than the head, which is
    applied here per element; per-tensor and per-token-head scales are folded in by the caller.
    nvfp4: codes and block scales decoded here (_nvfp4_tile), scale_2 folded in by the caller."""
    if SCALE_KIND == 3:
        x = _nvfp4_tile(ptr + h * s_h, scale_ptr + h * ss_h, blk * s_b + tok[:, None] * s_t,
                        blk * ss_b + tok[:, None] * ss_t, tmask[:, None], tmask.shape[0], DIM, d.shape[0], NVFP4_JOIN)
    elif (SCALE_KIND == 2) & (GROUP < DIM):
        x = _load_dequant(ptr, scale_ptr, blk, tok, tmask, h, d, s_b, s_t, s_h, ss_b, ss_t, ss_h,
                          DIM, SCALE_KIND, GROUP)
    else:
        x = tl.load(ptr + blk * s_b + tok[:, None] * s_t + h * s_h + d[None, :],
                    mask=tmask[:, None] & (d[None, :] < DIM), other=0.0)
    if OP_F16:
        return x.to(tl.float16)
    elif BF16_DOT:
        return x.to(tl.bfloat16)
    else:
        return x.to(tl.float32)


@triton.jit
def _split_window(n, sp, pps, n_pages, WINDOW: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """(first key visible, first page, end page) of split sp of a sequence of n tokens: key j is
    visible iff j > (n - 1) - WINDOW (WINDOW 0: all); pages wholly before the window left out."""
    lo_tok = 0
    if WINDOW > 0:
        lo_tok = tl.maximum(n - WINDOW, 0)
    return lo_tok, tl.maximum(sp * pps, lo_tok // BLOCK_SIZE), tl.minimum(sp * pps + pps, n_pages)


@triton.jit
def _gqa_step_tokens(page0, last, n, lo_tok, b, bt_ptr, s_btb, BLOCK_SIZE: tl.constexpr, PAGES: tl.constexpr):
    """The PAGES * BLOCK_SIZE token slots of one loop step: their cache block, slot in the block,
    and whether each holds a visible key (inside the split, before n, inside the window)."""
    t = tl.arange(0, PAGES * BLOCK_SIZE)
    page = page0 + t // BLOCK_SIZE
    tok = t % BLOCK_SIZE
    inside = page < last
    blk = tl.load(bt_ptr + b * s_btb + page, mask=inside, other=0).to(tl.int64)
    pos = page * BLOCK_SIZE + tok
    return blk, tok, inside & (pos < n) & (pos >= lo_tok)


@triton.jit
def _gqa_decode_tile(q, m_i, l_i, acc, page0, last, n, lo_tok, b, h, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, d, dv,
                     s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, ss_kb, ss_kt, ss_kh, ss_vb, ss_vt, ss_vh, s_btb, qk_scale,
                     D: tl.constexpr, DV: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGES: tl.constexpr,
                     SCALE_KIND: tl.constexpr, GROUP_K: tl.constexpr, GROUP_V: tl.constexpr, BF16_DOT: tl.constexpr,
                     OP_F16: tl.constexpr, SWAP_AB: tl.constexpr = False):
    """PAGES pages (from page0, none at or past `last`) of one KV head for the G query heads: the
    online-softmax update. SWAP_AB: the same update transposed -- q is q^T [BLOCK_D, BLOCK_G], acc is
    acc^T [BLOCK_DV, BLOCK_G], scores [tokens, heads] = K q^T and acc^T += V^T P^T -- so the tokens
    (64 a step) are the MMAs' M and the K / V tiles their shared-memory A operand (Hopper wgmma
    needs M >= 64; the G <= 16 heads are N). Several pages per step give each load and dot enough
    tokens to keep the memory system busy (one 16-token page per step read well under half of copy
    bandwidth at batch 1, long context).
    The caller's page range holds keys (no branch here: a branch in the loop body would stop
    Triton from pipelining the loads across steps). fp8 scales stay out of the dots: per-tensor
    ones are in qk_scale (K) and applied to the output by the caller (V); one scale per token and
    head (group = head dim) multiplies the score columns (K) and P's columns (V)."""
    blk, tok, tmask = _gqa_step_tokens(page0, last, n, lo_tok, b, bt_ptr, s_btb, BLOCK_SIZE, PAGES)
    k = _gqa_load_operand(k_ptr, ks_ptr, blk[:, None], tok, tmask, h, d, s_kb, s_kt, s_kh, ss_kb, ss_kt, ss_kh,
                          D, SCALE_KIND, GROUP_K, BF16_DOT, OP_F16, True)
    if SWAP_AB:     # (not an early return: Triton's frontend rejects a return inside an if)
        m_i, l_i, acc = _gqa_decode_tile_t(q, m_i, l_i, acc, k, blk, tok, tmask, h, v_ptr, ks_ptr, vs_ptr, dv,
                                           s_vb, s_vt, s_vh, ss_kb, ss_kt, ss_kh, ss_vb, ss_vt, ss_vh, qk_scale,
                                           D, DV, SCALE_KIND, GROUP_K, GROUP_V, BF16_DOT, OP_F16)
    else:
        s = _mma(q, tl.trans(k), BF16_DOT) * qk_scale                          # [BLOCK_G, PAGES * BLOCK_SIZE]
        if (SCALE_KIND == 2) & (GROUP_K == D):
            s = s * tl.load(ks_ptr + blk * ss_kb + tok * ss_kt + h * ss_kh, mask=tmask, other=0.0)[None, :]
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        v = _gqa_load_operand(v_ptr, vs_ptr, blk[:, None], tok, tmask, h, dv, s_vb, s_vt, s_vh, ss_vb, ss_vt, ss_vh,
                              DV, SCALE_KIND, GROUP_V, BF16_DOT, OP_F16, True)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if (SCALE_KIND == 2) & (GROUP_V == DV):
            pv = p * tl.load(vs_ptr + blk * ss_vb + tok * ss_vt + h * ss_vh, mask=tmask, other=0.0)[None, :]
        else:
            pv = p
        acc = acc * alpha[:, None] + _mma(pv.to(v.dtype), v, BF16_DOT)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _gqa_decode_tile_t(q_t, m_i, l_i, acc_t, k, blk, tok, tmask, h, v_ptr, ks_ptr, vs_ptr, dv,
                       s_vb, s_vt, s_vh, ss_kb, ss_kt, ss_kh, ss_vb, ss_vt, ss_vh, qk_scale,
                       D: tl.constexpr, DV: tl.constexpr, SCALE_KIND: tl.constexpr, GROUP_K: tl.constexpr,
                       GROUP_V: tl.constexpr, BF16_DOT: tl.constexpr, OP_F16: tl.constexpr):
    """_gqa_decode_tile's update transposed (SWAP_AB): the same products and reductions, over
    axis 0 (tokens) instead of 1."""
    s = _mma(k, q_t, BF16_DOT) * qk_scale                                  # [PAGES * BLOCK_SIZE, BLOCK_G]
    if (SCALE_KIND == 2) & (GROUP_K == D):
        s = s * tl.load(ks_ptr + blk * ss_kb + tok * ss_kt + h * ss_kh, mask=tmask, other=0.0)[:, None]
    s = tl.where(tmask[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[None, :])
    v = _gqa_load_operand(v_ptr, vs_ptr, blk[:, None], tok, tmask, h, dv, s_vb, s_vt, s_vh, ss_vb, ss_vt, ss_vh,
                          DV, SCALE_KIND, GROUP_V, BF16_DOT, OP_F16, True)
    l_i = l_i * alpha + tl.sum(p, axis=0)
    if (SCALE_KIND == 2) & (GROUP_V == DV):
        pv = p * tl.load(vs_ptr + blk * ss_vb + tok * ss_vt + h * ss_vh, mask=tmask, other=0.0)[:, None]
    else:
        pv = p
    acc_t = acc_t * alpha[None, :] + _mma(tl.trans(v), pv.to(v.dtype), BF16_DOT)
    return m_new, l_i, acc_t


# e4m3 words: 4 cache bytes as one int32 (byte p = element 4i + p) -> 4 f16, two cvt.rn.f16x2.e4m3x2
_E4M3X4_F16_ASM = tl.constexpr("{\n.reg .b16 lo, hi;\n.reg .b32 a, b;\nmov.b32 {lo, hi}, $4;\n"
                               "cvt.rn.f16x2.e4m3x2 a, lo;\ncvt.rn.f16x2.e4m3x2 b, hi;\n"
                               "mov.b32 {$0, $1}, a;\nmov.b32 {$2, $3}, b;\n}")


@triton.jit
def _e4m3_words_f16(wd, ASM: tl.constexpr):
    """int32 words of 4 e4m3 bytes -> f16 tiles of bytes 0, 1, 2, 3 (exact). ASM: the GPU's paired
    conversion; else Triton's per-byte one (the interpreter)."""
    if ASM:
        b0, b1, b2, b3 = tl.inline_asm_elementwise(_E4M3X4_F16_ASM, "=h,=h,=h,=h,r", [wd], dtype=(tl.float16,) * 4,
                                                   is_pure=True, pack=1)
    else:
        b0 = (wd & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        b1 = ((wd >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        b2 = ((wd >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        b3 = ((wd >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return b0, b1, b2, b3


@triton.jit
def _dot_acc(a, b, acc):
    """acc + a @ b on f16 operands (fp32 dot under the interpreter, as _mma)."""
    if _EMULATE_BF16_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _gqa_f8w_tile(q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, page0, last, n, lo_tok, b, h, kw_ptr, vw_ptr,
                  ks_ptr, vs_ptr, bt_ptr, w, wv, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, ss_kb, ss_kt, ss_kh,
                  ss_vb, ss_vt, ss_vh, s_btb, qk_scale, BLOCK_SIZE: tl.constexpr, PAGES: tl.constexpr,
                  SCALE_KIND: tl.constexpr, ASM: tl.constexpr):
    """_gqa_decode_tile over an fp8 cache read as int32 words (F8_WORDS): element 4i + p of a row is
    byte p of word i, so the K / V tiles are four f16 tiles (k_p = elements 4i + p) and the dots
    run per byte slot -- q_p @ k_p^T summed for the scores, P @ v_p into acc_p -- with no
    reshape: a word tile goes through shared memory as 32-bit words instead of single bytes
    (sm_90 SASS of the byte tile: 64 LDS.U8 and ~160 register moves a step)."""
    blk, tok, tmask = _gqa_step_tokens(page0, last, n, lo_tok, b, bt_ptr, s_btb, BLOCK_SIZE, PAGES)
    kwd = tl.load(kw_ptr + blk[:, None] * s_kb + tok[:, None] * s_kt + h * s_kh + w[None, :],
                  mask=tmask[:, None], other=0)
    k0, k1, k2, k3 = _e4m3_words_f16(kwd, ASM)
    s = tl.zeros([q0.shape[0], PAGES * BLOCK_SIZE], tl.float32)
    s = _dot_acc(q0, tl.trans(k0), s)
    s = _dot_acc(q1, tl.trans(k1), s)
    s = _dot_acc(q2, tl.trans(k2), s)
    s = _dot_acc(q3, tl.trans(k3), s) * qk_scale
    if SCALE_KIND == 2:                            # one scale per token and head (group = head dim)
        s = s * tl.load(ks_ptr + blk * ss_kb + tok * ss_kt + h * ss_kh, mask=tmask, other=0.0)[None, :]
    s = tl.where(tmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    vwd = tl.load(vw_ptr + blk[:, None] * s_vb + tok[:, None] * s_vt + h * s_vh + wv[None, :],
                  mask=tmask[:, None], other=0)
    v0, v1, v2, v3 = _e4m3_words_f16(vwd, ASM)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if SCALE_KIND == 2:
        p = p * tl.load(vs_ptr + blk * ss_vb + tok * ss_vt + h * ss_vh, mask=tmask, other=0.0)[None, :]
    p16 = p.to(tl.float16)
    a0 = _dot_acc(p16, v0, a0 * alpha[:, None])
    a1 = _dot_acc(p16, v1, a1 * alpha[:, None])
    a2 = _dot_acc(p16, v2, a2 * alpha[:, None])
    a3 = _dot_acc(p16, v3, a3 * alpha[:, None])
    return m_new, l_i, a0, a1, a2, a3


@triton.jit
def _gqa_f8w_split(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, acc_ptr, m_ptr, l_ptr, b, h, sp, n, first, last,
                   lo_tok, row, g, qh, s_qb, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh,
                   ss_kb, ss_kt, ss_kh, ss_vb, ss_vt, ss_vh, s_btb, qk_scale,
                   G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, PAGES: tl.constexpr, SCALE_KIND: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """One split of the GQA decode over an fp8 cache in words (see _gqa_f8w_tile): the cache
    strides are in 4-byte words; D and DV powers of two; writes m, l and acc like the split kernel."""
    w = tl.arange(0, D // 4)
    wv = tl.arange(0, DV // 4)
    gm = g[:, None] < G
    qb = q_ptr + b * s_qb + qh[:, None] * s_qh + 4 * w[None, :]
    q0 = tl.load(qb, mask=gm, other=0.0).to(tl.float16)
    q1 = tl.load(qb + 1, mask=gm, other=0.0).to(tl.float16)
    q2 = tl.load(qb + 2, mask=gm, other=0.0).to(tl.float16)
    q3 = tl.load(qb + 3, mask=gm, other=0.0).to(tl.float16)
    kw_ptr = k_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    vw_ptr = v_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    a0 = tl.zeros([BLOCK_G, DV // 4], tl.float32)
    a1 = tl.zeros([BLOCK_G, DV // 4], tl.float32)
    a2 = tl.zeros([BLOCK_G, DV // 4], tl.float32)
    a3 = tl.zeros([BLOCK_G, DV // 4], tl.float32)
    if INTERPRET:
        page = first
        while page < last:
            m_i, l_i, a0, a1, a2, a3 = _gqa_f8w_tile(
                q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, page, last, n, lo_tok, b, h, kw_ptr, vw_ptr, ks_ptr, vs_ptr,
                bt_ptr, w, wv, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, ss_kb, ss_kt, ss_kh, ss_vb, ss_vt, ss_vh, s_btb,
                qk_scale, BLOCK_SIZE, PAGES, SCALE_KIND, False)
            page += PAGES
    else:
        for page in range(first, last, PAGES):
            m_i, l_i, a0, a1, a2, a3 = _gqa_f8w_tile(
                q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, page, last, n, lo_tok, b, h, kw_ptr, vw_ptr, ks_ptr, vs_ptr,
                bt_ptr, w, wv, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, ss_kb, ss_kt, ss_kh, ss_vb, ss_vt, ss_vh, s_btb,
                qk_scale, BLOCK_SIZE, PAGES, SCALE_KIND, True)
    if SCALE_KIND == 1:                           # V's per-tensor scale, folded out of P @ V
        vsc = tl.load(vs_ptr)
        a0 = a0 * vsc
        a1 = a1 * vsc
        a2 = a2 * vsc
        a3 = a3 * vsc
    gmask = g < G
    tl.store(m_ptr + row, m_i, mask=gmask)
    tl.store(l_ptr + row, l_i, mask=gmask)
    ab = acc_ptr + row[:, None] * DV + 4 * wv[None, :]
    tl.store(ab, a0, mask=gmask[:, None])
    tl.store(ab + 1, a1, mask=gmask[:, None])
    tl.store(ab + 2, a2, mask=gmask[:, None])
    tl.store(ab + 3, a3, mask=gmask[:, None])


@triton.jit
def _gqa_prefetch(k_ptr, v_ptr, bt_ptr, lens_ptr, b, h, sp, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_btb, pages_min,
                  D: tl.constexpr, DV: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGES: tl.constexpr,
                  MAX_SPLITS: tl.constexpr, WINDOW: tl.constexpr, STEPS: tl.constexpr, KV_BYTES: tl.constexpr,
                  F8_WORDS: tl.constexpr, LONG_SPLITS: tl.constexpr):
    """Before the PDL wait (PF_STEPS): the K and V rows of this split's first STEPS loop steps into
    L2. At batch 1 the first step is a chain of three dependent DRAM round trips -- the sequence
    length (the split's pages), the block table, the first K / V tiles -- and that chain, not the
    stream, is a visible part of a long-context call (a program's first step takes several times a
    steady-state step; docs/kernels.md, attention). Under PDL
    this kernel is resident while the kernel before it finishes, so the chain can run then. Safe:
    the lengths and tables must be final before the kernel before starts (the engine copies them
    in from the host ahead of the step's first kernel; only the prefetch addresses use them), past
    tokens' K / V long before; the newest token's row may still be in flight from the KV write,
    which an L2 prefetch cannot get wrong (no register, no L1 line is filled; the real loads come
    after the wait). The length and table are read past L1 (.cg) for the same reason. Every
    address is inside the cache: tokens past the split read block 0 (the table's `other`).
    KV_BYTES: bytes of one element of the pointers as passed (4: F8_WORDS' int32 words)."""
    n = tl.load(lens_ptr + b, cache_modifier=".cg")
    n_pages, pps, used = _split_pages(n, pages_min, MAX_SPLITS, BLOCK_SIZE, LONG_SPLITS)
    lo_tok, first, last = _split_window(n, sp, pps, n_pages, WINDOW, BLOCK_SIZE)
    t = tl.arange(0, STEPS * PAGES * BLOCK_SIZE)
    page = first + t // BLOCK_SIZE
    tok = (t % BLOCK_SIZE).to(tl.int64)
    blk = tl.load(bt_ptr + b * s_btb + page, mask=(page < last) & (sp < used), other=0,
                  cache_modifier=".cg").to(tl.int64)
    if F8_WORDS:
        kp = k_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        vp = v_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    else:
        kp = k_ptr
        vp = v_ptr
    UNIT: tl.constexpr = 128 // KV_BYTES                      # pointer elements a 128-byte line holds
    RK: tl.constexpr = D // 4 if F8_WORDS else D               # a row's elements as addressed
    RV: tl.constexpr = DV // 4 if F8_WORDS else DV
    LK: tl.constexpr = max(1, RK // UNIT)                      # whole lines of a row (the rest: a hint less)
    LV: tl.constexpr = max(1, RV // UNIT)
    ck = tl.arange(0, LK) * UNIT
    cv = tl.arange(0, LV) * UNIT
    prefetch_l2(kp + (blk * s_kb + tok * s_kt + h * s_kh)[:, None] + ck[None, :])
    prefetch_l2(vp + (blk * s_vb + tok * s_vt + h * s_vh)[:, None] + cv[None, :])


@triton.jit
def _gqa_decode_split_kernel(
        q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, acc_ptr, m_ptr, l_ptr, out_ptr, cnt_ptr, s2_ptr,
        s_qb, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh,
        ss_kb, ss_kt, ss_kh, ss_vb, ss_vt, ss_vh, s_btb, scale, pages_min, s_ob, s_oh,
        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
        DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_SIZE: tl.constexpr, MAX_SPLITS: tl.constexpr,
        WINDOW: tl.constexpr, SCALE_KIND: tl.constexpr, GROUP_K: tl.constexpr, GROUP_V: tl.constexpr,
        BF16_DOT: tl.constexpr, INTERPRET: tl.constexpr, PAGES: tl.constexpr, OP_F16: tl.constexpr,
        FUSED_MERGE: tl.constexpr, BLOCK_S: tl.constexpr, DV_TILE: tl.constexpr, PDL: tl.constexpr,
        SWAP_AB: tl.constexpr = False, F8_WORDS: tl.constexpr = False, PF_STEPS: tl.constexpr = 0,
        KV_BYTES: tl.constexpr = 2, LONG_SPLITS: tl.constexpr = 0, SKIP_EMPTY: tl.constexpr = False,
        sinks_ptr=None, HAS_SINKS: tl.constexpr = False):
    if PF_STEPS > 0:                              # PDL only: before the wait (_gqa_prefetch)
        _gqa_prefetch(k_ptr, v_ptr, bt_ptr, lens_ptr, tl.program_id(0), tl.program_id(1), tl.program_id(2),
                      s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_btb, pages_min,
                      D, DV, BLOCK_SIZE, PAGES, MAX_SPLITS, WINDOW, PF_STEPS, KV_BYTES, F8_WORDS, LONG_SPLITS)
    if SKIP_EMPTY:
        # PDL with the long partition (not with the fused merge, whose counters need every
        # program): a program past its sequence's last split writes nothing, so it leaves without
        # waiting for the kernel before -- it would hold an SM slot through that wait (the long
        # grid's empty programs at batch 1 made the call slower than without the long partition).
        # Reads the length
        # before the wait, as _gqa_prefetch does. (Not yet timed on a GPU.)
        n0 = tl.load(lens_ptr + tl.program_id(0), cache_modifier=".cg")
        if tl.program_id(2) < _split_pages(n0, pages_min, MAX_SPLITS, BLOCK_SIZE, LONG_SPLITS)[2]:
            pdl_enter(PDL)
    else:
        pdl_enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    n = tl.load(lens_ptr + b)
    n_pages, pps, used = _split_pages(n, pages_min, MAX_SPLITS, BLOCK_SIZE, LONG_SPLITS)
    if F8_WORDS:                                  # an fp8 cache read as int32 words: _gqa_f8w_split
        if sp < used:
            g = tl.arange(0, BLOCK_G)
            qh = h * G + g
            qk_scale = scale
            if SCALE_KIND == 1:
                qk_scale = scale * tl.load(ks_ptr)
            lo_tok, first, last = _split_window(n, sp, pps, n_pages, WINDOW, BLOCK_SIZE)
            row = (b * (tl.num_programs(1) * G) + qh) * tl.num_programs(2) + sp
            _gqa_f8w_split(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, acc_ptr, m_ptr, l_ptr, b, h, sp, n, first, last,
                           lo_tok, row, g, qh, s_qb, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh,
                           ss_kb, ss_kt, ss_kh, ss_vb, ss_vt, ss_vh, s_btb, qk_scale,
                           G, BLOCK_G, D, DV, BLOCK_SIZE, PAGES, SCALE_KIND, INTERPRET)
    elif sp < used:                               # other splits write nothing; merge skips them
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        dv = tl.arange(0, BLOCK_DV)
        qh = h * G + g
        # fp8 caches with tensor-core dots run in f16: e4m3 -> f16 is one exact conversion per two
        # values, e4m3 -> bf16 went through f16 and a scalar f16 -> bf16 per value (SASS, sm_90:
        # 7.5 vs 4.1 instructions per KV element), and f16 keeps more of q and P than bf16
        qd = tl.float16 if OP_F16 else tl.bfloat16 if BF16_DOT else tl.float32
        if SWAP_AB:                               # q^T and acc^T: see _gqa_decode_tile
            q = tl.load(q_ptr + b * s_qb + qh[None, :] * s_qh + d[:, None],
                        mask=(g[None, :] < G) & (d[:, None] < D), other=0.0).to(qd)
            acc = tl.zeros([BLOCK_DV, BLOCK_G], tl.float32)
        else:
            q = tl.load(q_ptr + b * s_qb + qh[:, None] * s_qh + d[None, :],
                        mask=(g[:, None] < G) & (d[None, :] < D), other=0.0).to(qd)   # operand dtype, once
            acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
        qk_scale = scale
        if SCALE_KIND == 1:
            qk_scale = scale * tl.load(ks_ptr)
        if SCALE_KIND == 3:                       # nvfp4: K's scale_2, outside the dots
            qk_scale = scale * tl.load(s2_ptr)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        lo_tok, first, last = _split_window(n, sp, pps, n_pages, WINDOW, BLOCK_SIZE)
        if INTERPRET:                             # loaded-scalar loop bounds: see prefill_triton.py
            page = first
            while page < last:
                m_i, l_i, acc = _gqa_decode_tile(
                    q, m_i, l_i, acc, page, last, n, lo_tok, b, h, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, d, dv,
                    s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, ss_kb, ss_kt, ss_kh, ss_vb, ss_vt, ss_vh, s_btb, qk_scale,
                    D, DV, BLOCK_SIZE, PAGES, SCALE_KIND, GROUP_K, GROUP_V, BF16_DOT, OP_F16, SWAP_AB)
                page += PAGES
        else:
            for page in range(first, last, PAGES):
                m_i, l_i, acc = _gqa_decode_tile(
                    q, m_i, l_i, acc, page, last, n, lo_tok, b, h, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, d, dv,
                    s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, ss_kb, ss_kt, ss_kh, ss_vb, ss_vt, ss_vh, s_btb, qk_scale,
                    D, DV, BLOCK_SIZE, PAGES, SCALE_KIND, GROUP_K, GROUP_V, BF16_DOT, OP_F16, SWAP_AB)
        if SCALE_KIND == 1:                       # V's per-tensor scale, folded out of P @ V
            acc = acc * tl.load(vs_ptr)
        if SCALE_KIND == 3:                       # nvfp4: V's scale_2
            acc = acc * tl.load(s2_ptr + 1)
        # workspace [B, Hq, S]: S from the grid, so one compiled kernel serves every table width
        row = (b * (tl.num_programs(1) * G) + qh) * tl.num_programs(2) + sp
        gmask = g < G
        tl.store(m_ptr + row, m_i, mask=gmask)
        tl.store(l_ptr + row, l_i, mask=gmask)
        if SWAP_AB:
            tl.store(acc_ptr + row[None, :] * DV + dv[:, None], acc, mask=gmask[None, :] & (dv[:, None] < DV))
        else:
            tl.store(acc_ptr + row[:, None] * DV + dv[None, :], acc, mask=gmask[:, None] & (dv[None, :] < DV))
    if FUSED_MERGE:
        # No merge launch: every program of (sequence, kv head) counts itself once its partials
        # are stored (release), and the last to arrive (acquire) merges the group's heads in the
        # merge kernel's fixed order -- whichever program that is -- then re-zeroes the counter
        c = cnt_ptr + b * tl.num_programs(1) + h
        if signal(c, not INTERPRET) == tl.num_programs(2) - 1:
            tl.atomic_xchg(c, 0, sem="relaxed")
            acquired(not INTERPRET)
            _merge_group(acc_ptr, m_ptr, l_ptr, out_ptr, s_ob, s_oh, b, h * G, tl.num_programs(1) * G,
                         tl.num_programs(2), used, G, BLOCK_G, DV, BLOCK_DV, BLOCK_S, DV_TILE, sinks_ptr, HAS_SINKS)


@triton.jit
def _merge_chunk(m_ptr, l_ptr, row0, used, rows, c0, BLOCK_S: tl.constexpr):
    """Splits c0 .. c0 + BLOCK_S - 1 of a merge: (their index, mask of the used ones, m, l), loaded
    masked by the workspace's `rows` and the unused ones set after (see _merge_head)."""
    s = c0 + tl.arange(0, BLOCK_S)
    smask = s < used
    inside = s < rows
    m = tl.where(smask, tl.load(m_ptr + row0 + s, mask=inside, other=float("-inf")), float("-inf"))
    l = tl.where(smask, tl.load(l_ptr + row0 + s, mask=inside, other=0.0), 0.0)
    return s, smask, inside, m, l


@triton.jit
def _merge_head(acc_ptr, m_ptr, l_ptr, o_ptr, row0, used, rows, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                BLOCK_S: tl.constexpr, DV_TILE: tl.constexpr, NCHUNK: tl.constexpr = 1, sink=0.0,
                HAS_SINK: tl.constexpr = False):
    """The split merge of one (sequence, query head): its `used` splits' partials (workspace rows
    row0 .. row0 + used - 1) -> o_ptr[0:DV]. All splits are loaded at once, m and l as [BLOCK_S]
    vectors and acc as [BLOCK_S, DV_TILE] tiles (DV_TILE columns at a time, so a 512-wide MLA
    row stays within registers), and reduced with tl.max / tl.sum: no chain of dependent scalar
    loads (the old `for s in range(MAX_SPLITS)` form, two passes of one global round trip per
    split, was most of the time the merge added to the split kernel at batch 1). A fixed
    reduction over constexpr shapes: the result depends on the sequence's own partials and the
    constexprs alone (deterministic, batch-invariant). _merge_group is the same arithmetic for
    the fused merge.
    The loads are masked by `rows` (the workspace's splits, a launch argument), not by `used`, and
    the splits past `used` (never written: any bits) are dropped after with tl.where, the same
    values as masked loads: so the loads need not wait for the sequence length that `used` comes
    from (one dependent round trip less, in a program whose time is round trips, not bytes).
    NCHUNK > 1 (the GQA decode's long partition, _split_pages' LONG_SPLITS; one column tile,
    BLOCK_DV == DV_TILE): up to NCHUNK * BLOCK_S splits in chunks of BLOCK_S. The first chunk is
    merged as above, then each further chunk the sequence uses is merged on its own and folded in
    by its max (log-sum-exp), so the first chunk's loads still wait for nothing and a sequence that
    uses one chunk gets the bits of NCHUNK 1.
    HAS_SINK (gpt-oss): the head's sink logit joins the softmax's denominator (exp(sink - max)),
    adding nothing to the output: the merge is the one place that sees the whole denominator."""
    s, smask, inside, m, l = _merge_chunk(m_ptr, l_ptr, row0, used, rows, 0, BLOCK_S)
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)   # an empty sequence: all splits empty
    w = tl.where(smask, tl.exp(m - m_safe), 0.0)            # log-sum-exp rescale; 0 past `used`
    l_sum = tl.sum(w * l, 0)
    if HAS_SINK:
        if NCHUNK == 1:
            l_sum = l_sum + tl.exp(sink - m_safe)
    pos = l_sum > 0                                         # l_sum == 0 (no keys): output 0, no NaN
    den = tl.where(pos, l_sum, 1.0)
    dt = tl.arange(0, DV_TILE)
    for c in tl.static_range(0, BLOCK_DV, DV_TILE):
        cols = c + dt
        cmask = cols < DV
        a = tl.where(smask[:, None], tl.load(acc_ptr + (row0 + s)[:, None] * DV + cols[None, :],
                                             mask=inside[:, None] & cmask[None, :], other=0.0), 0.0)
        total = tl.sum(w[:, None] * a, 0)
        if NCHUNK > 1:                                    # (one column tile: c == 0)
            m_run = m_safe
            l_run = l_sum
            for k in tl.static_range(1, NCHUNK):
                if used > k * BLOCK_S:
                    sk, smk, ik, mk, lk = _merge_chunk(m_ptr, l_ptr, row0, used, rows, k * BLOCK_S, BLOCK_S)
                    mk_max = tl.max(mk, 0)               # finite: chunk k holds a used split
                    wk = tl.where(smk, tl.exp(mk - mk_max), 0.0)
                    ak = tl.where(smk[:, None], tl.load(acc_ptr + (row0 + sk)[:, None] * DV + cols[None, :],
                                                        mask=ik[:, None] & cmask[None, :], other=0.0), 0.0)
                    top = tl.maximum(m_run, mk_max)
                    e0 = tl.exp(m_run - top)
                    ek = tl.exp(mk_max - top)
                    total = total * e0 + tl.sum(wk[:, None] * ak, 0) * ek
                    l_run = l_run * e0 + tl.sum(wk * lk, 0) * ek
                    m_run = top
            if HAS_SINK:
                l_run = l_run + tl.exp(sink - m_run)
            pos_k = l_run > 0
            out = tl.where(pos_k, total / tl.where(pos_k, l_run, 1.0), 0.0)
        else:
            out = tl.where(pos, total / den, 0.0)
        tl.store(o_ptr + cols, out.to(o_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _merge_group(acc_ptr, m_ptr, l_ptr, out_ptr, s_ob, s_oh, b, qh0, hq, num_splits, used,
                 G: tl.constexpr, BLOCK_G: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                 BLOCK_S: tl.constexpr, DV_TILE: tl.constexpr, sinks_ptr=None, HAS_SINKS: tl.constexpr = False):
    """The fused merge of query heads qh0 .. qh0 + G - 1 of sequence b: _merge_head's arithmetic
    element for element (the same bits under the interpreter), with its loads past L1 (.cg:
    other SMs wrote the partials). m and l of all the heads at once as [BLOCK_G, BLOCK_S]; acc one
    head's [BLOCK_S, DV_TILE] tile at a time (a [BLOCK_G, BLOCK_S, BLOCK_DV] tile would be 16 x 32
    x 128 fp32 values, 512 registers a thread at 4 warps), the heads unrolled and their outputs
    gathered in registers so that no store separates the heads' loads (one store per column
    tile): on the H200 this form beat both the scalar merge and a head loop with one store (one
    round trip) per head at long context, but the two-launch call stays faster (docs/kernels.md,
    attention)."""
    hh = tl.arange(0, BLOCK_G)
    s = tl.arange(0, BLOCK_S)
    hmask = hh < G
    smask = s < used
    hs = hmask[:, None] & smask[None, :]
    row = (b * hq + qh0 + hh) * num_splits
    m = tl.load(m_ptr + row[:, None] + s[None, :], mask=hs, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(l_ptr + row[:, None] + s[None, :], mask=hs, other=0.0, cache_modifier=".cg")
    m_max = tl.max(m, 1)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(hs, tl.exp(m - m_safe[:, None]), 0.0)
    l_sum = tl.sum(w * l, 1)
    if HAS_SINKS:                                     # as _merge_head's, per head
        l_sum = l_sum + tl.exp(tl.load(sinks_ptr + qh0 + hh, mask=hmask, other=0.0).to(tl.float32) - m_safe)
    pos = l_sum > 0
    den = tl.where(pos, l_sum, 1.0)
    dt = tl.arange(0, DV_TILE)
    for c in tl.static_range(0, BLOCK_DV, DV_TILE):
        cols = c + dt
        cmask = cols < DV
        res = tl.zeros([BLOCK_G, DV_TILE], tl.float32)
        for i in tl.static_range(G):
            sel = hh == i
            w_i = tl.sum(tl.where(sel[:, None], w, 0.0), 0)          # head i's row of w (exact: + zeros)
            a = tl.load(acc_ptr + ((b * hq + qh0 + i) * num_splits + s)[:, None] * DV + cols[None, :],
                        mask=smask[:, None] & cmask[None, :], other=0.0, cache_modifier=".cg")
            res = tl.where(sel[:, None], tl.sum(w_i[:, None] * a, 0)[None, :], res)
        out = tl.where(pos[:, None], res / den[:, None], 0.0)
        tl.store(out_ptr + b * s_ob + (qh0 + hh)[:, None] * s_oh + cols[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=hmask[:, None] & cmask[None, :])


@triton.jit
def _lazy_rescale(m_i, l_i, acc, tile_max, SLACK: tl.constexpr, ROWS_LAST: tl.constexpr):
    """Lazy online-softmax rescaling (RESCALE_SLACK > 0): a row's running max moves only when the
    tile's max passes it by more than SLACK, and then its l and accumulator row are rescaled (behind
    one branch for the whole program); other rows are left exactly as they were, their exps this
    tile <= e^SLACK against the older max. The same sums up to rounding, deterministic, and a row's
    bits depend on its own scores only. ROWS_LAST: acc is [cols, rows] (the transposed MLA tiles),
    else [rows, cols]. Returns (the max to take this tile's exps against, l, acc)."""
    m_cand = tl.maximum(m_i, tile_max)
    grow = m_cand > m_i + SLACK
    if tl.max(grow.to(tl.int32), axis=0) > 0:
        # exactly 1 where the row does not move (its -inf - -inf never reaches the exp)
        alpha = tl.where(grow, tl.exp(m_i - tl.where(grow, m_cand, 0.0)), 1.0)
        l_i = l_i * alpha
        if ROWS_LAST:
            acc = acc * alpha[None, :]
        else:
            acc = acc * alpha[:, None]
        m_i = tl.where(grow, m_cand, m_i)
    return m_i, l_i, acc


@triton.jit
def _merge_splits_kernel(acc_ptr, m_ptr, l_ptr, lens_ptr, out_ptr, s_ob, s_oh, num_splits, pages_min,
                         HQ: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, MAX_SPLITS: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, BLOCK_S: tl.constexpr, DV_TILE: tl.constexpr,
                         PDL: tl.constexpr, LONG_SPLITS: tl.constexpr = 0, NCHUNK: tl.constexpr = 1,
                         sinks_ptr=None, HAS_SINKS: tl.constexpr = False):
    """Stage 2, grid (B, Hq): one program merges one (sequence, query head)'s splits, all of them
    at once (_merge_head; BLOCK_S = next power of two >= MAX_SPLITS; NCHUNK chunks of BLOCK_S where
    the partition has LONG_SPLITS)."""
    pdl_enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    # only the splits that hold keys were written (the same _split_pages as stage 1): with a table
    # padded to max_model_len most grid splits are empty and never touched
    _, _, used = _split_pages(tl.load(lens_ptr + b), pages_min, MAX_SPLITS, BLOCK_SIZE, LONG_SPLITS)
    sink = 0.0
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32)
    _merge_head(acc_ptr, m_ptr, l_ptr, out_ptr + b * s_ob + h * s_oh, (b * HQ + h) * num_splits, used, num_splits,
                DV, BLOCK_DV, BLOCK_S, DV_TILE, NCHUNK, sink, HAS_SINKS)


def _slack(rescale_slack: float | None, default: float = RESCALE_SLACK) -> float:
    """The lazy-rescale slack a launch compiles in (the launcher's default unless given; >= 0)."""
    v = default if rescale_slack is None else float(rescale_slack)
    if not v >= 0.0:
        raise ConfigError(f"rescale_slack must be >= 0 (nats), got {rescale_slack}")
    return v


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(x))


# fp32 partial-output values one merge program holds at a time ([BLOCK_S, DV_TILE]): 32 splits x
# 128 columns = 32 registers a thread at 4 warps; wider rows (MLA's 512) are merged in column tiles
MERGE_TILE_ELEMS = 4096


def _merge_blocks(max_splits: int, dv: int) -> dict:
    """The merge's constexprs (merge kernel and fused merge alike, so both give the same bits):
    BLOCK_S, the splits loaded at once (a power of two >= max_splits), and DV_TILE, the columns."""
    block_s = _pow2(max_splits, 2)
    return dict(BLOCK_S=block_s, DV_TILE=min(_pow2(dv), max(16, MERGE_TILE_ELEMS // block_s)))


def _splits(block_tables: torch.Tensor, bs: int, split_tokens: int | None, max_splits: int | None,
            long_splits: int = 0):
    """-> (pages_min, max_splits, grid splits): the most splits any sequence of this table can use
    (up to long_splits where the long partition is on, else max_splits)."""
    pages_min = max(1, -(-(split_tokens or 256) // bs))
    max_splits = max_splits or DEFAULT_MAX_SPLITS
    if max_splits < 1:
        raise ConfigError(f"paged decode (triton): max_splits must be >= 1, got {max_splits}")
    cap = max(max_splits, long_splits)
    return pages_min, max_splits, max(1, min(cap, -(-block_tables.shape[1] // pages_min)))


def gqa_decode_launch(q: torch.Tensor, cache: GQALayerKV, tile_tokens: int | None = None) -> GQALaunch:
    """(num_warps, num_stages) paged_decode_gqa launches with when not given: the table's entry
    for this device, KV format, shape and batch size q.shape[0] (attention_configs), for bf16
    queries; DEFAULT_GQA_DECODE otherwise (fp32 queries, the CPU interpreter, devices or shapes
    the table lacks). No host sync (the device name is cached)."""
    if not _bf16_dots(q):
        return DEFAULT_GQA_DECODE
    bs = cache.k.shape[1]
    step = max(1, (tile_tokens or GQA_TILE_TOKENS) // bs) * bs
    key = gqa_shape_key(cache.fmt, cache.k.dtype, cache.head_dim, cache.v_head_dim, step)
    return lookup_gqa_decode(_device_name(q.device), key, q.shape[0])


F8W_MIN_HEAD_DIM = 64      # a byte slot's dots have K = head_dim / 4, and the GPU's tl.dot needs K >= 16


def fp8_words_device_ok(device: torch.device) -> bool:
    """The words' paired conversion (cvt.rn.f16x2.e4m3x2) needs sm_89 or later; elsewhere (the
    interpreter) Triton converts byte by byte."""
    return device.type != "cuda" or device_capability(device) >= (8, 9)


def gqa_fp8_words_applies(q: torch.Tensor, cache: GQALayerKV, swap_ab: bool = False) -> bool:
    """Whether paged_decode_gqa can read this cache as int32 words (fp8_words): an fp8 cache whose
    scales are per tensor or per token-head (a group spans the head), bf16 queries, power-of-two
    head dims of at least F8W_MIN_HEAD_DIM, word-aligned page / token / head strides, not swap_ab,
    a device with the paired e4m3 conversion (fp8_words_device_ok)."""
    fmt = cache.fmt
    d, dv = cache.k.shape[-1], cache.v.shape[-1]
    strides = (*cache.k.stride()[:3], *cache.v.stride()[:3])
    return (fmt.is_fp8 and _bf16_dots(q) and not swap_ab
            and not (fmt.block_scaled and fmt.group < max(d, dv))
            and all(x == _pow2(x) and x >= F8W_MIN_HEAD_DIM for x in (d, dv))
            and not any(x % 4 for x in strides) and fp8_words_device_ok(q.device))


def paged_decode_gqa(q: torch.Tensor, cache: GQALayerKV, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                     *, split_tokens: int | None = None, max_splits: int | None = None,
                     tile_tokens: int | None = None, out: torch.Tensor | None = None,
                     num_warps: int | None = None, num_stages: int | None = None,
                     fused_merge: bool = False, swap_ab: bool = False, fp8_words: bool | None = None,
                     prefetch_steps: int | None = None, long_splits: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """As attention_reference.paged_decode_gqa (sinks [Hq]: gpt-oss's, added where the splits
    merge). split_tokens: tokens per split, rounded up to
    whole pages (default 256, FlashInfer/vLLM's order of magnitude; to be tuned on a GPU);
    max_splits (default GQA_DEFAULT_MAX_SPLITS): a sequence longer than split_tokens * max_splits
    gets max_splits longer splits. Both must be fixed per model (they change the last bits).
    out: optional [B, Hq, Dv] tensor to write into (CUDA graphs; the benchmark poisons it).
    num_warps / num_stages: the launch, default gqa_decode_launch (the device table). num_stages
    is Triton's cp.async pipeline depth of the page loop only (same math, same order: the same
    bits); num_warps sets the dots' and reductions' layouts, so like the splits it may change the
    last bits and must be fixed per model (the table never varies it by batch size).
    fused_merge: no merge launch; the last program of each (sequence, kv head) merges its heads'
    splits in the merge kernel's order (the same bits under the interpreter; compiled, another
    kernel's arithmetic may contract differently). Off in the engine
    (EngineConfig.kernels.attention_fused_merge): slower on the H200 at every batch (docs/kernels.md,
    attention).
    swap_ab: the tile's update transposed (tokens as the MMAs' M, so Hopper can use wgmma with the
    K / V tiles read from shared memory); the same math, other bits (fixed per model, like num_warps).
    fp8_words: an fp8 cache read as int32 words of 4 e4m3 bytes, the dots split by byte slot
    (_gqa_f8w_tile); other bits than the byte tile. None (default): wherever it applies
    (gqa_fp8_words_applies: a property of the model's shapes and KV format, never of the batch, so
    batch invariance holds); faster on the H200 at every batch, more so the larger the batch
    (docs/kernels.md, attention).
    True: refused (ConfigError) where it does not apply; False: the byte tile.
    prefetch_steps: under PDL (pdl.small_kernel_pdl), the first loop steps of each split whose K / V
    rows a program prefetches into L2 before its PDL wait (_gqa_prefetch; a power of two, 0 = none;
    default GQA_PREFETCH_STEPS where the grid fits the GPU's SMs, else none). A hint: the same bits
    whatever it is, so it may follow the batch.
    long_splits: the long partition (_split_pages' LONG_SPLITS; default GQA_LONG_SPLITS, off, where
    max_splits is the default, else none; 0 = none; no effect at or below max_splits; none with
    fused_merge or rows wider than one merge tile): past max_splits splits of 1,024 tokens a
    sequence gets up to long_splits splits of 1,024 tokens. Like the splits it is part of a model's
    bits (for sequences past 32K at the default splits). With it, under PDL, programs past their
    sequence's splits leave before the PDL wait (SKIP_EMPTY).
    (A chains=2 option, each split's halves walked as two online-softmax chains, was slower in
    every case on the H200 and removed: docs/kernels.md, attention.)"""
    q = q.contiguous()
    b, hq, d = q.shape
    nb, bs, hkv, _ = cache.k.shape
    dv = cache.v_head_dim
    if hq % hkv:
        raise ConfigError(f"paged decode: {hq} query heads are not a multiple of {hkv} kv heads")
    if bs < 16 or bs & (bs - 1):
        raise ConfigError(f"paged decode (triton): block_size must be a power of two >= 16, got {bs}")
    fmt = cache.fmt
    kind = scale_kind(fmt)
    if long_splits is None:           # the long partition belongs to the default split cap
        long_splits = GQA_LONG_SPLITS if max_splits is None else 0
    long_splits = int(long_splits)
    if long_splits < 0:
        raise ConfigError(f"paged decode (triton): long_splits must be >= 0, got {long_splits}")
    pages_min, max_splits, num_splits = _splits(block_tables, bs, split_tokens, max_splits or GQA_DEFAULT_MAX_SPLITS,
                                                long_splits)
    merge = _merge_blocks(max_splits, dv)
    if fused_merge or long_splits <= max_splits or merge["DV_TILE"] < _pow2(dv):   # (its merge: one column tile)
        long_splits = 0
        num_splits = min(num_splits, max_splits)
    nchunk = -(-long_splits // merge["BLOCK_S"]) if long_splits else 1
    if num_warps is None or num_stages is None:
        launch = gqa_decode_launch(q, cache, tile_tokens)
        num_warps = num_warps or launch.num_warps
        num_stages = num_stages or launch.num_stages
    g = hq // hkv
    acc = torch.empty(b, hq, num_splits, dv, dtype=torch.float32, device=q.device)
    m = torch.empty(b, hq, num_splits, dtype=torch.float32, device=q.device)
    l_ = torch.empty_like(m)
    out = torch.empty(b, hq, dv, dtype=q.dtype, device=q.device) if out is None else out
    ks = cache.k_scale if cache.k_scale is not None else m      # any pointer; never read
    vs = cache.v_scale if cache.v_scale is not None else m
    sk = ks.stride() if kind in (_SCALE_BLOCK, _SCALE_NVFP4) else (0, 0, 0)
    sv = vs.stride() if kind in (_SCALE_BLOCK, _SCALE_NVFP4) else (0, 0, 0)
    s2 = cache.scale_2 if cache.scale_2 is not None else m       # nvfp4's scale_2; else never read
    cnt = _merge_counters(q.device, b * hkv) if fused_merge else m    # any pointer when not fused
    kst, vst = cache.k.stride()[:3], cache.v.stride()[:3]
    applies = gqa_fp8_words_applies(q, cache, swap_ab)
    if fp8_words and not applies:
        raise ConfigError("paged decode (triton): fp8_words needs an fp8 cache with per-tensor or per-token-head "
                          f"scales, bf16 queries, power-of-two head dims >= {F8W_MIN_HEAD_DIM} and word-aligned "
                          "strides (not swap_ab)")
    fp8_words = applies if fp8_words is None else fp8_words
    if fp8_words:
        kst, vst = tuple(x // 4 for x in kst), tuple(x // 4 for x in vst)
    pdl = pdl_launch(q)
    if prefetch_steps is None:        # a hint, so it may follow the grid (no bits change): GQA_PREFETCH_STEPS
        pf = GQA_PREFETCH_STEPS if pdl["PDL"] and b * hkv * min(num_splits, max_splits) <= sm_count(q.device) else 0
    else:
        pf = int(prefetch_steps)
    if pf < 0 or pf & (pf - 1):
        raise ConfigError(f"paged decode (triton): prefetch_steps must be 0 or a power of two, got {prefetch_steps}")
    sink_args = dict(sinks_ptr=sinks.contiguous() if sinks is not None else m, HAS_SINKS=sinks is not None)
    _gqa_decode_split_kernel[(b, hkv, num_splits)](
        q, cache.k, cache.v, ks, vs, block_tables, seq_lens, acc, m, l_, out, cnt, s2,
        q.stride(0), q.stride(1), *kst, *vst,
        *sk[:3], *sv[:3], block_tables.stride(0), float(scale), pages_min, out.stride(0), out.stride(1),
        G=g, BLOCK_G=_pow2(g), D=d, BLOCK_D=_pow2(d), DV=dv, BLOCK_DV=_pow2(dv), BLOCK_SIZE=bs,
        MAX_SPLITS=max_splits, WINDOW=sliding_window or 0, SCALE_KIND=kind, GROUP_K=min(fmt.group, d),
        GROUP_V=min(fmt.group, dv), BF16_DOT=_bf16_dots(q), INTERPRET=_INTERPRET,
        PAGES=max(1, (tile_tokens or GQA_TILE_TOKENS) // bs), OP_F16=fmt.is_fp8 and _bf16_dots(q),
        FUSED_MERGE=fused_merge, **merge, num_warps=num_warps, num_stages=num_stages,
        SWAP_AB=swap_ab, F8_WORDS=fp8_words, PF_STEPS=pf if pdl["PDL"] else 0,
        KV_BYTES=4 if fp8_words else cache.k.element_size(), LONG_SPLITS=long_splits,
        SKIP_EMPTY=pdl["PDL"] and bool(long_splits), **sink_args, **pdl)
    if not fused_merge:
        _merge_splits_kernel[(b, hq)](acc, m, l_, seq_lens, out, out.stride(0), out.stride(1), num_splits, pages_min,
                                      HQ=hq, DV=dv, BLOCK_DV=_pow2(dv), MAX_SPLITS=max_splits, BLOCK_SIZE=bs,
                                      **merge, LONG_SPLITS=long_splits, NCHUNK=nchunk, **sink_args, **pdl)
    return out


MERGE_COUNTERS = COUNTERS                 # (sequence, kv head) pairs one fused-merge launch may have


def _merge_counters(device: torch.device, n: int) -> torch.Tensor:
    """The fused merge's counters (grid_sync.device_counters)."""
    if n > MERGE_COUNTERS:
        raise ConfigError(f"paged decode (triton): a fused merge of {n} (sequence, kv head) pairs exceeds "
                          f"{MERGE_COUNTERS}; use fused_merge=False")
    return device_counters("attention_triton", device)
