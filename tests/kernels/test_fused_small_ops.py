"""The second round of fused decode ops compute what the torch sequences they replace compute:
q/k head norm + both rotations in one launch (norm_rope_triton.qk_norm_rope), GQA's k and v
stored in one launch (kv_write_triton.write_gqa_kv), SwiGLU on the fused gate_up output
(swiglu_triton.swiglu) and the RMSNorm residual add with a second delta (routed + shared
experts). Fresh random inputs each run, bf16 and fp32, small shapes; under TRITON_INTERPRET=1
without a GPU, compiled on CUDA."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import os
import subprocess
import sys
from pathlib import Path

from tests.kernels.triton_support import requires_ptxas, requires_triton

pytestmark = requires_triton

from moet.checkpoint.spec import AttentionSpec, RopeSpec  # noqa: E402
from moet.kernels import kv_cache  # noqa: E402
from moet.kernels.kv_cache import KVFormat, new_gqa_layer  # noqa: E402
from moet.model.layers.attention import GQAttention  # noqa: E402
from moet.model.layers.norm import RMSNorm  # noqa: E402
from moet.model.layers.rope import Rotary  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[2]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in units of the last place of the model dtype at b's magnitude."""
    eps = torch.finfo(b.dtype).eps
    scale = b.float().abs().clamp_min(torch.finfo(torch.float32).tiny)
    return float(((a.float() - b.float()).abs() / (scale * eps)).max())


def _nrt():
    from moet.kernels import norm_rope_triton
    return norm_rope_triton


def _close_rope(got: torch.Tensor, want: torch.Tensor, dtype) -> None:
    """Rotations: bit-identical in bf16 and in the interpreter; fp32 on a GPU may contract
    x*c + p*s into one FMA (see test_norm_rope_triton)."""
    if dtype == torch.bfloat16 or DEVICE == "cpu":
        assert torch.equal(got.cpu(), want)
    else:
        assert float((got.cpu() - want).abs().max()) <= 1e-6 * float(want.abs().max())


# ---------------------------------------------------------------------------- q/k norm + rotary

ROPES = [(16, 16, False), (16, 8, False), (16, 16, True), (24, 8, False)]


def _qkv(g, t, hq, hkv, d, dtype):
    """q, k, v as strided views of one fused projection output [T, (hq + 2 hkv) d], as _project has."""
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 2).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d,rd,interleave", ROPES)
def test_qk_rope_without_norm_matches_rotary(dtype, d, rd, interleave):
    g = _gen()
    rot = Rotary(RopeSpec(dim=rd, theta=10000.0, interleave=interleave), 4096)
    t, hq, hkv = 3, 4, 2
    q, k, _ = _qkv(g, t, hq, hkv, d, dtype)
    cos, sin = rot.cos_sin(torch.randint(0, 4000, (t,), generator=g), dtype)
    gq, gk = _nrt().qk_norm_rope(q.to(DEVICE), k.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), interleave)
    assert gq.shape == (t, hq, d) and gk.shape == (t, hkv, d) and gq.dtype == gk.dtype == dtype
    _close_rope(gq, rot.apply(q, cos, sin), dtype)
    _close_rope(gk, rot.apply(k, cos, sin), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d,rd,interleave", ROPES)
def test_qk_norm_rope_matches_norm_then_rotary(dtype, d, rd, interleave):
    g = _gen()
    rot = Rotary(RopeSpec(dim=rd, theta=10000.0, interleave=interleave), 4096)
    t, hq, hkv = 3, 4, 2
    q, k, _ = _qkv(g, t, hq, hkv, d, dtype)
    qn, kn = RMSNorm(d, 1e-6, dtype), RMSNorm(d, 1e-6, dtype)
    for n in (qn, kn):
        n.weight.data = (1 + 0.5 * torch.randn(d, generator=g)).to(dtype)
    cos, sin = rot.cos_sin(torch.randint(0, 4000, (t,), generator=g), dtype)
    gq, gk = _nrt().qk_norm_rope(q.to(DEVICE), k.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), interleave,
                                 qn.weight.to(DEVICE), kn.weight.to(DEVICE), qn.eps)
    for got, x, norm in ((gq, q, qn), (gk, k, kn)):
        if DEVICE == "cpu":  # exact against the unfused Triton norm (same sum order) + torch's rotation
            normed = _nrt().rms_norm(x, norm.weight, norm.eps)[0]
            assert torch.equal(got, rot.apply(normed, cos, sin))
        # and against the whole torch sequence: only where the norm's last bit moved
        want = rot.apply(norm(x), cos, sin)
        tol = 4.0 if dtype == torch.bfloat16 else 64.0
        assert float((got.cpu().float() - want.float()).abs().max()) <= \
            tol * torch.finfo(dtype).eps * float(want.float().abs().max())


def test_qk_norm_rope_as_attention_calls_it():
    """With a GQAttention's own norm weights and eps: _project's CPU sequence, q and k."""
    g = _gen()
    dtype, hidden, d = torch.bfloat16, 32, 16
    spec = AttentionSpec(kind="gqa", num_heads=4, num_kv_heads=2, head_dim=d, v_head_dim=d, qk_norm=True,
                         scale=d ** -0.5)
    rot = Rotary(RopeSpec(dim=d, theta=1e6), 4096)
    attn = GQAttention(spec, hidden, rot, 1e-6, dtype)
    for p in attn.parameters():
        p.data = (torch.randn(p.shape, generator=g) * 0.3 + (1 if p.dim() == 1 else 0)).to(dtype)
    assert attn.fuse_qkv()
    x = torch.randn(2, hidden, generator=g).to(dtype)
    cos, sin = rot.cos_sin(torch.tensor([5, 6]), dtype)
    q_want, k_want, v_want, _ = attn._project(x, cos, sin)
    q, k, v = F.linear(x, *attn.qkv).split([4 * d, 2 * d, 2 * d], dim=-1)
    gq, gk = _nrt().qk_norm_rope(q.view(2, 4, d).to(DEVICE), k.view(2, 2, d).to(DEVICE), cos.to(DEVICE),
                                 sin.to(DEVICE), False, attn.q_norm.weight.to(DEVICE),
                                 attn.k_norm.weight.to(DEVICE), attn.q_norm.eps)
    for got, want in ((gq, q_want), (gk, k_want)):
        assert _ulps(got.cpu(), want) <= 4.0 or float((got.cpu() - want).abs().max()) <= \
            4 * torch.finfo(dtype).eps * float(want.float().abs().max())
        assert (got.cpu() == want).float().mean() > 0.8


def test_qk_norm_rope_rejects_bad_inputs():
    x = torch.randn(2, 1, 16)
    with pytest.raises(ValueError, match="interleaved"):
        _nrt().qk_norm_rope(x, x, torch.randn(2, 8), torch.randn(2, 8), True)
    with pytest.raises(ValueError, match="both"):
        _nrt().qk_norm_rope(x, x, torch.randn(2, 16), torch.randn(2, 16), False, torch.ones(16))


# ---------------------------------------------------------------------------- k and v in one store

NB, BS = 6, 16
KV_FORMATS = [KVFormat("auto", dtype=torch.float32), KVFormat("auto", dtype=torch.bfloat16),
              KVFormat("fp8_e4m3", "tensor"), KVFormat("fp8_e4m3", "block", group=16)]
# (group 8, k and v of 3 and 2 groups: test_kv_write_triton, which now runs the fused launch too)


@pytest.mark.parametrize("fmt", KV_FORMATS, ids=lambda f: f"{f.name}-{f.scale}-{f.group}-{f.dtype}")
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_fused_kv_store_strided_views(fmt, src_dtype):
    """k and v as views of a wider projection output (as the fused qkv gives v), k and v of
    different widths (group 16: v's chunk is its whole 8-wide row, k has two 16-groups)."""
    from moet.kernels import kv_write_triton
    g = _gen()
    t, hkv, d, dv = 7, 2, 32, 8
    wide = (torch.randn(t, hkv * (d + dv) + 4, generator=g) * 4).to(src_dtype)
    k = wide[:, :hkv * d].view(t, hkv, d)
    v = wide[:, hkv * d:hkv * (d + dv)].view(t, hkv, dv)
    slots = torch.randperm(NB * BS, generator=g)[:t]
    slots[1] = -1
    want = new_gqa_layer(NB, BS, hkv, d, dv, fmt)
    got = new_gqa_layer(NB, BS, hkv, d, dv, fmt, device=DEVICE)
    if fmt.is_fp8 and not fmt.block_scaled:
        for c in (want, got):
            c.k_scale.fill_(0.02)
            c.v_scale.fill_(0.05)
    kv_cache.write_gqa_kv(want, k, v, slots)
    kv_write_triton.write_gqa_kv(got, k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE))
    as_bytes = lambda x: x.contiguous().view(torch.uint8)
    assert torch.equal(as_bytes(got.k.cpu()), as_bytes(want.k))
    assert torch.equal(as_bytes(got.v.cpu()), as_bytes(want.v))
    if fmt.block_scaled:
        assert torch.equal(got.k_scale.cpu(), want.k_scale) and torch.equal(got.v_scale.cpu(), want.v_scale)
    assert want.v.float().abs().sum() > 0


# ---------------------------------------------------------------------------- SwiGLU

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,inter", [(1, 48), (5, 1100)])
def test_swiglu_matches_torch(dtype, t, inter):
    from moet.kernels.swiglu_triton import swiglu
    g = _gen()
    gu = (torch.randn(t, 2 * inter, generator=g) * 3).to(dtype)
    gu[0, :4] = torch.tensor([0.0, -30.0, 30.0, -1e-3]).to(dtype)       # zero, saturated tails, tiny
    gate, up = gu.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = swiglu(gu.to(DEVICE)).cpu()
    assert got.shape == (t, inter) and got.dtype == dtype
    # exp is numpy's in the interpreter and libdevice's expf compiled: the fp32 silu may move
    # by an ulp, which bf16 rounding hides nearly always
    if dtype == torch.bfloat16:
        assert _ulps(got, want) <= 1.0 and (got == want).float().mean() > 0.99
    else:
        assert _ulps(got, want) <= 8.0
    # a strided input (a slice of a wider buffer)
    wide = torch.cat([gu, gu[:, :3]], dim=-1)[:, :2 * inter]
    assert torch.equal(swiglu(wide.to(DEVICE)).cpu(), got)


# ---------------------------------------------------------------------------- norm with two deltas

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_second_delta(dtype):
    g = _gen()
    n = 80
    norm = RMSNorm(n, 1e-5, dtype)
    norm.weight.data = (1 + 0.5 * torch.randn(n, generator=g)).to(dtype)
    routed, shared = (torch.randn(4, n, generator=g).to(dtype) for _ in range(2))
    res = (10 * torch.randn(4, n, generator=g)).to(dtype)
    want_s = res + (routed + shared)                                   # MoE.forward's add, then the layer's
    got, total = _nrt().rms_norm(routed.to(DEVICE), norm.weight.to(DEVICE), norm.eps, residual=res.to(DEVICE),
                                 x2=shared.to(DEVICE))
    assert torch.equal(total.cpu(), want_s)
    assert _ulps(got.cpu(), norm(want_s)) <= (1.0 if dtype == torch.bfloat16 else 16.0)
    # the module's CPU path: the same two adds
    h, s = norm.add(routed, res, shared)
    assert torch.equal(s, want_s) and torch.equal(h, norm(want_s))
    h0, s0 = norm.add(routed, None, shared)
    assert torch.equal(s0, routed + shared) and torch.equal(h0, norm(routed + shared))
    with pytest.raises(ValueError, match="residual"):
        _nrt().rms_norm(routed, norm.weight, norm.eps, x2=shared)


# ---------------------------------------------------------------------------- the modules' CUDA branches

@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter only: it hands CPU tensors to the kernels; "
                    "on a GPU the CUDA branches run for real (tests/model, the engine bench)")
def test_model_cuda_branches_under_interpreter(monkeypatch):
    """The decoder layers' CUDA branches (fused q/k norm + rotary, SwiGLU, the norm taking routed
    and shared experts unsummed) wired end to end: tiny Qwen3 (q/k norm) and GLM (qkv bias,
    partial rotary, dense layer 0, shared experts, an MTP layer) models run once on the torch
    path and once with every tensor claiming is_cuda, which sends the modules to the Triton
    kernels (interpreted here; the routed experts stay on the torch reference, not under test);
    the logits agree to the norm's last-bit differences."""
    from moet.bench import shapes as eb
    from moet.kernels import moe_dispatch, norm_rope_triton, swiglu_triton

    glm = dict(eb.GLM45_AIR, vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
               n_routed_experts=8, num_experts_per_tok=2, eos_token_id=257, num_nextn_predict_layers=1)
    calls = {"qk": 0, "swiglu": 0, "x2": 0}

    def spy(name, fn, check=lambda *a, **k: True):
        def wrapped(*a, **k):
            calls[name] += bool(check(*a, **k))
            return fn(*a, **k)
        return wrapped

    for cfg in (eb.MICRO, glm):
        m = eb.random_model(cfg, torch.device("cpu"), seed=int(torch.seed() % 2**31))
        m.fuse_projections()
        x = torch.randint(0, 250, (3,))
        nxt = torch.randint(0, 250, (3,))

        def run():
            cache = m.new_cache(8, "cpu")
            hidden = m.hidden_states(x, 0, cache)
            out = [m.logits(hidden).float()]
            if len(m.mtp):
                out.append(m.mtp_forward(0, nxt, m.model.norm(hidden), 0, cache)[1].float())
            return out

        want = run()
        with monkeypatch.context() as mp:
            mp.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
            mp.setattr(moe_dispatch, "uses_triton", lambda pool: False)     # routed experts: as before
            mp.setattr(norm_rope_triton, "qk_norm_rope", spy("qk", norm_rope_triton.qk_norm_rope))
            mp.setattr(swiglu_triton, "swiglu", spy("swiglu", swiglu_triton.swiglu))
            mp.setattr(norm_rope_triton, "rms_norm", spy("x2", norm_rope_triton.rms_norm,
                                                         lambda *a, **k: len(a) > 4 and a[4] is not None))
            got = run()
        for g, w in zip(got, want):
            assert torch.allclose(g, w, rtol=0, atol=2e-2 * float(w.abs().max()))
    assert calls["qk"] > 0 and calls["swiglu"] > 0 and calls["x2"] > 0, calls


# ---------------------------------------------------------------------------- sm_90 compile (no GPU)

_AOT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moet.kernels import kv_write_triton as kw, norm_rope_triton as nr, swiglu_triton as sw


def build(fn, types, const, warps, default="i32"):
    if "PDL" in fn.arg_names:
        const = {"PDL": False, **const}
    sig = {n: "constexpr" if n in const else types.get(n, default) for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    return k


ptr = lambda t: {n: t for n in ("q_ptr", "k_ptr", "qw_ptr", "kw_ptr", "cos_ptr", "sin_ptr", "qo_ptr", "ko_ptr")}
for d, rd, il, norm in ((128, 128, False, True), (128, 64, False, False), (64, 64, True, True)):
    k = build(nr._qk_norm_rope_kernel, dict(ptr("*bf16"), eps="fp32"),
              dict(D=d, RD=rd, BLOCK=triton.next_power_of_2(d), INTERLEAVE=il, HAS_NORM=norm, OUT=1), 1)
    print("qk_norm_rope", d, rd, il, norm, len(k.asm["cubin"]))
for d, rd, il in ((128, 64, False), (64, 64, True)):
    k = build(nr._rope_kernel, {n: "*bf16" for n in ("x_ptr", "cos_ptr", "sin_ptr", "out_ptr")},
              dict(D=d, RD=rd, BLOCK=d, INTERLEAVE=il, OUT=1), 1)     # rope alone: compiles (no line)
k = build(nr._rmsnorm_kernel, {n: "*bf16" for n in ("x_ptr", "x2_ptr", "res_ptr", "w_ptr", "out_ptr", "sum_ptr")}
          | dict(eps="fp32"), dict(BLOCK=4096, HAS_RES=True, HAS_X2=True, OUT=1), 4)
print("rmsnorm x2", len(k.asm["cubin"]))
for kind, dst in ((0, "*bf16"), (1, "*fp8e4nv"), (2, "*fp8e4nv")):
    types = dict(k_ptr="*bf16", v_ptr="*bf16", slot_ptr="*i64", kc_ptr=dst, vc_ptr=dst, ks_ptr="*fp32", vs_ptr="*fp32")
    k = build(kw._store_kv_kernel, types, dict(CK=128, CHUNK_K=128 if kind < 2 else 64, CV=128,
              CHUNK_V=128 if kind < 2 else 64, BLOCK=128 if kind < 2 else 64, KIND=kind, OUT=1 if kind == 0 else 0), 4)
    print("store_kv", kind, len(k.asm["cubin"]))
k = build(sw._swiglu_kernel, dict(gu_ptr="*bf16", out_ptr="*bf16"), dict(BLOCK=1024, OUT_BF16=True, ACCURATE=True), 4)
assert "__nv_expf" not in k.asm["ptx"]
print("swiglu", len(k.asm["cubin"]))
"""


@requires_ptxas
def test_fused_kernels_compile_for_sm90():
    """The interpreter does not type-check like the compiler: compile every new kernel (and the
    norm's second-delta form) for sm_90 at the real shapes' constexprs, as the GPU would."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", _AOT], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert len(r.stdout.splitlines()) == 8, r.stdout
