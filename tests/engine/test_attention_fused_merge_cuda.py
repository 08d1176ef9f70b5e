"""EngineConfig.attention_fused_merge (the GQA decode's split merge inside the split kernel): a CUDA
engine with it is deterministic run to run, eager and in graphs, and gives the two-launch
engine's logprobs within fp32 rounding (its bits may differ: another kernel's arithmetic).
The kernel itself is compared bit for bit under the interpreter (test_attention_triton.py)."""
import pytest
import torch

from moet.config import EngineConfig
from moet.kernels import attention_ops

def test_off_by_default():
    assert EngineConfig(model="x").attention_fused_merge is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_merge_engine_deterministic_and_close():
    from tests.model.tiny_glm import greedy_outputs

    dev = torch.device("cuda")
    seed = int(torch.seed() % 2**31)
    try:
        outs = {(on, eager, rep): greedy_outputs(dev, seed, enforce_eager=eager, attention_fused_merge=on)
                for on in (False, True) for eager in (True, False) for rep in (0, 1)}
    finally:
        attention_ops.set_gqa_fused_merge(False)
    for eager in (True, False):
        assert outs[True, eager, 0] == outs[True, eager, 1]
        for (ids_on, lp_on), (ids_off, lp_off) in zip(outs[True, eager, 0], outs[False, eager, 0]):
            first_on, first_off = lp_on[0], lp_off[0]              # the first token: same context
            common = set(first_on) & set(first_off)
            assert len(common) >= 4
            assert max(abs(first_on[t] - first_off[t]) for t in common) < 1e-3
