"""Triton FP8 block-128 dense GEMM: y = x @ W^T with W e4m3 [N, K] and DeepSeek-style block
scales weight_scale_inv fp32 [ceil(N/128), ceil(K/128)]; same signature and numerics as
moet.kernels.fp8_gemm_reference.fp8_block_gemm_reference (modes "w8a8" and "w8a16" are defined
there). Importing this module needs triton. e4m3 needs sm_89+ (Ada, Hopper, Blackwell).

One kernel, BLOCK_K = 128 = the scale block, so every K step of a tile multiplies its partial
sum by exactly one weight scale (BLOCK_N divides 128: the tile's rows share one scale row):
  A_MODE 0  (w8a16)  x and W upcast in-register to fp32, acc += dot(x, W) * w_scale; the dot
                     runs on TF32 tensor cores, exact for bf16/fp16 x and e4m3 W (half the
                     bf16 tensor-core rate: this mode is for the memory-bound regime)
  A_MODE 1  (w8a8)   x already e4m3 + per-(token, group) scales from _act_quant_kernel,
                     acc += dot(xq, W) * x_scale * w_scale
  A_MODE 2  (w8a8)   the same with x quantized inside the K loop (no separate launch: the
                     decode regime, where x is a few rows and the launch costs more than the
                     redundant quantization). Same math as _act_quant_kernel, IEEE divisions
                     (div_rn), so modes 1 and 2 give the same bits.
Few rows (decode): the weight bytes dominate and N / BLOCK_N tiles cannot fill the GPU, so K
is split over SPLIT programs writing fp32 partials [SPLIT, M, N] that _split_sum_kernel adds in
fixed order (no atomics: reruns are bit-identical). Many rows (prefill): 128x128 tiles,
grouped launch order for L2 reuse of W, no split.
Launch configs: `pick_config` (table by M; the split from the SM count), overridable per call
(moet.bench.fp8_gemm_bench sweeps them).
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from moet.kernels.fp8_gemm_reference import MODES
from moet.kernels.launch_tables import device_name as _device_name

BLOCK = 128
E4M3_MAX = tl.constexpr(448.0)   # a constexpr: jitted code reads only constexpr globals


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int
    block_n: int
    split: int          # K split (1 = none); clipped to the number of K blocks
    num_warps: int
    num_stages: int
    group_m: int = 8
    inline_quant: bool = True   # w8a8 only: quantize x inside the GEMM (A_MODE 2) or in a launch before (1)


@triton.jit
def _round_to_e4m3(v):
    """fp32 v (|v| <= 448) rounded to the nearest e4m3 value (ties to even), still fp32, so the
    cast that follows is exact. Done by hand because Triton's interpreter rounds fp32 -> e4m3
    wrongly where the mantissa carries into the exponent (124.7 -> 64); the GPU's cvt.rn is
    right, and this costs a few integer ops per activation element, not per weight."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # keep 3 mantissa bits
    sub = ((v * 512.0 + 12582912.0) - 12582912.0) * 0.001953125     # spacing 2^-9 below 2^-6 (subnormals)
    return tl.where(tl.abs(v) < 0.015625, sub, normal)


@triton.jit
def _quant_tile(x, kmask):
    """x fp32 [R, 128] (zeros outside kmask) -> (e4m3 [R, 128], scales fp32 [R])."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, E4M3_MAX), 1.0)
    q = tl.math.div_rn(x, scale[:, None])
    q = tl.minimum(tl.maximum(q, -E4M3_MAX), E4M3_MAX)
    return _round_to_e4m3(q).to(tl.float8e4nv), scale


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, s_xm, s_qm, s_sm,
                      ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    kb = tl.program_id(1)
    k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    rmask = rows < M
    kmask = k < K
    m = rmask[:, None] & kmask[None, :]
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * s_xm + k[None, :], mask=m, other=0.0).to(tl.float32)
    q, scale = _quant_tile(x, kmask)
    tl.store(q_ptr + r64[:, None] * s_qm + k[None, :], q, mask=m)
    tl.store(s_ptr + r64 * s_sm + kb, scale, mask=rmask)


@triton.jit
def _fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, c_ptr,
                     M, N, K, s_am, s_asm, s_wn, s_wsn, s_cm, s_split,
                     KB_PER_SPLIT: tl.constexpr, A_MODE: tl.constexpr, DOT_IEEE: tl.constexpr, HAS_BIAS: tl.constexpr,
                     SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row tiles sweep the N tiles together, so W tiles are reused from L2
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    nmask = rn < N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    ws_row = ws_ptr + ((pid_n * BLOCK_N) // BLOCK_K) * s_wsn   # BLOCK_N divides 128
    num_kb = (K + BLOCK_K - 1) // BLOCK_K

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # the last split may run past K: its extra steps are fully masked (k >= K) and add zero
    for i in range(0, KB_PER_SPLIT):
        kb = sid * KB_PER_SPLIT + i
        k = kb * BLOCK_K + rk
        kmask = k < K
        w = tl.load(w_ptr + rn64[:, None] * s_wn + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        w_scale = tl.load(ws_row + kb, mask=kb < num_kb, other=0.0)
        amask = mmask[:, None] & kmask[None, :]
        if A_MODE == 0:
            # fp32 operands: TF32 tensor cores multiply bf16 / fp16 x and e4m3 W exactly (<= 10
            # mantissa bits each); fp32 x takes the IEEE path. (Also: Triton's interpreter
            # computes bf16 dots wrongly, so a bf16 dot could not be tested on CPU.)
            x = tl.load(a_ptr + rm64[:, None] * s_am + k[None, :], mask=amask, other=0.0).to(tl.float32)
            if DOT_IEEE:
                part = tl.dot(x, tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                part = tl.dot(x, tl.trans(w.to(tl.float32)), input_precision="tf32")
            acc += part * w_scale
        else:
            if A_MODE == 1:
                xq = tl.load(a_ptr + rm64[:, None] * s_am + k[None, :], mask=amask, other=0.0)
                x_scale = tl.load(as_ptr + rm64 * s_asm + kb, mask=mmask, other=1.0)
            else:
                x = tl.load(a_ptr + rm64[:, None] * s_am + k[None, :], mask=amask, other=0.0).to(tl.float32)
                xq, x_scale = _quant_tile(x, kmask)
            acc += tl.dot(xq, tl.trans(w)) * (x_scale[:, None] * w_scale)

    cmask = mmask[:, None] & nmask[None, :]
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + rm64[:, None] * s_cm + rn64[None, :], acc.to(c_ptr.dtype.element_ty), mask=cmask)
    else:
        tl.store(c_ptr + sid * s_split + rm64[:, None] * s_cm + rn64[None, :], acc, mask=cmask)


@triton.jit
def _split_sum_kernel(p_ptr, bias_ptr, c_ptr, MN, N, s_split, SPLIT: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """c = ((p[0] + p[1]) + p[2]) + ... (+ bias): a fixed order, so reruns are bit-identical."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < MN
    acc = tl.load(p_ptr + i, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(p_ptr + s * s_split + i, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + i % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + i, acc.to(c_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: keep the split path exercised at tiny shapes


# Measured best configs: {device name: {"NxK": {mode: {"T": Fp8GemmConfig fields}}}}, written by
# `python -m moet.bench.fp8_gemm_bench --sweep` ($OUT/fp8_gemm_configs.json, copied here).
TABLE_PATH = Path(__file__).with_name("fp8_gemm_configs.json")


@functools.lru_cache(maxsize=None)
def _table() -> dict:
    return json.loads(TABLE_PATH.read_text()) if TABLE_PATH.exists() else {}


# Past the largest swept T a shape's entry stands in only if that T is a prefill size: a sweep cut
# short by its time budget (one stopped at T = 16 on some shapes) must not hand a 16-row decode
# tile to a 2048-row prefill; the defaults below take it instead.
TABLE_EXTRAPOLATE_FROM_T = 2048


def table_config(m: int, n: int, k: int, mode: str, device: torch.device) -> Fp8GemmConfig | None:
    """The measured config of the smallest swept T >= m (past the largest, that one's if it is a
    prefill size, TABLE_EXTRAPOLATE_FROM_T), if the table has this device, shape and mode."""
    entry = _table().get(_device_name(device), {}).get(f"{n}x{k}", {}).get(mode)
    if not entry:
        return None
    ts = sorted(int(t) for t in entry)
    if m > ts[-1] and ts[-1] < TABLE_EXTRAPOLATE_FROM_T:
        return None
    t = next((t for t in ts if t >= m), ts[-1])
    return Fp8GemmConfig(**entry[str(t)])


# w8a8 with few rows: quantize x inside the GEMM (A_MODE 2) only while few programs share each
# K block of x. Every N tile requantizes the same x, and the quantization's IEEE divisions are a
# software routine: the sm_90 AOT loop step of the 16 x 64 tile is several times longer inline
# than reading x pre-quantized (A_MODE 1), whose cost is one more small launch. On a wide weight
# (DeepSeek-V3's 129280 x 7168 head) at T = 1 the inline form was several times slower than w8a16
# on the H200 (docs/kernels.md, FP8 GEMM), hence the bound on the N tiles.
INLINE_QUANT_MAX_N_TILES = 16


def pick_config(m: int, n: int, k: int, mode: str, device: torch.device) -> Fp8GemmConfig:
    """Launch config: the measured table (table_config) where it has the shape, else by row
    count (first guesses sized for the H200). Few rows: split K until ~2 programs per SM."""
    cfg = table_config(m, n, k, mode, device)
    if cfg is not None:
        return cfg
    num_kb = triton.cdiv(k, BLOCK)
    if m <= 64:
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        bn = 64
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        split = max(1, min(num_kb, triton.cdiv(2 * _num_sms(device), tiles)))
        inline = triton.cdiv(n, bn) <= INLINE_QUANT_MAX_N_TILES
        return Fp8GemmConfig(bm, bn, split, num_warps=4, num_stages=4, inline_quant=inline)
    if m <= 256:
        # w8a16's TF32 dots: 32-row tiles (faster than 64 rows on every swept shape at T = 128
        # on the H200); w8a8's f16 dots keep 64
        bm = 32 if mode == "w8a16" else 64
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, 128)
        split = max(1, min(num_kb, triton.cdiv(_num_sms(device), tiles)))
        return Fp8GemmConfig(bm, 128, split, num_warps=4, num_stages=4, inline_quant=False)
    return Fp8GemmConfig(128, 128, 1, num_warps=8, num_stages=3, inline_quant=False)


def num_splits(k: int, cfg: Fp8GemmConfig) -> int:
    """The K split actually launched: cfg.split, evened out over the ceil(K/128) blocks."""
    num_kb = triton.cdiv(k, BLOCK)
    return triton.cdiv(num_kb, triton.cdiv(num_kb, max(1, cfg.split)))


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, mode: str) -> tuple[int, int]:
    if mode not in MODES:
        raise ValueError(f"fp8 GEMM mode {mode!r}; expected one of {MODES}")
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"weight must be a row-major float8_e4m3fn [N, K], got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has K={x.shape[-1]}, weight {tuple(weight.shape)}")
    want = (triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK))
    if weight_scale_inv.dtype != torch.float32 or tuple(weight_scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv must be float32 [{triton.cdiv(n, BLOCK)}, {triton.cdiv(k, BLOCK)}], "
                         f"got {weight_scale_inv.dtype} {tuple(weight_scale_inv.shape)}")
    return n, k


def act_quant_triton(x: torch.Tensor, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """As act_quant_reference: x [M, K] -> (e4m3 [M, K], fp32 scales [M, ceil(K/128)])."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, triton.cdiv(k, BLOCK), dtype=torch.float32, device=x.device)
    if m:
        _act_quant_kernel[(triton.cdiv(m, rows), triton.cdiv(k, BLOCK))](
            x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), ROWS=rows, BLOCK_K=BLOCK, num_warps=4)
    return q, s


# ---------------------------------------------------------------- the split-K frame (fp8, nvfp4)

def gemm_rows(x: torch.Tensor, k: int) -> tuple[torch.Size, torch.Tensor]:
    """(leading shape, x as row-major [M, K]) of a GEMM's input x [..., K]."""
    x2 = x.reshape(-1, k)
    return x.shape[:-1], (x2 if x2.stride(1) == 1 else x2.contiguous())


def split_target(out: torch.Tensor, partials: torch.Tensor | None, split: int
                 ) -> tuple[torch.Tensor, int, int, torch.Tensor | None]:
    """Where a GEMM kernel of `split` K ranges writes: out [M, N] itself (no split) or fp32
    partials [split, M, N] (made here unless given: tests poison them) -> (c, row stride, split
    stride, partials)."""
    if split == 1:
        return out, out.stride(0), 0, None
    m, n = out.shape
    if partials is None:
        partials = torch.empty(split, m, n, dtype=torch.float32, device=out.device)
    assert partials.shape == (split, m, n) and partials.dtype == torch.float32 and partials.is_contiguous()
    return partials, n, m * n, partials


def sum_splits(partials: torch.Tensor | None, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out = the partials summed in a fixed order (+ bias); nothing without a split."""
    if partials is None:
        return
    m, n = out.shape
    blk = 1024
    _split_sum_kernel[(triton.cdiv(m * n, blk),)](
        partials, bias if bias is not None else partials, out, m * n, n, m * n,
        SPLIT=partials.shape[0], HAS_BIAS=bias is not None, BLOCK=blk, num_warps=4)


def fp8_block_gemm_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, *,
                          mode: str = "w8a8", bias: torch.Tensor | None = None,
                          config: Fp8GemmConfig | None = None, partials: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype. `partials` (fp32 [split, M, N]) may be passed in
    (tests poison it)."""
    n, k = _check(x, weight, weight_scale_inv, mode)
    lead, x2 = gemm_rows(x, k)
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, n)
    cfg = config or pick_config(m, n, k, mode, x.device)
    if cfg.block_n > BLOCK or BLOCK % cfg.block_n:
        raise ValueError(f"block_n {cfg.block_n} must divide {BLOCK} (one weight scale row per tile)")
    split = num_splits(k, cfg)
    kb_per_split = triton.cdiv(triton.cdiv(k, BLOCK), split)
    a, a_scale, a_mode = x2, x2, 0
    if mode == "w8a8":
        if cfg.inline_quant:
            a_mode = 2
        else:
            a, a_scale = act_quant_triton(x2)
            a_mode = 1
    c, s_cm, s_split, partials = split_target(out, partials, split)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), split)
    _fp8_gemm_kernel[grid](
        a, a_scale, weight, weight_scale_inv, bias if bias is not None else weight_scale_inv, c,
        m, n, k, a.stride(0), a_scale.stride(0), weight.stride(0), weight_scale_inv.stride(0), s_cm, s_split,
        KB_PER_SPLIT=kb_per_split, A_MODE=a_mode, DOT_IEEE=x.dtype == torch.float32,
        HAS_BIAS=bias is not None and split == 1,
        SPLIT=split, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    sum_splits(partials, bias, out)
    return out.reshape(*lead, n)
