"""Load a checkpoint into a CausalLM, shard by shard, tensor by tensor.

Like nano-vllm, a parameter is found by its (canonical) name and receives its on-disk tensors
through a weight_loader (`param.weight_loader` if a module defines one, else
default_weight_loader: decode + shape check + copy); routed experts are re-quantized into the
MoE layers' pools instead (moet.quant.requantize; every expert resident: slot = expert id).
Host memory holds the model, the one open shard's mapped pages that were touched, and one
parameter's tensors (plus its decoded copy) at a time; each shard is closed before the next is
opened.
"""
from __future__ import annotations

import logging
import re
from dataclasses import replace

import torch
from tqdm import tqdm

from moet.checkpoint import Checkpoint
from moet.checkpoint import weight_format as wf
from moet.checkpoint.spec import ExpertRef, expert_ref
from moet.errors import CheckpointError
from moet.model import kept_dense
from moet.model.layers.moe import MoE
from moet.model.model import CausalLM
from moet.quant.decode import decode
from moet.quant.requantize import check_all_arrived, convert_into, fused_shape, new_pool, split_fused
from moet.store.expert_slots import REPAIR_FORMAT, ExpertSlots

log = logging.getLogger("moet.load")

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def default_weight_loader(param: torch.nn.Parameter, fmt: str, parts: dict[str, torch.Tensor], where: str) -> None:
    value = decode(fmt, parts, param.dtype, where)
    if tuple(value.shape) != tuple(param.shape):
        raise CheckpointError(f"{where}: shape {list(value.shape)} does not match the {list(param.shape)} "
                              "that config.json implies")
    param.data.copy_(value)


def allocate_pool(moe: MoE, expert_format: str, dtype: torch.dtype, device, repair: bool = False,
                  repair_slots: int | None = None) -> None:
    """Every expert resident: slot = expert id (the block's ExpertSlots, store/expert_slots.py);
    repair: an FP4 repair tier beside it, of every expert (slot = expert id too), or with
    repair_slots < experts a device pool of that many slots, empty (store/repair_pool.py fills it),
    and every expert's FP4 rows in host memory (pinned on CUDA)."""
    n = moe.spec.router.num_experts
    moe.experts = ExpertSlots.resident(expert_format, new_pool(moe.spec, expert_format, n, dtype, device), device)
    if not repair:
        return
    slots = n if repair_slots is None else min(n, repair_slots)
    if slots == n:
        moe.experts.add_repair_tier(new_pool(moe.spec, REPAIR_FORMAT, n, dtype, device),
                                    torch.arange(n, dtype=torch.int32, device=device))
        return
    moe.experts.add_repair_tier(new_pool(moe.spec, REPAIR_FORMAT, slots, dtype, device),
                                torch.full((n,), -1, dtype=torch.int32, device=device))
    host = new_pool(moe.spec, REPAIR_FORMAT, n, dtype, "cpu")
    if torch.device(device).type == "cuda":
        host = replace(host, **{f: getattr(host, f).pin_memory() for f in host.__slots__
                                if isinstance(getattr(host, f), torch.Tensor)})
    moe.experts.repair_host_pool = host


def load_expert(moe: MoE, expert: int, proj: str, fmt: str, parts: dict[str, torch.Tensor],
                w2_opts: dict, where: str) -> None:
    """Convert one projection of one expert into its rows of the layer's pool (slot = expert), and
    of the repair tier's pool when the layer has one. w2_opts: keyword arguments of
    moet.formats.w2.quantize (zero_mode, scale_rule)."""
    spec = moe.spec
    if not 0 <= expert < spec.router.num_experts:
        raise CheckpointError(f"{where}: expert {expert} is out of range (config says {spec.router.num_experts} experts)")
    convert_into(moe.experts.pool, expert, spec, proj, fmt, parts, w2_opts, where)
    e = moe.experts
    if e.repair_host_pool is not None:               # a partial repair pool: the host holds every row
        convert_into(e.repair_host_pool, expert, spec, proj, fmt, parts, w2_opts, where)
    elif e.repair_pool is not None:
        convert_into(e.repair_pool, expert, spec, proj, fmt, parts, w2_opts, where)


def _moe_of(model: CausalLM, ref: ExpertRef, where: str) -> MoE:
    layer = model.model.layers[ref.layer] if ref.layer is not None else model.mtp[ref.mtp].layer
    if not isinstance(layer.mlp, MoE):
        raise CheckpointError(f"{where}: routed-expert tensor for a dense layer (config.json's "
                              "first_k_dense_replace / mlp_only_layers disagree with the weights)")
    return layer.mlp


def load_weights(model: CausalLM, ckpt: Checkpoint, *, expert_format: str, zero_mode: str = "auto",
                 scale_rule: str = "published", device: torch.device | str = "cpu", progress: bool = False,
                 keep_quantized_dense: bool | None = None, routed_experts: bool = True, repair_tier: bool = False,
                 repair_slots: int | None = None) -> None:
    """Fill `model` from `ckpt`; progress=True shows a bar (bytes, rate, ETA) on stderr.
    repair_tier: every MoE block also gets the FP4 repair tier (ExpertSlots.add_repair_tier), filled
    from the same tensors: the checkpoint's NVFP4 bytes unchanged, other formats quantized to NVFP4;
    repair_slots: FP4 device slots per layer when fewer than the experts (allocate_pool).
    keep_quantized_dense: FP8 block-128 / NVFP4 dense weights keep their bytes (model/kept_dense.py);
    None = where the device can run the format's kernel. routed_experts=False skips routed-expert tensors and leaves
    the MoE blocks without a pool: the store (moet.store: pack -> arena -> device cache) provides them."""
    spec, reader = ckpt.spec, ckpt.reader
    dense_fmt = ckpt.weight_format
    keep = keep_quantized_dense if keep_quantized_dense is not None else kept_dense.available(dense_fmt, device)
    if keep and dense_fmt in kept_dense.FORMATS:
        kept_dense.use_kept_linears(model, kept_dense.kept_linear_names(ckpt, dense_fmt), dense_fmt)
    moes = [m for m in model.modules() if isinstance(m, MoE)] if routed_experts else []
    for moe in moes:
        allocate_pool(moe, expert_format, model.dtype, device, repair=repair_tier, repair_slots=repair_slots)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    experts_loaded: dict[int, set[tuple[int, str]]] = {id(m): set() for m in moes}
    w2_opts = {"zero_mode": zero_mode, "scale_rule": scale_rule}

    def add_expert(moe: MoE, expert: int, proj: str, fmt: str, parts: dict, where: str) -> None:
        if (expert, proj) in experts_loaded[id(moe)]:
            raise CheckpointError(f"{where}: expert {expert} {proj} is stored twice (per-expert and fused?)")
        load_expert(moe, expert, proj, fmt, parts, w2_opts, where)
        experts_loaded[id(moe)].add((expert, proj))

    shard_bytes = reader.shard_bytes()
    bar = tqdm(total=sum(shard_bytes.values()), unit="B", unit_scale=True, unit_divisor=1024,
               desc=f"loading ({expert_format}{' + fp4' if repair_tier and moes else ''} experts)", disable=not progress, leave=False)
    by_shard: dict[str, list[str]] = {sh: [] for sh in reader.shards}
    for n, info in reader.tensors.items():
        by_shard[info.file].append(n)
    left_on_disk = 0
    for shard in reader.shards:
        for disk_name in sorted(by_shard[shard]):
            if wf.primary_name(disk_name) is not None:
                continue  # a scale / calibration companion, read with its weight
            base = disk_name[: -len(wf.MXFP4_BLOCKS)] if disk_name.endswith(wf.MXFP4_BLOCKS) else disk_name
            name = spec.canonical_name(base)
            if any(p.search(name) for p in wf.IGNORED_NAMES):
                continue
            if any(re.search(p, name) for p in spec.ignored):
                left_on_disk += 1          # a part moet does not build (Qwen3.5's vision tower, MTP block)
                continue
            if name.startswith("mtp.") and int(name.split(".")[1]) < spec.num_mtp_layers and not model.mtp:
                continue  # MTP layers not requested (load_mtp=False)
            fmt = wf.tensor_format(base, reader.tensors)
            target = params.get(name)
            # an integer parameter (DeepSeek-V4's tid2eid table) is read as stored
            integer_table = target is not None and not target.dtype.is_floating_point
            if fmt == "float" and not integer_table and reader.info(disk_name).dtype not in FLOAT_DTYPES:
                raise CheckpointError(f"{reader.where(disk_name)}: stored as {reader.info(disk_name).dtype} "
                                      "without the scale tensors of a quantized weight")
            names = wf.companions(base, fmt)
            for role, n in names.items():
                if n not in reader:
                    raise CheckpointError(f"{reader.where(disk_name)}: {fmt} weight without its {role} tensor {n}")
            where = reader.where(disk_name)
            shape = wf.logical_shape(fmt, {r: reader.info(n).shape for r, n in names.items()})

            ref = expert_ref(name)
            if ref is not None and not routed_experts:
                continue
            if ref is not None and ref.expert is not None:
                moe = _moe_of(model, ref, where)
                want = ((spec.hidden_size, spec.moe_intermediate_size) if ref.proj == "down_proj"
                        else (spec.moe_intermediate_size, spec.hidden_size))
                if shape != want:
                    raise CheckpointError(f"{where}: shape {list(shape)} does not match the {list(want)} "
                                          "that config.json implies")
                parts = {r: reader.get(n, copy=False) for r, n in names.items()}
                add_expert(moe, ref.expert, ref.proj, fmt, parts, where)
                continue
            if ref is not None:
                _load_fused(model, ref, fmt, names, shape, reader, add_expert, where)
                continue
            param = params.get(name)
            if param is None:
                raise CheckpointError(f"{where}: unexpected tensor (no {spec.architecture} parameter named {name}); "
                                      "config.json and the weights disagree")
            if tuple(shape) != tuple(getattr(param, "logical_shape", param.shape)):
                raise CheckpointError(f"{where}: shape {list(shape)} does not match the {list(param.shape)} "
                                      "that config.json implies")
            parts = {r: reader.get(n, copy=False) for r, n in names.items()}
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, fmt, parts, where)
            loaded.add(name)
        reader.close()
        bar.update(shard_bytes[shard])
    bar.close()
    if left_on_disk:
        log.info("%s: %d tensors of parts moet does not build were left on disk (%s)", ckpt.path, left_on_disk,
                 ", ".join(spec.ignored))

    _finish(model, ckpt, params, loaded, moes, experts_loaded)


def _load_fused(model, ref: ExpertRef, fmt, names, shape, reader, add_expert, where) -> None:
    """transformers-style fused expert tensors: gate_up_proj [E, 2I, H] (gate rows first) and
    down_proj [E, H, I]; float or MXFP4 (gpt-oss style *_blocks / *_scales). gpt-oss's layout
    (ModelSpec.fused_expert_layout): gate and up rows interleaved, and float tensors stored
    transposed ([E, H, 2I], [E, I, H]; its MXFP4 blocks are not)."""
    spec = model.spec
    moe = _moe_of(model, ref, where)
    want = fused_shape(spec, ref.proj, fmt)
    if tuple(shape) != want:
        raise CheckpointError(f"{where}: shape {list(shape)} does not match the {list(want)} that config.json implies")
    if fmt not in ("float", "mxfp4"):
        raise CheckpointError(f"{where}: fused {fmt} expert tensors are not supported (per-expert tensors are)")
    full = {r: reader.get(n, copy=False) for r, n in names.items()}
    for x in range(spec.router.num_experts):
        for proj, parts in split_fused(spec, ref.proj, fmt, full, x):
            add_expert(moe, x, proj, fmt, parts, f"{where}[{x}]")


def _finish(model: CausalLM, ckpt: Checkpoint, params: dict, loaded: set[str], moes: list[MoE],
            experts_loaded: dict[int, set]) -> None:
    spec = ckpt.spec
    if "lm_head.weight" not in loaded and spec.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        loaded.add("lm_head.weight")
    for j, m in enumerate(model.mtp):
        # DeepSeek-V3 MTP blocks share the main embedding and head (paper 2.2); checkpoints may
        # store copies. Keep a copy only if it differs, so memory is not spent twice.
        for attr, main, own in (("has_own_embed", model.model.embed_tokens.weight, f"mtp.{j}.embed_tokens.weight"),
                                ("has_own_head", model.lm_head.weight, f"mtp.{j}.shared_head.head.weight")):
            if own in loaded and not torch.equal(params[own], main):
                setattr(m, attr, True)
            loaded.add(own)
        if not m.has_own_embed:
            m.embed_tokens = None
        if not m.has_own_head:
            m.shared_head.head = None
    missing = [n for n in params if n not in loaded]
    if missing:
        raise CheckpointError(f"{ckpt.path}: tensor {_disk_hint(spec, missing[0])} is missing from the checkpoint "
                              f"({len(missing)} parameters missing)")
    for moe in moes:
        where = next(n for n, mod in model.named_modules() if mod is moe)
        check_all_arrived(moe.spec.router.num_experts, experts_loaded[id(moe)], f"{ckpt.path}: {where}")


def _disk_hint(spec, canonical: str) -> str:
    """A canonical name as the checkpoint would spell it (MTP blocks live at model.layers.{N + j})."""
    m = re.match(r"mtp\.(\d+)\.(layer\.)?(.*)$", canonical)
    return f"model.layers.{spec.num_layers + int(m.group(1))}.{m.group(3)}" if m else canonical
