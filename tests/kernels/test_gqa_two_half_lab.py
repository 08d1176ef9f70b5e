"""CPU test of the two-half GQA decode split lab (tools/kernel_lab/gqa_two_half.py, run31.sh twohalf):
both forms (batched over a leading half dimension, and stacked along the dots' M / N) against the
reference paged decode on ragged lengths and a shuffled block table, where some splits have an odd
step count (half B one step shorter) or an empty half B; reruns bit-identical."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.kernels.triton_support import requires_triton

pytestmark = requires_triton

LAB = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "kernel_lab")
sys.path.insert(0, os.path.abspath(LAB))


@pytest.mark.parametrize("stacked", [False, True])
def test_two_half_split_matches_the_reference(stacked):
    import gqa_two_half as lab

    from moet.kernels.attention_reference import paged_decode_gqa as ref
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    launch = dict(num_warps=8, num_stages=3) if dev.type == "cuda" else dict(num_warps=4, num_stages=1)
    q, cache, table, lens = lab._case(dev, [5000, 33, 300], seed=7)  # 5000: the 32-split cap, 3-step splits
    scale = q.shape[-1] ** -0.5
    want = ref(q.float(), cache, table, lens, scale).float()
    got = lab.paged_decode_gqa_two_half(q, cache, table, lens, scale, stacked=stacked, **launch)
    err = float((got.float() - want).norm() / want.norm())
    assert torch.isfinite(got).all() and err < 1e-2, err
    assert torch.equal(got, lab.paged_decode_gqa_two_half(q, cache, table, lens, scale, stacked=stacked, **launch))
