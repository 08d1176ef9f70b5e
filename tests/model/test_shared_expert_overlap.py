"""EngineConfig.overlap_shared_experts: the shared experts run on a second CUDA stream next to the
routed experts (ExpertSlots.shared_stream). Off CUDA it is a no-op; on CUDA greedy token ids and logprobs
are bit-identical with and without it, eager and inside the captured decode graphs."""
from __future__ import annotations

import pytest
import torch

from moet.bench import shapes as eb
from moet.config import EngineConfig
from moet.model.layers.moe import MoE
from tests.model.tiny_glm import GLM_TINY, greedy_outputs


def test_overlap_is_a_noop_off_cuda():
    m = eb.random_model(GLM_TINY, torch.device("cpu"), seed=int(torch.seed() % 2**31))
    assert m.overlap_shared_experts(torch.device("cpu")) == 0
    assert all(b.experts.shared_stream is None for b in m.modules() if isinstance(b, MoE))
    assert EngineConfig(model="x").overlap_shared_experts is True       # on: measured faster (docs/perf.md)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter only: it hands CPU tensors to the kernels; "
                    "on a GPU test_overlap_bit_identical_on_cuda runs the branch for real")
def test_two_stream_branch_orders_and_values(monkeypatch):
    """The branch itself on CPU with stand-in streams: the side stream waits for the main one
    before the shared experts run on it, the main stream waits for the side one after the routed
    experts, and both parts equal the one-stream ones."""
    import contextlib

    from moet.model.layers import moe as moe_mod

    m = eb.random_model(GLM_TINY, torch.device("cpu"), seed=int(torch.seed() % 2**31))
    block = next(b for b in m.modules() if isinstance(b, MoE))
    x = torch.randn(5, GLM_TINY["hidden_size"]).to(m.dtype)
    log = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(f"{self.name} waits {other.name}")

    main, side = Stream("main"), Stream("side")
    current = [main]

    @contextlib.contextmanager
    def on(s):
        current.append(s)
        yield
        current.pop()

    shared_mlp, routed = block.shared_experts.forward, block._routed
    monkeypatch.setattr(block.shared_experts, "forward",
                        lambda h: (log.append(f"shared on {current[-1].name}"), shared_mlp(h))[1])
    monkeypatch.setattr(block, "_routed", lambda h: (log.append(f"routed on {current[-1].name}"), routed(h))[1])
    monkeypatch.setattr(moe_mod.torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(moe_mod.torch.cuda, "stream", on)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))    # the modules' CUDA branches
    want = block.forward_parts(x)                                                # one stream, same kernels
    assert log == ["routed on main", "shared on main"]
    log.clear()
    block.experts.shared_stream = side
    got = block.forward_parts(x)
    monkeypatch.undo()
    assert log == ["side waits main", "shared on side", "routed on main", "main waits side"]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (streams)")
def test_overlap_bit_identical_on_cuda():
    dev = torch.device("cuda")
    seed = int(torch.seed() % 2**31)
    outs = {}
    for overlap in (False, True):
        def streams(eng, model, overlap=overlap):
            n = sum(b.experts.shared_stream is not None for b in model.modules() if isinstance(b, MoE))
            assert n == (2 if overlap else 0)                     # layer 0 is dense in GLM-4.5
        for eager in (True, False):
            outs[overlap, eager] = greedy_outputs(dev, seed, streams, enforce_eager=eager,
                                                  overlap_shared_experts=overlap)
    assert outs[True, True] == outs[False, True]
    assert outs[True, False] == outs[False, False]
