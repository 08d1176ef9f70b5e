"""The routed-expert reference (moet.kernels.reference.moe_experts_reference): slot-table
addressing, misses, the three pool formats, the SwiGLU clamp and the fixed-order combine."""
import torch
import torch.nn.functional as F

from moet.formats import nvfp4, w2
from moet.kernels.pools import DensePool, FP4Pool, W2Pool
from moet.kernels.reference import ExpertActivation, moe_experts_reference

E, H, I, T, K = 6, 64, 32, 9, 3


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    down = torch.randn(E, H, I, generator=g) / I ** 0.5
    return gate_up, down


def _inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    return x, ids, w


def _naive(x, ids, w, gate_up, down, limit=None, resident=None):
    """Token by token, pair by pair, in float64."""
    out = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(K):
            e = int(ids[t, j])
            if resident is not None and e not in resident:
                continue
            h = gate_up[e].double() @ x[t].double()
            g, u = h[:I], h[I:]
            if limit is not None:
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            out[t] += float(w[t, j]) * (down[e].double() @ (F.silu(g) * u))
    return out


def test_dense_pool_matches_naive_and_counts_no_miss():
    gate_up, down = _weights()
    x, ids, w = _inputs()
    miss = torch.zeros(1, dtype=torch.int64)
    out = moe_experts_reference(x, ids, w, torch.arange(E, dtype=torch.int32), DensePool(gate_up, down), miss)
    assert torch.allclose(out.double(), _naive(x, ids, w, gate_up, down), atol=1e-5)
    assert miss.item() == 0


def test_slots_are_addressed_through_the_table():
    gate_up, down = _weights()
    x, ids, w = _inputs()
    perm = torch.tensor([3, 5, 0, 1, 4, 2])  # expert e lives in slot perm[e]
    pool = DensePool(torch.empty_like(gate_up), torch.empty_like(down))
    pool.gate_up[perm], pool.down[perm] = gate_up, down
    miss = torch.zeros(1, dtype=torch.int64)
    out = moe_experts_reference(x, ids, w, perm.to(torch.int32), pool, miss)
    ref = moe_experts_reference(x, ids, w, torch.arange(E, dtype=torch.int32), DensePool(gate_up, down), miss)
    assert torch.equal(out, ref)


def test_missing_experts_contribute_zero_and_are_counted():
    gate_up, down = _weights()
    x, ids, w = _inputs()
    table = torch.arange(E, dtype=torch.int32)
    table[[1, 4]] = -1
    miss = torch.zeros(1, dtype=torch.int64)
    out = moe_experts_reference(x, ids, w, table, DensePool(gate_up, down), miss)
    assert miss.item() == int(((ids == 1) | (ids == 4)).sum()) > 0
    want = _naive(x, ids, w, gate_up, down, resident={0, 2, 3, 5})
    assert torch.allclose(out.double(), want, atol=1e-5)
    moe_experts_reference(x, ids, w, table, DensePool(gate_up, down), miss)
    assert miss.item() == 2 * int(((ids == 1) | (ids == 4)).sum())  # accumulates across calls


def test_w2_pool_computes_with_the_decoded_w2_values():
    gate_up, down = _weights()
    x, ids, w = _inputs()
    q_gu = [w2.quantize(gate_up[e]) for e in range(E)]
    q_dn = [w2.quantize(down[e]) for e in range(E)]
    pool = W2Pool(torch.stack([q.codes for q in q_gu]), torch.stack([q.scales for q in q_gu]),
                  torch.stack([q.codes for q in q_dn]), torch.stack([q.scales for q in q_dn]))
    miss = torch.zeros(1, dtype=torch.int64)
    out = moe_experts_reference(x, ids, w, torch.arange(E, dtype=torch.int32), pool, miss)
    dq_gu = torch.stack([w2.dequantize(q, dtype=torch.float64) for q in q_gu])
    dq_dn = torch.stack([w2.dequantize(q, dtype=torch.float64) for q in q_dn])
    assert torch.allclose(out.double(), _naive(x, ids, w, dq_gu, dq_dn), atol=1e-4)
    assert not torch.allclose(out.double(), _naive(x, ids, w, gate_up, down), atol=1e-2)


def test_fp4_pool_uses_separate_gate_and_up_scale_2():
    gate_up, down = _weights()
    gate_up[:, I:] *= 7.0  # up rows on a different scale: one shared scale_2 would be wrong
    x, ids, w = _inputs()
    qg = [nvfp4.quantize(gate_up[e, :I]) for e in range(E)]
    qu = [nvfp4.quantize(gate_up[e, I:]) for e in range(E)]
    qd = [nvfp4.quantize(down[e]) for e in range(E)]
    pool = FP4Pool(torch.stack([torch.cat([a.weight, b.weight]) for a, b in zip(qg, qu)]),
                   torch.stack([torch.cat([a.weight_scale, b.weight_scale]) for a, b in zip(qg, qu)]),
                   torch.stack([torch.stack([a.weight_scale_2, b.weight_scale_2]) for a, b in zip(qg, qu)]),
                   torch.stack([q.weight for q in qd]), torch.stack([q.weight_scale for q in qd]),
                   torch.stack([q.weight_scale_2.reshape(()) for q in qd]))
    miss = torch.zeros(1, dtype=torch.int64)
    out = moe_experts_reference(x, ids, w, torch.arange(E, dtype=torch.int32), pool, miss)
    deq = lambda q: nvfp4.dequantize(q.weight, q.weight_scale, q.weight_scale_2, dtype=torch.float64)
    dq_gu = torch.stack([torch.cat([deq(a), deq(b)]) for a, b in zip(qg, qu)])
    dq_dn = torch.stack([deq(q) for q in qd])
    assert torch.allclose(out.double(), _naive(x, ids, w, dq_gu, dq_dn), atol=1e-4)


def test_swiglu_clamp_is_applied_in_fp32():
    gate_up, down = _weights()
    gate_up *= 8.0  # pre-activations well beyond the limit
    x, ids, w = _inputs()
    miss = torch.zeros(1, dtype=torch.int64)
    pool = DensePool(gate_up.bfloat16(), down.bfloat16())
    table = torch.arange(E, dtype=torch.int32)
    clamped = moe_experts_reference(x.bfloat16(), ids, w, table, pool, miss, act=ExpertActivation(limit=7.0))
    free = moe_experts_reference(x.bfloat16(), ids, w, table, pool, miss)
    want = _naive(x.bfloat16().float(), ids, w, gate_up.bfloat16().float(), down.bfloat16().float(), limit=7.0)
    assert (clamped.double() - want).abs().max() < 0.05 * want.abs().max()
    assert (free.double() - want).abs().max() > 0.2 * want.abs().max()


def test_combine_is_deterministic():
    gate_up, down = _weights()
    x, ids, w = _inputs()
    pool, table = DensePool(gate_up, down), torch.arange(E, dtype=torch.int32)
    miss = torch.zeros(1, dtype=torch.int64)
    runs = [moe_experts_reference(x, ids, w, table, pool, miss) for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    # the combine is the sum of the k per-pair outputs
    ys = [moe_experts_reference(x, ids[:, j:j + 1], w[:, j:j + 1], table, pool, miss) for j in range(K)]
    assert torch.allclose(runs[0], ys[0] + ys[1] + ys[2], atol=1e-6)
