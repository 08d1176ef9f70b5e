"""Lab: the paged GQA decode split kernel with each split walked as two independent halves by the
two halves of an 8-warp program (bf16 caches, no window).

Why (docs/perf.md attention, run 20's Nsight Compute at batch 1, 32K, Qwen3 heads): the production
split kernel runs 128 programs of 4 warps, one per SM, so each scheduler holds one warp; issue slots
21% busy at 4.2 cycles per instruction -- one dependent chain per scheduler. Run 22's two chains in
one 4-warp program doubled the registers (194-255 a thread) and lost. Here the two chains live in
different warps: the tile has a leading dimension of 2 (half A = the split's first steps, half B
the rest), the dots are batched over it ([2, G, D] x [2, D, 64]), and with 8 warps Triton's layout
puts 4 warps on each half (sm_90 AOT: see `--aot`), so registers per thread stay those of the
4-warp kernel. The halves' (m, l, acc) are merged at the end into one split partial in the
production workspace layout, and the production merge kernel finishes. Other bits than the
production kernel (another summation order), the same math.

    python tools/kernel_lab/gqa_two_half.py --check          # CPU (TRITON_INTERPRET=1) or GPU
    python tools/kernel_lab/gqa_two_half.py --aot            # sm_90 registers / spills / smem, no GPU
    python tools/kernel_lab/gqa_two_half.py --bench --out DIR  # GPU: vs paged_decode_gqa, 32K, batch 1 / 8 / 32
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

from moet.kernels import attention_triton as at


@triton.jit
def _step(q3, m_i, l_i, acc, i, first, last, steps, steps_a, n, half, t, b, h, bt_ptr, k_ptr, v_ptr,
          s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_btb, scale, d, dv, BLOCK_SIZE: tl.constexpr, PAGES: tl.constexpr):
    """Step i of both halves: half A at step i, half B at step steps_a + i (masked past the split)."""
    page0 = first + (half * steps_a + i) * PAGES                       # [2]
    page = page0[:, None] + t[None, :] // BLOCK_SIZE                   # [2, TOK]
    tok = t[None, :] % BLOCK_SIZE
    inside = (page < last) & ((half[:, None] == 0) | (steps_a + i < steps))
    blk = tl.load(bt_ptr + b * s_btb + page, mask=inside, other=0).to(tl.int64)
    tmask = inside & (page * BLOCK_SIZE + tok < n)
    k = tl.load(k_ptr + blk[:, :, None] * s_kb + tok[:, :, None] * s_kt + h * s_kh + d[None, None, :],
                mask=tmask[:, :, None], other=0.0).to(q3.dtype)        # [2, TOK, D]
    s = tl.dot(q3, tl.permute(k, (0, 2, 1))) * scale                   # [2, BLOCK_G, TOK]
    s = tl.where(tmask[:, None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=2))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)             # half B past its end: no keys
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, :, None])
    v = tl.load(v_ptr + blk[:, :, None] * s_vb + tok[:, :, None] * s_vt + h * s_vh + dv[None, None, :],
                mask=tmask[:, :, None], other=0.0).to(q3.dtype)        # [2, TOK, DV]
    l_i = l_i * alpha + tl.sum(p, axis=2)
    acc = acc * alpha[:, :, None] + tl.dot(p.to(q3.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _step_stacked(q2, m_i, l_i, acc, i, first, last, steps, steps_a, n, t2, b, h, bt_ptr, k_ptr, v_ptr,
                  s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_btb, scale, d, dv, BLOCK_G: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, PAGES: tl.constexpr):
    """_step with the halves stacked along the dots' M and N instead of a batch dimension: rows
    [2 * BLOCK_G] (half = row // BLOCK_G) against tokens [2 * TOK] (half = token // TOK), the
    cross-half scores masked to -inf, so P is block-diagonal. Twice the MMAs per warp of the
    production tile, but 2-D dots: with 8 warps Triton tiles M over 2 warps (one per half) and N
    over 4, so each half's reductions stay inside its own 4 warps."""
    TOK: tl.constexpr = PAGES * BLOCK_SIZE
    th = t2 // TOK                                                     # [2 * TOK]: the token's half
    tt = t2 % TOK
    page = first + (th * steps_a + i) * PAGES + tt // BLOCK_SIZE
    tok = tt % BLOCK_SIZE
    inside = (page < last) & ((th == 0) | (steps_a + i < steps))
    blk = tl.load(bt_ptr + b * s_btb + page, mask=inside, other=0).to(tl.int64)
    tmask = inside & (page * BLOCK_SIZE + tok < n)
    k = tl.load(k_ptr + blk[:, None] * s_kb + tok[:, None] * s_kt + h * s_kh + d[None, :],
                mask=tmask[:, None], other=0.0).to(q2.dtype)           # [2 * TOK, D]
    s = tl.dot(q2, tl.trans(k)) * scale                               # [2 * BLOCK_G, 2 * TOK]
    rh = tl.arange(0, 2 * BLOCK_G) // BLOCK_G
    s = tl.where(tmask[None, :] & (rh[:, None] == th[None, :]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    v = tl.load(v_ptr + blk[:, None] * s_vb + tok[:, None] * s_vt + h * s_vh + dv[None, :],
                mask=tmask[:, None], other=0.0).to(q2.dtype)           # [2 * TOK, DV]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q2.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _two_half_split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, acc_ptr, m_ptr, l_ptr,
                           s_qb, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_btb, scale, pages_min,
                           G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                           BLOCK_SIZE: tl.constexpr, MAX_SPLITS: tl.constexpr, PAGES: tl.constexpr,
                           INTERPRET: tl.constexpr, STACKED: tl.constexpr = False):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    n = tl.load(lens_ptr + b)
    n_pages, pps, used = at._split_pages(n, pages_min, MAX_SPLITS, BLOCK_SIZE)
    if sp < used:
        TOK: tl.constexpr = PAGES * BLOCK_SIZE
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        dv = tl.arange(0, DV)
        qh = h * G + g
        q = tl.load(q_ptr + b * s_qb + qh[:, None] * s_qh + d[None, :], mask=(g[:, None] < G), other=0.0)
        # the dots' operands: bf16 on the GPU, fp32 under the interpreter (whose batched bf16 dot is
        # wrong in Triton 3.6; attention_triton keeps fp32 operands there too)
        if INTERPRET:
            q3 = tl.broadcast_to(q.to(tl.float32)[None, :, :], (2, BLOCK_G, D))
        else:
            q3 = tl.broadcast_to(q.to(tl.bfloat16)[None, :, :], (2, BLOCK_G, D))
        first = sp * pps
        last = tl.minimum(first + pps, n_pages)
        steps = (last - first + PAGES - 1) // PAGES
        steps_a = (steps + 1) // 2                       # half A: steps [0, steps_a), half B: the rest
        half = tl.arange(0, 2)
        t = tl.arange(0, TOK)
        if STACKED:
            q2 = tl.reshape(q3, (2 * BLOCK_G, D))
            t2 = tl.arange(0, 2 * TOK)
            m_s2 = tl.full([2 * BLOCK_G], float("-inf"), tl.float32)
            l_s2 = tl.zeros([2 * BLOCK_G], tl.float32)
            acc_s2 = tl.zeros([2 * BLOCK_G, DV], tl.float32)
            if INTERPRET:
                i = 0
                while i < steps_a:
                    m_s2, l_s2, acc_s2 = _step_stacked(q2, m_s2, l_s2, acc_s2, i, first, last, steps, steps_a, n, t2,
                                                       b, h, bt_ptr, k_ptr, v_ptr, s_kb, s_kt, s_kh, s_vb, s_vt,
                                                       s_vh, s_btb, scale, d, dv, BLOCK_G, BLOCK_SIZE, PAGES)
                    i += 1
            else:
                for i in range(0, steps_a):
                    m_s2, l_s2, acc_s2 = _step_stacked(q2, m_s2, l_s2, acc_s2, i, first, last, steps, steps_a, n, t2,
                                                       b, h, bt_ptr, k_ptr, v_ptr, s_kb, s_kt, s_kh, s_vb, s_vt,
                                                       s_vh, s_btb, scale, d, dv, BLOCK_G, BLOCK_SIZE, PAGES)
            m_i = tl.reshape(m_s2, (2, BLOCK_G))
            l_i = tl.reshape(l_s2, (2, BLOCK_G))
            acc = tl.reshape(acc_s2, (2, BLOCK_G, DV))
        else:
            m_i = tl.full([2, BLOCK_G], float("-inf"), tl.float32)
            l_i = tl.zeros([2, BLOCK_G], tl.float32)
            acc = tl.zeros([2, BLOCK_G, DV], tl.float32)
            if INTERPRET:                   # loaded-scalar loop bounds (as attention_triton's decode)
                i = 0
                while i < steps_a:
                    m_i, l_i, acc = _step(q3, m_i, l_i, acc, i, first, last, steps, steps_a, n, half, t, b, h, bt_ptr,
                                          k_ptr, v_ptr, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_btb, scale, d, dv,
                                          BLOCK_SIZE, PAGES)
                    i += 1
            else:                           # a for loop: Triton pipelines its loads (a while loop it does not)
                for i in range(0, steps_a):
                    m_i, l_i, acc = _step(q3, m_i, l_i, acc, i, first, last, steps, steps_a, n, half, t, b, h, bt_ptr,
                                          k_ptr, v_ptr, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_btb, scale, d, dv,
                                          BLOCK_SIZE, PAGES)
        # the two halves -> one split partial (fixed order: A, then B)
        is_a = (half == 0)[:, None]
        m_a = tl.max(tl.where(is_a, m_i, float("-inf")), axis=0)
        m_b = tl.max(tl.where(is_a, float("-inf"), m_i), axis=0)
        m_all = tl.maximum(m_a, m_b)
        m_s = tl.where(m_all == float("-inf"), 0.0, m_all)
        w = tl.exp(m_i - m_s[None, :])                                       # [2, BLOCK_G]
        l_out = tl.sum(w * l_i, axis=0)
        acc_out = tl.sum(w[:, :, None] * acc, axis=0)                        # [BLOCK_G, DV]
        row = (b * (tl.num_programs(1) * G) + qh) * tl.num_programs(2) + sp
        gm = g < G
        tl.store(m_ptr + row, m_all, mask=gm)
        tl.store(l_ptr + row, l_out, mask=gm)
        tl.store(acc_ptr + row[:, None] * DV + dv[None, :], acc_out, mask=gm[:, None])


def paged_decode_gqa_two_half(q, cache, block_tables, seq_lens, scale, *, num_warps: int = 8,
                              num_stages: int = 3, tile_tokens: int | None = None, stacked: bool = False):
    """As attention_triton.paged_decode_gqa on a bf16 cache (its split partition and merge)."""
    b, hq, d = q.shape
    nb, bs, hkv, _ = cache.k.shape
    dv = cache.v.shape[-1]
    assert cache.k.dtype == torch.bfloat16 and d == triton.next_power_of_2(d) and dv == triton.next_power_of_2(dv)
    pages_min, max_splits, num_splits = at._splits(block_tables, bs, None, at.GQA_DEFAULT_MAX_SPLITS)
    g = hq // hkv
    acc = torch.empty(b, hq, num_splits, dv, dtype=torch.float32, device=q.device)
    m = torch.empty(b, hq, num_splits, dtype=torch.float32, device=q.device)
    l_ = torch.empty_like(m)
    out = torch.empty(b, hq, dv, dtype=q.dtype, device=q.device)
    q = q.contiguous()
    _two_half_split_kernel[(b, hkv, num_splits)](
        q, cache.k, cache.v, block_tables, seq_lens, acc, m, l_, q.stride(0), q.stride(1),
        *cache.k.stride()[:3], *cache.v.stride()[:3], block_tables.stride(0), float(scale), pages_min,
        G=g, BLOCK_G=at._pow2(g), D=d, DV=dv, BLOCK_SIZE=bs, MAX_SPLITS=max_splits,
        PAGES=max(1, (tile_tokens or at.GQA_TILE_TOKENS) // bs), INTERPRET=at._INTERPRET, STACKED=stacked,
        num_warps=num_warps, num_stages=num_stages)
    at._merge_splits_kernel[(b, hq)](acc, m, l_, seq_lens, out, out.stride(0), out.stride(1), num_splits, pages_min,
                                     HQ=hq, DV=dv, BLOCK_DV=at._pow2(dv), MAX_SPLITS=max_splits, BLOCK_SIZE=bs,
                                     **at._merge_blocks(max_splits, dv), PDL=False)
    return out


def _case(dev, lens, hq=8, hkv=2, d=64, bs=16, seed=0):
    from moet.kernels.kv_cache import KVFormat, new_gqa_layer
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // bs) for n in lens]
    nb = sum(pages) + 3
    cache = new_gqa_layer(nb, bs, hkv, d, d, KVFormat("auto", dtype=torch.bfloat16), device=dev)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g).to(torch.bfloat16))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g).to(torch.bfloat16))
    perm = torch.randperm(nb, generator=g)
    width = max(pages)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    o = 0
    for i, p in enumerate(pages):
        table[i, :p] = perm[o:o + p]
        o += p
    q = torch.randn(len(lens), hq, d, generator=g).to(torch.bfloat16)
    return q.to(dev), cache, table.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev)


def check(dev) -> bool:
    from moet.kernels.attention_reference import paged_decode_gqa as ref
    ok = True
    launch = dict(num_warps=8, num_stages=3) if dev.type == "cuda" else dict(num_warps=4, num_stages=1)
    # ragged lengths: one split, many splits (the 32-split cap), odd step counts (half B one step
    # shorter), a split whose half B is empty, lengths off the page boundary
    for lens in ([1, 17, 100], [300, 1000, 65], [5000, 33, 2049]):
        q, cache, table, sl = _case(dev, lens, seed=len(lens) + lens[0])
        scale = q.shape[-1] ** -0.5
        want = ref(q.float(), cache, table, sl, scale).float()
        for stacked in (False, True):
            got = paged_decode_gqa_two_half(q, cache, table, sl, scale, stacked=stacked, **launch)
            again = paged_decode_gqa_two_half(q, cache, table, sl, scale, stacked=stacked, **launch)
            err = float((got.float() - want).norm() / want.norm())
            same = bool(torch.equal(got, again))
            print(f"lens {lens} stacked {stacked}: relerr {err:.2e}, rerun identical {same}", flush=True)
            ok &= err < 1e-2 and same and bool(torch.isfinite(got).all())
    return ok


def aot() -> None:
    from tests.kernels.aot_compile import _compile, sass_report
    types = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", bt_ptr="*i32", lens_ptr="*i32", acc_ptr="*fp32",
                 m_ptr="*fp32", l_ptr="*fp32", s_qb="i32", s_qh="i32", s_kb="i32", s_kt="i32", s_kh="i32",
                 s_vb="i32", s_vt="i32", s_vh="i32", s_btb="i32", scale="fp32", pages_min="i32")
    const = dict(G=8, BLOCK_G=16, D=128, DV=128, BLOCK_SIZE=16, MAX_SPLITS=32, PAGES=4, INTERPRET=False)
    for stacked, warps, stages in ((False, 8, 3), (True, 8, 3), (True, 8, 5), (True, 8, 7), (True, 4, 3)):
        c = _compile(_two_half_split_kernel, types, dict(const, STACKED=stacked), dict(num_warps=warps,
                     num_stages=stages), div16=("s_qb", "s_qh", "s_kb", "s_kt", "s_kh", "s_vb", "s_vt", "s_vh", "s_btb"))
        r = sass_report(c)
        print(f"stacked {stacked} warps {warps} stages {stages}: regs {r['regs']} smem {r['smem']} "
              f"spills {r['spill_ops']} loop {r['loop_instrs']} mma {r['loop_mmas']}", flush=True)


def bench(out: str) -> None:
    from moet.bench.timing import graph_time_ms
    os.makedirs(out, exist_ok=True)
    dev = torch.device("cuda")
    recs = []
    for batch in (1, 8, 32):
        lens = [32768] * batch
        q, cache, table, sl = _case(dev, lens, hq=32, hkv=4, d=128, seed=batch)
        scale = 128 ** -0.5
        kv_bytes = 2 * batch * 32768 * 4 * 128 * 2
        base = lambda: at.paged_decode_gqa(q, cache, table, sl, scale)
        ref_out = base()
        ms = graph_time_ms(base)
        recs.append(dict(batch=batch, variant="production", ms=ms, GBps=kv_bytes / ms / 1e6))
        print(f"b{batch} production: {ms * 1e3:.1f} us {kv_bytes / ms / 1e6:.0f} GB/s", flush=True)
        # the K / V tiles get ceil(stages / 2) - 1 shared-memory buffers (the block-table load takes
        # the other stages; sm_90 TTGIR): 1 at 3-4 stages, 2 at 5-6, 3 at 7 (206 KB)
        for stacked, warps, stages in ((True, 8, 5), (True, 8, 7), (True, 8, 3), (False, 8, 3)):
            fn = lambda w=warps, s=stages, st=stacked: paged_decode_gqa_two_half(q, cache, table, sl, scale,
                                                                                  num_warps=w, num_stages=s, stacked=st)
            try:
                got = fn()
                err = float((got.float() - ref_out.float()).norm() / ref_out.float().norm())
                ms = graph_time_ms(fn)
            except Exception as exc:           # e.g. out of shared memory
                print(f"b{batch} stacked {stacked} w{warps} s{stages}: {type(exc).__name__}: {str(exc)[:200]}",
                      flush=True)
                continue
            name = f"two halves {'stacked' if stacked else 'batched'} w{warps} s{stages}"
            recs.append(dict(batch=batch, variant=name, ms=ms, GBps=kv_bytes / ms / 1e6, relerr_vs_production=err))
            print(f"b{batch} {name}: {ms * 1e3:.1f} us {kv_bytes / ms / 1e6:.0f} GB/s relerr {err:.1e}", flush=True)
        del cache
    with open(os.path.join(out, "gqa_two_half.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), records=recs), f, indent=1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--aot", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.check:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if not check(dev):
            print("CHECK FAILED", flush=True)
            return 1
    if args.aot:
        aot()
    if args.bench:
        bench(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
