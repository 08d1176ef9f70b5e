"""Paged attention on the GPU: correctness at real shapes first, then decode and prefill speed.

    python benchmarks/kernels/benchmark_attention.py --out $OUT --budget-s 200

1. Checks (every Triton kernel against its torch reference, on the GPU, at real shapes): GQA as
   Qwen3-30B-A3B (32 q heads / 4 kv heads, d 128), MLA as DeepSeek-V3 (128 heads, R 512, P 64, the
   softmax scale from its spec: YaRN mscale included); random block tables, ragged lengths across
   page and split boundaries, bf16 / fp8 per-tensor / fp8 per-token-group caches, fp32 and bf16
   queries; outputs poisoned with NaN before each run (the `out` tensor and the allocator's free
   memory), bit-identical run to run; the KV writes byte-equal to the torch writes.
2. Decode at context 1K / 8K / 32K / 128K, batch 1 and 32, bf16 and fp8 KV: GB/s of KV bytes read,
   (split_tokens, max_splits) swept, held to two bandwidths measured in the same run (bandwidth()):
   a device copy of 2 GiB (bytes read + bytes written) and a bf16 GEMV (weight bytes, the reference
   of the MoE / FP8 / engine benches); torch SDPA on the same shapes (contiguous, non-paged) side by side.
3. Prefill at 8K (one sequence, causal): TFLOP/s vs a bf16 torch.matmul GEMM measured in the same
   run; SDPA (flash / efficient / cuDNN, never the math fallback) side by side.
Timing: each op is captured in a CUDA graph (no Python launch overhead) and replayed under
triton.testing.do_bench, which flushes L2 before every run; median. Not the copy reference: a
contiguous copy_ is a cudaMemcpyAsync, captured it becomes a graph memcpy node, and the driver
runs 1 GiB memcpy nodes far below the eager copy (pytorch/pytorch#191284; on the H200 a captured
1 GiB copy reached about two thirds of an eager one's rate): it is timed eagerly. Combos that do
not fit in free memory or the remaining budget are skipped (listed).
Writes attention_bench.json and attention_bench.md under --out and prints as it goes. Exit code 1
if any check failed.
`--smoke` runs the same code on CPU (TRITON_INTERPRET=1) at toy shapes: a test of this script.
`--quick` (the short GPU call, ~1 minute warm): no checks (run tests/kernels/test_attention_cuda.py
first), decode at 32K only (batch 1, 8 and 32, bf16 and fp8; GQA: the launch table's default next
to explicit 3 / 5 / 7 stages (QUICK_SPLITS), outputs compared bit for bit within a split
partition and warp count; MLA: a few split settings), prefill 8K bf16.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
                 "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                 "mlp_only_layers": [], "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
                 "rope_theta": 1000000.0, "use_sliding_window": False, "sliding_window": None}
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
               "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
               "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
               "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
               "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
               "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
               "norm_topk_prob": True, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
               "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                                     "type": "yarn"}}
BS = 16                                    # tokens per page (vLLM's default)
# decode (split_tokens, max_splits) swept: one compiled kernel serves them all (runtime args)
SPLITS = ((64, 32), (128, 32), (256, 32), (512, 32), (1024, 32), (2048, 32), (256, 8), (256, 128))
# --quick: the defaults (GQA 256/32, MLA 256/32) and alternatives. MLA with twice the programs at
# batch 1 (256/64) and half the split partials at batch 32 (2048/32).
# GQA entries: (split_tokens, max_splits[, tile_tokens[, num_warps, num_stages]]); None or absent =
# paged_decode_gqa's default (GQA_TILE_TOKENS; the launch table, attention_configs.json). At 32K
# (256/32: 32 splits of 1,024 tokens; 4 kv heads) the default launch next to Triton's 3 stages
# (single-buffered cp.async: the default before the table, still the table's at batch 32 bf16), 5
# (double) and 7 (triple): the rows the launch table is written from (attention_configs.py), so a
# new device or Triton version can be re-tabled with one call. Batch 1 bf16 stays well short of the
# copy with 128 programs on 132 SMs.
# What left the list, each slower than 256/32 on the H200 (docs/kernels.md, attention): other
# splits (256/128, 128/256) and 16- and 32-token steps; 8 warps; register-prefetch loop forms
# (removed); more, shorter splits with deep pipelines (256/64 s7, 256/128 s7 / s5: a 64-token
# stage is 32 KiB of K + V, so 5-7 stages leave room for one program per SM and 256 / 512 programs
# ran in 2 / 4 waves); the same split counts with the programs co-resident (256/64 s3 = 96 KiB, two
# per SM; 32-token tiles, 16 KiB a stage: 256/64/32 s5 two per SM, 256/128/32 s3 four per SM) and
# 256/32/32 s7 (short walks, not waves, cost); the fused split merge (a sixth element True, no
# merge launch); paged_decode_gqa(chains=2) (each split's halves as two online-softmax chains;
# the option was removed).
QUICK_SPLITS = {"gqa": ((256, 32), (256, 32, None, 4, 3), (256, 32, None, 4, 5), (256, 32, None, 4, 7)),
                "mla": ((256, 32), (256, 64), (2048, 32))}


def gqa_kw(s: tuple) -> dict:
    """paged_decode_gqa keywords of a GQA setting tuple (see QUICK_SPLITS)."""
    s = tuple(s) + (None,) * (6 - len(s))
    return dict(split_tokens=s[0], max_splits=s[1], tile_tokens=s[2], num_warps=s[3], num_stages=s[4],
                fused_merge=bool(s[5]))


def setting_label(s: tuple) -> str:
    """256/32 (the defaults), 256/32/64 (tile), 256/32 w4 s5 (an explicit launch)."""
    kw = gqa_kw(s)
    lab = f"{kw['split_tokens']}/{kw['max_splits']}" + (f"/{kw['tile_tokens']}" if kw["tile_tokens"] else "")
    if kw["num_warps"] or kw["num_stages"]:
        lab += f" w{kw['num_warps'] or '-'} s{kw['num_stages'] or '-'}"
    if kw["fused_merge"]:
        lab += " fused merge"
    return lab


class Bench:
    def __init__(self, args):
        self.smoke = args.smoke
        self.quick = args.quick
        self.dev = torch.device("cpu" if self.smoke else "cuda")
        self.t0 = time.monotonic()
        self.budget = args.budget_s
        self.records: list[dict] = []
        self.skipped: list[str] = []
        self.failures: list[str] = []
        from moet.checkpoint.spec import spec_from_config
        self.gqa = spec_from_config(QWEN3_30B_A3B).attention
        self.mla = spec_from_config(DEEPSEEK_V3).attention
        if self.smoke:                    # toy shapes with the same structure
            from dataclasses import replace
            self.gqa = replace(self.gqa, num_heads=4, num_kv_heads=2, head_dim=16, v_head_dim=16)
            self.mla = replace(self.mla, num_heads=4, kv_lora_rank=32, qk_rope_head_dim=16)

    # ------------------------------------------------------------------ plumbing

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def log(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {msg}", flush=True)

    def time_ms(self, fn) -> tuple[float, bool]:
        """Median ms of fn; (time, whether a CUDA graph was used)."""
        fn()
        if self.smoke:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3, False
        import triton

        from moet.bench.timing import graphed as capture
        run, err = capture(fn)
        graphed = err is None
        if err is not None:
            self.log(f"  (no CUDA graph: {type(err).__name__}: {err})")
        ms = triton.testing.do_bench(run, warmup=10, rep=40, return_mode="median")
        return float(ms), graphed

    def poison_allocator(self) -> None:
        """Fill the caching allocator's free memory with NaN: a kernel reading a workspace it did
        not write then shows NaN instead of a plausible stale value."""
        if self.smoke:
            return
        free, _ = torch.cuda.mem_get_info()
        n = min(1 << 30, free // 4) // 4
        torch.full((n,), float("nan"), device=self.dev)
        for k in (1 << 10, 1 << 14, 1 << 18):          # small-pool sizes too
            [torch.full((k,), float("nan"), device=self.dev) for _ in range(8)]

    def check(self, name: str, got: torch.Tensor, want: torch.Tensor, tol: float, again: torch.Tensor) -> None:
        finite = bool(torch.isfinite(got).all())
        err = float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))
        same = bool(torch.equal(got, again))
        ok = finite and err < tol and same
        self.records.append(dict(kind="check", name=name, rel_err=err, tol=tol, finite=finite, bit_identical=same,
                                 ok=ok))
        self.log(f"check {'ok  ' if ok else 'FAIL'} {name}: rel err {err:.2e} (tol {tol:g}), finite {finite}, "
                 f"bit-identical {same}")
        if not ok:
            self.failures.append(name)

    # ------------------------------------------------------------------ caches

    def formats(self, model_dtype=torch.bfloat16) -> list:
        from moet.kernels.kv_cache import KVFormat
        return [("bf16", KVFormat("auto", dtype=model_dtype)), ("fp8", KVFormat("fp8_e4m3", "tensor")),
                ("fp8-block", KVFormat("fp8_e4m3", "block", group=128, dtype=model_dtype))]

    def table(self, lens: list[int], num_blocks: int, gen: torch.Generator) -> torch.Tensor:
        need = [-(-n // BS) for n in lens]
        perm = torch.randperm(num_blocks, generator=gen)
        width = max(need + [1]) + 2
        t = torch.randint(0, num_blocks, (len(lens), width), generator=gen, dtype=torch.int32)
        at = 0
        for b, k in enumerate(need):
            t[b, :k] = perm[at:at + k].to(torch.int32)
            at += k
        return t.to(self.dev)

    def fill_gqa(self, fmt, lens, gen):
        """A GQA cache holding random K/V for sequences of `lens` tokens (written through the
        torch reference write, so checks compare against exactly what is stored)."""
        from moet.kernels.kv_cache import new_gqa_layer, write_gqa_kv
        a = self.gqa
        nb = sum(-(-n // BS) for n in lens) + 4
        cache = new_gqa_layer(nb, BS, a.num_kv_heads, a.head_dim, a.v_head_dim, fmt, device=self.dev)
        if fmt.is_fp8 and not fmt.block_scaled:
            cache.k_scale.fill_(0.02)
            cache.v_scale.fill_(0.03)
        table = self.table(lens, nb, gen)
        for b, n in enumerate(lens):
            pos = torch.arange(n)
            slots = (table[b].cpu()[pos // BS].long() * BS + pos % BS).to(self.dev)
            k = torch.randn(n, a.num_kv_heads, a.head_dim, generator=gen).to(self.dev)
            write_gqa_kv(cache, k, torch.randn(n, a.num_kv_heads, a.v_head_dim, generator=gen).to(self.dev), slots)
        return cache, table

    def fill_mla(self, fmt, lens, gen):
        from moet.kernels.kv_cache import new_mla_layer, write_mla_kv
        a = self.mla
        nb = sum(-(-n // BS) for n in lens) + 4
        cache = new_mla_layer(nb, BS, a.kv_lora_rank, a.qk_rope_head_dim, fmt, device=self.dev)
        if fmt.is_fp8 and not fmt.block_scaled:
            cache.latent_scale.fill_(0.02)
        table = self.table(lens, nb, gen)
        for b, n in enumerate(lens):
            pos = torch.arange(n)
            slots = (table[b].cpu()[pos // BS].long() * BS + pos % BS).to(self.dev)
            write_mla_kv(cache, torch.randn(n, a.kv_lora_rank, generator=gen).to(self.dev),
                         torch.randn(n, a.qk_rope_head_dim, generator=gen).to(self.dev), slots)
        return cache, table

    # ------------------------------------------------------------------ 1. checks

    def checks(self) -> None:
        from moet.kernels import attention_reference as ref
        from moet.kernels import (attention_triton, kv_cache, kv_write_triton, mla_decode_triton, mla_prefill_triton,
                                  prefill_triton)
        gen = torch.Generator().manual_seed(int(time.time()) % 2**31)     # fresh inputs every run
        dec_lens = [1, 15, 16, 17, 255, 1000, 3001, 4103] if not self.smoke else [1, 15, 17, 40]
        pre = ([(1000, 1000), (3000, 517), (17, 1), (300, 0), (2053, 2053)] if not self.smoke
               else [(20, 20), (40, 9), (5, 1), (17, 0)])
        mla_pre = ([(700, 700), (1500, 300), (33, 1), (64, 0)] if not self.smoke else [(20, 20), (40, 9), (17, 0)])
        tol = {torch.float32: 2e-4, torch.bfloat16: 1e-2}
        g, m = self.gqa, self.mla
        i32 = dict(dtype=torch.int32, device=self.dev)
        for fname, fmt in self.formats():
            # fp32 queries (tight tolerance) on the bf16 cache, bf16 queries (as served) on all:
            # every query dtype is one more compile per kernel
            qdtypes = (torch.float32, torch.bfloat16) if fname == "bf16" else (torch.bfloat16,)
            # GQA decode, two split sizes
            cache, table = self.fill_gqa(fmt, dec_lens, gen)
            lens = torch.tensor(dec_lens, **i32)
            for qd in qdtypes:
                q = torch.randn(len(dec_lens), g.num_heads, g.head_dim, generator=gen).to(self.dev, qd)
                want = ref.paged_decode_gqa(q, cache, table, lens, g.scale)
                for split in (64, 512):
                    runs = []
                    for _ in range(2):
                        self.poison_allocator()
                        out = torch.full_like(want, float("nan"))
                        attention_triton.paged_decode_gqa(q, cache, table, lens, g.scale, split_tokens=split, out=out)
                        runs.append(out)
                    self.check(f"gqa decode {fname} q {str(qd)[6:]} split {split}", runs[0], want, tol[qd], runs[1])
            # GQA prefill / extend
            cache, table = self.fill_gqa(fmt, [n for n, _ in pre], gen)
            cu = torch.tensor([0] + [q for _, q in pre], dtype=torch.int32).cumsum(0).to(**i32)
            lens = torch.tensor([n for n, _ in pre], **i32)
            for qd in qdtypes:
                q = torch.randn(int(cu[-1]), g.num_heads, g.head_dim, generator=gen).to(self.dev, qd)
                want = ref.paged_prefill_gqa(q, cache, table, cu, lens, g.scale)
                runs = []
                for _ in range(2):
                    self.poison_allocator()
                    out = torch.full_like(want, float("nan"))
                    prefill_triton.paged_prefill_gqa(q, cache, table, cu, lens, g.scale,
                                                     max_seqlen_q=max(q for _, q in pre), out=out)
                    runs.append(out)
                self.check(f"gqa prefill {fname} q {str(qd)[6:]}", runs[0], want, tol[qd], runs[1])
            del cache
            # MLA decode
            cache, table = self.fill_mla(fmt, dec_lens, gen)
            lens = torch.tensor(dec_lens, **i32)
            for qd in qdtypes:
                ql = torch.randn(len(dec_lens), m.num_heads, m.kv_lora_rank, generator=gen).to(self.dev, qd)
                qr = torch.randn(len(dec_lens), m.num_heads, m.qk_rope_head_dim, generator=gen).to(self.dev, qd)
                want = ref.paged_decode_mla(ql, qr, cache, table, lens, m.scale)
                for split in (64, 512):
                    runs = []
                    for _ in range(2):
                        self.poison_allocator()
                        out = torch.full_like(want, float("nan"))
                        mla_decode_triton.paged_decode_mla(ql, qr, cache, table, lens, m.scale, split_tokens=split,
                                                           out=out)
                        runs.append(out)
                    self.check(f"mla decode {fname} q {str(qd)[6:]} split {split}", runs[0], want, tol[qd], runs[1])
            # MLA prefill / extend
            cache, table = self.fill_mla(fmt, [n for n, _ in mla_pre], gen)
            cu = torch.tensor([0] + [q for _, q in mla_pre], dtype=torch.int32).cumsum(0).to(**i32)
            lens = torch.tensor([n for n, _ in mla_pre], **i32)
            for qd in qdtypes:
                ql = torch.randn(int(cu[-1]), m.num_heads, m.kv_lora_rank, generator=gen).to(self.dev, qd)
                qr = torch.randn(int(cu[-1]), m.num_heads, m.qk_rope_head_dim, generator=gen).to(self.dev, qd)
                want = ref.paged_prefill_mla(ql, qr, cache, table, cu, lens, m.scale)
                runs = []
                for _ in range(2):
                    self.poison_allocator()
                    out = torch.full_like(want, float("nan"))
                    mla_prefill_triton.paged_prefill_mla(ql, qr, cache, table, cu, lens, m.scale,
                                                         max_seqlen_q=max(q for _, q in mla_pre), out=out)
                    runs.append(out)
                self.check(f"mla prefill {fname} q {str(qd)[6:]}", runs[0], want, tol[qd], runs[1])
            del cache
            # KV writes: bytes equal to the torch write (bf16 source; 2 skipped slots)
            t = 4096 if not self.smoke else 40
            slots = torch.randperm(2 * t, generator=gen)[:t].to(self.dev)
            slots[:2] = -1
            nb = 2 * t // BS
            k = torch.randn(t, g.num_kv_heads, g.head_dim, generator=gen).to(self.dev, torch.bfloat16)
            v = torch.randn(t, g.num_kv_heads, g.v_head_dim, generator=gen).to(self.dev, torch.bfloat16)
            caches = [kv_cache.new_gqa_layer(nb, BS, g.num_kv_heads, g.head_dim, g.v_head_dim, fmt, device=self.dev)
                      for _ in range(2)]
            kv_cache.write_gqa_kv(caches[0], k, v, slots)
            kv_write_triton.write_gqa_kv(caches[1], k, v, slots)
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in
                       ((caches[0].k, caches[1].k), (caches[0].v, caches[1].v)))
            if fmt.block_scaled:
                same = same and torch.equal(caches[0].k_scale, caches[1].k_scale)
            self._byte_check(f"kv write gqa {fname}", same)
            lat = torch.randn(t, m.kv_lora_rank, generator=gen).to(self.dev, torch.bfloat16)
            rope = torch.randn(t, m.qk_rope_head_dim, generator=gen).to(self.dev, torch.bfloat16)
            caches = [kv_cache.new_mla_layer(nb, BS, m.kv_lora_rank, m.qk_rope_head_dim, fmt, device=self.dev)
                      for _ in range(2)]
            kv_cache.write_mla_kv(caches[0], lat, rope, slots)
            kv_write_triton.write_mla_kv(caches[1], lat, rope, slots)
            self._byte_check(f"kv write mla {fname}", torch.equal(caches[0].buffer.view(torch.uint8),
                                                                  caches[1].buffer.view(torch.uint8)))

    def _byte_check(self, name: str, same: bool) -> None:
        self.records.append(dict(kind="check", name=name, bytes_equal=same, ok=same))
        self.log(f"check {'ok  ' if same else 'FAIL'} {name}: bytes equal to the torch write {same}")
        if not same:
            self.failures.append(name)

    # ------------------------------------------------------------------ 2. decode

    def eager_ms(self, fn, reps: int = 10) -> float:
        """Median ms of fn run eagerly (no CUDA graph), each call between two CUDA events; the calls
        are queued back to back (one sync at the end), so no host gap falls inside a window."""
        fn()
        if self.smoke:
            times = []
            for _ in range(3):
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
            return sorted(times)[1]
        for _ in range(2):                 # warm: allocator, clocks
            fn()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        torch.cuda.synchronize()
        for start, end in ev:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        times = sorted(start.elapsed_time(end) for start, end in ev)
        return float(times[len(times) // 2])

    def bandwidth(self) -> dict:
        """The memory bandwidths the decode rows are held to, measured in this run:
        copy: dst.copy_(src) of 2 GiB, eager (see the module docstring: as a CUDA-graph memcpy node
          the driver copies 1 GiB at ~2/3 of this), median of 10, counting the bytes read plus the
          bytes written (each once), so a read-only stream may exceed it;
        gemv: a bf16 GEMV (x[1, K] @ W^T, W [32768, 7168], 470 MB; timing.bf16_gemv_bandwidth, do_bench,
          L2 flushed) counting the weight bytes: the read-only yardstick of the MoE / FP8 / engine
          benches.
        Also recorded, not used: the copy of 1 GiB as the first measurements timed it (a graph
        memcpy node)."""
        from moet.bench.timing import bf16_gemv_bandwidth
        n = (2 << 30) if not self.smoke else (1 << 20)
        src = torch.empty(n, dtype=torch.uint8, device=self.dev).random_()
        dst = torch.empty_like(src)
        reps = 10
        ms = self.eager_ms(lambda: dst.copy_(src), reps)
        copy = 2 * n / ms / 1e6
        how = "eager copy_, median of " + ("3 perf_counter-timed calls" if self.smoke else
                                           f"{reps} CUDA-event-timed calls")
        self.records.append(dict(kind="copy", bytes=n, ms=ms, gbps=copy, how=how))
        self.log(f"device copy of {n / 2**30:.2f} GiB (eager): {copy:.0f} GB/s (read + write)")
        half = n // 2
        ms_g, graphed = self.time_ms(lambda: dst[:half].copy_(src[:half]))
        old = 2 * half / ms_g / 1e6
        self.records.append(dict(kind="copy_graph_node", bytes=half, ms=ms_g, gbps=old, graph=graphed))
        self.log(f"  (the same copy of {half / 2**30:.2f} GiB as a CUDA-graph memcpy node, the reference of runs "
                 f"1-10, not used: {old:.0f} GB/s)")
        del src, dst
        wn, wk = (32768, 7168) if not self.smoke else (256, 128)
        gemv = bf16_gemv_bandwidth(self.dev, wn, wk)
        self.records.append(dict(kind="gemv", what=gemv["what"], ms=gemv["ms"], gbps=gemv["GBps"],
                                 bytes=2 * wn * wk))
        self.log(f"{gemv['what']}: {gemv['GBps']:.0f} GB/s (weight bytes)")
        if not self.smoke:
            torch.cuda.empty_cache()
        return {"copy": copy, "gemv": gemv["GBps"]}

    def random_cache(self, arch: str, fmt, tokens: int):
        """A cache of `tokens` tokens of random bytes-valid data, filled block-chunk by chunk."""
        from moet.kernels.kv_cache import new_gqa_layer, new_mla_layer
        nb = -(-tokens // BS) + 1
        if arch == "gqa":
            a = self.gqa
            cache = new_gqa_layer(nb, BS, a.num_kv_heads, a.head_dim, a.v_head_dim, fmt, device=self.dev)
            parts = [cache.k, cache.v]
        else:
            a = self.mla
            cache = new_mla_layer(nb, BS, a.kv_lora_rank, a.qk_rope_head_dim, fmt, device=self.dev)
            parts = [cache.latent, cache.rope]
        step = max(1, (1 << 26) // max(1, parts[0][0].numel()))
        for t in parts:
            for i in range(0, nb, step):
                t[i:i + step] = torch.randn(t[i:i + step].shape, device=self.dev).to(t.dtype)
        for s in (getattr(cache, n, None) for n in ("k_scale", "v_scale", "latent_scale")):
            if s is not None:
                s.fill_(0.05)
        return cache

    def kv_bytes(self, arch: str, fmt) -> int:
        from moet.kernels.kv_cache import gqa_bytes_per_token, mla_bytes_per_token
        if arch == "gqa":
            a = self.gqa
            return gqa_bytes_per_token(a.num_kv_heads, a.head_dim, a.v_head_dim, fmt)
        return mla_bytes_per_token(self.mla.kv_lora_rank, self.mla.qk_rope_head_dim, fmt)

    def decode(self, bw: dict) -> None:
        """bw: the references of bandwidth(), {"copy": GB/s, "gemv": GB/s}."""
        from moet.kernels import attention_triton, mla_decode_triton
        ctxs = (1024, 8192, 32768, 131072) if not self.smoke else (48,)    # whole pages, as the table below
        batches = (1, 32) if not self.smoke else (1, 2)
        splits = ({a: SPLITS for a in ("gqa", "mla")} if not self.smoke else
                  {"gqa": ((16, 32), (32, 2), (16, 32, None, 4, 5)), "mla": ((16, 32), (32, 2))})
        if self.quick and not self.smoke:
            ctxs, batches, splits = (32768,), (1, 8, 32), QUICK_SPLITS
        # fp8 as deployed: GQA per-tensor scales, MLA the fp8_ds_mla row (656 B at R 512)
        fmts = {"gqa": [f for f in self.formats() if f[0] != "fp8-block"],
                "mla": [f for f in self.formats() if f[0] != "fp8"]}
        for arch in ("gqa", "mla"):
            heads, width = ((self.gqa.num_heads, self.gqa.v_head_dim) if arch == "gqa"
                            else (self.mla.num_heads, self.mla.kv_lora_rank))
            for ctx in ctxs:
                for batch in batches:
                    for fname, fmt in fmts[arch]:
                        label = f"decode {arch} ctx {ctx} batch {batch} {fname}"
                        need = self.kv_bytes(arch, fmt) * ctx * batch
                        if not self.smoke and need * 1.3 > torch.cuda.mem_get_info()[0]:
                            self.skipped.append(f"{label}: {need / 2**30:.1f} GiB does not fit")
                            continue
                        if self.left() < 15:
                            self.skipped.append(f"{label}: budget")
                            continue
                        cache = self.random_cache(arch, fmt, ctx * batch)
                        nb = cache.num_blocks - 1
                        perm = torch.randperm(nb, device=self.dev)[: batch * (ctx // BS)]
                        table = perm.view(batch, ctx // BS).to(torch.int32)
                        lens = torch.full((batch,), ctx, dtype=torch.int32, device=self.dev)
                        if arch == "gqa":
                            a = self.gqa
                            q = torch.randn(batch, a.num_heads, a.head_dim, device=self.dev, dtype=torch.bfloat16)
                            out = torch.empty(batch, a.num_heads, a.v_head_dim, device=self.dev, dtype=q.dtype)
                            run = lambda s: attention_triton.paged_decode_gqa(q, cache, table, lens, a.scale,
                                                                              out=out, **gqa_kw(s))
                            run_on = lambda s, c, o: attention_triton.paged_decode_gqa(q, c, table, lens, a.scale,
                                                                                       out=o, **gqa_kw(s))
                        else:
                            a = self.mla
                            ql = torch.randn(batch, a.num_heads, a.kv_lora_rank, device=self.dev, dtype=torch.bfloat16)
                            qr = torch.randn(batch, a.num_heads, a.qk_rope_head_dim, device=self.dev,
                                             dtype=torch.bfloat16)
                            out = torch.empty_like(ql)
                            run = lambda s: mla_decode_triton.paged_decode_mla(ql, qr, cache, table, lens, a.scale,
                                                                               split_tokens=s[0], max_splits=s[1],
                                                                               out=out)
                            run_on = lambda s, c, o: mla_decode_triton.paged_decode_mla(
                                ql, qr, c, table, lens, a.scale, split_tokens=s[0], max_splits=s[1], out=o)
                        by_split, setting_of = {}, {}
                        # absorbed MLA decode is compute-bound at 128 heads (~240 FLOP per bf16 KV byte):
                        # its TFLOP/s say how far from the tensor cores' peak it runs
                        flops_per_token = (2 * self.gqa.num_heads * (self.gqa.head_dim + self.gqa.v_head_dim)
                                           if arch == "gqa" else
                                           2 * self.mla.num_heads * (2 * self.mla.kv_lora_rank
                                                                     + self.mla.qk_rope_head_dim))
                        first_out: dict = {}       # (split, max, tile, warps) -> (setting, output) of the first
                        for s in splits[arch]:
                            if self.left() < 10:
                                break
                            kw = gqa_kw(s)
                            # the launch it runs with: explicit, else the table's (GQA); MLA's is fixed
                            launch = (attention_triton.gqa_decode_launch(q, cache, kw["tile_tokens"])
                                      if arch == "gqa" else None)
                            warps = kw["num_warps"] or (launch and launch.num_warps)
                            stages = kw["num_stages"] or (launch and launch.num_stages)
                            used = min(s[1], -(-ctx // (-(-s[0] // BS) * BS)))
                            partials = batch * heads * used * (width + 2) * 4 * 2      # written + read
                            ms, graphed = self.time_ms(lambda: run(s))
                            gbps = need / ms / 1e6
                            lab = setting_label(s)
                            by_split[lab] = gbps
                            setting_of[lab] = s
                            # pipeline depths of one split partition at one num_warps (the layouts):
                            # same math in the same order, so the outputs must agree bit for bit
                            part = (kw["split_tokens"], kw["max_splits"], kw["tile_tokens"], warps)
                            same = None
                            if part in first_out:
                                same = bool(torch.equal(out, first_out[part][1]))
                                if not same:            # same math, different bits: a failure
                                    self.log(f"  {label} {lab}: output differs from {first_out[part][0]}'s")
                                    if not kw["fused_merge"]:   # the fused merge is another kernel's
                                        # arithmetic: whether its bits agree is what the record says
                                        self.failures.append(f"{label} {lab}: not bit-identical to "
                                                             f"{first_out[part][0]}")
                            else:
                                first_out[part] = (lab, out.clone())
                            self.records.append(dict(kind="decode", arch=arch, ctx=ctx, batch=batch, fmt=fname,
                                                     split_tokens=s[0], max_splits=s[1], tile_tokens=kw["tile_tokens"],
                                                     num_warps=warps, num_stages=stages, setting=lab,
                                                     fused_merge=kw["fused_merge"],
                                                     same_output_as_first_of_partition=same,
                                                     compared_with=first_out[part][0], ms=ms, kv_bytes=need,
                                                     partial_bytes=partials, gbps=gbps,
                                                     frac_of_copy=gbps / bw["copy"],
                                                     frac_of_gemv=gbps / bw["gemv"], graph=graphed,
                                                     tflops=flops_per_token * ctx * batch / ms / 1e9))
                        if by_split:
                            best = max(by_split, key=by_split.get)
                            self.log(f"{label}: best split/max {best}: {by_split[best]:.0f} GB/s = "
                                     f"{by_split[best] / bw['copy']:.0%} of copy, {by_split[best] / bw['gemv']:.0%} "
                                     "of GEMV  (all: " + ", ".join(f"{s}:{v:.0f}" for s, v in by_split.items()) + ")")
                            self.decode_in_graphs(arch, fmt, fname, ctx, batch, need, bw, setting_of[best], best,
                                                  cache, out, run_on)
                        if fname == "bf16":
                            self.sdpa_decode(arch, ctx, batch, need, bw)
                        del cache
                        if not self.smoke:
                            torch.cuda.empty_cache()

    GRAPH_CALLS = 4

    def decode_in_graphs(self, arch, fmt, fname, ctx, batch, need, bw, setting, label, cache, out, run_on) -> None:
        """The row's best setting once more, as one CUDA graph of GRAPH_CALLS calls over as many
        distinct caches (per call = graph time / GRAPH_CALLS; each call's cache is cold: the others'
        bytes and do_bench's L2 flush lie between its reads). A one-call graph pays the graph
        launch's fixed cost on every call; the engine's decode step is one graph for all its layers
        and pays it once, so this is the engine-shaped figure (at batch 1, long context, the
        graph of four is measurably faster a call than one-call graphs)."""
        n = self.GRAPH_CALLS
        if not self.smoke and need * (n - 1) * 1.3 > torch.cuda.mem_get_info()[0]:
            self.skipped.append(f"decode {arch} ctx {ctx} batch {batch} {fname} graph of {n}: does not fit")
            return
        if self.left() < 10:
            self.skipped.append(f"decode {arch} ctx {ctx} batch {batch} {fname} graph of {n}: budget")
            return
        caches = [cache] + [self.random_cache(arch, fmt, ctx * batch) for _ in range(n - 1)]
        outs = [out] + [torch.empty_like(out) for _ in range(n - 1)]
        ms, graphed = self.time_ms(lambda: [run_on(setting, c, o) for c, o in zip(caches, outs)])
        per = ms / n
        gbps = need / per / 1e6
        self.records.append(dict(kind="decode_graph", arch=arch, ctx=ctx, batch=batch, fmt=fname, setting=label,
                                 calls=n, ms=per, kv_bytes=need, gbps=gbps, frac_of_copy=gbps / bw["copy"],
                                 frac_of_gemv=gbps / bw["gemv"], graph=graphed))
        self.log(f"  in a graph of {n} calls over {n} caches: {per:.4f} ms a call, {gbps:.0f} GB/s = "
                 f"{gbps / bw['copy']:.0%} of copy, {gbps / bw['gemv']:.0%} of GEMV")
        del caches, outs

    def sdpa_decode(self, arch: str, ctx: int, batch: int, need: int, bw: dict) -> None:
        """torch SDPA on the same shapes, contiguous K/V (what a non-paged engine would read)."""
        import torch.nn.functional as F
        bf = dict(device=self.dev, dtype=torch.bfloat16)
        try:
            if arch == "gqa":
                a = self.gqa
                q = torch.randn(batch, a.num_heads, 1, a.head_dim, **bf)
                k = torch.randn(batch, a.num_kv_heads, ctx, a.head_dim, **bf)
                v = torch.randn(batch, a.num_kv_heads, ctx, a.v_head_dim, **bf)
            else:
                # absorbed MLA decode is MQA with no mask: the heads fold into the query length
                # (one key head), so no backend expands K/V 128 times
                a = self.mla
                d = a.kv_lora_rank + a.qk_rope_head_dim
                q = torch.randn(batch, 1, a.num_heads, d, **bf)
                k = torch.randn(batch, 1, ctx, d, **bf)
                v = k[..., :a.kv_lora_rank]
            from torch.nn.attention import SDPBackend, sdpa_kernel
            # GQA: fused backends only (the math fallback would repeat K/V per query head);
            # folded MLA: any (its score matrix is [B, 1, H, ctx])
            if arch == "gqa":
                fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
                with sdpa_kernel([SDPBackend.MATH] if self.smoke else fused):
                    ms, graphed = self.time_ms(lambda: F.scaled_dot_product_attention(q, k, v, scale=a.scale,
                                                                                      enable_gqa=True))
            else:
                ms, graphed = self.time_ms(lambda: F.scaled_dot_product_attention(q, k, v, scale=a.scale))
        except Exception as e:            # noqa: BLE001 -- record why, keep going
            self.records.append(dict(kind="sdpa_decode", arch=arch, ctx=ctx, batch=batch, error=str(e)[:300]))
            self.log(f"  sdpa decode {arch} ctx {ctx} batch {batch}: {type(e).__name__}: {str(e)[:120]}")
            return
        gbps = need / ms / 1e6
        self.records.append(dict(kind="sdpa_decode", arch=arch, ctx=ctx, batch=batch, ms=ms, kv_bytes=need,
                                 gbps=gbps, frac_of_copy=gbps / bw["copy"], frac_of_gemv=gbps / bw["gemv"],
                                 graph=graphed))
        self.log(f"  sdpa decode {arch} ctx {ctx} batch {batch} (contiguous bf16): {gbps:.0f} GB/s")

    # ------------------------------------------------------------------ 3. prefill

    def prefill(self) -> None:
        import torch.nn.functional as F
        from moet.kernels import mla_prefill_triton, prefill_triton
        n = 8192 if not self.smoke else 32
        gemm_n = 8192 if not self.smoke else 64
        a_ = torch.randn(gemm_n, gemm_n, device=self.dev, dtype=torch.bfloat16)
        b_ = torch.randn(gemm_n, gemm_n, device=self.dev, dtype=torch.bfloat16)
        ms, _ = self.time_ms(lambda: torch.matmul(a_, b_))
        gemm = 2 * gemm_n ** 3 / ms / 1e9
        self.records.append(dict(kind="gemm", n=gemm_n, ms=ms, tflops=gemm))
        self.log(f"bf16 GEMM {gemm_n}^3: {gemm:.0f} TFLOP/s")
        del a_, b_
        pairs = n * (n + 1) // 2                                  # causal (query, key) pairs
        cu = torch.tensor([0, n], dtype=torch.int32, device=self.dev)
        lens = torch.tensor([n], dtype=torch.int32, device=self.dev)
        table = torch.randperm(n // BS + 1, device=self.dev)[: n // BS].view(1, -1).to(torch.int32)
        bf = dict(device=self.dev, dtype=torch.bfloat16)
        for arch in ("gqa", "mla"):
            for fname, fmt in self.formats():
                if fname == ("fp8-block" if arch == "gqa" else "fp8"):      # fp8 as deployed (see decode)
                    continue
                if self.quick and fname != "bf16":
                    continue
                if self.left() < 20:
                    self.skipped.append(f"prefill {arch} {fname}: budget")
                    continue
                cache = self.random_cache(arch, fmt, n)
                if arch == "gqa":
                    a = self.gqa
                    flops = 2 * pairs * a.num_heads * (a.head_dim + a.v_head_dim)
                    q = torch.randn(n, a.num_heads, a.head_dim, **bf)
                    out = torch.empty(n, a.num_heads, a.v_head_dim, **bf)
                    fn = lambda: prefill_triton.paged_prefill_gqa(q, cache, table, cu, lens, a.scale, max_seqlen_q=n,
                                                                  out=out)
                else:
                    a = self.mla
                    r, p = a.kv_lora_rank, a.qk_rope_head_dim
                    flops = 2 * pairs * a.num_heads * (r + p + r)
                    ql, qr = torch.randn(n, a.num_heads, r, **bf), torch.randn(n, a.num_heads, p, **bf)
                    out = torch.empty_like(ql)
                    fn = lambda: mla_prefill_triton.paged_prefill_mla(ql, qr, cache, table, cu, lens, a.scale,
                                                                      max_seqlen_q=n, out=out)
                ms, graphed = self.time_ms(fn)
                tf = flops / ms / 1e9
                self.records.append(dict(kind="prefill", arch=arch, fmt=fname, tokens=n, ms=ms, tflops=tf,
                                         frac_of_gemm=tf / gemm, graph=graphed))
                self.log(f"prefill {arch} {n} {fname}: {ms:.2f} ms, {tf:.1f} TFLOP/s = {tf / gemm:.1%} of GEMM")
                del cache
            if self.left() < 20:
                continue
            try:                       # SDPA, contiguous, causal; never the math fallback (O(n^2) memory)
                from torch.nn.attention import SDPBackend, sdpa_kernel
                if arch == "gqa":
                    a = self.gqa
                    q = torch.randn(1, a.num_heads, n, a.head_dim, **bf)
                    k = torch.randn(1, a.num_kv_heads, n, a.head_dim, **bf)
                    v = torch.randn(1, a.num_kv_heads, n, a.v_head_dim, **bf)
                    flops = 2 * pairs * a.num_heads * (a.head_dim + a.v_head_dim)
                else:
                    # the expanded (non-absorbed) form, what a non-paged engine runs for MLA prefill:
                    # per head q/k of nope + rope = 192, v of 128; its own FLOPs
                    a = self.mla
                    dk = a.qk_nope_head_dim + a.qk_rope_head_dim
                    q = torch.randn(1, a.num_heads, n, dk, **bf)
                    k = torch.randn(1, a.num_heads, n, dk, **bf)
                    v = torch.randn(1, a.num_heads, n, a.v_head_dim, **bf)
                    flops = 2 * pairs * a.num_heads * (dk + a.v_head_dim)
                backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
                if self.smoke:
                    backends = [SDPBackend.MATH]
                with sdpa_kernel(backends):
                    ms, graphed = self.time_ms(lambda: F.scaled_dot_product_attention(
                        q, k, v, is_causal=True, scale=a.scale, enable_gqa=True))
                tf = flops / ms / 1e9
                self.records.append(dict(kind="sdpa_prefill", arch=arch, tokens=n, ms=ms, tflops=tf,
                                         frac_of_gemm=tf / gemm, graph=graphed))
                self.log(f"  sdpa prefill {arch} {n} (contiguous bf16): {ms:.2f} ms, {tf:.1f} TFLOP/s")
            except Exception as e:        # noqa: BLE001
                self.records.append(dict(kind="sdpa_prefill", arch=arch, tokens=n, error=str(e)[:300]))
                self.log(f"  sdpa prefill {arch}: {type(e).__name__}: {str(e)[:120]}")

    # ------------------------------------------------------------------ report

    def table_md(self) -> str:
        lines = [f"# attention_bench ({'smoke, CPU' if self.smoke else torch.cuda.get_device_name()})", ""]
        first = {k: next((r for r in self.records if r["kind"] == k), None)
                 for k in ("copy", "gemv", "copy_graph_node")}
        if first["copy"]:
            c = first["copy"]
            lines.append(f"device copy: {c['gbps']:.0f} GB/s ({c['bytes'] / 2**30:.3g} GiB, {c['how']}; bytes read + "
                         "bytes written, each counted once)")
        if first["gemv"]:
            lines.append(f"bf16 GEMV: {first['gemv']['gbps']:.0f} GB/s ({first['gemv']['what']}; weight bytes)")
        if first["copy_graph_node"]:
            c = first["copy_graph_node"]
            lines.append(f"(not used: the copy of {c['bytes'] / 2**30:.3g} GiB as a CUDA-graph memcpy node, the "
                         f"reference of the first measurements: {c['gbps']:.0f} GB/s)")
        checks = [r for r in self.records if r["kind"] == "check"]
        lines.append(f"checks: {sum(r['ok'] for r in checks)}/{len(checks)} ok"
                     + (f"; FAILED: {', '.join(self.failures)}" if self.failures else ""))
        lines += ["", "## decode (best setting per row; KV GB/s and fraction of the copy and the GEMV; 'graph of "
                  f"{self.GRAPH_CALLS}': that setting as one CUDA graph of {self.GRAPH_CALLS} calls over as many caches, "
                  "per call, as the engine's decode-step graph runs it)", "",
                  "| arch | ctx | batch | kv | best setting | launch | ms | GB/s | of copy | of GEMV | TFLOP/s "
                  f"| graph of {self.GRAPH_CALLS}: ms, GB/s, of copy | sdpa bf16 GB/s |",
                  "|" + "---|" * 13]
        sdpa = {(r["arch"], r["ctx"], r["batch"]): r for r in self.records if r["kind"] == "sdpa_decode"}
        in_graph = {(r["arch"], r["ctx"], r["batch"], r["fmt"]): r for r in self.records if r["kind"] == "decode_graph"}
        best: dict[tuple, dict] = {}
        for r in self.records:
            if r["kind"] == "decode":
                key = (r["arch"], r["ctx"], r["batch"], r["fmt"])
                if key not in best or r["gbps"] > best[key]["gbps"]:
                    best[key] = r
        for (arch, ctx, batch, fmt), r in best.items():
            s = sdpa.get((arch, ctx, batch), {})
            lab = r.get("setting") or f"{r['split_tokens']}/{r['max_splits']}"
            launch = f"w{r['num_warps']} s{r['num_stages']}" if r.get("num_warps") else "-"
            gr = in_graph.get((arch, ctx, batch, fmt))
            gcell = f"{gr['ms']:.4f}, {gr['gbps']:.0f}, {gr['frac_of_copy']:.0%}" if gr else "-"
            lines.append(f"| {arch} | {ctx} | {batch} | {fmt} | {lab} | {launch} | {r['ms']:.3f} "
                         f"| {r['gbps']:.0f} | {r['frac_of_copy']:.0%} | {r['frac_of_gemv']:.0%} "
                         f"| {r.get('tflops', float('nan')):.0f} | {gcell} | {s.get('gbps', float('nan')):.0f} |")
        # every GQA setting side by side (--quick: the launches)
        gqa = [r for r in self.records if r["kind"] == "decode" and r["arch"] == "gqa"]
        cols = list(dict.fromkeys((r["ctx"], r["batch"], r["fmt"]) for r in gqa))
        if gqa and len({r["setting"] for r in gqa}) > 1:
            lines += ["", "GQA decode GB/s per setting (split/max splits, w = warps, s = stages: an explicit launch; "
                      "none = the launch table's, named in the last row; '!=' = the output differs from that of "
                      "the first setting with the same split partition and warps, i.e. the same math)", "",
                      "| setting | " + " | ".join(f"{c[0] // 1024 or c[0]}{'K' if c[0] >= 1024 else ''} b{c[1]} {c[2]}"
                                                for c in cols) + " |",
                      "|" + "---|" * (len(cols) + 1)]
            cell = {(r["setting"], r["ctx"], r["batch"], r["fmt"]): r for r in gqa}
            default = next(iter(dict.fromkeys(r["setting"] for r in gqa)))
            for lab in dict.fromkeys(r["setting"] for r in gqa):
                row = []
                for c in cols:
                    r = cell.get((lab, *c))
                    row.append("-" if r is None else f"{r['gbps']:.0f}"
                               + (" !=" if r.get("same_output_as_first_of_partition") is False else ""))
                lines.append(f"| {lab} | " + " | ".join(row) + " |")
            lines.append(f"| {default}: launch | " + " | ".join(
                f"w{r['num_warps']} s{r['num_stages']}" if (r := cell.get((default, *c))) else "-"
                for c in cols) + " |")
            best = [max((r for r in gqa if (r["ctx"], r["batch"], r["fmt"]) == c), key=lambda r: r["gbps"])
                    for c in cols]
            lines.append("| best: of copy / of GEMV | " + " | ".join(
                f"{r['frac_of_copy']:.0%} / {r['frac_of_gemv']:.0%}" for r in best) + " |")
        splits = sorted({(r["split_tokens"], r["max_splits"]) for r in self.records if r["kind"] == "decode"})
        if splits and not self.quick:
            lines += ["", "geometric-mean GB/s over the decode rows measured with every setting, per "
                      "split_tokens/max_splits (the default to pick): " + ", ".join(
                          f"{s[0]}/{s[1]}: {self._geo(s, splits):.0f}" for s in splits)]
        lines += ["", "## prefill", "", "| arch | kv | tokens | ms | TFLOP/s | of GEMM |", "|" + "---|" * 6]
        for r in self.records:
            if r["kind"] in ("prefill", "sdpa_prefill") and "ms" in r:
                lines.append(f"| {r['arch']} | {r.get('fmt', 'sdpa bf16')} | {r['tokens']} | {r['ms']:.2f} | "
                             f"{r['tflops']:.1f} | {r['frac_of_gemm']:.1%} |")
        gemm = [r for r in self.records if r["kind"] == "gemm"]
        if gemm:
            lines.append(f"\nbf16 GEMM {gemm[0]['n']}^3: {gemm[0]['tflops']:.0f} TFLOP/s")
        if self.skipped:
            lines += ["", "skipped: " + "; ".join(self.skipped)]
        return "\n".join(lines) + "\n"

    def _geo(self, s: tuple, settings: list) -> float:
        """Over the (arch, ctx, batch, fmt) rows that were measured with every setting (a budget
        cut must not favour the settings timed first)."""
        rows: dict[tuple, dict] = {}
        for r in self.records:
            if r["kind"] == "decode":
                rows.setdefault((r["arch"], r["ctx"], r["batch"], r["fmt"]), {})[(r["split_tokens"],
                                                                                   r["max_splits"])] = r["gbps"]
        vals = [v[s] for v in rows.values() if len(v) == len(settings)]
        return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for attention_bench.json / .md")
    ap.add_argument("--budget-s", type=float, default=200.0, help="stop starting new measurements after this")
    ap.add_argument("--smoke", action="store_true", help="CPU + TRITON_INTERPRET=1, toy shapes (tests the script)")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="no checks, decode at 32K only (batch 1 / 32, bf16 / fp8), prefill 8K bf16: "
                         "the short GPU call")
    ap.add_argument("--small-kernel-pdl", action=argparse.BooleanOptionalAction, default=True,
                    help="the kernels launched as the engine launches them, EngineConfig.kernels.small_kernel_pdl "
                         "(default on: under programmatic dependent launch, so the GQA decode also prefetches its "
                         "first steps before the PDL wait; --no-small-kernel-pdl for the A/B)")
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("attention_bench needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    if args.smoke and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton
    from moet.kernels import pdl
    pdl.set_small_kernel_pdl(args.small_kernel_pdl and not args.smoke)
    bench = Bench(args)
    bench.log(f"torch {torch.__version__}, triton {triton.__version__}, device "
              f"{'cpu (smoke)' if args.smoke else torch.cuda.get_device_name()}; budget {args.budget_s:.0f}s; "
              f"small-kernel PDL {'on' if pdl.small_kernel_pdl() else 'off'}")
    bench.log(f"GQA {bench.gqa.num_heads}/{bench.gqa.num_kv_heads} heads d {bench.gqa.head_dim}; MLA "
              f"{bench.mla.num_heads} heads R {bench.mla.kv_lora_rank} P {bench.mla.qk_rope_head_dim} "
              f"scale {bench.mla.scale:.6f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        if not (args.skip_checks or args.quick):
            bench.checks()
        bench.decode(bench.bandwidth())
        bench.prefill()
    finally:
        meta = dict(torch=torch.__version__, triton=triton.__version__, smoke=args.smoke, block_size=BS,
                    small_kernel_pdl=pdl.small_kernel_pdl(),
                    device="cpu" if args.smoke else torch.cuda.get_device_name(), elapsed_s=time.monotonic() - bench.t0)
        (out / "attention_bench.json").write_text(json.dumps(
            dict(meta=meta, records=bench.records, skipped=bench.skipped, failures=bench.failures), indent=1))
        (out / "attention_bench.md").write_text(bench.table_md())
        print(bench.table_md(), flush=True)
    return 1 if bench.failures else 0


if __name__ == "__main__":
    sys.exit(main())
