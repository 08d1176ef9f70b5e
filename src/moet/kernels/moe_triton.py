"""Triton grouped MoE over W2 and FP4 expert pools: moe_experts_w2_triton and
moe_experts_fp4_triton, with moe_experts_reference's signature and semantics
(moet.kernels.reference). This module is the Python driver: the launch configuration, the
workspaces and the launches of one layer, described below. The kernels live beside it:
moe_align.py and moe_align_triton.py (the slot alignment, step 1), moe_gemm.py (the grouped GEMMs, the SwiGLU finish,
the combine: steps 2 to 4), moe_tiles.py (the device functions those are built from: weight
decoders, dots, tile loads). Importing this module needs triton.

Pipeline (decode: 4 launches, 5 with split-K on gate/up; no host synchronisation, no atomics;
CUDA-graph capturable in both regimes):
  1. slot alignment: the (token, expert) pairs grouped by pool SLOT (through the slot table)
     into tiles of BM pairs, one slot per tile, each resident slot's pairs in as few tiles as
     possible, so each active expert's bytes are read once per tile. Misses (slot -1) are
     dropped and counted into the device miss counter. Up to SMALL_ALIGN_MAX_PAIRS pairs
     (decode) this is one Triton program of _prep_small_kernel, whose other programs copy the
     hidden states into the slot-major order below; above it the sort-based
     moe_align_block_size and a torch copy (prefill).
  2. gate/up: per (row block of I, tile, K split): gate rows n and up rows I + n of the tile's
     slot against the tile's token rows; without split-K the SwiGLU (clamp in fp32 where
     given) runs in the epilogue and writes act [P, I]; with split-K the fp32 partials go to a
     workspace and
  2b. _swiglu_finish_kernel sums them in split order and writes act.
  3. down: per (row block of H, tile, K split): fp32 partials y_s [P, H].
  4. _combine_kernel: out[t] = sum_j w[t, j] * sum_s y_s[t * k + j] in the fixed order
     j = 0..k-1, s = 0..SPLIT_K-1; pairs of non-resident experts are skipped (zero).
Every output element has one writer and a fixed summation order: reruns are bit-identical,
and an expert gives the same bits whichever slot holds it.
The weight tile is the MMA's A operand, decoded in registers (the device functions of
moet.kernels.moe_tiles); the activation rows (padded to
BM, masked rows read nothing) are the B operand. Codes are read as 16-bit units (8 W2 / 4 FP4
weights); the K order inside a unit is split into slot tensors (slot p = weight UPW * u + p),
one tl.dot per slot. The activations are kept slot-major per row (hidden is copied so once per
call, [T, UPW, H / UPW]; the gate/up epilogue writes act so), so each slot's tile is one
contiguous, cp.async-pipelined load. (Splitting a natural-order tile in registers instead
costs 16-bit shared-memory stores and a fence before every wgmma, and was slower on the H200.)
  W2 (pool layout "nb8", moet.formats.w2.to_nb8): one LOP3 + one IMAD per two bf16 weights,
     the UE8M0 scale folded into the exponent (NB8_ASM; docs/kernels.md, W2 decode). Exact
     for scale bytes 1..252 (the range any bf16/fp32 source produces); byte 0 decodes the +-1
     level as +-0 instead of +-2^-127.
  FP4 (NVFP4 bytes as in the checkpoint): per bf16 pair the e2m1 bits are placed under a bf16
     exponent bias of 2^-126 (shift + mask) and multiplied (fma.rn.bf16x2) by the group's e4m3
     scale times 2^118, which is exact (<= 6 significant bits); the remaining 2^8 and the
     per-tensor scale_2 multiply the fp32 accumulator.
Operands are bf16 with fp32 accumulation on the GPU: the weights are exact in bf16, the
activations of gate/up are the bf16 hidden states, and the SwiGLU output is rounded to bf16
before the down projection (as vLLM's fused_moe does), so against the fp32 reference
||out - ref|| / ||ref|| is a few 1e-3 on the H200 at real shapes, asserted <= 1e-2. (An fp32
hidden input is rounded to bf16 as well.) An e4m3 NaN scale byte (0x7F)
decodes as 480 below sm_89 and as NaN from sm_89 on (NVFP4 encoders never write it).
Under TRITON_INTERPRET=1 (CPU tests) the inline asm cannot run: the same bits are built with
plain Triton integer ops in fp32, dots are fp32 "ieee" and act stays fp32 (bound 1e-5).
Launch configurations: moet.kernels.moe_configs (table in the repo, tuning script
benchmarks/kernels/tune_moe.py). Measured speed and its limits: docs/perf.md.
"""
from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch
import triton

from moet.kernels.grid_sync import COUNTERS, device_counters
from moet.kernels.launch_tables import device_name as _device_name
from moet.kernels.moe_align import moe_align_block_size
from moet.kernels.moe_align_triton import _prep_small_kernel
from moet.kernels.moe_configs import SMALL_ALIGN_MAX_PAIRS, MoEConfig, lookup
from moet.kernels.moe_gemm import _combine_kernel, _moe_gemm_kernel, _swiglu_finish_kernel
from moet.kernels.pools import FP4Pool, W2Pool
from moet.kernels.reference import SILU, ExpertActivation

FMT_W2 = 0
FMT_FP4 = 1
# prefill workspaces (fp32 partial outputs [SPLIT_K, P, H]) are capped by chunking the tokens
MAX_WORKSPACE_BYTES = 1 << 30


# ====================================================================================== driver

def asm_level(device: torch.device) -> int:
    """The kernels' USE_ASM constexpr: 0 under the interpreter (plain-Triton decoders, fp32 dots),
    1 on a GPU (inline-asm decoders, bf16 dots), 2 on a GPU that also converts e4m3 natively
    (sm_89+: the FP4 scales through Triton's float8e4nv)."""
    if device.type != "cuda":
        return 0
    return _cuda_asm_level(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_asm_level(index: int) -> int:          # once per device: every MoE layer call asks
    return 2 if torch.cuda.get_device_capability(index) >= (8, 9) else 1


def _workspace(shape, dtype, device) -> torch.Tensor:
    """Every buffer the kernels write (tests replace this to poison them)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _format(pool) -> tuple[int, str]:
    if isinstance(pool, W2Pool):
        if pool.layout not in ("nb8", "nb8t"):
            raise ValueError(f"the W2 Triton kernels read the nb8 (or row-tiled nb8t) code layout, this pool is "
                             f"{pool.layout!r}: convert its codes with moet.formats.w2.to_nb8 (moet.quant.requantize "
                             "does at fill time)")
        return FMT_W2, "w2"
    if isinstance(pool, FP4Pool):
        if pool.layout not in ("nvfp4", "nvfp4t"):
            raise ValueError(f"the FP4 Triton kernels read the nvfp4 (or row-tiled nvfp4t) layout, this pool is "
                             f"{pool.layout!r}")
        return FMT_FP4, "fp4"
    raise TypeError(f"the Triton MoE kernels take a W2Pool or an FP4Pool, got {type(pool).__name__}")


def _operands(pool, fmt: int):
    """(gate_up units int16 [S, 2I, K/UPW], gate_up scales uint8, gate_up scale_2 fp32,
    down units, down scales, down scale_2) in the kernels' views."""
    if fmt == FMT_W2:
        gu_q, gu_s, dn_q, dn_s = pool.gate_up_codes, pool.gate_up_scales, pool.down_codes, pool.down_scales
        gu_s2 = dn_s2 = gu_s                 # unused by the W2 path; any pointer
    else:
        gu_q, gu_s, dn_q, dn_s = pool.gate_up_weight, pool.gate_up_scale, pool.down_weight, pool.down_scale
        gu_s, dn_s = gu_s.view(torch.uint8), dn_s.view(torch.uint8)
        gu_s2, dn_s2 = pool.gate_up_scale_2.float().contiguous(), pool.down_scale_2.float().contiguous()
    for t in (gu_q, gu_s, dn_q, dn_s):
        if not t.is_contiguous():
            raise ValueError("the expert pool tensors must be contiguous")
    return gu_q.view(torch.int16), gu_s, gu_s2, dn_q.view(torch.int16), dn_s, dn_s2


def _check_shapes(hidden: torch.Tensor, fmt: int, ops) -> tuple[int, int]:
    gu_q, gu_s, _, dn_q, dn_s, _ = ops
    h = hidden.shape[1]
    upw, gs = (8, 32) if fmt == FMT_W2 else (4, 16)
    two_i = gu_q.shape[1]
    i = two_i // 2
    if (two_i % 2 or h % gs or i % gs or gu_q.shape[2] * upw != h or gu_s.shape[1:] != (two_i, h // gs)
            or dn_q.shape[1:] != (h, i // upw) or dn_s.shape[1:] != (h, i // gs)):
        raise ValueError(f"expert pool shapes {tuple(gu_q.shape)}, {tuple(dn_q.shape)} (16-bit units) do not fit "
                         f"hidden size {h}")
    return h, i


FINISH_COUNTERS = COUNTERS                 # (tile | token, row block) pairs of one fused-finish / -combine launch


def _finish_counters(device: torch.device) -> torch.Tensor:
    """The fused finish's and fused combine's counters (grid_sync.device_counters)."""
    return device_counters("moe_triton", device)


def fit_token_tile(config: MoEConfig, pairs: int, num_slots: int) -> MoEConfig:
    """A table config tuned at fewer pairs than this call (the nearest bucket is smaller) can carry
    a token tile far below the pairs each expert now gets: BM 1 at 4 pairs per expert reads every
    expert's weights 4 times. Raise BM to the mean pairs per active slot (power of two, <= 16) when
    the tile is below half of it; never lower a tuned tile. The active slots are the expected
    number of distinct experts among `pairs` uniform draws (GLM-4.5-Air at 32 streams: 256 pairs
    hit ~111 of 128 experts, 2.3 each; counting all 128 slots said 2 and kept BM 1)."""
    if pairs > SMALL_ALIGN_MAX_PAIRS:
        return config
    slots = max(1, num_slots)
    active = max(1.0, min(pairs, slots * (1.0 - (1.0 - 1.0 / slots) ** pairs)))
    mean = pairs / active
    if config.BM >= mean / 2:
        return config
    return replace(config, BM=min(16, 1 << int(math.log2(mean))))


def _align_launch(pp: int) -> dict:
    """Compare-chunk width and warps of the one-program slot alignment: its [PP, QB] compare
    tiles live in registers, and at PP 512 with QB 32 on 4 warps (128 values a thread a tile)
    they spilled and the call took over ten times as long as at PP 256 (H200), so the chunk shrinks
    as PP grows and the program gets 8 warps from PP 256."""
    return dict(QB=max(1, min(pp, 32, 2048 // pp)), num_warps=8 if pp >= 256 else 4)


def _run(hidden, topk_ids, topk_weights, slot_table, pool, miss_counter, act: ExpertActivation,
         config: MoEConfig | None, out: torch.Tensor) -> None:
    fmt, fname = _format(pool)
    ops = _operands(pool, fmt)
    h, i = _check_shapes(hidden, fmt, ops)
    # row-tiled pools (nb8t, nvfp4t: moet.formats.row_tiles): the tiled GEMM path only; 64-row x
    # 256-weight tiles
    tiled = pool.layout in ("nb8t", "nvfp4t")
    if tiled and (h % 256 or i % 256):
        raise ValueError(f"a row-tiled ({pool.layout}) pool needs hidden and intermediate sizes that are multiples of "
                         f"256, got {h} and {i}")
    gu_q, gu_s, gu_s2, dn_q, dn_s, dn_s2 = ops
    t, k = topk_ids.shape
    p = t * k
    dev = hidden.device
    use_asm = asm_level(dev)
    if config is None:
        config = fit_token_tile(lookup(fname, h, i, p, _device_name(dev)), p, gu_q.shape[0])
    # programmatic dependent launch (config.pdl, table-driven): every kernel of the layer starts
    # with griddepcontrol.wait, so the next launch overlaps the kernel before
    pdl = dict(PDL=bool(use_asm) and config.pdl, **({"launch_pdl": config.pdl} if use_asm else {}))
    bm, cg, cd = config.BM, config.gate_up, config.down
    ids = topk_ids.reshape(-1).contiguous()
    table = slot_table.contiguous()
    num_slots = gu_q.shape[0]
    # operands: bf16 on the GPU (tensor cores), fp32 under the interpreter. The activations are
    # stored slot-major per row ([UPW, K / UPW]: element UPW * u + q at q * K / UPW + u), so each
    # slot's K tile is one contiguous load; the gate/up epilogue writes act in that order.
    op_dtype = torch.bfloat16 if use_asm else torch.float32
    upw = 8 if fmt == FMT_W2 else 4
    limit = float(act.limit) if act.limit is not None else 0.0
    has_limit = act.limit is not None
    tw = topk_weights.reshape(-1).contiguous()
    # gpt-oss: gate/up biases by expert id and the alpha activation, in the gate/up epilogue
    bias = act.gate_up_bias.contiguous() if act.gate_up_bias is not None else tw     # any pointer when none
    act_args = dict(bias_ptr=bias, alpha=float(act.alpha) if act.alpha is not None else 1.0,
                    HAS_BIAS=act.gate_up_bias is not None, HAS_ALPHA=act.alpha is not None)
    x_perm = _workspace((t, upw, h // upw), op_dtype, dev)
    # the top-k combine in the down GEMM's last programs (MoEConfig.fused_combine): one launch fewer;
    # decode regime only (the prep kernel zeroes the rows of tokens no pair writes)
    fuse_combine = (config.fused_combine and p <= SMALL_ALIGN_MAX_PAIRS
                    and t * triton.cdiv(h, cd.BN) <= FINISH_COUNTERS)
    if p <= SMALL_ALIGN_MAX_PAIRS:
        nb = min(p, p // bm + min(p, num_slots))
        pp = triton.next_power_of_2(p)
        sorted_ids = _workspace((nb * bm,), torch.int32, dev)
        bslot = _workspace((nb,), torch.int32, dev)
        nblk = _workspace((pp,), torch.int32, dev)
        bh = min(2048, triton.next_power_of_2(h))
        _prep_small_kernel[(1 + t * triton.cdiv(h, bh),)](
            ids, table, sorted_ids, bslot, nblk, miss_counter, p, nb, hidden, x_perm, hidden.stride(0), out,
            H=h, UPW=upw, BH=bh, BM=bm, PP=pp, FILL=1024, ZERO_OUT=fuse_combine, **_align_launch(pp), **pdl)
    else:
        aligned = moe_align_block_size(topk_ids, slot_table, num_slots, bm)
        sorted_ids, bslot, nb = aligned.sorted_ids, aligned.block_slot, aligned.num_blocks
        miss_counter += aligned.num_misses.to(miss_counter.dtype)
        x_perm.copy_(hidden.view(t, h // upw, upw).transpose(1, 2))
    act = _workspace((p, i), op_dtype, dev)
    common = dict(TOPK=k, FMT=fmt, HAS_LIMIT=has_limit, USE_ASM=use_asm, BM=bm)
    if cg.SPLIT_K == 1:
        gu_out = act
    else:
        gu_out = _workspace((cg.SPLIT_K, p, 2 * i), torch.float32, dev)
    # the SwiGLU finish of a split gate/up in its last programs (MoEConfig.fused_finish): one launch less
    fuse_finish = config.fused_finish and cg.SPLIT_K > 1 and nb * triton.cdiv(i, cg.BN) <= FINISH_COUNTERS
    cnt = _finish_counters(dev) if fuse_finish else gu_out          # any pointer when not fused
    _moe_gemm_kernel[(triton.cdiv(i, cg.BN), nb, cg.SPLIT_K)](
        x_perm, gu_q, gu_s, gu_s2, sorted_ids, bslot, gu_out, act, cnt, ids, table, tw, h, gu_q.stride(0),
        gu_s.stride(0), limit, p, N=i, K=h, GATE_UP=True, SPLIT_K=cg.SPLIT_K, BN=cg.BN, BKH=cg.BKH,
        FUSED_FINISH=fuse_finish, FUSED_COMBINE=False, UNROLL=cg.unroll, TILED=tiled, CHAINS=cg.chains,
        KW2=cg.kwidth2, **_even_tiles(i, h, fmt, cg, bm), num_warps=cg.num_warps,
        num_stages=cg.num_stages, **act_args,
        **common, **pdl)
    if cg.SPLIT_K > 1 and not fuse_finish:
        bi = min(1024, triton.next_power_of_2(i))
        _swiglu_finish_kernel[(p, triton.cdiv(i, bi))](gu_out, act, ids, table, limit, p, I=i, UPW=upw,
                                                         SPLIT_K=cg.SPLIT_K,
                                                         HAS_LIMIT=has_limit, BI=bi, num_warps=4, **act_args, **pdl)
    y = _workspace((cd.SPLIT_K, p, h), torch.float32, dev)
    # the counters are shared with the fused finish: each launch leaves them zero, and the down
    # launch starts after the gate/up one has finished (stream order; under PDL its griddepcontrol.wait)
    cnt = _finish_counters(dev) if fuse_combine else y
    _moe_gemm_kernel[(triton.cdiv(h, cd.BN), nb, cd.SPLIT_K)](
        act, dn_q, dn_s, dn_s2, sorted_ids, bslot, y, out, cnt, ids, table, tw, act.stride(0), dn_q.stride(0),
        dn_s.stride(0), limit, p, N=h, K=i, GATE_UP=False, SPLIT_K=cd.SPLIT_K, BN=cd.BN, BKH=cd.BKH,
        FUSED_FINISH=False, FUSED_COMBINE=fuse_combine, UNROLL=cd.unroll, TILED=tiled, CHAINS=cd.chains,
        KW2=cd.kwidth2, **_even_tiles(h, i, fmt, cd, bm), num_warps=cd.num_warps,
        num_stages=cd.num_stages, PREFETCH=prefetch_points(config, fmt, i, tiled) if pdl["PDL"] else 0,
        PREFETCH_STEPS=config.down_prefetch_steps,
        **common, **pdl)
    if not fuse_combine:
        bh = min(1024, triton.next_power_of_2(h))
        _combine_kernel[(t, triton.cdiv(h, bh))](y, ids, table, tw, out, p, H=h, TOPK=k, SPLIT_K=cd.SPLIT_K,
                                                 BH=bh, num_warps=4, **pdl)


# Tiles that divide their GEMM exactly run with constant (all-true) K / row masks, so the loads lose
# their predicates and selects (moe_gemm's EVEN_K / EVEN_N; the same values are loaded, the same
# bits). A switch for A/B timing (benchmarks/kernels/tune_moe.py --masked-tiles), not a user setting.
UNMASK_EVEN_TILES = True
# On such tiles with at most X_CLAMP_MAX_BM pairs the x loads lose their pair mask too (X_CLAMP:
# padding rows read a real row whose product column is dropped): the same bits. Only below BM 4,
# where x goes straight to registers: from BM 4 on it is staged by cp.async, which zero-fills a
# masked row without reading it, so a clamped row costs a real read (on the H200 clamping was
# slower at BM 8 and a little faster at BM 1, DeepSeek-V3 W2, T = 1). A/B switch (tune_moe.py
# --masked-x), not a setting.
CLAMP_X_ROWS = True
X_CLAMP_MAX_BM = 2


def _even_tiles(n: int, k: int, fmt: int, c, bm: int) -> dict:
    """EVEN_K / EVEN_N / X_CLAMP for a GEMM of N rows (each half, for gate/up) over K weights with
    launch c and bm pairs a tile."""
    if not UNMASK_EVEN_TILES:
        return {}
    units = k // (8 if fmt == FMT_W2 else 4)
    even_k = units % c.BKH == 0 and triton.cdiv(units, c.BKH) % c.SPLIT_K == 0
    return dict(EVEN_K=even_k, EVEN_N=n % c.BN == 0, X_CLAMP=even_k and CLAMP_X_ROWS and bm <= X_CLAMP_MAX_BM)


def prefetch_points(config: MoEConfig, fmt: int, k: int, tiled: bool) -> int:
    """The down GEMM's L2 prefetch points per row (_prefetch_slab; 0 = none): MoEConfig.down_prefetch
    over a K of k weights split as config.down says."""
    if not config.down_prefetch:
        return 0
    c = config.down
    units = k // (8 if fmt == FMT_W2 else 4)
    per = triton.cdiv(triton.cdiv(units, c.BKH), c.SPLIT_K)
    if config.down_prefetch_steps:
        per = min(per, config.down_prefetch_steps)
    pstep = (32 if fmt == FMT_W2 else 64) if tiled else 64
    return triton.next_power_of_2(triton.cdiv(per * c.BKH, pstep))


def moe_experts_triton(
    hidden: torch.Tensor,            # [T, H]
    topk_ids: torch.Tensor,          # [T, k] int, expert ids
    topk_weights: torch.Tensor,      # [T, k] float, router weights (already scaled)
    slot_table: torch.Tensor,        # int32 [num_experts], -1 = not resident
    pool: W2Pool | FP4Pool,
    miss_counter: torch.Tensor,      # int [1], incremented by the number of missed pairs
    *,
    act: ExpertActivation = SILU,
    config: MoEConfig | None = None,
) -> torch.Tensor:
    """moe_experts_reference for a W2Pool (layout nb8) or an FP4Pool, on the GPU (or the Triton
    interpreter). Long prefills run in token chunks that keep the fp32 workspace <= 1 GiB."""
    _format(pool)
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    t, k = topk_ids.shape
    out = _workspace(hidden.shape, hidden.dtype, hidden.device)
    if t == 0:
        return out
    if k == 0:
        return out.zero_()
    h = hidden.shape[1]
    split = config.down.SPLIT_K if config is not None else 1
    chunk = max(SMALL_ALIGN_MAX_PAIRS // k + 1, MAX_WORKSPACE_BYTES // (k * h * 4 * split))
    for t0 in range(0, t, chunk):
        t1 = min(t, t0 + chunk)
        _run(hidden[t0:t1], topk_ids[t0:t1], topk_weights[t0:t1], slot_table, pool, miss_counter,
             act, config, out[t0:t1])
    return out


def moe_experts_w2_triton(hidden, topk_ids, topk_weights, slot_table, pool: W2Pool, miss_counter, *,
                          act: ExpertActivation = SILU, config: MoEConfig | None = None) -> torch.Tensor:
    """As moe_experts_reference for a W2Pool in the nb8 layout."""
    if not isinstance(pool, W2Pool):
        raise TypeError(f"moe_experts_w2_triton needs a W2Pool, got {type(pool).__name__}")
    return moe_experts_triton(hidden, topk_ids, topk_weights, slot_table, pool, miss_counter,
                              act=act, config=config)


def moe_experts_fp4_triton(hidden, topk_ids, topk_weights, slot_table, pool: FP4Pool, miss_counter, *,
                           act: ExpertActivation = SILU, config: MoEConfig | None = None) -> torch.Tensor:
    """As moe_experts_reference for an FP4Pool (NVFP4 bytes)."""
    if not isinstance(pool, FP4Pool):
        raise TypeError(f"moe_experts_fp4_triton needs an FP4Pool, got {type(pool).__name__}")
    return moe_experts_triton(hidden, topk_ids, topk_weights, slot_table, pool, miss_counter,
                              act=act, config=config)
