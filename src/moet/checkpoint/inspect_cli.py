"""`moet inspect CHECKPOINT`: what a checkpoint is and what fits where, from headers only
(no tensor data is read, so it is instant on a 700 GB checkpoint).

Parameter classes: routed experts (what moet compresses), MTP layers, and dense (everything
else: attention, dense MLPs, shared experts, router, norms, embeddings, LM head). "Active per
token" is dense + top_k routed experts per MoE layer (MTP excluded).
Bytes: native = on disk (incl. scales); W2 = 2.25 bits/weight; FP4 = NVFP4 layout, 4.5
bits/weight (e2m1 + one e4m3 scale per 16); dense as loaded = the model dtype (FP8 and NVFP4
dense weights are decoded to bf16 at load). docs/formats.md describes the formats.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from moet.checkpoint import open_checkpoint
from moet.checkpoint import weight_format as wf
from moet.checkpoint.spec import expert_ref

GiB = 2**30
W2_BITS, FP4_BITS = 2.25, 4.5


@dataclass
class Summary:
    path: str
    architecture: str
    family: str
    weight_format: str
    dtype: str
    layers: int
    dense_layers: int
    moe_layers: int
    mtp_layers: int
    experts: int
    top_k: int
    dense_params: int
    expert_params: int
    mtp_params: int
    active_params: int
    native_dense_bytes: int
    native_expert_bytes: int
    native_mtp_bytes: int
    dense_loaded_bytes: int
    w2_expert_bytes: int
    fp4_expert_bytes: int
    # the dense stack on a GPU, where FP8 / NVFP4 dense weights keep their stored bytes
    # (model/kept_dense.py) and the rest loads as dense_loaded_bytes does
    dense_gpu_bytes: int = 0


def _elements(fmt: str, shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * 2 if fmt in ("nvfp4", "mxfp4") else n  # two e2m1 codes per byte


def summarize(path: str) -> Summary:
    ckpt = open_checkpoint(path)
    spec, reader = ckpt.spec, ckpt.reader
    params = {"dense": 0, "expert": 0, "mtp": 0}
    native = {"dense": 0, "expert": 0, "mtp": 0}
    loaded_bytes = 2 if spec.torch_dtype in ("bfloat16", "float16") or ckpt.weight_format != "float" else 4
    dense_gpu = 0
    for name, info in reader.tensors.items():
        primary = wf.primary_name(name)
        base = name if primary is None else primary
        if base == "":
            continue
        if base.endswith(wf.MXFP4_BLOCKS):
            base = base[: -len(wf.MXFP4_BLOCKS)]
        canon = spec.canonical_name(base)
        is_expert = expert_ref(canon) is not None
        kind = "mtp" if canon.startswith("mtp.") else "expert" if is_expert else "dense"
        native[kind] += info.nbytes
        fmt = wf.tensor_format(base, reader.tensors)
        kept = fmt in wf.KEPT_DENSE_FORMATS and not canon[: -len(".weight")].endswith(wf.KEEP_DECODED)
        if primary is None:
            n = _elements(fmt, info.shape)
            params[kind] += n
            if kind == "dense":
                dense_gpu += info.nbytes if kept else n * loaded_bytes
        elif kind == "dense" and kept and not name.endswith(wf.IGNORED_SUFFIXES):
            dense_gpu += info.nbytes                 # a kept weight's scales
    active = params["dense"] + len(spec.moe_layers) * spec.router.top_k * spec.expert_params()
    return Summary(
        path=ckpt.path, architecture=spec.architecture, family=spec.family, weight_format=ckpt.weight_format,
        dtype=spec.torch_dtype, layers=spec.num_layers, dense_layers=spec.num_layers - len(spec.moe_layers),
        moe_layers=len(spec.moe_layers), mtp_layers=spec.num_mtp_layers, experts=spec.router.num_experts,
        top_k=spec.router.top_k, dense_params=params["dense"], expert_params=params["expert"],
        mtp_params=params["mtp"], active_params=active, native_dense_bytes=native["dense"],
        native_expert_bytes=native["expert"], native_mtp_bytes=native["mtp"],
        dense_loaded_bytes=params["dense"] * loaded_bytes,
        w2_expert_bytes=int(params["expert"] * W2_BITS / 8), fp4_expert_bytes=int(params["expert"] * FP4_BITS / 8),
        dense_gpu_bytes=dense_gpu,
    )


def placement(s: Summary, gpu_memory_gib: float, reserve_gib: float) -> dict:
    """What fits in `gpu_memory_gib` after the dense stack and a reserve (KV cache, activations)."""
    free = gpu_memory_gib * GiB - (s.dense_gpu_bytes or s.dense_loaded_bytes) - reserve_gib * GiB
    per_expert_w2 = s.w2_expert_bytes / max(1, s.moe_layers * s.experts)
    return {
        "gpu_memory_gib": gpu_memory_gib,
        "reserve_gib": reserve_gib,
        "dense_fits": free >= 0,
        "free_for_experts_gib": max(free, 0) / GiB,
        "w2_all_resident": free >= s.w2_expert_bytes,
        "fp4_all_resident": free >= s.fp4_expert_bytes,
        "w2_resident_fraction": min(1.0, max(free, 0) / s.w2_expert_bytes) if s.w2_expert_bytes else 1.0,
        "w2_expert_slots": int(max(free, 0) // per_expert_w2) if per_expert_w2 else 0,
        "host_or_disk_w2_gib": max(s.w2_expert_bytes - max(free, 0), 0) / GiB,
        # the engine's floor: the expert cache must hold layers x top_k x (1 + drafts) x min(seqs, 4) slots
        "min_slots": s.moe_layers * s.top_k,
        "min_slots_4_seqs": s.moe_layers * s.top_k * 4,
    }


def _fmt_n(n: int) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _fmt_b(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:.2f} MiB"


def render(s: Summary, place: dict | None) -> str:
    lines = [
        f"checkpoint   {s.path}",
        f"family       {s.family} ({s.architecture}), weights {s.weight_format}, dtype {s.dtype}",
        f"layers       {s.layers} ({s.dense_layers} dense, {s.moe_layers} MoE) + {s.mtp_layers} MTP; "
        f"{s.experts} routed experts, top-{s.top_k}",
        f"parameters   dense {_fmt_n(s.dense_params)}, routed experts {_fmt_n(s.expert_params)}, "
        f"MTP {_fmt_n(s.mtp_params)}, active per token {_fmt_n(s.active_params)}",
        f"bytes        native: dense {_fmt_b(s.native_dense_bytes)}, experts {_fmt_b(s.native_expert_bytes)}, "
        f"MTP {_fmt_b(s.native_mtp_bytes)}",
        f"             experts as W2 (2.25 b/w) {_fmt_b(s.w2_expert_bytes)}, as FP4 (4.5 b/w) "
        f"{_fmt_b(s.fp4_expert_bytes)}; dense as loaded {_fmt_b(s.dense_loaded_bytes)}"
        + (f" (on a GPU {_fmt_b(s.dense_gpu_bytes)}: {s.weight_format} dense weights kept)"
           if s.dense_gpu_bytes and s.dense_gpu_bytes != s.dense_loaded_bytes else ""),
    ]
    if place is not None:
        if not place["dense_fits"]:
            lines.append(f"fit          {place['gpu_memory_gib']:g} GiB: the dense stack alone "
                         f"({_fmt_b(s.dense_gpu_bytes or s.dense_loaded_bytes)}) plus the {place['reserve_gib']:g} GiB reserve does not fit")
        else:
            lines.append(
                f"fit          {place['gpu_memory_gib']:g} GiB (reserve {place['reserve_gib']:g} GiB): "
                f"{place['free_for_experts_gib']:.2f} GiB for experts; W2 all resident: "
                f"{'yes' if place['w2_all_resident'] else 'no'} ({100 * place['w2_resident_fraction']:.1f}%, "
                f"{place['w2_expert_slots']} slots); FP4 all resident: {'yes' if place['fp4_all_resident'] else 'no'}; "
                f"W2 on host/disk: {place['host_or_disk_w2_gib']:.2f} GiB")
            lines.append(
                f"             expert cache needs >= {place['min_slots']} slots for 1 sequence, "
                f"{place['min_slots_4_seqs']} for 4+ (x (1 + MTP drafts)): "
                f"{'ok' if place['w2_expert_slots'] >= place['min_slots'] else 'TOO SMALL'}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from moet.checkpoint.resolve import resolve_checkpoint

    s = summarize(resolve_checkpoint(args.checkpoint))
    place = placement(s, args.gpu_memory, args.reserve) if args.gpu_memory is not None else None
    if args.json:
        print(json.dumps({"summary": asdict(s), "placement": place}, indent=2))
    else:
        print(render(s, place))
    return 0


def add_subcommand(subparsers) -> None:
    p = subparsers.add_parser("inspect", help="family, parameter counts, bytes per format and what fits where",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="checkpoint directory or Hugging Face repo id")
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                   help="GPU memory in GiB to plan for (dense stack + experts)")
    p.add_argument("--reserve", type=float, default=2.0, metavar="GIB",
                   help="GiB kept back for KV cache and activations when planning (default 2)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
