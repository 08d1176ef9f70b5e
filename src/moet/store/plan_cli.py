"""`moet plan [CHECKPOINT] --gpu-memory 32GiB --host-memory 64GiB`: where the W2 experts live
(GPU slot pool / pinned host arena / pack on disk) for that budget, whether the engine would start
(the expert cache's minimum), and the decode tok/s that placement predicts from measured
bandwidths; headers only (instant on a 700 GB checkpoint). docs/architecture.md (`moet plan`)
explains the model behind the numbers; `moet inspect` gives the checkpoint summary it starts from.

Sizes: 32GiB, 96GB (decimal), 24g / 24G (GiB), 512MiB, 1.5TiB; a bare number is GiB.
"""
from __future__ import annotations

import argparse
import json
import os
import re

from moet.errors import ConfigError
from moet.store import plan as P

_UNITS = {"": 2**30, "b": 1, "k": 2**10, "kb": 1e3, "kib": 2**10, "m": 2**20, "mb": 1e6, "mib": 2**20,
          "g": 2**30, "gb": 1e9, "gib": 2**30, "t": 2**40, "tb": 1e12, "tib": 2**40}


def parse_size(text: str, what: str = "size") -> int:
    """'32GiB' / '96GB' / '24g' / '512MiB' / '1.5' (GiB) -> bytes; anything else: ConfigError."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ConfigError(f"{what}={text!r} is not a size; write e.g. 32GiB, 96GB (decimal), 24g (GiB), 512MiB, "
                          "or a bare number of GiB")
    return int(float(m.group(1)) * _UNITS[unit])


def _size_arg(what: str):
    def parse(text: str) -> int:
        try:
            return parse_size(text, what)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def _gib(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div / 10:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def _default_gpu_memory() -> tuple[int, str]:
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory, f"this machine's {torch.cuda.get_device_name(0)}"
    except Exception:       # no driver: fall back to the example card
        pass
    return 32 * 2**30, "no GPU here: a 32 GiB card"


def _default_host_memory() -> tuple[int, str]:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"


def render(plan: P.Plan, summary=None, notes: dict | None = None) -> str:
    f, g, bw = plan.facts, plan.gpu, plan.bandwidths
    notes = notes or {}
    lines = []
    if summary is not None:
        from moet.checkpoint.inspect_cli import render as inspect_render
        lines += inspect_render(summary, None).splitlines()
    lines += [
        f"experts      {f.moe_layers} MoE layers x {f.experts} = {f.rows} W2 rows of {_gib(f.row_bytes)} "
        f"(pack stride {_gib(f.stride)}): {_gib(f.expert_bytes)}; top-{f.top_k}",
        f"budget       GPU {_gib(g.total_bytes)}{notes.get('gpu', '')} x utilization {g.utilization:g} = "
        f"{_gib(g.budget_bytes)}; host {_gib(plan.host_memory_bytes)}{notes.get('host', '')}",
        "",
        f"{'tier':<26}{'bytes':>14}{'W2 rows':>10}{'share':>9}",
        f"{'GPU  dense stack':<26}{_gib(g.dense_bytes):>14}",
        f"{'GPU  KV reserve':<26}{_gib(g.kv_reserve_bytes):>14}    {notes.get('kv', '')}",
        f"{'GPU  activation reserve':<26}{_gib(g.activation_reserve_bytes):>14}",
    ]
    names = {"gpu": "GPU  expert slot pool", "host_arena": "host pinned arena", "disk": "pack on disk (rest)"}
    for t in plan.tiers:
        lines.append(f"{names[t.name]:<26}{_gib(t.bytes):>14}{t.rows:>10}{100 * t.rows / f.rows:>8.1f}%")
    lines.append(f"{'':<26}arena {_gib(plan.host_arena_bytes)}{notes.get('arena', '')}; pack file "
                 f"{_gib(f.rows * f.stride)} when the store is on")
    lines.append("")
    fit = plan.fit
    if not fit.ok:
        lines.append(f"fit          DOES NOT FIT: {fit.message}")
    elif fit.all_resident:
        lines.append("fit          every expert fits on the GPU: all resident, no store and no pack at run time")
    else:
        lines.append(f"fit          ok: {plan.tier('gpu').rows} slots >= {fit.min_slots} a decode step needs "
                     f"(MoE layers x top_k x min(max_num_seqs {plan.max_num_seqs}, 4))")
    p = plan.prediction
    if p is not None:
        lines += [
            f"hit model    {p.hit_model}: GPU {100 * p.hit_rate:.1f}%, arena {100 * p.arena_share:.1f}%, "
            f"disk {100 * p.disk_share:.1f}% of expert pairs",
            f"decode       batch {p.batch}, context {p.context}, miss tolerance {plan.miss_tolerance}:",
            f"  HBM        {_gib(p.hbm_bytes_per_step)} per step (dense - embedding {_gib(f.dense_bytes - f.embedding_bytes)}"
            f", experts, KV {_gib(p.batch * p.context * f.kv_bytes_per_token)}) -> {1e3 * p.hbm_s:.2f} ms",
            f"  misses     {p.misses_per_step:.1f} rows per step -> {_gib(p.fetch_bytes_per_step)} host-to-device, "
            f"{_gib(p.disk_bytes_per_step)} from disk -> {1e3 * p.fetch_s:.2f} ms",
            f"  replay     {p.passes_per_step:.2f} passes per step",
            f"  predicted  {p.tok_s:.2f} tok/s (all resident: {p.resident_tok_s:.1f} tok/s; fetches alone at "
            f"{bw.h2d_gbps:g} GB/s: " + (f"{p.pcie_bound_tok_s:.1f} tok/s)" if p.pcie_bound_tok_s else "no fetches)"),
        ]
        if p.prefill_chunk_fetch_bytes:
            lines.append(f"prefill      a long prompt's chunk routes to every expert: {_gib(p.prefill_chunk_fetch_bytes)} "
                         f"host-to-device ({_gib(p.prefill_chunk_disk_bytes)} from disk), layer by layer -> at least "
                         f"{p.prefill_chunk_fetch_s:.2f} s per chunk of up to max_num_batched_tokens tokens")
    rt = P.repair_tier_plan(plan)
    if rt is not None:
        if rt.from_pack:
            where = f"the expert store is on: FP4 rows from their own pack, a pool of {_gib(max(0, rt.room_bytes))}"
        else:
            where = f"room left beside the W2 experts {_gib(max(0, rt.room_bytes))}"
        pool = ("every expert's FP4 rows fit, the confidence gate runs" if rt.fits else
                f"a partial pool of {rt.slots} of {f.experts} experts per MoE layer, the rest repair with W2 rows"
                if rt.slots else f"fewer FP4 experts than top_k {f.top_k} per layer fit: no gate")
        lines.append(f"FP4 tier     {f.rows} FP4 rows of {_gib(f.fp4_row_bytes)}: {_gib(rt.fp4_bytes)}; {where}: {pool}")
        lines.append(f"  repair     a full reach of {rt.reach}: {_gib(rt.repair_bytes)} per pass -> {1e3 * rt.repair_s:.2f} ms; "
                     "batch-1 tok/s at fire rate " + ", ".join(f"{100 * r:g}%: {v:.1f}"
                                                               for r, v in rt.tok_s_at_fire.items()))
    lines.append(f"kernels      {100 * bw.kernel_efficiency:g}% of the HBM bandwidth, {bw.pass_overhead_ms:g} ms per pass"
                 + (" (the roofline; --kernel-efficiency / --pass-overhead-ms calibrate it)"
                    if bw.kernel_efficiency == 1.0 and bw.pass_overhead_ms == 0 else " (given)"))
    lines.append("bandwidths   (* = the host-to-device rate used)")
    for name, label in (("hbm_gbps", "HBM"), ("h2d_pinned_gbps", "H2D pinned"),
                        ("h2d_pageable_gbps", "H2D pageable"), ("disk_gbps", "disk")):
        used = "*" if (name == "h2d_pinned_gbps" and bw.pinned) or (name == "h2d_pageable_gbps" and not bw.pinned) else ""
        lines.append(f"  {label + used:<14}{getattr(bw, name):>7g} GB/s  {bw.sources[name]}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from moet.checkpoint.resolve import resolve_checkpoint

    path = resolve_checkpoint(args.checkpoint)
    facts, summary = P.facts_from_checkpoint(path, args.dtype, args.kv_cache_dtype)
    notes = {}
    gpu, gpu_src = (args.gpu_memory, "") if args.gpu_memory is not None else _default_gpu_memory()
    host, host_src = (args.host_memory, "") if args.host_memory is not None else _default_host_memory()
    if gpu_src:
        notes["gpu"] = f" ({gpu_src}; --gpu-memory)"
    if host_src:
        notes["host"] = f" ({host_src}; --host-memory)"
    kv_name = "bf16" if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    if args.kv_reserve is None:
        notes["kv"] = (f"min(max_num_seqs, 4) x {args.context} tokens x {_gib(facts.kv_bytes_per_token)}/token "
                       f"({kv_name}; --kv-reserve, --kv-cache-dtype)")
    elif facts.kv_bytes_per_token:
        notes["kv"] = (f"{args.kv_reserve // facts.kv_bytes_per_token:,} tokens of {kv_name} KV at "
                       f"{_gib(facts.kv_bytes_per_token)}/token (--kv-cache-dtype)")
    if args.host_arena is None:
        notes["arena"] = " (half the host memory, the engine's default; --host-arena)"
    if not 0 < args.kernel_efficiency <= 1 or args.pass_overhead_ms < 0:
        raise ConfigError(f"--kernel-efficiency must be in (0, 1] and --pass-overhead-ms >= 0, got "
                          f"{args.kernel_efficiency} and {args.pass_overhead_ms}")
    bw = P.Bandwidths(pinned=not args.pageable, kernel_efficiency=args.kernel_efficiency,
                      pass_overhead_ms=args.pass_overhead_ms)
    for name in ("hbm_gbps", "h2d_gbps", "h2d_pageable_gbps", "disk_gbps"):
        v = getattr(args, name)
        if v is not None:
            bw.override("h2d_pinned_gbps" if name == "h2d_gbps" else name, v, "given on the command line")
    plan = P.make_plan(facts, gpu_memory_bytes=gpu, host_memory_bytes=host, host_arena_bytes=args.host_arena,
                       gpu_memory_utilization=args.gpu_memory_utilization, kv_reserve_bytes=args.kv_reserve,
                       activation_reserve=args.activation_reserve, max_num_seqs=args.max_num_seqs,
                       context=args.context, batch=args.batch, miss_tolerance=args.miss_tolerance, zipf=args.zipf,
                       hit_rate=args.hit_rate, bandwidths=bw)
    if args.json:
        print(json.dumps({"summary": vars(summary), "plan": plan.to_json()}, indent=2))
    else:
        print(render(plan, summary, notes))
    return 0 if plan.fit.ok else 1


def add_subcommand(subparsers) -> None:
    from moet.assets import default_model
    from moet.config import KV_CACHE_DTYPES, SchedulerConfig

    p = subparsers.add_parser("plan", help="expert placement per tier and predicted decode tok/s for a GPU/host budget",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", nargs="?", default=default_model(),
                   help="checkpoint directory or Hugging Face repo id (default: the shipped moet-tiny)")
    p.add_argument("--gpu-memory", type=_size_arg("--gpu-memory"), default=None, metavar="SIZE",
                   help="GPU memory of the card (default: this machine's GPU, else 32GiB)")
    p.add_argument("--host-memory", type=_size_arg("--host-memory"), default=None, metavar="SIZE",
                   help="host memory (default: this machine's RAM)")
    p.add_argument("--host-arena", type=_size_arg("--host-arena"), default=None, metavar="SIZE",
                   help="pinned host arena for pack rows (engine: --host-arena-gb; default: half of --host-memory)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the card moet may use, as the engine's flag (default 0.9)")
    p.add_argument("--kv-reserve", type=_size_arg("--kv-reserve"), default=None, metavar="SIZE",
                   help="GPU memory kept for the KV cache (default: min(max_num_seqs, 4) x --context tokens of bf16 "
                        "KV, the engine's floor for an auto-sized expert cache)")
    p.add_argument("--kv-cache-dtype", default="bf16", choices=KV_CACHE_DTYPES,
                   help="KV cache layout the reserve is counted in, as the engine's flag (default bf16)")
    p.add_argument("--activation-reserve", type=float, default=0.05, metavar="FRACTION",
                   help="share of the GPU budget kept for activations (default 0.05, the engine's)")
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig().max_num_seqs,
                   help="as the engine's flag: the expert cache must hold MoE layers x top_k x min(this, 4) rows")
    p.add_argument("--context", type=int, default=4096, help="tokens of context per sequence (KV read and reserve; "
                                                             "default 4096)")
    p.add_argument("--batch", type=int, default=1, help="decode batch of the prediction (default 1)")
    p.add_argument("--miss-tolerance", type=int, default=0, help="as the engine's flag (default 0: strict replay)")
    p.add_argument("--hit-rate", type=float, default=None, help="expected GPU cache hit rate instead of the model")
    p.add_argument("--zipf", type=float, default=0.0, metavar="S",
                   help="routing skew: expert popularity ~ 1/rank^S per layer (default 0: uniform routing)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                   help="dense weights' dtype on the GPU (default: as `moet inspect` loads them)")
    p.add_argument("--hbm-gbps", type=float, default=None, help="HBM bandwidth in GB/s")
    p.add_argument("--h2d-gbps", type=float, default=None, help="pinned host-to-device bandwidth in GB/s")
    p.add_argument("--h2d-pageable-gbps", type=float, default=None, help="pageable host-to-device bandwidth in GB/s")
    p.add_argument("--pageable", action="store_true", help="the arena is not pinned: copies at the pageable rate")
    p.add_argument("--disk-gbps", type=float, default=None, help="pack read bandwidth in GB/s")
    p.add_argument("--kernel-efficiency", type=float, default=1.0, metavar="FRACTION",
                   help="share of the HBM bandwidth the decode kernels reach (default 1.0: the roofline; "
                        "docs/perf.md has measured values)")
    p.add_argument("--pass-overhead-ms", type=float, default=0.0, metavar="MS",
                   help="fixed cost per forward pass: launches and host work (default 0)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
