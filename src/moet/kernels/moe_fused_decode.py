"""One-launch MoE decode for a few tokens (MoEConfig.fused, up to FUSED_MAX_PAIRS pairs): the
whole routed-expert layer -- gate/up + SwiGLU, down, the fixed-order top-k combine -- in one
persistent Triton launch, with moe_experts_reference's semantics.

Why: at T = 1 the layer streams only 39 MB (GLM-4.5-Air), ~10 us at the H200's bandwidth, and the
tiled path's 4 launches each ramp the whole GPU up and drain it; register-A wgmma GEMVs that reach
most of the bandwidth on their own still lose that at T = 1 to the launch boundaries
(docs/kernels.md, MoE). Token-major (2 launches) lost to the tiled path on its down projection's
serial walk over the k experts. Here there is one launch and no serial walk: the work
items are (pair, gate/up row block) then (pair, down row block), handed out round-robin to a
grid of at most one program per SM, and the dependencies become counters in global memory:

  gate/up item (p, nb): act[p][rows nb] = SwiGLU(...)      -> ready[p] += 1
  down item (p, hb):    wait ready[p] == NA (every gate/up block of p stored),
                        y[p][rows hb] = W_down[slot p] @ act[p] (fp32)
                        -> the last of the k pairs of token t to finish block hb (tile[t, hb]
                           reaches k) sums y[t k + j][rows hb] * w[t, j] for j = 0..k-1 in that
                           order into out[t][rows hb]

Every output element has one writer and a fixed summation order (whoever arrives last, the sum
is the same), so reruns are bit-identical and an expert gives the same bits in any slot; act
is the token-major path's (same tile code), so the two agree bit for bit.

No deadlock: a program waits only in a down item, and only for gate/up items, which come first
in the item order and never wait. Each program takes its items in increasing order, so an
unfinished gate/up item belongs to a program that is running, not waiting, provided every
program is resident at once: the grid is at most one program per SM, and the kernel never lets
a later launch start early (no griddepcontrol.launch_dependents: PDL only waits for the kernel
before). Kernels of other streams (the shared-expert overlap) may delay programs, not block them.
Under the interpreter, which runs programs one after another, the grid is one program, so items
run in order and no wait ever spins.

Counters: ready[p] and tile[t, hb] live in a zeroed int32 buffer per device and are zero again
when the kernel ends: the last reader of each resets it (ready[p] also counts its ND readers:
the one that brings it to NA + ND writes 0; tile[t, hb]'s last arriver writes 0 after its
sum), so consecutive layers and CUDA-graph replays need no memset. A pair whose expert is not
resident writes nothing, is counted once into the miss counter and adds zero; its items still
signal and wait like any other, so liveness never depends on two items reading the slot table
alike.

Memory ordering (kernels/grid_sync.py): a producer's stores, then fence.acq_rel.gpu in every
thread, a CTA barrier and the atomic; a consumer's acquire atomic, the fence and a barrier, then
loads that bypass L1 (.cg: act and y were written by other SMs during this launch).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moet.kernels.grid_sync import COUNTERS, device_counters
from moet.kernels.grid_sync import gpu_fence as _gpu_fence
from moet.kernels.grid_sync import signal as _signal
from moet.kernels.grid_sync import wait_at_least as _wait_at_least
from moet.kernels.moe_configs import FUSED_MAX_PAIRS
from moet.kernels.moe_tiles import _pdl_wait
from moet.kernels.moe_token_major import _down_rows, _tm_gate_up_item

# ready[P] then tile[T, ND]: at most FUSED_MAX_PAIRS + FUSED_MAX_PAIRS * cdiv(H, BN) ints
_COUNTER_INTS = COUNTERS


def _zeroed_counters(device: torch.device, n: int) -> torch.Tensor:
    """The device's counter buffer (zero between launches, see the module doc). Made on the first
    call, which CUDA-graph warm-up runs before capture."""
    if n > _COUNTER_INTS:
        raise ValueError(f"the fused MoE decode needs {n} counters, more than {_COUNTER_INTS}: use a larger down BN")
    return device_counters("moe_fused_decode", device)


@triton.jit
def _fused_decode_kernel(x_ptr, ids_ptr, table_ptr, tw_ptr, gq_ptr, gs_ptr, gs2_ptr, dq_ptr, ds_ptr, ds2_ptr,
                         act_ptr, y_ptr, out_ptr, cnt_ptr, miss_ptr,
                         s_x, s_gq, s_gs, s_dq, s_ds, s_out, limit, P, NPROG,
                         ROUNDS: tl.constexpr, H: tl.constexpr, I: tl.constexpr, TOPK: tl.constexpr, FMT: tl.constexpr,
                         HAS_LIMIT: tl.constexpr, USE_ASM: tl.constexpr, BNA: tl.constexpr, BKA: tl.constexpr,
                         BND: tl.constexpr, BKD: tl.constexpr, PDL: tl.constexpr):
    """Grid (NPROG,): items it = pid, pid + NPROG, ... of [P x NA gate/up items, P x ND down
    items] (module doc). cnt_ptr: ready[P], then tile[T, ND]."""
    _pdl_wait(PDL)
    NA: tl.constexpr = (I + BNA - 1) // BNA
    ND: tl.constexpr = (H + BND - 1) // BND
    n_gate_up = P * NA
    total = n_gate_up + P * ND
    pid = tl.program_id(0)
    for r in range(ROUNDS):                     # ROUNDS = cdiv(total, NPROG): item pid + r NPROG
        it = pid + r * NPROG
        if it < n_gate_up:
            p = it // NA
            _tm_gate_up_item(it % NA, p, x_ptr, ids_ptr, table_ptr, gq_ptr, gs_ptr, gs2_ptr, act_ptr, miss_ptr,
                             s_x, s_gq, s_gs, limit, I, H, TOPK, FMT, HAS_LIMIT, USE_ASM, BNA, BKA)
            # signalled whatever the slot: no wait may hang on what one item read of the slot table
            _signal(cnt_ptr + p, USE_ASM)
        elif it < total:
            d = it - n_gate_up
            p = d // ND
            hb = d % ND
            t = p // TOPK
            slot = tl.load(table_ptr + tl.load(ids_ptr + p))
            n = hb * BND + tl.arange(0, BND)
            nmask = n < H
            _wait_at_least(cnt_ptr + p, NA, USE_ASM)
            if slot >= 0:
                acc = _down_rows(act_ptr + p.to(tl.int64) * I, slot, n, nmask, dq_ptr, ds_ptr, ds2_ptr, s_dq, s_ds,
                                 I, FMT, USE_ASM, BND, BKD, ".cg")
                tl.store(y_ptr + p.to(tl.int64) * H + n[:, None], acc, mask=nmask[:, None])
            # ready[p] counts its ND readers too; the last one leaves it at zero for the next launch
            if tl.atomic_add(cnt_ptr + p, 1, sem="relaxed") == NA + ND - 1:
                tl.atomic_xchg(cnt_ptr + p, 0, sem="relaxed")
            tile = cnt_ptr + P + t * ND + hb
            if _signal(tile, USE_ASM) == TOPK - 1:          # the token's last pair for this block: combine
                _gpu_fence(USE_ASM)
                tl.debug_barrier()
                o = tl.zeros([BND, 1], dtype=tl.float32)
                for j in tl.static_range(TOPK):
                    pr = t * TOPK + j
                    sj = tl.load(table_ptr + tl.load(ids_ptr + pr))
                    w = tl.load(tw_ptr + pr).to(tl.float32)
                    v = tl.load(y_ptr + pr.to(tl.int64) * H + n[:, None], mask=nmask[:, None] & (sj >= 0), other=0.0,
                                cache_modifier=".cg")
                    o += tl.where(sj >= 0, v * w, 0.0)
                tl.store(out_ptr + t.to(tl.int64) * s_out + n[:, None], o.to(out_ptr.dtype.element_ty),
                         mask=nmask[:, None])
                tl.atomic_xchg(tile, 0, sem="relaxed")


def fused_grid(device: torch.device, items: int) -> int:
    """Programs of the launch: one per SM at most (all resident at once: the waits need it), one
    under the interpreter (programs run one after another there)."""
    if device.type != "cuda":
        return 1
    return max(1, min(items, torch.cuda.get_device_properties(device).multi_processor_count))


def run_fused_decode(hidden, ids, table, tw, ops, fmt: int, t: int, k: int, h: int, i: int, limit: float,
                     has_limit: bool, config, miss_counter, out, workspace, use_asm: int, pdl: dict) -> None:
    """One launch of _fused_decode_kernel (moe_triton._run's decode branch for config.fused)."""
    gu_q, gu_s, gu_s2, dn_q, dn_s, dn_s2 = ops
    p = t * k
    if p > FUSED_MAX_PAIRS:
        raise ValueError(f"the fused MoE decode takes at most {FUSED_MAX_PAIRS} pairs, got {p}")
    cg, cd = config.gate_up, config.down
    dev = hidden.device
    op_dtype = torch.bfloat16 if use_asm else torch.float32
    na, nd = triton.cdiv(i, cg.BN), triton.cdiv(h, cd.BN)
    act = workspace((p, i), op_dtype, dev)
    y = workspace((p, h), torch.float32, dev)
    cnt = _zeroed_counters(dev, p + t * nd)
    nprog = fused_grid(dev, p * (na + nd))
    _fused_decode_kernel[(nprog,)](
        hidden, ids, table, tw, gu_q, gu_s, gu_s2, dn_q, dn_s, dn_s2, act, y, out, cnt, miss_counter,
        hidden.stride(0), gu_q.stride(0), gu_s.stride(0), dn_q.stride(0), dn_s.stride(0), out.stride(0),
        limit, p, nprog, ROUNDS=triton.cdiv(p * (na + nd), nprog), H=h, I=i, TOPK=k, FMT=fmt, HAS_LIMIT=has_limit, USE_ASM=use_asm,
        BNA=cg.BN, BKA=cg.BKH, BND=cd.BN, BKD=cd.BKH, num_warps=cg.num_warps, num_stages=cg.num_stages, **pdl)
