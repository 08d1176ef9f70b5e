"""Triton grouped MoE over W2 experts for the prefill regime (many tokens per expert); signature
and semantics equal moe_experts_reference's (moet.kernels.reference). Importing this module
needs triton (an optional dependency: moet.kernels never imports it on its own).

Layout: vLLM's fused_moe. moe_align.moe_align_block_size sorts the (token, expert) pairs by
pool SLOT (through the slot table), drops and counts the non-resident ones, and pads each slot's
list to BLOCK_M rows, so every BLOCK_M-row tile reads exactly one slot's weights.

  launch 1 (_w2_gate_up_kernel), grid (tiles, cdiv(I, BLOCK_N)): for a tile's pairs, gate and
    up = x @ W_gate_up[slot]^T with the W2 codes decoded inside the K loop (codes [2I, H/4],
    UE8M0 scales [2I, H/32]; gate rows n and up rows I + n of the same program), then the
    optional SwiGLU clamp and silu(gate) * up in fp32 -> act[pair, I] (fp32).
  launch 2 (_w2_down_kernel), grid (tiles, cdiv(H, BLOCK_N)): y[pair] = topk_weight[pair] *
    (act[pair] @ W_down[slot]^T), codes [H, I/4], scales [H, I/32] -> y [T, k, H] (fp32).
  Then pairs of non-resident experts are zeroed and out = y[:, 0] + ... + y[:, k-1] in torch,
  in that fixed order (as the reference). No atomics: every element of act and y has exactly
  one writer and a fixed K order, so reruns are bit-identical.

Decode per weight: byte j of the row holds elements 4j..4j+3 in bits 0-1, 2-3, 4-5, 6-7; level
(-4, -1, 1, 4)[code]; scale 2^(byte - 127) built by shifting the byte into an fp32 exponent
(byte 0, 2^-127, is a subnormal and is special-cased). Products level * scale are exact in fp32.

Status: correct under TRITON_INTERPRET=1 at small shapes (tests/kernels/test_moe_w2_triton.py);
NOT yet compiled or measured on a GPU. Both GEMMs use fp32 operands with input_precision="ieee"
so the CPU interpreter and the GPU agree with the fp32 reference; the decode is the naive one
(one byte load per element, shift/mask/select), i.e. the "dot_tl" design of
tools/kernel_lab/RESULTS.md. Block sizes are first guesses, not tuned.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moet.kernels.moe_align import AlignedPairs, moe_align_block_size
from moet.kernels.pools import W2Pool

BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _w2_tile(codes_ptr, scales_ptr, rows, rmask, kk, kmask, s_n, ss_n):
    """Decoded W2 weights [len(rows), len(kk)] float32 of one slot (row-major v1 layout); the
    pointers are already offset to the slot."""
    m = rmask[:, None] & kmask[None, :]
    r64 = rows.to(tl.int64)
    byte = tl.load(codes_ptr + r64[:, None] * s_n + (kk // 4)[None, :], mask=m, other=0).to(tl.int32)
    c = (byte >> ((kk % 4) * 2)[None, :]) & 3
    lv = tl.where(c == 0, -4.0, tl.where(c == 1, -1.0, tl.where(c == 2, 1.0, 4.0)))
    sb = tl.load(scales_ptr + r64[:, None] * ss_n + (kk // 32)[None, :], mask=m, other=127)
    sb = sb.to(tl.int32)
    sf = (sb << 23).to(tl.float32, bitcast=True)
    sf = tl.where(sb == 0, 5.877471754111438e-39, sf)                  # 2^-127 (subnormal)
    return tl.where(m, lv * sf, 0.0)


@triton.jit
def _w2_gate_up_kernel(
        x_ptr, codes_ptr, scales_ptr, sorted_ptr, bslot_ptr, act_ptr,
        s_xt, s_xh, s_cs, s_cn, s_ss, s_sn, limit,
        P, TOPK: tl.constexpr, H: tl.constexpr, I: tl.constexpr, HAS_LIMIT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    b = tl.program_id(0)
    nb = tl.program_id(1)
    slot = tl.load(bslot_ptr + b)
    if slot < 0:
        return
    m_idx = tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + b * BLOCK_M + m_idx)
    pmask = pair < P
    tok = (pair // TOPK).to(tl.int64)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    slot64 = slot.to(tl.int64)
    c_base = codes_ptr + slot64 * s_cs
    s_base = scales_ptr + slot64 * s_ss
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < H
        x = tl.load(x_ptr + tok[:, None] * s_xt + kk[None, :] * s_xh,
                    mask=pmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        wg = _w2_tile(c_base, s_base, n, nmask, kk, kmask, s_cn, s_sn)
        wu = _w2_tile(c_base, s_base, n + I, nmask, kk, kmask, s_cn, s_sn)
        acc_g += tl.dot(x, tl.trans(wg), input_precision="ieee")
        acc_u += tl.dot(x, tl.trans(wu), input_precision="ieee")
    if HAS_LIMIT:
        acc_g = tl.minimum(acc_g, limit)
        acc_u = tl.minimum(tl.maximum(acc_u, -limit), limit)
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(act_ptr + pair.to(tl.int64)[:, None] * I + n[None, :], act,
             mask=pmask[:, None] & nmask[None, :])


@triton.jit
def _w2_down_kernel(
        act_ptr, codes_ptr, scales_ptr, sorted_ptr, bslot_ptr, tw_ptr, y_ptr,
        s_cs, s_cn, s_ss, s_sn,
        P, H: tl.constexpr, I: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    b = tl.program_id(0)
    nb = tl.program_id(1)
    slot = tl.load(bslot_ptr + b)
    if slot < 0:
        return
    m_idx = tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + b * BLOCK_M + m_idx)
    pmask = pair < P
    pair64 = pair.to(tl.int64)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < H
    slot64 = slot.to(tl.int64)
    c_base = codes_ptr + slot64 * s_cs
    s_base = scales_ptr + slot64 * s_ss
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < I
        a = tl.load(act_ptr + pair64[:, None] * I + kk[None, :],
                    mask=pmask[:, None] & kmask[None, :], other=0.0)
        w = _w2_tile(c_base, s_base, n, nmask, kk, kmask, s_cn, s_sn)
        acc += tl.dot(a, tl.trans(w), input_precision="ieee")
    tw = tl.load(tw_ptr + pair64, mask=pmask, other=0.0)
    acc = acc * tw[:, None]
    tl.store(y_ptr + pair64[:, None] * H + n[None, :], acc, mask=pmask[:, None] & nmask[None, :])


def _check_pool(hidden: torch.Tensor, pool) -> tuple[int, int]:
    if not isinstance(pool, W2Pool):
        raise TypeError(f"moe_experts_w2_triton needs a W2Pool, got {type(pool).__name__}")
    h = hidden.shape[1]
    two_i = pool.gate_up_codes.shape[1]
    i = two_i // 2
    if (h % 32 or i % 32 or two_i % 2 or pool.gate_up_codes.shape[2] * 4 != h
            or pool.gate_up_scales.shape[1:] != (two_i, h // 32)
            or pool.down_codes.shape[1:] != (h, i // 4) or pool.down_scales.shape[1:] != (h, i // 32)):
        raise ValueError(f"W2 pool shapes {tuple(pool.gate_up_codes.shape)}, {tuple(pool.gate_up_scales.shape)}, "
                         f"{tuple(pool.down_codes.shape)}, {tuple(pool.down_scales.shape)} do not fit H={h}")
    for t in (pool.gate_up_codes, pool.gate_up_scales, pool.down_codes, pool.down_scales):
        if t.stride(-1) != 1:
            raise ValueError("W2 pool tensors need a unit stride in their last dimension")
    return h, i


def _moe_w2_grouped(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    slot_table: torch.Tensor, pool: W2Pool, *, swiglu_limit: float | None = None,
                    block_m: int = BLOCK_M, block_n: int = BLOCK_N, block_k: int = BLOCK_K,
                    act: torch.Tensor | None = None, y: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, AlignedPairs]:
    """The two launches. Returns (y [T, k, H] fp32, already weighted, zero for missed pairs; the
    aligned pairs). act ([T*k, I] fp32) and y may be passed in (tests poison them with NaN)."""
    h, i = _check_pool(hidden, pool)
    t, k = topk_ids.shape
    p = t * k
    dev = hidden.device
    aligned = moe_align_block_size(topk_ids, slot_table, pool.num_slots, block_m)
    if act is None:
        act = torch.empty(p, i, dtype=torch.float32, device=dev)
    if y is None:
        y = torch.empty(t, k, h, dtype=torch.float32, device=dev)
    assert act.shape == (p, i) and act.dtype == torch.float32 and act.is_contiguous()
    assert y.shape == (t, k, h) and y.dtype == torch.float32 and y.is_contiguous()
    tw = topk_weights.reshape(p).to(torch.float32).contiguous()
    nblk = aligned.num_blocks
    if nblk > 0:
        gu_c, gu_s, dn_c, dn_s = pool.gate_up_codes, pool.gate_up_scales, pool.down_codes, pool.down_scales
        _w2_gate_up_kernel[(nblk, triton.cdiv(i, block_n))](
            hidden, gu_c, gu_s, aligned.sorted_ids, aligned.block_slot, act,
            hidden.stride(0), hidden.stride(1), gu_c.stride(0), gu_c.stride(1), gu_s.stride(0), gu_s.stride(1),
            float(swiglu_limit) if swiglu_limit is not None else 0.0,
            p, TOPK=k, H=h, I=i, HAS_LIMIT=swiglu_limit is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
        _w2_down_kernel[(nblk, triton.cdiv(h, block_n))](
            act, dn_c, dn_s, aligned.sorted_ids, aligned.block_slot, tw, y,
            dn_c.stride(0), dn_c.stride(1), dn_s.stride(0), dn_s.stride(1),
            p, H=h, I=i, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    # pairs of non-resident experts contribute zero (no kernel writes them)
    missed = slot_table.long()[topk_ids.long()] < 0
    y.masked_fill_(missed[:, :, None], 0.0)
    return y, aligned


def moe_experts_w2_triton(
    hidden: torch.Tensor,            # [T, H]
    topk_ids: torch.Tensor,          # [T, k] int, expert ids
    topk_weights: torch.Tensor,      # [T, k] float, router weights (already scaled)
    slot_table: torch.Tensor,        # int32 [num_experts], -1 = not resident
    pool: W2Pool,
    miss_counter: torch.Tensor,      # int [1], incremented by the number of missed pairs
    *,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """As moe_experts_reference for a W2Pool (fp32 accumulation, fixed-order combine over k)."""
    y, aligned = _moe_w2_grouped(hidden, topk_ids, topk_weights, slot_table, pool, swiglu_limit=swiglu_limit)
    miss_counter += aligned.num_misses.to(miss_counter.dtype)
    k = topk_ids.shape[1]
    if k == 0:
        return torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    out = y[:, 0]
    for j in range(1, k):                                             # fixed-order combine
        out = out + y[:, j]
    return out.to(hidden.dtype)
