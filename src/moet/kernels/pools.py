"""Expert slot pools: plain tensors whose leading dimension is the slot. A slot holds one
routed expert's gate_up [2I, H] and down [H, I] weights in one format. Who fills which slot
(and the slot table that says so) is the store's business; kernels only read.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moet.formats import row_tiles


@dataclass(slots=True)
class W2Pool:
    """moet's 2-bit code (moet.formats.w2): 2.25 bits per weight. `layout` names the code
    byte layout: "v1" (files, moet.formats.w2), "nb8" (what the Triton kernels read; the
    model's pools, converted at fill time with moet.formats.w2.to_nb8; scales as v1) or "nb8t"
    (nb8 with codes and scales row-tiled, moet.formats.w2.tile_rows: the model's pools where
    moet.quant.requantize.pool_layout allows)."""
    gate_up_codes: torch.Tensor    # uint8 [S, 2I, H/4]
    gate_up_scales: torch.Tensor   # uint8 [S, 2I, H/32]  UE8M0
    down_codes: torch.Tensor       # uint8 [S, H, I/4]
    down_scales: torch.Tensor      # uint8 [S, H, I/32]
    layout: str = "v1"

    @property
    def num_slots(self) -> int:
        return self.gate_up_codes.shape[0]


@dataclass(slots=True)
class FP4Pool:
    """NVFP4 layout (the FP4 tier, SPEC 2.2): e2m1 pairs, e4m3 block-16 scales, fp32 scale_2.
    `layout`: "nvfp4" (the checkpoint's row-major bytes) or "nvfp4t" (weights and block scales
    row-tiled, moet.formats.row_tiles, read by the same kernels to the same bits, faster:
    the model's pools where moet.quant.requantize.pool_layout allows)."""
    gate_up_weight: torch.Tensor   # uint8 [S, 2I, H/2]
    gate_up_scale: torch.Tensor    # float8_e4m3fn [S, 2I, H/16]
    gate_up_scale_2: torch.Tensor  # float32 [S, 2]: gate rows, up rows
    down_weight: torch.Tensor      # uint8 [S, H, I/2]
    down_scale: torch.Tensor       # float8_e4m3fn [S, H, I/16]
    down_scale_2: torch.Tensor     # float32 [S]
    layout: str = "nvfp4"

    @property
    def num_slots(self) -> int:
        return self.gate_up_weight.shape[0]


@dataclass(slots=True)
class DensePool:
    """Decoded weights in the model dtype: the reference tier (most memory)."""
    gate_up: torch.Tensor          # [S, 2I, H]
    down: torch.Tensor             # [S, H, I]

    @property
    def num_slots(self) -> int:
        return self.gate_up.shape[0]


@dataclass(slots=True)
class DecodedPool:
    """A W2 / FP4 pool's experts decoded once to float32: exactly the values the reference decodes
    on every call (moet.kernels.reference.decoded_pool), computed with the same float32 math. For
    CPU runs whose slots never change (every expert resident, no expert store): a step then reads
    weights instead of decoding them. 4 bytes per weight, which is why it is made only there."""
    gate_up: torch.Tensor          # float32 [S, 2I, H]
    down: torch.Tensor             # float32 [S, H, I]

    @property
    def num_slots(self) -> int:
        return self.gate_up.shape[0]


def pool_nbytes(pool) -> int:
    return sum(v.nbytes for v in (getattr(pool, f) for f in pool.__slots__) if isinstance(v, torch.Tensor))


# The row-tiled layouts (moet.formats.row_tiles): each tiled field and its elements per weight.
ROW_TILED_FIELDS = {
    "nb8t": {"gate_up_codes": 1 / 4, "gate_up_scales": 1 / 32, "down_codes": 1 / 4, "down_scales": 1 / 32},
    "nvfp4t": {"gate_up_weight": 1 / 2, "gate_up_scale": 1 / 16, "down_weight": 1 / 2, "down_scale": 1 / 16},
}
_ROW_MAJOR = {"nb8t": "nb8", "nvfp4t": "nvfp4"}


def untile_field(t: torch.Tensor, per_weight: float) -> torch.Tensor:
    """One row-tiled field (any dtype, e.g. e4m3 scales) back in row-major order."""
    return row_tiles.untile_rows(t.view(torch.uint8), per_weight).view(t.dtype)


def row_tiled(pool):
    """The row-tiled twin of a row-major W2 (nb8 -> nb8t) or FP4 (nvfp4 -> nvfp4t) pool: the same
    bytes, permuted (bit-exact; row_major inverts it)."""
    layout = {v: k for k, v in _ROW_MAJOR.items()}[pool.layout]
    return replace(pool, layout=layout, **{f: row_tiles.tile_rows(getattr(pool, f).view(torch.uint8), per)
                                          .view(getattr(pool, f).dtype)
                                          for f, per in ROW_TILED_FIELDS[layout].items()})


def row_major(pool):
    """Inverse of row_tiled."""
    return replace(pool, layout=_ROW_MAJOR[pool.layout],
                   **{f: untile_field(getattr(pool, f), per) for f, per in ROW_TILED_FIELDS[pool.layout].items()})
