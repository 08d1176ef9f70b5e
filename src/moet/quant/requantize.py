"""Re-quantizing routed experts: a checkpoint's expert projections -> rows of an expert pool.

Each checkpoint projection is converted on arrival straight into its rows of one pool slot
(gate -> gate_up rows [0, I), up -> [I, 2I), down -> down), so nothing waits for its partner and
host memory holds one projection at a time. The model's loader fills its all-resident pools
with it (slot = expert id) and the store its pack rows, with the same functions, so a pack row
equals the loader's pool bit for bit.

expert_format:
  "w2"   moet.formats.w2, from the exact float64 value of the checkpoint's own format
         (NVFP4 / FP8 / MXFP4 decode exactly; BF16 is exact already). gate and up are
         quantized as the separate tensors they are on disk (zero-sign mode is per tensor).
  "fp4"  NVFP4 layout. An NVFP4 checkpoint's bytes are copied unchanged; other formats are
         decoded and quantized with moet.formats.nvfp4.quantize (per projection scale_2).
  "bf16" decoded to the model dtype (the reference; in a float32 run it is float32).
"""
from __future__ import annotations

import torch

from moet.errors import CheckpointError, ConfigError
from moet.formats import nvfp4, row_tiles, w2
from moet.kernels.pools import DensePool, FP4Pool, W2Pool
from moet.quant.decode import decode

PROJS = ("gate_proj", "up_proj", "down_proj")


def new_pool(spec, expert_format: str, num_slots: int, dtype: torch.dtype, device) -> W2Pool | FP4Pool | DensePool:
    """An all-zero pool of `num_slots` slots for `spec`'s routed experts (the loader builds its
    pools, the store its layer buffers and device caches with this, so every pool has one shape
    per format)."""
    s, h, i = num_slots, spec.hidden_size, spec.moe_intermediate_size
    u8 = dict(dtype=torch.uint8, device=device)
    if expert_format == "w2":
        if h % 32 or i % 32:
            raise ConfigError(f"expert_format=w2 needs hidden_size ({h}) and moe_intermediate_size ({i}) "
                              "divisible by 32; use --expert-format fp4 or bf16")
        # codes in the kernels' nb8 layout (moet.formats.w2.to_nb8; files keep v1), rows tiled
        # (nb8t, moet.formats.w2.tile_rows) where the shapes allow: the same kernels read it to
        # the same bits, faster (on the H200, DeepSeek-V3's layer at T = 1; docs/kernels.md, MoE)
        return W2Pool(torch.zeros(s, 2 * i, h // 4, **u8), torch.zeros(s, 2 * i, h // 32, **u8),
                      torch.zeros(s, h, i // 4, **u8), torch.zeros(s, h, i // 32, **u8),
                      layout=pool_layout("w2", h, i))
    if expert_format == "fp4":
        if h % 16 or i % 16:
            raise ConfigError(f"expert_format=fp4 needs hidden_size ({h}) and moe_intermediate_size ({i}) "
                              "divisible by 16; use --expert-format bf16")
        # rows tiled (nvfp4t) where the shapes allow, as W2 above: the same bits, faster (on the
        # H200, DeepSeek-V3's layer at T = 1 and 8; docs/kernels.md, MoE)
        f8 = dict(dtype=torch.float8_e4m3fn, device=device)
        return FP4Pool(torch.zeros(s, 2 * i, h // 2, **u8), torch.zeros(s, 2 * i, h // 16, **f8),
                       torch.zeros(s, 2, dtype=torch.float32, device=device),
                       torch.zeros(s, h, i // 2, **u8), torch.zeros(s, h, i // 16, **f8),
                       torch.zeros(s, dtype=torch.float32, device=device), layout=pool_layout("fp4", h, i))
    if expert_format == "bf16":
        return DensePool(torch.zeros(s, 2 * i, h, dtype=dtype, device=device),
                         torch.zeros(s, h, i, dtype=dtype, device=device))
    raise ConfigError(f"unknown expert_format {expert_format!r}")


def pool_layout(expert_format: str, hidden_size: int, moe_intermediate_size: int) -> str:
    """The model's W2 / FP4 pool layout for these expert shapes: row-tiled ("nb8t", "nvfp4t") when
    every K is whole 256-weight tiles (then every row count is whole 64-row tiles too), else
    row-major ("nb8", "nvfp4": GLM-4.5-Air's I = 1408, moet-tiny)."""
    tiled = hidden_size % row_tiles.TILE_WEIGHTS == 0 and moe_intermediate_size % row_tiles.TILE_WEIGHTS == 0
    return {"w2": ("nb8", "nb8t"), "fp4": ("nvfp4", "nvfp4t")}[expert_format][tiled]


def _to_w2(fmt: str, parts: dict[str, torch.Tensor], w2_opts: dict, name: str) -> w2.W2Tensor:
    if fmt == "float":
        return w2.quantize(parts["weight"], **w2_opts, name=name)
    if fmt == "fp8_block":
        return w2.from_fp8_block(parts["weight"], parts["weight_scale_inv"], **w2_opts, name=name)
    if fmt == "nvfp4":
        return w2.from_nvfp4(parts["weight"], parts["weight_scale"], parts["weight_scale_2"], **w2_opts, name=name)
    if fmt == "mxfp4":
        return w2.from_mxfp4(parts["blocks"], parts["scales"], **w2_opts, name=name)
    raise CheckpointError(f"{name}: unknown weight format {fmt}")


def _to_fp4(fmt: str, parts: dict[str, torch.Tensor], name: str) -> nvfp4.NVFP4Tensor:
    if fmt == "nvfp4":
        nvfp4.validate(parts["weight"], parts["weight_scale"], parts["weight_scale_2"], name)
        return nvfp4.NVFP4Tensor(parts["weight"], parts["weight_scale"], parts["weight_scale_2"].float().reshape(()))
    return nvfp4.quantize(decode(fmt, parts, torch.float32, name), name=name)


def convert_into(pool, slot: int, spec, proj: str, fmt: str, parts: dict[str, torch.Tensor],
                 w2_opts: dict, where: str) -> None:
    """Convert one projection of one expert (its on-disk tensors `parts` in checkpoint format
    `fmt`) into slot `slot` of `pool`, on the pool's device: gate -> gate_up rows [0, I),
    up -> [I, 2I), down -> down."""
    i = spec.moe_intermediate_size
    rows = {"gate_proj": slice(0, i), "up_proj": slice(i, 2 * i), "down_proj": slice(None)}[proj]
    fused = "down" if proj == "down_proj" else "gate_up"
    device = getattr(pool, pool.__slots__[0]).device
    if device.type != "cpu":  # re-encode where the pool lives: the GPU converts far faster
        parts = {k: v.to(device) for k, v in parts.items()}
    if isinstance(pool, DensePool):
        getattr(pool, fused)[slot, rows] = decode(fmt, parts, pool.gate_up.dtype, where)
    elif isinstance(pool, W2Pool):
        t = _to_w2(fmt, parts, w2_opts, where)
        codes = w2.to_nb8(t.codes) if pool.layout in ("nb8", "nb8t") else t.codes    # bit-exact, invertible
        scales = t.scales
        if pool.layout == "nb8t":
            # the rows of one projection are whole 64-row tiles of the slot (I % 256 == 0), so
            # tiling it alone gives exactly its part of the slot's tiled bytes
            codes, scales = w2.tile_rows(codes, 1 / 4), w2.tile_rows(scales, 1 / 32)
        getattr(pool, f"{fused}_codes")[slot, rows] = codes
        getattr(pool, f"{fused}_scales")[slot, rows] = scales
    else:
        t = _to_fp4(fmt, parts, where)
        weight, scale = t.weight, t.weight_scale
        if pool.layout == "nvfp4t":   # rows tiled, one projection at a time (as nb8t above)
            weight = row_tiles.tile_rows(weight, 1 / 2)
            scale = row_tiles.tile_rows(scale.view(torch.uint8), 1 / 16).view(scale.dtype)
        getattr(pool, f"{fused}_weight")[slot, rows] = weight
        getattr(pool, f"{fused}_scale")[slot, rows] = scale
        if proj == "down_proj":
            pool.down_scale_2[slot] = t.weight_scale_2
        else:
            pool.gate_up_scale_2[slot, 0 if proj == "gate_proj" else 1] = t.weight_scale_2


def fused_shape(spec, proj: str, fmt: str) -> tuple[int, int, int]:
    """The logical shape of a fused expert tensor as stored (proj gate_up_proj | down_proj):
    [E, 2I, H] / [E, H, I]; gpt-oss's float tensors transposed ([E, H, 2I] / [E, I, H])."""
    e, h, i = spec.router.num_experts, spec.hidden_size, spec.moe_intermediate_size
    want = (e, h, i) if proj == "down_proj" else (e, 2 * i, h)
    if spec.fused_expert_layout == "gpt_oss" and fmt == "float":
        want = (e, want[2], want[1])
    return want


def split_fused(spec, proj: str, fmt: str, parts: dict[str, torch.Tensor],
                expert: int) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """One expert's projections out of fused expert tensors (parts: role -> [E, ...]), as
    [(gate_proj, parts), (up_proj, parts)] or [(down_proj, parts)] in the per-expert [N, K]
    layout. Gate rows first ("stacked"), or gate and up rows interleaved (gpt-oss)."""
    if spec.fused_expert_layout == "gpt_oss" and fmt == "float":
        parts = {r: t.transpose(1, 2) for r, t in parts.items()}
    if proj == "down_proj":
        return [("down_proj", {r: t[expert] for r, t in parts.items()})]
    i = spec.moe_intermediate_size
    rows = ((slice(0, 2 * i, 2), slice(1, 2 * i, 2)) if spec.fused_expert_layout == "gpt_oss"
            else (slice(0, i), slice(i, 2 * i)))
    return [(name, {r: t[expert, sl] for r, t in parts.items()}) for name, sl in zip(("gate_proj", "up_proj"), rows)]


def check_all_arrived(n: int, loaded: set[tuple[int, str]], where: str) -> None:
    """Every (expert, projection) of a layer of `n` experts arrived (`loaded`)."""
    missing = [(e, p) for e in range(n) for p in PROJS if (e, p) not in loaded]
    if missing:
        e, p = missing[0]
        raise CheckpointError(f"{where}: routed expert tensors missing from the checkpoint, e.g. expert {e} "
                              f"{p} ({len(missing)} of {3 * n} missing)")
