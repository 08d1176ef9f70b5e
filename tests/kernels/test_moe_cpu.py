"""The CPU routed-expert path (moet.kernels.moe_cpu) against the torch reference it replaces on
CPU runs: a DecodedPool (W2 / FP4, every layout the model's pools use) or a (packed) DensePool at
one token bit for bit, with misses and the SwiGLU clamp; W2 / FP4 pools get no repack that rounds."""
import pytest
import torch

from moet.formats import nvfp4, w2
from moet.kernels.moe_cpu import CpuPool, cpu_pool, moe_experts_cpu
from moet.kernels.pools import DecodedPool, DensePool, FP4Pool, W2Pool, row_tiled
from moet.kernels.reference import ExpertActivation, decoded_pool, moe_experts_reference

E, H, I, K = 6, 256, 256, 3       # H, I whole 256-weight tiles: the row-tiled layouts apply


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, H, generator=g) / H ** 0.5, torch.randn(E, H, I, generator=g) / I ** 0.5


def _inputs(t, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    return x, ids, torch.rand(t, K, generator=g)


def _w2_pool(layout):
    gate_up, down = _weights()
    qg = [w2.quantize(gate_up[e]) for e in range(E)]
    qd = [w2.quantize(down[e]) for e in range(E)]
    pool = W2Pool(torch.stack([q.codes for q in qg]), torch.stack([q.scales for q in qg]),
                  torch.stack([q.codes for q in qd]), torch.stack([q.scales for q in qd]))
    if layout == "v1":
        return pool
    nb8 = W2Pool(w2.to_nb8(pool.gate_up_codes), pool.gate_up_scales, w2.to_nb8(pool.down_codes), pool.down_scales,
                 layout="nb8")
    return nb8 if layout == "nb8" else row_tiled(nb8)


def _fp4_pool(layout):
    gate_up, down = _weights()
    gate_up[:, I:] *= 7.0             # up rows on their own scale_2
    qg = [nvfp4.quantize(gate_up[e, :I]) for e in range(E)]
    qu = [nvfp4.quantize(gate_up[e, I:]) for e in range(E)]
    qd = [nvfp4.quantize(down[e]) for e in range(E)]
    pool = FP4Pool(torch.stack([torch.cat([a.weight, b.weight]) for a, b in zip(qg, qu)]),
                   torch.stack([torch.cat([a.weight_scale, b.weight_scale]) for a, b in zip(qg, qu)]),
                   torch.stack([torch.stack([a.weight_scale_2, b.weight_scale_2]) for a, b in zip(qg, qu)]),
                   torch.stack([q.weight for q in qd]), torch.stack([q.weight_scale for q in qd]),
                   torch.stack([q.weight_scale_2.reshape(()) for q in qd]))
    return pool if layout == "nvfp4" else row_tiled(pool)


def _rel(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def _table(missing=()):
    t = torch.arange(E, dtype=torch.int32)
    t[list(missing)] = -1
    return t


POOLS = [("w2", "v1"), ("w2", "nb8"), ("w2", "nb8t"), ("fp4", "nvfp4"), ("fp4", "nvfp4t")]


@pytest.mark.parametrize("fmt,layout", POOLS)
@pytest.mark.parametrize("t", [1, 5])
def test_quantized_pools_decode_exactly_and_match_the_reference(fmt, layout, t):
    """W2 / FP4 pools: no repack (a rounding one would move outputs off the reference, and off an
    expert-store run of the same model); their exact float32 decode gives the reference's bits."""
    pool = _w2_pool(layout) if fmt == "w2" else _fp4_pool(layout)
    for dtype in (torch.bfloat16, torch.float32):
        assert cpu_pool(pool, dtype) is None
    dec = decoded_pool(pool)
    x, ids, w = _inputs(t)
    table = _table(missing=[2])
    m_ref, m_cpu = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    ref = moe_experts_reference(x, ids, w, table, pool, m_ref)
    assert torch.equal(moe_experts_cpu(x, ids, w, table, dec, m_cpu), ref)
    assert m_cpu.item() == m_ref.item() == int((ids == 2).sum())


@pytest.mark.parametrize("kind", ["decoded-w2", "decoded-fp4", "dense-bf16", "dense-fp32", "packed-dense-bf16"])
@pytest.mark.parametrize("limit", [None, 0.5])
def test_one_token_is_bit_for_bit_the_reference(kind, limit):
    if kind.startswith("decoded"):
        src = _w2_pool("nb8t") if kind == "decoded-w2" else _fp4_pool("nvfp4t")
        pool, ref_pool = decoded_pool(src), src
        x_dtype = torch.bfloat16
    else:
        dt = torch.float32 if kind == "dense-fp32" else torch.bfloat16
        gate_up, down = _weights()
        pool = ref_pool = DensePool(gate_up.to(dt), down.to(dt))
        x_dtype = dt
        if kind == "packed-dense-bf16":
            pool = cpu_pool(ref_pool, torch.bfloat16)
            if pool is None:
                pytest.skip("this torch cannot pack bf16 weights for oneDNN")
            assert pool.kind == "dense" and pool.packed and pool.source is ref_pool
    assert isinstance(pool, (DecodedPool, DensePool, CpuPool))
    for seed in range(4):
        x, ids, w = _inputs(1, seed)
        x = x.to(x_dtype)
        table = _table(missing=[int(ids[0, 1])] if seed == 3 else [])
        m_ref, m_cpu = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        ref = moe_experts_reference(x, ids, w, table, ref_pool, m_ref, act=ExpertActivation(limit=limit))
        out = moe_experts_cpu(x, ids, w, table, pool, m_cpu, act=ExpertActivation(limit=limit))
        assert torch.equal(out, ref)
        assert m_cpu.item() == m_ref.item() == (1 if seed == 3 else 0)
    # several tokens: the reference itself
    x, ids, w = _inputs(5)
    table = _table()
    assert torch.equal(moe_experts_cpu(x.to(x_dtype), ids, w, table, pool, torch.zeros(1, dtype=torch.int64)),
                       moe_experts_reference(x.to(x_dtype), ids, w, table, ref_pool, torch.zeros(1, dtype=torch.int64)))


def test_decoded_pool_is_the_reference_decode():
    pool = _w2_pool("nb8t")
    dec = decoded_pool(pool)
    assert dec.gate_up.dtype == torch.float32 and dec.gate_up.shape == (E, 2 * I, H)
    want = torch.stack([w2.dequantize(w2.quantize(g)) for g in _weights()[0]])
    assert torch.equal(dec.gate_up, want)
