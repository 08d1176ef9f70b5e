"""CPU tests of the fp8-decode W2 lab (tools/kernel_lab/w2_fp8_lab.py, docs/perf.md "Stop 28 / run 33"):
the f8w layout decodes (rotate 0 / 2 / 4 / 6, mask 0x90909090, or 0x20202020) to the code's values,
and the kernel (interpreter: the asm's bytes built with plain integer ops; a GPU: the asm; x as two
e4m3 halves) matches a float64 reference over several 128-weight blocks, rows and tokens."""
from __future__ import annotations

import os
import sys

import torch

from tests.kernels.triton_support import requires_triton

pytestmark = requires_triton

LAB = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "kernel_lab")
sys.path.insert(0, os.path.abspath(LAB))


def _lab():
    import w2_fp8_lab
    return w2_fp8_lab


def _decode(words: torch.Tensor) -> torch.Tensor:
    """int32 [N, K/128, 8] f8w words -> [N, K] levels +-1/8, +-1/2 (the e4m3 bytes the asm builds)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    n, kb, _ = w.shape
    out = torch.empty(n, kb, 4, 8, 4, dtype=torch.float64)
    for q, t in enumerate(_lab().ROT):
        r = ((w << t) | (w >> (32 - t))) & 0xFFFFFFFF
        for y in range(4):
            byte = ((r >> (8 * y)) & 0x90) | 0x20
            mag = torch.where(((byte >> 4) & 1).bool(), 0.5, 0.125)
            out[:, :, q, :, y] = torch.where(((byte >> 7) & 1).bool(), -mag, mag)
    return out.reshape(n, kb * 128)


def test_f8w_layout_decodes_to_the_codes():
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    neg = torch.randint(0, 2, (5, 384), generator=g, dtype=torch.bool)
    big = torch.randint(0, 2, (5, 384), generator=g, dtype=torch.bool)
    want = (1 - 2 * neg.double()) * (1 + 3 * big.double()) / 8
    assert torch.equal(_decode(_lab().to_f8w(neg, big)), want)
    assert _lab().ROT == (0, 2, 4, 6)


def test_kernel_matches_float64():
    """Under the interpreter without a GPU (the plain decode); on a GPU the inline-asm decode."""
    lab = _lab()
    e, n, k, t = 2, 32, 256, 3
    gpu = torch.cuda.is_available()
    args, ref, _, _ = lab.make(e, n, k, t, "cuda" if gpu else "cpu", seed=torch.seed() % 2**31)
    out = lab.run(*args, n, k, e, t, bn=32, bm=16, use_asm=gpu)
    assert out.abs().max() > 0
    assert lab.relerr(out, ref) < 5e-3          # x as hi + lo e4m3: ~bf16 precision
