"""Row-tiled kernel layouts (docs/formats.md, "Kernel layout nb8t"; FP4's "nvfp4t" likewise): an
[..., N, W] code or scale array with its rows tiled in TILE_ROWS x TILE_WEIGHTS tiles, each tile
one contiguous block (row-major inside), tiles in row-tile-major order, so a kernel step over a
row block reads one run of bytes instead of one short segment per row. The same bytes, permuted:
bit-exact both ways. Needs rows % 64 == 0 and K % 256 == 0.

    element (r, c) -> ((r // 64) * (W / cols) + c // cols) * 64 * cols + (r % 64) * cols + c % cols,
    cols = 256 * per_weight (array elements per weight: W2 codes 1/4, W2 scales 1/32, NVFP4 codes
    1/2, NVFP4 scales 1/16)
"""
from __future__ import annotations

import torch

from moet.errors import FormatError

TILE_ROWS = 64
TILE_WEIGHTS = 256


def _tile_cols(a: torch.Tensor, per_weight: float) -> int:
    """Columns of one tile row of an [..., N, W] array holding per_weight elements per weight."""
    cols = int(TILE_WEIGHTS * per_weight)
    n, w = a.shape[-2], a.shape[-1]
    if cols < 1 or n % TILE_ROWS or w % cols:
        raise FormatError(f"the row-tiled layouts (nb8t, nvfp4t) tile {TILE_ROWS} rows x {TILE_WEIGHTS} weights: "
                          f"got {n} rows and {w} columns ({w // max(cols, 1)} tiles of {cols} and {w % max(cols, 1)} "
                          "left over); use the row-major layout (nb8, nvfp4)")
    return cols


def tile_rows(a: torch.Tensor, per_weight: float) -> torch.Tensor:
    """[..., N, W] row-major -> the same shape in the row-tiled order (module docstring)."""
    cols = _tile_cols(a, per_weight)
    *lead, n, w = a.shape
    t = a.reshape(*lead, n // TILE_ROWS, TILE_ROWS, w // cols, cols).transpose(-3, -2)
    return t.contiguous().reshape(*lead, n, w)


def untile_rows(a: torch.Tensor, per_weight: float) -> torch.Tensor:
    """Inverse of tile_rows."""
    cols = _tile_cols(a, per_weight)
    *lead, n, w = a.shape
    t = a.reshape(*lead, n // TILE_ROWS, w // cols, TILE_ROWS, cols).transpose(-3, -2)
    return t.contiguous().reshape(*lead, n, w)
