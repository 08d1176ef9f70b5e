"""Residency store on a GPU box: correctness first, then bandwidths.

    PYTHONUNBUFFERED=1 python benchmarks/benchmark_store.py --out $OUT --budget-s 420

1. correctness: a tiny qwen3_moe (40 experts x 2 MoE layers) on the device, W2 experts from a
   pack through a pinned host arena into device caches of 10% / 25% / 50%, strict replay:
   every step's logits must equal the fully resident model's bit for bit (exit 1 otherwise);
   then a fetched slot's bytes are compared with the pack row on a large synthetic pack.
2. timings on a synthetic pack of DeepSeek-V3-sized W2 rows (H 7168, I 2048: ~12.4 MB a row):
   pack write (pwrite + fdatasync), checksum speed, arena fills from the pack (buffered page
   cache warm; O_DIRECT = disk) with 1 / 4 / 8 reader threads, device cache fetches (pinned
   arena -> device slots, side stream) in batches of 8 and 32 rows, against one plain pinned
   host-to-device copy of the same bytes (the PCIe bound).
Results: <out>/store_bench.json (+ the same lines on stdout). Stops before --budget-s.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

from moet.kernels.pools import W2Pool
from moet.store import ExpertCache, HostArena, open_pack, run_with_replay
from moet.store.pack_builder import _fresh_file
from moet.store.pack_file import PackFile, PackMeta, PackPaths, RowLayout, checksum_fn, default_checksum, field_bytes

T0 = time.monotonic()
RESULTS: dict = {}


def say(key: str, value) -> None:
    RESULTS[key] = value
    print(f"{time.monotonic() - T0:7.1f}s  {key}: {value}", flush=True)


def left(budget: float) -> float:
    return budget - (time.monotonic() - T0)


def check_tiny_model(device: torch.device, work: str) -> bool:
    from moet.checkpoint import open_checkpoint
    from moet.model import load_model
    from moet.testing.tiny_checkpoint import make_checkpoint

    path = make_checkpoint(os.path.join(work, "tiny"), "qwen3_moe", "bf16", tokenizer=False, num_experts=40)
    ckpt = open_checkpoint(path)
    ref = load_model(ckpt, expert_format="w2", dtype=torch.float32, device=device)
    ok = True
    with open_pack(ckpt, os.path.join(work, "packs"), device=device) as pack:
        rows = pack.num_layers * pack.num_experts
        for fraction in (0.10, 0.25, 0.50):
            model = load_model(ckpt, expert_format="w2", dtype=torch.float32, device=device, routed_experts=False)
            cache = ExpertCache(pack, int(rows * fraction), device, arena=HostArena(pack, rows // 8))
            cache.attach(model.moe_blocks())
            g = torch.Generator().manual_seed(1)
            prompt = torch.randint(0, 256, (6,), generator=g).to(device)
            kv_ref, kv = ref.new_cache(64, device), model.new_cache(64, device)
            start, equal, passes = 0, True, []
            ids = prompt[:2]
            for n in range(12):
                want = ref.forward(ids, start, kv_ref)
                got, res = run_with_replay(lambda: model.forward(ids, start, kv), cache, scan=n < 3)
                equal &= torch.equal(got, want)
                passes.append(res.passes)
                start += ids.shape[0]
                ids = prompt[2 * (n + 1):2 * (n + 2)] if n < 2 else want[-1:].argmax(-1)
            say(f"tiny_model_bit_identical_{int(fraction * 100)}pct", bool(equal))
            say(f"tiny_model_passes_{int(fraction * 100)}pct", passes)
            ok &= bool(equal)
    return ok


def synthetic_pack(work: str, h: int, i: int, layers: int, experts: int) -> tuple[PackPaths, PackMeta, float]:
    u8 = dict(dtype=torch.uint8)
    probe = W2Pool(torch.zeros(1, 2 * i, h // 4, **u8), torch.zeros(1, 2 * i, h // 32, **u8),
                   torch.zeros(1, h, i // 4, **u8), torch.zeros(1, h, i // 32, **u8))
    layout = RowLayout.of_pool("w2", probe)
    meta = PackMeta(tag="w2", checkpoint_identity="synthetic", quantizer={"name": "w2", "version": 1, "options": {}},
                    layers=[f"model.layers.{l}" for l in range(layers)], num_experts=experts, row=layout.to_json(),
                    checksum=default_checksum())
    paths = PackPaths.of(os.path.join(work, "synth"), "synthetic", "w2", "bench", 0)
    os.makedirs(os.path.dirname(paths.data), exist_ok=True)
    _fresh_file(paths, meta)
    g = torch.Generator().manual_seed(0)
    t = time.perf_counter()
    with PackFile(paths, meta, writable=True) as pf:
        for l in range(layers):
            rows = torch.randint(0, 256, (experts, layout.stride), dtype=torch.uint8, generator=g)
            rows[:, layout.row_bytes:] = 0
            pf.commit_layer(l, pf.write_layer(l, rows))
    return paths, meta, time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=420)
    ap.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    say("device", torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
    say("checksum", default_checksum())
    work = args.work or tempfile.mkdtemp(prefix="moet-store-bench-")
    os.makedirs(args.out, exist_ok=True)

    def dump():
        with open(os.path.join(args.out, "store_bench.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)

    try:
        try:
            tiny_ok = check_tiny_model(device, work)
        except Exception as exc:  # report what broke instead of losing the timings' JSON
            say("FAILED", f"tiny model check raised {type(exc).__name__}: {exc}")
            raise
        if not tiny_ok:
            say("FAILED", "cached logits differ from fully resident")
            return 1
        h, i = args.hidden, args.inter
        paths, meta, write_s = synthetic_pack(work, h, i, args.layers, args.experts)
        stride, n_rows = meta.row["stride"], args.layers * args.experts
        total = n_rows * stride
        say("row_bytes", meta.row["row_bytes"])
        say("pack_write_GBps", round(total / write_s / 1e9, 2))
        buf = np.random.randint(0, 256, stride, dtype=np.uint8)
        fn = checksum_fn(meta.checksum)
        t = time.perf_counter()
        for _ in range(20):
            fn(memoryview(buf))
        say("checksum_GBps_one_thread", round(20 * stride / (time.perf_counter() - t) / 1e9, 2))

        pin = device.type == "cuda"
        for o_direct in (False, True):
            for threads in (1, 4, 8):
                if left(args.budget_s) < 60:
                    break
                try:
                    pack = PackFile(paths, meta, o_direct=o_direct)
                except Exception as exc:
                    say(f"arena_fill_odirect_{o_direct}", f"skipped: {exc}")
                    break
                arena = HostArena(pack, n_rows, pin=pin, threads=threads)
                t = time.perf_counter()
                for s in range(0, n_rows, 32):
                    arena.rows(list(range(s, min(s + 32, n_rows))))
                dt = time.perf_counter() - t
                say(f"arena_fill_GBps_{'odirect' if o_direct else 'buffered'}_t{threads}", round(total / dt / 1e9, 2))
                arena.close()
                pack.close()

        pack = PackFile(paths, meta)
        arena = HostArena(pack, n_rows, pin=pin, threads=8)
        arena.rows(list(range(n_rows)))                            # every row in the arena
        for batch in (8, 32):
            if left(args.budget_s) < 45:
                break
            cache = ExpertCache(pack, batch, device, arena=arena)
            keys = np.arange(n_rows)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            for s in range(0, n_rows - batch + 1, batch):
                cache.fetch(keys[s:s + batch])
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t
            moved = (n_rows // batch) * batch * meta.row["row_bytes"]
            say(f"cache_fetch_GBps_batch{batch}", round(moved / dt / 1e9, 2))
            # the last batch's slots hold exactly the pack's rows
            last = keys[(n_rows // batch - 1) * batch:(n_rows // batch) * batch]
            good = True
            for k in last[:4]:
                s = int(cache.slot_table.view(-1)[int(k)])
                row = arena.rows([int(k)])[0]
                for f in cache.layout.fields:
                    good &= torch.equal(field_bytes(cache.pool, f)[s].cpu(), row[f.offset:f.offset + f.nbytes])
            say(f"cache_slots_equal_pack_rows_batch{batch}", bool(good))
            if not good:
                return 1
        if device.type == "cuda":
            src = torch.empty(32 * meta.row["row_bytes"], dtype=torch.uint8, pin_memory=True)
            dst = torch.empty_like(src, device=device)
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(10):
                dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            say("pinned_h2d_bound_GBps", round(10 * src.numel() / (time.perf_counter() - t) / 1e9, 2))
        return 0
    finally:
        dump()


if __name__ == "__main__":
    sys.exit(main())
