"""Triton forms of the small per-token ops around attention: RMSNorm (optionally fused with the
residual add before it, and with a second delta: an MoE block's routed + shared outputs), rotary
embedding, and GQA's q/k head norm + both rotations in one launch (qk_norm_rope). Why: in eager
torch an RMSNorm is 8 kernels (cast, pow, mean, add, rsqrt, mul, cast, mul) and a rotation 5 (neg,
cat, 2 mul, add); an H200 profile of a captured Qwen3-30B-A3B decode step spent about a third of
each layer's time in such microsecond kernels (docs/kernels.md, small fused kernels). Here each is
one kernel; and q_norm, k_norm, rotate q, rotate k are one together.

Both reproduce the torch modules' arithmetic step by step (model/layers/norm.py, rope.py):
  RMSNorm:  h = fp32(x); y = model_dtype(h * rsqrt(mean(h^2) + eps)); out = model_dtype(w * y)
            with the residual add first, s = model_dtype(x + residual), as torch's bf16 add
            (with x2: s = model_dtype(residual + model_dtype(x + x2)), torch's two adds);
  rotation: each product rounded to the model dtype, then the sum rounded (what torch's
            x * cos + rotated * sin does elementwise in bf16).
  qk_norm_rope: per (token, head) program the head-dim RMSNorm above (the row summed in natural
            order as _rmsnorm_kernel does: under the interpreter it equals rms_norm then rope bit
            for bit; compiled, the reduction order is the compiler's), then the rotation of the
            normed values; each lane norms the element it needs and its rotation partner.
Roundings to bf16 are done on the bits (kv_write_triton._bf16_rne) so the interpreter twin in
the CPU tests computes the same as the GPU. The only difference from torch is the order of the
fp32 sum in the mean (a tree here), which can move the last bit of rsqrt's input.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moet.kernels.kv_write_triton import _bf16_rne
from moet.kernels.pdl import pdl_enter, pdl_launch

_OUT_BF16, _OUT_OTHER = 1, 0


@triton.jit
def _round(x, OUT: tl.constexpr, dtype: tl.constexpr):
    """fp32 -> the model dtype and back to fp32 (the rounding torch applies between ops)."""
    if OUT == 1:
        return _bf16_rne(x).to(tl.float32)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _rmsnorm_kernel(x_ptr, x2_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, N, s_x, s_x2, s_res, s_out, s_sum, eps,
                    BLOCK: tl.constexpr, HAS_RES: tl.constexpr, HAS_X2: tl.constexpr, OUT: tl.constexpr,
                    PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * s_x + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_X2:      # a second delta (MoE routed + shared experts): x = model_dtype(x + x2) first
        x2 = tl.load(x2_ptr + row * s_x2 + cols, mask=m, other=0.0).to(tl.float32)
        x = _round(x + x2, OUT, dtype)
    if HAS_RES:
        r = tl.load(res_ptr + row * s_res + cols, mask=m, other=0.0).to(tl.float32)
        x = _round(r + x, OUT, dtype)
        if OUT == 1:
            tl.store(sum_ptr + row * s_sum + cols, _bf16_rne(x), mask=m)
        else:
            tl.store(sum_ptr + row * s_sum + cols, x.to(dtype), mask=m)
    ms = tl.sum(x * x, axis=0) / N
    y = _round(x * tl.math.rsqrt(ms + eps), OUT, dtype)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    if OUT == 1:
        tl.store(out_ptr + row * s_out + cols, _bf16_rne(w * y), mask=m)
    else:
        tl.store(out_ptr + row * s_out + cols, (w * y).to(dtype), mask=m)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., N] as a 2-D [rows, N] view with a unit last stride (a copy only if it has none)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             x2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm over the last dim. With `residual`: s = residual + x first; returns (norm(s), s).
    Without: (norm(x), None). With `x2` (needs `residual`): s = residual + (x + x2), both adds
    rounded to the model dtype as torch's two adds are. Outputs are new tensors of x's shape and dtype."""
    if x2 is not None and residual is None:
        raise ValueError("rms_norm: a second delta x2 needs a residual")
    n = x.shape[-1]
    xr = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o2 = out.view(-1, n)
    s2 = r2 = d2 = o2                                       # placeholders when there is no residual / x2
    total = None
    if residual is not None:
        r2 = _rows(residual)
        total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        s2 = total.view(-1, n)
    if x2 is not None:
        d2 = _rows(x2)
    if xr.shape[0]:
        _rmsnorm_kernel[(xr.shape[0],)](
            xr, d2, r2, weight, o2, s2, n, xr.stride(0), d2.stride(0), r2.stride(0), o2.stride(0), s2.stride(0),
            eps, BLOCK=triton.next_power_of_2(n), HAS_RES=residual is not None, HAS_X2=x2 is not None,
            OUT=_OUT_BF16 if x.dtype == torch.bfloat16 else _OUT_OTHER, num_warps=4 if n >= 1024 else 1,
            **pdl_launch(x))
    return out, total


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, s_xt, s_xh, s_ct, s_ot, s_oh,
                 D: tl.constexpr, RD: tl.constexpr, BLOCK: tl.constexpr, INTERLEAVE: tl.constexpr,
                 OUT: tl.constexpr):
    """One (token, head) row: the rotation alone (_norm_rope_head without the norm)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    _norm_rope_head(x_ptr + t * s_xt + h * s_xh, out_ptr + t * s_ot + h * s_oh, x_ptr, cos_ptr + t * s_ct,
                    sin_ptr + t * s_ct, D, 0.0, D, RD, BLOCK, INTERLEAVE, False, OUT)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotary embedding of x [T, heads, d] (any strides with a unit last stride) with cos/sin
    [T, rope_dim] in x's dtype; the same contract as Rotary.apply. -> a new [T, heads, d] tensor."""
    t, h, d = x.shape
    rd = cos.shape[-1]
    if interleave and rd != d:
        raise ValueError(f"interleaved rotary over {rd} of {d} dims is not a supported layout")
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t:
        _rope_kernel[(t, h)](x, cos, sin, out, h, x.stride(0), x.stride(1), cos.stride(0), out.stride(0),
                             out.stride(1), D=d, RD=rd, BLOCK=triton.next_power_of_2(d), INTERLEAVE=interleave,
                             OUT=_OUT_BF16 if x.dtype == torch.bfloat16 else _OUT_OTHER, num_warps=1)
    return out


@triton.jit
def _normed(x, r, w, OUT: tl.constexpr, dtype: tl.constexpr):
    """One element of RMSNorm's output given the row's rsqrt r: model_dtype(w * model_dtype(x * r))."""
    return _round(w * _round(x * r, OUT, dtype), OUT, dtype)


@triton.jit
def _norm_rope_head(src, dst, w_ptr, cos_row, sin_row, N, eps, D: tl.constexpr, RD: tl.constexpr,
                    BLOCK: tl.constexpr, INTERLEAVE: tl.constexpr, HAS_NORM: tl.constexpr, OUT: tl.constexpr):
    """One (token, head) row: optional RMSNorm over the head dim, then the rotation of the first RD
    dims (dims >= RD pass through):
      neox:        out[i] = x[i] c[i] + rot[i] s[i], rot = (-x[HALF:RD], x[:HALF]);
      interleaved: out[j] = x[2j] c[j] - x[2j+1] s[j], out[HALF + j] = x[2j+1] c[j] + x[2j] s[j].
    The norm is elementwise once the row's rsqrt is known, so each lane norms the element it
    needs (its own and its rotation partner) without a shuffle."""
    dtype = dst.dtype.element_ty
    i = tl.arange(0, BLOCK)
    HALF: tl.constexpr = RD // 2
    r = 0.0
    if HAS_NORM:        # the row in natural order: the same fp32 sum tree as _rmsnorm_kernel
        xr = tl.load(src + i, mask=i < D, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(tl.sum(xr * xr, axis=0) / N + eps)
    if INTERLEAVE:
        j = i % HALF
        first = i < HALF
        m = i < RD
        ia = 2 * j + tl.where(first, 0, 1)
        ib = 2 * j + tl.where(first, 1, 0)
        a = tl.load(src + ia, mask=m, other=0.0).to(tl.float32)
        b = tl.load(src + ib, mask=m, other=0.0).to(tl.float32)
        if HAS_NORM:
            a = _normed(a, r, tl.load(w_ptr + ia, mask=m, other=0.0).to(tl.float32), OUT, dtype)
            b = _normed(b, r, tl.load(w_ptr + ib, mask=m, other=0.0).to(tl.float32), OUT, dtype)
        c = tl.load(cos_row + j, mask=m, other=0.0).to(tl.float32)
        s = tl.load(sin_row + j, mask=m, other=0.0).to(tl.float32)
        bs = _round(b * s, OUT, dtype)
        y = _round(_round(a * c, OUT, dtype) + tl.where(first, -bs, bs), OUT, dtype)
    else:
        m = i < D
        rot = i < RD
        partner = tl.where(i < HALF, i + HALF, i - HALF)
        x = tl.load(src + i, mask=m, other=0.0).to(tl.float32)
        p = tl.load(src + partner, mask=rot, other=0.0).to(tl.float32)
        if HAS_NORM:
            x = _normed(x, r, tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32), OUT, dtype)
            p = _normed(p, r, tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32), OUT, dtype)
        p = tl.where(i < HALF, -p, p)
        c = tl.load(cos_row + i, mask=rot, other=0.0).to(tl.float32)
        s = tl.load(sin_row + i, mask=rot, other=0.0).to(tl.float32)
        y = tl.where(rot, _round(_round(x * c, OUT, dtype) + _round(p * s, OUT, dtype), OUT, dtype), x)
    if OUT == 1:
        tl.store(dst + i, _bf16_rne(y), mask=m)
    else:
        tl.store(dst + i, y.to(dtype), mask=m)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, HQ, N, eps,
                         s_qt, s_qh, s_kt, s_kh, s_ct, s_qot, s_qoh, s_kot, s_koh,
                         D: tl.constexpr, RD: tl.constexpr, BLOCK: tl.constexpr, INTERLEAVE: tl.constexpr,
                         HAS_NORM: tl.constexpr, OUT: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cos_row = cos_ptr + t * s_ct
    sin_row = sin_ptr + t * s_ct
    if h < HQ:
        _norm_rope_head(q_ptr + t * s_qt + h * s_qh, qo_ptr + t * s_qot + h * s_qoh, qw_ptr, cos_row, sin_row,
                        N, eps, D, RD, BLOCK, INTERLEAVE, HAS_NORM, OUT)
    else:
        hk = h - HQ
        _norm_rope_head(k_ptr + t * s_kt + hk * s_kh, ko_ptr + t * s_kot + hk * s_koh, kw_ptr, cos_row, sin_row,
                        N, eps, D, RD, BLOCK, INTERLEAVE, HAS_NORM, OUT)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                 eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """GQA's q/k step in one launch: q [T, Hq, d], k [T, Hkv, d] (strided views of the fused qkv
    output are fine: unit last stride), optionally RMSNorm'ed over d with q_weight / k_weight (as
    RMSNorm: rms_norm's arithmetic), then rotated as rope(). -> new q [T, Hq, d], k [T, Hkv, d]."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    rd = cos.shape[-1]
    if interleave and rd != d:
        raise ValueError(f"interleaved rotary over {rd} of {d} dims is not a supported layout")
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"q {list(q.shape)} and k {list(k.shape)} disagree on tokens or head dim")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("qk_norm_rope: give both q_weight and k_weight, or neither")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    qo = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((t, hkv, d), dtype=k.dtype, device=k.device)
    has_norm = q_weight is not None
    qw, kw = (q_weight, k_weight) if has_norm else (cos, cos)            # placeholders: never read
    if t:
        _qk_norm_rope_kernel[(t, hq + hkv)](
            q, k, qw, kw, cos, sin, qo, ko, hq, d, eps, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            cos.stride(0), qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1), D=d, RD=rd,
            BLOCK=triton.next_power_of_2(d), INTERLEAVE=interleave, HAS_NORM=has_norm,
            OUT=_OUT_BF16 if q.dtype == torch.bfloat16 else _OUT_OTHER, num_warps=1, **pdl_launch(q))
    return qo, ko
