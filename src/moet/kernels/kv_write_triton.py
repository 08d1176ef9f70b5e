"""Triton KV writes: the step's new K/V (GQA) or latent + rope rows (MLA) stored into their slots,
quantized on the way for fp8 caches. Signatures and stored bytes equal kv_cache.write_gqa_kv /
write_mla_kv exactly (tests/kernels/test_kv_write_triton.py compares the raw bytes). Importing this
module needs triton.

One kernel, `_store_rows_kernel`, stores one tensor part (k, v, latent or rope): grid (T, heads,
chunks), one program = one token, one head, one chunk of the row. GQA's k and v go in one launch
(`_store_kv_kernel`: the chunk axis runs over k's chunks, then v's; the same per-row code). For fp8 block scales a chunk is
one scale group (amax over it -> scale = amax / 448, 1 for an all-zero group), else the whole row.
Slot -1 programs exit at once. Why it matches the torch reference bit for bit:
  - divisions are IEEE round-to-nearest (tl.math.div_rn; a plain `/` in Triton is an approximate
    division on NVIDIA GPUs), as torch's x / s and amax / 448;
  - the fp8 cast saturates explicitly at +-448 first, then rounds to nearest even, as to_e4m3;
  - the "auto" cast to bf16 rounds to nearest even, as torch's .to();
  both roundings are done on the bits (_bf16_rne, _e4m3_rne): Triton's casts are RNE on the GPU
  but not under TRITON_INTERPRET=1, and the tests must check the compiled arithmetic's twin.
Destination addressing: every cache part (also the typed views into an MLA row buffer) has
stride(0) = block_size * stride(1), so element (slot, h, c) sits at slot * stride(1) + h * s_h + c.
nvfp4 (`_store_nvfp4_kernel`, GQA's k and v in one launch as above; MLA's latent, its rope part
through `_store_rows_kernel` as e4m3 with scale_2[1]): one program = one (token, head) row, held as
[blocks of 16, 8] tiles of its even and odd elements, so each block's amax is a row reduction and
each code byte is even | odd << 4 with no reshape. The same roundings as formats.nvfp4.quantize_blocks:
scale = e4m3(div_rn(amax, 6 * scale_2)) saturating at 448, x / (scale * scale_2) by div_rn, e2m1
nearest even by comparisons with the midpoints (ties to the even code), saturating at 6.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moet.errors import ConfigError
from moet.kernels.kv_cache import GQALayerKV, MLALayerKV, _groups
from moet.kernels.pdl import pdl_enter, pdl_launch

_PLAIN, _TENSOR, _BLOCK = 0, 1, 2
E4M3_MAX = 448.0


@triton.jit
def _bf16_rne(x):
    """fp32 -> bf16, round to nearest even, on the bits (finite inputs). Triton's own cast is RNE
    on the GPU but truncates under TRITON_INTERPRET=1; this form is the same everywhere."""
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _e4m3_rne(y):
    """fp32 in [-448, 448] -> float8_e4m3fn, round to nearest even, on the bits (what torch's
    .to(float8_e4m3fn) gives; the interpreter's own fp8 cast differs in the last bit)."""
    u = y.to(tl.uint32, bitcast=True)
    sign = (u >> 31).to(tl.uint32)
    a = u & 0x7FFFFFFF
    # normal (|y| >= 2**-6): keep 3 mantissa bits, RNE on the 20 dropped bits, rebias 127 -> 7;
    # a mantissa carry walks into the exponent, which is the right result
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960
    # subnormal: multiples of 2**-9 (m = 8 is the smallest normal, code 8: continuous)
    f = tl.abs(y) * 512.0
    m = f.to(tl.int32)
    rem = f - m.to(tl.float32)
    m = m + ((rem > 0.5) | ((rem == 0.5) & ((m & 1) == 1))).to(tl.int32)
    code = tl.where(tl.abs(y) < 0.015625, m.to(tl.uint32), normal) | (sign << 7)
    return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _e2m1_rne(y):
    """fp32 (already divided by its scale) -> e2m1 code 0..15 as int32: nearest, ties to the even
    code (the midpoints 0.75, 1.75, 3.5 round up, 0.25, 1.25, 2.5, 5 down), |y| > 6 saturates to
    6, the sign bit kept (so -0.0 -> 8), as formats.e2m1.encode(..., "nearest_even")."""
    m = tl.abs(y)
    idx = ((m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32)
           + (m >= 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32) + (m > 5.0).to(tl.int32))
    sign = (y.to(tl.uint32, bitcast=True) >> 31).to(tl.int32)
    return idx | (sign << 3)


@triton.jit
def _nvfp4_row(src_ptr, dst_ptr, scale_ptr, s2_ptr, slot, t, h, s_src_t, s_src_h, s_dst_slot, s_dst_h, s_sc_slot,
               s_sc_h, C: tl.constexpr, BLOCK_B: tl.constexpr):
    """Token t, head h of one part -> nvfp4 at its slot (slot >= 0): C / 16 e4m3 block scales and
    C / 2 code bytes (element 2i in the low nibble of byte i)."""
    i = tl.arange(0, BLOCK_B)[:, None]                       # block of 16
    j = tl.arange(0, 8)[None, :]                             # pair within the block
    bmask = i < C // 16
    src = src_ptr + t.to(tl.int64) * s_src_t + h * s_src_h + i * 16 + 2 * j
    xe = tl.load(src, mask=bmask, other=0.0).to(tl.float32)
    xo = tl.load(src + 1, mask=bmask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))     # [BLOCK_B]
    g = tl.load(s2_ptr)
    sc = _e4m3_rne(tl.minimum(tl.math.div_rn(amax, tl.zeros_like(amax) + 6.0 * g), 448.0))
    tl.store(scale_ptr + slot * s_sc_slot + h * s_sc_h + tl.arange(0, BLOCK_B), sc, mask=tl.arange(0, BLOCK_B) < C // 16)
    denom = (sc.to(tl.float32) * g)[:, None]
    pos = denom > 0
    safe = tl.where(pos, denom, 1.0)
    ce = _e2m1_rne(tl.where(pos, tl.math.div_rn(xe, tl.zeros_like(xe) + safe), xe * 0.0))
    co = _e2m1_rne(tl.where(pos, tl.math.div_rn(xo, tl.zeros_like(xo) + safe), xo * 0.0))
    tl.store(dst_ptr + slot * s_dst_slot + h * s_dst_h + i * 8 + j, (ce | (co << 4)).to(tl.uint8), mask=bmask)


@triton.jit
def _store_nvfp4_kernel(k_ptr, v_ptr, slot_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, s2_ptr,
                        s_k_t, s_k_h, s_v_t, s_v_h, s_kc_slot, s_kc_h, s_vc_slot, s_vc_h,
                        s_ks_slot, s_ks_h, s_vs_slot, s_vs_h,
                        CK: tl.constexpr, CV: tl.constexpr, BLOCK_B: tl.constexpr, PARTS: tl.constexpr,
                        PDL: tl.constexpr):
    """nvfp4 rows, grid (T, heads, PARTS): part 0 (k / MLA's latent) with scale_2[0], part 1 (v)
    with scale_2[1]."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    part = tl.program_id(2)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        if part == 0:
            _nvfp4_row(k_ptr, kc_ptr, ks_ptr, s2_ptr, slot, t, h, s_k_t, s_k_h, s_kc_slot, s_kc_h, s_ks_slot, s_ks_h,
                       CK, BLOCK_B)
        else:
            _nvfp4_row(v_ptr, vc_ptr, vs_ptr, s2_ptr + 1, slot, t, h, s_v_t, s_v_h, s_vc_slot, s_vc_h, s_vs_slot,
                       s_vs_h, CV, BLOCK_B)


@triton.jit
def _store_row(src_ptr, dst_ptr, scale_ptr, slot, t, h, ch, s_src_t, s_src_h, s_dst_slot, s_dst_h, s_sc_slot,
               s_sc_h, C: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, KIND: tl.constexpr,
               OUT: tl.constexpr):
    """Token t, head h, chunk ch of one part -> its slot (slot >= 0)."""
    c = ch * CHUNK + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < CHUNK) & (c < C)
    x = tl.load(src_ptr + t.to(tl.int64) * s_src_t + h * s_src_h + c, mask=mask, other=0.0).to(tl.float32)
    dst = dst_ptr + slot * s_dst_slot + h * s_dst_h + c
    if KIND == 0:
        if OUT == 1:
            tl.store(dst, _bf16_rne(x), mask=mask)
        else:
            tl.store(dst, x.to(dst_ptr.dtype.element_ty), mask=mask)
    else:
        if KIND == 1:
            s = tl.load(scale_ptr)
        else:
            amax = tl.max(tl.abs(x), axis=0)
            s = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
            tl.store(scale_ptr + slot * s_sc_slot + h * s_sc_h + ch, s)
        y = tl.math.div_rn(x, tl.zeros_like(x) + s)
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        tl.store(dst, _e4m3_rne(y), mask=mask)


@triton.jit
def _store_rows_kernel(src_ptr, slot_ptr, dst_ptr, scale_ptr,
                       s_src_t, s_src_h, s_dst_slot, s_dst_h, s_sc_slot, s_sc_h,
                       C: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, KIND: tl.constexpr,
                       OUT: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    ch = tl.program_id(2)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        _store_row(src_ptr, dst_ptr, scale_ptr, slot, t, h, ch, s_src_t, s_src_h, s_dst_slot, s_dst_h,
                   s_sc_slot, s_sc_h, C, CHUNK, BLOCK, KIND, OUT)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, slot_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
                     s_k_t, s_k_h, s_v_t, s_v_h, s_kc_slot, s_kc_h, s_vc_slot, s_vc_h,
                     s_ks_slot, s_ks_h, s_vs_slot, s_vs_h,
                     CK: tl.constexpr, CHUNK_K: tl.constexpr, CV: tl.constexpr, CHUNK_V: tl.constexpr,
                     BLOCK: tl.constexpr, KIND: tl.constexpr, OUT: tl.constexpr, PDL: tl.constexpr):
    """GQA's k and v in one launch: grid (T, Hkv, chunks of k + chunks of v)."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    ch = tl.program_id(2)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    NCK: tl.constexpr = CK // CHUNK_K
    if slot >= 0:
        if ch < NCK:
            _store_row(k_ptr, kc_ptr, ks_ptr, slot, t, h, ch, s_k_t, s_k_h, s_kc_slot, s_kc_h,
                       s_ks_slot, s_ks_h, CK, CHUNK_K, BLOCK, KIND, OUT)
        else:
            _store_row(v_ptr, vc_ptr, vs_ptr, slot, t, h, ch - NCK, s_v_t, s_v_h, s_vc_slot, s_vc_h,
                       s_vs_slot, s_vs_h, CV, CHUNK_V, BLOCK, KIND, OUT)


def _check_dst(dst: torch.Tensor, kind: int) -> int:
    """Raises for a cache part this module cannot write; -> the OUT code (1: bf16 on the bits)."""
    if dst.stride(-1) != 1 or dst.stride(0) != dst.shape[1] * dst.stride(1):
        raise ConfigError("kv write (triton): cache part must be row-major with whole pages per block")
    if kind != _PLAIN and dst.dtype != torch.float8_e4m3fn:
        raise ConfigError(f"kv write (triton): an fp8 cache part must be float8_e4m3fn, got {dst.dtype}")
    if kind == _PLAIN and dst.dtype not in (torch.bfloat16, torch.float32):
        # no bit-exact rounding written for other dtypes: keep the reference's exact bytes
        raise ConfigError(f"kv write (triton): cache dtype {dst.dtype} unsupported; use bfloat16 or float32")
    return 1 if dst.dtype == torch.bfloat16 else 0


def _store(src: torch.Tensor, slot_mapping: torch.Tensor, dst: torch.Tensor, scale: torch.Tensor | None,
           kind: int, group: int) -> None:
    """src [T, C] or [T, H, C] -> dst [NB, BS, C] or [NB, BS, H, C] at the slots."""
    if src.dim() == 2:
        src, dst = src[:, None, :], dst[..., None, :]
        scale = scale[..., None, :] if kind == _BLOCK else scale
    t, h, c = src.shape
    if src.stride(-1) != 1:
        src = src.contiguous()
    out = _check_dst(dst, kind)
    chunk = min(group, c) if kind == _BLOCK else c
    chunks = c // chunk
    sc = scale if scale is not None else dst                     # any pointer; never read (plain)
    ss = (scale.stride(1), scale.stride(2)) if kind == _BLOCK else (0, 0)
    _store_rows_kernel[(t, h, chunks)](
        src, slot_mapping, dst, sc, src.stride(0), src.stride(1), dst.stride(1), dst.stride(2), *ss,
        C=c, CHUNK=chunk, BLOCK=triton.next_power_of_2(chunk), KIND=kind, OUT=out, **pdl_launch(src))


def _kind(fmt) -> int:
    return _BLOCK if fmt.block_scaled else _TENSOR if fmt.is_fp8 else _PLAIN


def _check_nvfp4(*parts: torch.Tensor) -> None:
    for p in parts:
        if p.stride(-1) != 1 or p.stride(0) != p.shape[1] * p.stride(1):
            raise ConfigError("kv write (triton): cache part must be row-major with whole pages per block")


def _write_nvfp4(srcs, slots, codes, scales, s2) -> None:
    """srcs: (k [T, H, C]) or (k, v [T, H, Cv]) -> nvfp4 parts (codes [NB, BS, H, C/2], scales
    [NB, BS, H, C/16]) in one launch, grid (T, H, parts)."""
    srcs = [x if x.stride(-1) == 1 else x.contiguous() for x in srcs]
    _check_nvfp4(*codes, *scales)
    k, kc, ks = srcs[0], codes[0], scales[0]
    v, vc, vs = (srcs[1], codes[1], scales[1]) if len(srcs) > 1 else (k, kc, ks)
    t, h, ck = k.shape
    cv = v.shape[-1]
    _store_nvfp4_kernel[(t, h, len(srcs))](
        k, v, slots, kc, vc, ks, vs, s2, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(1), kc.stride(2), vc.stride(1), vc.stride(2), ks.stride(1), ks.stride(2), vs.stride(1), vs.stride(2),
        CK=ck, CV=cv, BLOCK_B=triton.next_power_of_2(max(ck, cv) // 16), PARTS=len(srcs), **pdl_launch(k))


def write_gqa_kv(cache: GQALayerKV, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """As kv_cache.write_gqa_kv: k [T, Hkv, D], v [T, Hkv, Dv], slot_mapping int [T] (-1 skips)."""
    if k.shape[0] == 0:
        return
    fmt, kind = cache.fmt, _kind(cache.fmt)
    if fmt.is_nvfp4:                     # the reference's block rule (multiples of 16)
        _groups(k.shape[-1], fmt), _groups(v.shape[-1], fmt)
        _write_nvfp4((k, v), slot_mapping.to(torch.int64), (cache.k, cache.v), (cache.k_scale, cache.v_scale),
                     cache.scale_2)
        return
    if kind == _BLOCK:                   # the reference's group rule (clip to the dim, must divide)
        _groups(k.shape[-1], fmt), _groups(v.shape[-1], fmt)
    slots = slot_mapping.to(torch.int64)
    if k.dtype != v.dtype or k.shape[:2] != v.shape[:2] or cache.k.dtype != cache.v.dtype:
        _store(k, slots, cache.k, cache.k_scale, kind, fmt.group)
        _store(v, slots, cache.v, cache.v_scale, kind, fmt.group)
        return
    # both parts in one launch (decode is launch-bound): _store_kv_kernel, the same per-part code
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    out = _check_dst(cache.k, kind)
    _check_dst(cache.v, kind)
    t, h, ck = k.shape
    cv = v.shape[-1]
    chunk_k = min(fmt.group, ck) if kind == _BLOCK else ck
    chunk_v = min(fmt.group, cv) if kind == _BLOCK else cv
    ks = cache.k_scale if cache.k_scale is not None else cache.k     # any pointer; never read (plain)
    vs = cache.v_scale if cache.v_scale is not None else cache.v
    sks = (ks.stride(1), ks.stride(2)) if kind == _BLOCK else (0, 0)
    svs = (vs.stride(1), vs.stride(2)) if kind == _BLOCK else (0, 0)
    _store_kv_kernel[(t, h, ck // chunk_k + cv // chunk_v)](
        k, v, slots, cache.k, cache.v, ks, vs, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cache.k.stride(1), cache.k.stride(2), cache.v.stride(1), cache.v.stride(2), *sks, *svs,
        CK=ck, CHUNK_K=chunk_k, CV=cv, CHUNK_V=chunk_v, BLOCK=triton.next_power_of_2(max(chunk_k, chunk_v)),
        KIND=kind, OUT=out, **pdl_launch(k))


def write_mla_kv(cache: MLALayerKV, latent: torch.Tensor, k_rope: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """As kv_cache.write_mla_kv: latent [T, R], k_rope [T, P], slot_mapping int [T] (-1 skips).
    fp8 block (fp8_ds_mla): the latent is quantized per group, the rope stored in fmt.dtype."""
    if latent.shape[0] == 0:
        return
    fmt, kind = cache.fmt, _kind(cache.fmt)
    slots = slot_mapping.to(torch.int64)
    if fmt.is_nvfp4:                     # latent nvfp4 (scale_2[0]); rope e4m3 with scale_2[1]
        _groups(latent.shape[-1], fmt)
        _write_nvfp4((latent[:, None, :],), slots, (cache.latent[..., None, :],),
                     (cache.latent_scale[..., None, :],), cache.scale_2)
        _store(k_rope, slots, cache.rope, cache.scale_2[1:2], _TENSOR, fmt.group)
    elif kind == _BLOCK:
        _groups(latent.shape[-1], fmt)
        _store(latent, slots, cache.latent, cache.latent_scale, _BLOCK, fmt.group)
        _store(k_rope, slots, cache.rope, None, _PLAIN, fmt.group)
    else:
        _store(latent, slots, cache.latent, cache.latent_scale, kind, fmt.group)
        _store(k_rope, slots, cache.rope, cache.latent_scale, kind, fmt.group)
