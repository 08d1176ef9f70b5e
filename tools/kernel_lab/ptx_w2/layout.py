"""Fragment-major W2 layout for a hand-written mma.sync m16n8k32 e4m3 decode GEMV (lab only).

Fragment layouts of `mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32` (PTX ISA, section
"Matrix Fragments for mma.m16n8k32", 8-bit element types; lane = laneid, g = lane >> 2
("groupID"), t = lane & 3 ("threadID_in_group")):

  A (16 x 32, row-major), 4 .b32 registers a0..a3 per lane, 4 e4m3 bytes each, byte i of
    register r = element e = 4r + i:
      row = g       for a0, a2 (e < 4 or 8 <= e < 12),   row = g + 8 for a1, a3
      col = 4t + i  for a0, a1 (e < 8),                  col = 16 + 4t + i for a2, a3
  B (32 x 8, column-major), 2 .b32 registers b0, b1 per lane, byte i of register r:
      row (k) = 4t + i for b0,  16 + 4t + i for b1;      col (n) = g
  C / D (16 x 8, f32), 4 registers c0..c3 per lane:
      row = g for c0, c1; g + 8 for c2, c3;              col = 2t + (i & 1)

Kernel roles (the brief's orientation): weights are B (one mma = 8 weight rows x 32 k = one
UE8M0 group), tokens are A (16 rows, rows 0..T-1 real, T <= 8; a1 = a3 = 0 always), so D rows
8..15 are zero and a lane's useful outputs are c0 = y[token g, row 2t], c1 = y[token g, row 2t+1].

Codes, "fm8" (uint8 [N/8, K/256, 32 lanes, 16 bytes] = 4 little-endian uint32 words per lane):
  tile i = rows 8i..8i+7, chunk c = K range 256c..256c+255 (8 groups), word q (0..3) of lane
  (g, t) covers groups j0 = 8c + 2q and j1 = j0 + 1 of row 8i + g:
      nibble n     (n = 0..3): bits 0-1 = code(row, 32 j0 + 4t + n)        (-> b0 of group j0)
                               bits 2-3 = code(row, 32 j0 + 16 + 4t + n)   (-> b1 of group j0)
      nibble 4 + n (n = 0..3): the same for group j1
  so one 128-bit load per lane gives its B fragments for 8 mmas (one tile, 8 groups), and the
  PRMT selectors are (prmt reads only selector bits 0..15; nibble bit 3 must be 0, bit 2 = 0 here):
      m = w & 0x33333333:  sel(b0, j0) = m,       sel(b0, j1) = m >> 16
      h = w & 0xCCCCCCCC:  sel(b1, j0) = h >> 2,  sel(b1, j1) = h >> 18
  5 integer ops for 4 registers (16 weights), then prmt.b32(LUT, 0, sel) with LUT = 0x4838B8C8
  (bytes C8, B8, 38, 48 = e4m3 -4, -1, +1, +4; code c selects byte c).

Scales, "fm8" (uint8 [N/8, K/256, 4 (t), 16 bytes]): byte 2*jj + r of (tile i, chunk c, t) is
  scale[8i + 2t + r, 8c + jj] (jj = 0..7, r = 0, 1): exactly the rows of the lane's c0 / c1, so
  the 8 lanes sharing t read the same 16 bytes (one broadcast 128-bit load per tile per chunk).

Activations, "xfm" (uint8 [K/64, 32 lanes, 16 bytes]): lane (g, t), half h (group 2u + h):
  bytes 8h..8h+3 = x[g, 32(2u+h) + 4t ..+3] (a0), bytes 8h+4..8h+7 = x[g, 32(2u+h) + 16 + 4t ..+3]
  (a2), zero for tokens g >= T. One 128-bit load gives a lane's A fragments for two groups.

All conversions are numpy, bit-exact and invertible (tests/kernels/test_ptx_w2_lab.py).
Requirements: N % 8 == 0, K % 256 == 0 (DeepSeek-V3: K 7168 = 28 chunks, 2048 = 8).
"""
from __future__ import annotations

import numpy as np

TILE_N = 8        # weight rows per mma (B columns)
CHUNK_K = 256     # K per 128-bit code load per lane (8 groups of 32)
GROUP = 32
LUT = 0x4838B8C8  # e4m3 bytes of levels -4, -1, +1, +4 for codes 0..3
LEVEL_E4M3 = (0xC8, 0xB8, 0x38, 0x48)


def _check(n: int, k: int) -> None:
    if n % TILE_N or k % CHUNK_K:
        raise ValueError(f"fm8 layout needs N % {TILE_N} == 0 and K % {CHUNK_K} == 0, got N={n} K={k}")


def unpack_v1(codes: np.ndarray) -> np.ndarray:
    """v1 bytes [N, K/4] -> codes [N, K] (element 4j + i at bits 2i..2i+1 of byte j)."""
    c = np.asarray(codes, dtype=np.uint8)
    return ((c[..., None] >> np.array([0, 2, 4, 6], np.uint8)) & 3).reshape(c.shape[0], -1)


def pack_v1(codes: np.ndarray) -> np.ndarray:
    c = np.asarray(codes, dtype=np.uint8).reshape(codes.shape[0], -1, 4)
    return (c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)).astype(np.uint8)


def _code_index(n: int, k: int):
    """For every (tile, chunk, lane, word, bit-pair p = 0..15) the (row, k) of the code stored there.
    Bit pair p = 2 * nibble + half: nibble n4 = p // 2, half = p % 2 (0: bits 0-1, 1: bits 2-3)."""
    ti, ci, lane, q, p = np.meshgrid(np.arange(n // TILE_N), np.arange(k // CHUNK_K), np.arange(32),
                                     np.arange(4), np.arange(16), indexing="ij")
    g, t = lane >> 2, lane & 3
    nib, half = p // 2, p % 2
    grp = 8 * ci + 2 * q + (nib >= 4)
    kk = GROUP * grp + 16 * half + 4 * t + (nib % 4)
    row = TILE_N * ti + g
    return row, kk


def to_fm8_codes(codes_v1: np.ndarray) -> np.ndarray:
    """v1 codes uint8 [N, K/4] -> fm8 uint8 [N/8, K/256, 32, 16]."""
    n, k = codes_v1.shape[0], codes_v1.shape[1] * 4
    _check(n, k)
    c = unpack_v1(codes_v1)
    row, kk = _code_index(n, k)
    vals = c[row, kk].astype(np.uint32)                              # [..., 4 words, 16 pairs]
    words = (vals << (2 * np.arange(16, dtype=np.uint32))).sum(axis=-1, dtype=np.uint32)
    return np.ascontiguousarray(words.astype("<u4")).view(np.uint8).reshape(n // 8, k // 256, 32, 16)


def from_fm8_codes(fm: np.ndarray, n: int, k: int) -> np.ndarray:
    """Inverse of to_fm8_codes -> v1 uint8 [N, K/4]."""
    _check(n, k)
    words = np.ascontiguousarray(fm, dtype=np.uint8).view("<u4").reshape(n // 8, k // 256, 32, 4)
    vals = (words[..., None].astype(np.uint32) >> (2 * np.arange(16, dtype=np.uint32))) & 3
    row, kk = _code_index(n, k)
    c = np.zeros((n, k), np.uint8)
    c[row, kk] = vals
    return pack_v1(c)


def _scale_index(n: int, k: int):
    ti, ci, t, b = np.meshgrid(np.arange(n // TILE_N), np.arange(k // CHUNK_K), np.arange(4), np.arange(16),
                               indexing="ij")
    return TILE_N * ti + 2 * t + (b % 2), 8 * ci + b // 2


def to_fm8_scales(scales: np.ndarray) -> np.ndarray:
    """scales uint8 [N, K/32] -> fm8 uint8 [N/8, K/256, 4, 16]."""
    n, k = scales.shape[0], scales.shape[1] * GROUP
    _check(n, k)
    row, grp = _scale_index(n, k)
    return np.ascontiguousarray(np.asarray(scales, np.uint8)[row, grp])


def from_fm8_scales(fm: np.ndarray, n: int, k: int) -> np.ndarray:
    _check(n, k)
    row, grp = _scale_index(n, k)
    s = np.zeros((n, k // GROUP), np.uint8)
    s[row, grp] = fm
    return s


def _x_index(k: int):
    u, lane, b = np.meshgrid(np.arange(k // 64), np.arange(32), np.arange(16), indexing="ij")
    g, t = lane >> 2, lane & 3
    h, reg, i = b // 8, (b // 4) % 2, b % 4
    kk = GROUP * (2 * u + h) + 16 * reg + 4 * t + i
    return g, kk


def to_xfm(x_bytes: np.ndarray) -> np.ndarray:
    """e4m3 bytes uint8 [T, K] (T <= 8) -> xfm uint8 [K/64, 32, 16], token rows >= T zero."""
    tt, k = x_bytes.shape
    if tt > 8 or k % 64:
        raise ValueError(f"xfm needs T <= 8 and K % 64 == 0, got T={tt} K={k}")
    pad = np.zeros((8, k), np.uint8)
    pad[:tt] = x_bytes
    g, kk = _x_index(k)
    return np.ascontiguousarray(pad[g, kk])


def from_xfm(xfm: np.ndarray, t: int, k: int) -> np.ndarray:
    g, kk = _x_index(k)
    pad = np.zeros((8, k), np.uint8)
    pad[g, kk] = xfm
    return pad[:t]


# ----------------------------------------------------------------------------- torch fast paths
# The same conversions as reshapes/permutes (CPU or GPU; used by run_gpu.py at DeepSeek shapes,
# tested equal to the numpy index definitions above).

def to_fm8_codes_torch(codes_v1):
    import torch
    n, k = codes_v1.shape[0], codes_v1.shape[1] * 4
    _check(n, k)
    sh = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=codes_v1.device)
    c = ((codes_v1.unsqueeze(-1) >> sh) & 3).reshape(n, k).to(torch.int64)
    # k = 256 c + 32 (2q + jh) + 16 half + 4 t + nb ; row = 8 i + g
    c = c.reshape(n // 8, 8, k // 256, 4, 2, 2, 4, 4)            # i g c q jh half t nb
    c = c.permute(0, 2, 1, 6, 3, 4, 7, 5)                         # i c g t q jh nb half
    c = c.reshape(n // 8, k // 256, 32, 4, 16)                    # p = 8 jh + 2 nb + half
    w = (c << (2 * torch.arange(16, device=c.device))).sum(-1)    # int64 words < 2**32
    b = (w.unsqueeze(-1) >> (8 * torch.arange(4, device=c.device))) & 0xFF
    return b.to(torch.uint8).reshape(n // 8, k // 256, 32, 16).contiguous()


def to_fm8_scales_torch(scales):
    n, k = scales.shape[0], scales.shape[1] * GROUP
    _check(n, k)
    s = scales.reshape(n // 8, 4, 2, k // 256, 8)                 # i t r c jj
    return s.permute(0, 3, 1, 4, 2).reshape(n // 8, k // 256, 4, 16).contiguous()


def to_xfm_torch(x_bytes):
    import torch
    tt, k = x_bytes.shape
    if tt > 8 or k % 64:
        raise ValueError(f"xfm needs T <= 8 and K % 64 == 0, got T={tt} K={k}")
    pad = torch.zeros((8, k), dtype=torch.uint8, device=x_bytes.device)
    pad[:tt] = x_bytes
    x = pad.reshape(8, k // 64, 2, 2, 4, 4)                       # g u h reg t i
    return x.permute(1, 0, 4, 2, 3, 5).reshape(k // 64, 32, 16).contiguous()
