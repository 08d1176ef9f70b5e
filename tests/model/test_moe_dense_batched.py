"""moe_dispatch.moe_experts_dense_batched (the DensePool MoE on CUDA at decode sizes: no host sync,
so it can be captured in a CUDA graph) against the torch reference and a float64 pair-by-pair sum:
slot addressing, misses, the SwiGLU clamp, the fixed-order combine; and which batches take it."""
import pytest
import torch

from moet.kernels import moe_dispatch
from moet.kernels.moe_dispatch import dense_batched_fits, moe_experts, moe_experts_dense_batched
from moet.kernels.pools import DensePool
from moet.kernels.reference import ExpertActivation, moe_experts_reference
from tests.model.test_moe_reference import E, H, I, K, T, _inputs, _naive, _weights


@pytest.mark.parametrize("limit", [None, 0.7])
@pytest.mark.parametrize("resident", [None, (0, 2, 3, 5)])
def test_matches_reference_and_naive(limit, resident):
    gate_up, down = _weights()
    x, ids, w = _inputs()
    # slots permuted against expert ids, so that a slot / id mix-up cannot pass
    table = torch.full((E,), -1, dtype=torch.int32)
    order = [4, 1, 5, 0, 3, 2]
    keep = range(E) if resident is None else resident
    for e in keep:
        table[e] = order[e]
    pool = DensePool(torch.zeros_like(gate_up), torch.zeros_like(down))
    for e in keep:
        pool.gate_up[order[e]], pool.down[order[e]] = gate_up[e], down[e]
    miss_ref, miss = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    ref = moe_experts_reference(x, ids, w, table, pool, miss_ref, act=ExpertActivation(limit=limit))
    got = moe_experts_dense_batched(x, ids, w, table, pool, miss, act=ExpertActivation(limit=limit))
    assert got.dtype == x.dtype and got.shape == (T, H)
    assert torch.allclose(got, ref, atol=1e-5, rtol=0)
    assert torch.allclose(got.double(), _naive(x, ids, w, gate_up, down, limit, resident), atol=1e-5)
    assert miss.item() == miss_ref.item() == (0 if resident is None else int((table[ids] < 0).sum()))


def test_float64_equals_naive_closely():
    gate_up, down = (t.double() for t in _weights())
    x, ids, w = _inputs()
    x, w = x.double(), w.double()
    got = moe_experts_dense_batched(x, ids, w, torch.arange(E, dtype=torch.int32), DensePool(gate_up, down),
                                    torch.zeros(1, dtype=torch.int64))
    assert (got - _naive(x, ids, w, gate_up, down)).abs().max() < 1e-12


def test_dispatch_cpu_keeps_the_reference_and_size_rule(monkeypatch):
    gate_up, down = _weights()
    pool = DensePool(gate_up, down)
    x, ids, w = _inputs()
    table = torch.arange(E, dtype=torch.int32)
    called = []
    monkeypatch.setattr(moe_dispatch, "moe_experts_dense_batched", lambda *a, **k: called.append(1))
    out = moe_experts(x, ids, w, table, pool, torch.zeros(1, dtype=torch.int64))
    assert not called                                           # CPU tensors: the reference
    assert torch.equal(out, moe_experts_reference(x, ids, w, table, pool, torch.zeros(1, dtype=torch.int64)))
    # the size rule: slots x rows x max(2I, H) elements
    monkeypatch.setattr(moe_dispatch, "DENSE_BATCHED_MAX_ELEMENTS", E * 10 * max(2 * I, H))
    assert dense_batched_fits(pool, 10) and not dense_batched_fits(pool, 11)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (graph capture)")
def test_cuda_dense_pool_is_capturable():
    """moe_experts on a CUDA DensePool inside a CUDA graph: the capture succeeds and its replay
    equals the eager call (the reference form reads the slots on the host and cannot be captured)."""
    dev = torch.device("cuda")
    gate_up, down = (t.to(dev) for t in _weights())
    x, ids, w = (t.to(dev) for t in _inputs())
    table = torch.arange(E, dtype=torch.int32, device=dev)
    pool, miss = DensePool(gate_up, down), torch.zeros(1, dtype=torch.int64, device=dev)
    eager = moe_experts(x, ids, w, table, pool, miss)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = moe_experts(x, ids, w, table, pool, miss)
    for t in (x, ids, w):                       # new inputs in the captured buffers: rows reversed
        t.copy_(t.flip(0))
    g.replay()
    torch.cuda.synchronize()
    assert torch.allclose(out, eager.flip(0), atol=1e-5, rtol=0)
    want = _naive(x.cpu(), ids.cpu(), w.cpu(), gate_up.cpu(), down.cpu())
    assert torch.allclose(out.double().cpu(), want, atol=1e-5)
    assert miss.item() == 0
