"""moet.probe.activations: the e4m3 expert-activation rule against a float64 reference, and the
patched DeepseekV3Experts forward against transformers' own."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moet.probe.activations import (apply_expert_activations, e4m3_rne_satfinite, fake_quantize_e4m3_rows,
                                    quantize_e4m3_rows)


# --- float64 reference of the rule ------------------------------------------------------------------
def _e4m3_ref(v: float) -> float:
    """float64 e4m3fn value nearest to v (ties to even mantissa), saturated to +-448."""
    if math.isnan(v):
        return v
    a = abs(v)
    if a == 0:
        return 0.0
    e = max(math.floor(math.log2(a)), -6)          # subnormals below 2^-6 share its step
    if 2.0 ** e > a:                               # log2 rounding guard
        e -= 1
    elif 2.0 ** (e + 1) <= a:
        e += 1
    e = max(e, -6)
    step = 2.0 ** (e - 3)                          # 3 mantissa bits
    q = min(round(a / step) * step, 448.0)         # round() is half-to-even; satfinite
    return math.copysign(q, v)


def _rows_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's rule in float64: scale = fp32(amax / 448) (1 for a zero row), code =
    e4m3_rne(fp32(x / scale)) -- each fp32 division done in float64 and rounded once, which is
    the correctly rounded fp32 quotient."""
    x = x.astype(np.float32)
    amax = np.abs(x).max(axis=1).astype(np.float64)
    scale = np.where(amax > 0, (amax / 448.0).astype(np.float32), np.float32(1)).astype(np.float64)
    scaled = (x.astype(np.float64) / scale[:, None]).astype(np.float32).astype(np.float64)
    codes = np.vectorize(_e4m3_ref)(scaled)
    return codes, scale


def _check_rows(x: torch.Tensor):
    q, s = quantize_e4m3_rows(x)
    codes, scale = _rows_ref(x.numpy())
    assert q.dtype == torch.float8_e4m3fn and s.shape == (x.shape[0], 1)
    np.testing.assert_array_equal(s[:, 0].double().numpy(), scale)
    np.testing.assert_array_equal(q.double().numpy(), codes)
    dq = fake_quantize_e4m3_rows(x)
    ref = codes * scale[:, None]
    np.testing.assert_allclose(dq.double().numpy(), ref, rtol=2.0 ** -23, atol=0)
    return q, s


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_rows_match_float64_reference(seed):
    g = torch.Generator().manual_seed(1000 + seed)
    # rows of very different magnitudes, heavy tails: normals and subnormals of e4m3 both occur
    x = torch.randn(64, 384, generator=g) * torch.logspace(-6, 4, 64)[:, None]
    x[::5] *= torch.exp(3 * torch.randn(13, 384, generator=g))
    q, _ = _check_rows(x)
    qa = q.float().abs()
    assert (qa == 448).any() and ((qa > 0) & (qa < 2.0 ** -6)).any()  # saturation row max, subnormals
    # relative error of the dequantized values: at most half an e4m3 step (2^-4) for normals
    dq = fake_quantize_e4m3_rows(x).double()
    big = x.abs() >= (x.abs().amax(1, keepdim=True) / 448 * 2.0 ** -6)
    rel = ((dq - x.double()).abs() / x.double().abs())[big]
    assert float(rel.max()) <= 2.0 ** -4 + 1e-7


def test_ties_round_to_even():
    # 1 + 1/16 is the midpoint of 1 and 1.125: even mantissa (1.0) wins; 1 + 3/16 -> 1.25
    v = torch.tensor([1.0625, 1.1875, -1.0625, 2.0 ** -9 * 1.5, 2.0 ** -9 * 0.5, 416.0 + 16.0])
    got = e4m3_rne_satfinite(v).double().tolist()
    assert got == [_e4m3_ref(float(a)) for a in v] == [1.0, 1.25, -1.0, 2.0 ** -8, 0.0, 448.0]


def test_saturation():
    v = torch.tensor([448.0, 449.0, 464.0, 479.9, 480.0, 1e6, 1e38, -500.0, float("inf"), float("-inf")])
    got = e4m3_rne_satfinite(v).float()
    assert got.tolist() == [448.0] * 7 + [-448.0, 448.0, -448.0]
    assert torch.isnan(e4m3_rne_satfinite(torch.tensor([float("nan")])).float()).all()
    # inside a row the max maps to +-448 exactly (never NaN from fp32 rounding of x / scale)
    x = torch.tensor([[3.0e-3, -7.77e-1, 1.0e-30, 0.5]])
    q, s = _check_rows(x)
    assert q.float()[0, 1] == -448.0 and torch.isfinite(q.float()).all()


def test_all_zero_rows():
    x = torch.randn(6, 40)
    x[[1, 4]] = 0.0
    x[2, :] = -0.0
    q, s = _check_rows(x)
    assert s[[1, 2, 4], 0].tolist() == [1.0, 1.0, 1.0]
    dq = fake_quantize_e4m3_rows(x)
    assert (dq[[1, 2, 4]] == 0).all() and torch.isfinite(dq).all()
    assert fake_quantize_e4m3_rows(torch.zeros(0, 40)).shape == (0, 40)


def test_scales_are_per_token():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, 64, generator=g)
    q, s = quantize_e4m3_rows(x)
    # scaling one row by a power of two scales only that row's scale; codes are unchanged
    y = x.clone()
    y[3] *= 2.0 ** 20
    q2, s2 = quantize_e4m3_rows(y)
    assert torch.equal(q2.float(), q.float())
    assert s2[3, 0] == s[3, 0] * 2.0 ** 20
    assert torch.equal(torch.cat([s2[:3], s2[4:]]), torch.cat([s[:3], s[4:]]))
    # an outlier in one row does not coarsen another: each row's max code is +-448
    assert (q.float().abs().amax(1) == 448).all()
    # batch invariance: a row quantizes the same alone as inside the batch
    assert torch.equal(fake_quantize_e4m3_rows(x[5:6]), fake_quantize_e4m3_rows(x)[5:6])


# --- the patched experts forward ---------------------------------------------------------------------
def _tiny_moe():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    cfg = DeepseekV3Config(hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                           n_group=2, topk_group=1, n_shared_experts=1, vocab_size=64, num_hidden_layers=2,
                           first_k_dense_replace=1, intermediate_size=48)
    torch.manual_seed(3)
    moe = DeepseekV3MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe.eval()


def test_patched_experts_forward():
    moe = _tiny_moe()
    h = torch.randn(2, 9, 32)
    with torch.no_grad():
        base = moe(h)
        _, tw, ti = moe.gate(h)
        routed_base = moe.experts(h.view(-1, 32), ti, tw)
        assert apply_expert_activations(moe, "e4m3") == 1
        got = moe(h)
        routed = moe.experts(h.view(-1, 32), ti, tw)
        # reference: per token x -> e4m3, per (token, expert) act -> e4m3, in float64
        e = moe.experts
        xs = h.view(-1, 32)
        codes, scale = _rows_ref(xs.numpy())
        xq = torch.from_numpy(codes * scale[:, None])
        ref = torch.zeros(xs.shape[0], 32, dtype=torch.float64)
        for t in range(xs.shape[0]):
            for k in range(ti.shape[1]):
                ex = int(ti[t, k])
                gu = e.gate_up_proj[ex].double() @ xq[t]
                g, u = gu[:16], gu[16:]
                act = (g * torch.sigmoid(g) * u).float()[None]
                ac, asc = _rows_ref(act.numpy())
                ref[t] += float(tw[t, k]) * (e.down_proj[ex].double() @ torch.from_numpy(ac[0] * asc[0]))
        torch.testing.assert_close(routed.double(), ref, rtol=1e-4, atol=1e-4)
        # quantization changes the routed output a little, and only the routed output
        rel = float((routed - routed_base).norm() / routed_base.norm())
        assert 1e-4 < rel < 0.1
        torch.testing.assert_close(got - routed.view_as(got), base - routed_base.view_as(base))
        assert apply_expert_activations(moe, "bf16") == 0
        assert torch.equal(moe(h), base)
    with pytest.raises(ValueError):
        apply_expert_activations(moe, "e5m2")


def test_load_applies_activations(ckpt, tensors):
    from moet.errors import CheckpointError
    from moet.probe.loader import load
    m = load(ckpt, "w2", "cpu", tensors=tensors, activations="e4m3")
    assert m.activations == "e4m3"
    patched = [mod for r in (m.model, m.mtp) for mod in r.modules() if "forward" in mod.__dict__]
    assert len(patched) == 6  # 5 MoE layers + the MTP layer; nothing else
    assert all(type(mod).__name__ == "DeepseekV3Experts" for mod in patched)
    with pytest.raises(CheckpointError):
        load(ckpt, "w2", "cpu", tensors=tensors, activations="int8")
