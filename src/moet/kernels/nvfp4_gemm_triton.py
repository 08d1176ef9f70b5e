"""Triton NVFP4 dense GEMM (W4A16): y = x @ W^T with W as modelopt stores it (codes uint8
[N, K/2], e4m3 block-16 scales [N, K/16], one fp32 scale_2); same signature and numerics as
moet.kernels.nvfp4_gemm_reference. Importing this module needs triton. Any GPU with bf16 dots
(sm_80+): the weight is decoded in registers, there is no FP4 tensor-core path here.

The weight tile [BLOCK_N, BLOCK_K] is decoded per element: element k is nibble k % 2 of byte
k // 2 times scale k // 16 (attention_triton._nvfp4_tile says why not the nibble join). e2m1 x
e4m3 is exact in the dot operand dtype, so the tensor cores see the weight exactly and scale_2
multiplies the fp32 sums once. Few rows (decode): K is split over SPLIT programs writing fp32
partials that fp8_gemm_triton.sum_splits adds in a fixed order (reruns are bit-identical);
many rows: tiles, no split. Reads 4.5 bits a weight: 0.28x the bytes of bf16 per decode step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moet.kernels.attention_triton import _EMULATE_BF16_DOT, _e2m1_f32
from moet.kernels.fp8_gemm_triton import _num_sms, gemm_rows, split_target, sum_splits
from moet.kernels.nvfp4_gemm_reference import check_nvfp4_weight


@dataclass(frozen=True)
class Nvfp4GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split: int          # K split (1 = none); clipped to the number of K blocks
    num_warps: int
    num_stages: int
    group_m: int = 8


@triton.jit
def _nvfp4_gemm_kernel(x_ptr, w_ptr, s_ptr, s2_ptr, bias_ptr, c_ptr, M, N, K, s_xm, s_wn, s_sn, s_cm, s_split,
                       KB_PER_SPLIT: tl.constexpr, DOT_IEEE: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid, sp = tl.program_id(0), tl.program_id(1)
    # grouped launch order: GROUP_M row tiles walk the same weight columns together (L2 reuse)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pm = first_m + (pid % (GROUP_M * tiles_n)) % size_m
    pn = (pid % (GROUP_M * tiles_n)) // size_m
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, KB_PER_SPLIT):            # past K (the last split's tail): masked to 0
        rk = (sp * KB_PER_SPLIT + i) * BLOCK_K + kk
        kmask = rk < K
        x = tl.load(x_ptr + rm[:, None] * s_xm + rk[None, :], mask=(rm < M)[:, None] & kmask[None, :], other=0.0)
        wmask = (rn < N)[:, None] & kmask[None, :]
        byte = tl.load(w_ptr + rn[:, None] * s_wn + (rk // 2)[None, :], mask=wmask, other=0).to(tl.int32)
        code = (byte >> ((rk & 1) * 4)[None, :]) & 15
        sc = tl.load(s_ptr + rn[:, None] * s_sn + (rk // 16)[None, :], mask=wmask, other=0.0).to(tl.float32)
        w = _e2m1_f32(code) * sc                          # [BLOCK_N, BLOCK_K], exact
        if DOT_IEEE or _EMULATE_BF16_DOT:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    acc = acc * tl.load(s2_ptr)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    cmask = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(c_ptr + sp * s_split + rm[:, None] * s_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=cmask)


def pick_config(m: int, n: int, k: int, device: torch.device) -> Nvfp4GemmConfig:
    """By row count (first guesses, as fp8_gemm_triton's): few rows split K until ~2 programs per SM."""
    if m <= 64:
        bm, bn, bk = (16 if m <= 16 else (32 if m <= 32 else 64)), 64, 128
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        split = max(1, min(triton.cdiv(k, bk), triton.cdiv(2 * _num_sms(device), tiles)))
        return Nvfp4GemmConfig(bm, bn, bk, split, num_warps=4, num_stages=4)
    if m <= 256:
        tiles = triton.cdiv(m, 64) * triton.cdiv(n, 128)
        split = max(1, min(triton.cdiv(k, 64), triton.cdiv(_num_sms(device), tiles)))
        return Nvfp4GemmConfig(64, 128, 64, split, num_warps=4, num_stages=4)
    return Nvfp4GemmConfig(128, 128, 64, 1, num_warps=8, num_stages=3)


def nvfp4_gemm_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      weight_scale_2: torch.Tensor, *, bias: torch.Tensor | None = None,
                      config: Nvfp4GemmConfig | None = None, partials: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype. `partials` (fp32 [split, M, N]) may be passed in
    (tests poison it)."""
    n, k = check_nvfp4_weight(x, weight, weight_scale, weight_scale_2)
    lead, x2 = gemm_rows(x, k)
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, n)
    cfg = config or pick_config(m, n, k, x.device)
    num_kb = triton.cdiv(k, cfg.block_k)
    kb_per_split = triton.cdiv(num_kb, max(1, min(cfg.split, num_kb)))
    split = triton.cdiv(num_kb, kb_per_split)
    c, s_cm, s_split, partials = split_target(out, partials, split)
    s2 = weight_scale_2.reshape(1)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), split)
    _nvfp4_gemm_kernel[grid](
        x2, weight, weight_scale, s2, bias if bias is not None else s2, c,
        m, n, k, x2.stride(0), weight.stride(0), weight_scale.stride(0), s_cm, s_split,
        KB_PER_SPLIT=kb_per_split, DOT_IEEE=x.dtype == torch.float32, HAS_BIAS=bias is not None and split == 1, SPLIT=split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    sum_splits(partials, bias, out)
    return out.reshape(*lead, n)
