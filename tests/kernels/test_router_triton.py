"""The fused router kernel (moet.kernels.router_triton.router_topk) picks the same expert set as
route()'s torch ops with the same weights, in its documented slot order (descending selection
value, lowest expert index first among equal values), deterministically on exact ties.
Softmax (Qwen3 / Mixtral, norm on/off) and sigmoid (DeepSeek-V3 group-limited with a correction
bias and scaling; GLM with one group). Under TRITON_INTERPRET=1 without a GPU (small shapes);
the GPU twin at the models' real sizes (route() itself, eager and CUDA-graph captured) is
skipped without CUDA. The kernels' sm_90 compile is checked in a subprocess (TRITON_INTERPRET
unset) with triton's bundled ptxas."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels.triton_support import requires_ptxas, requires_triton

pytestmark = requires_triton

from moet.checkpoint.spec import RouterSpec  # noqa: E402
from moet.errors import ConfigError  # noqa: E402
from moet.model.layers import router as router_mod  # noqa: E402
from moet.model.layers.router import route  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[2]

QWEN3 = RouterSpec(num_experts=128, top_k=8, scoring="softmax", norm_topk_prob=True)
QWEN3_RAW = RouterSpec(num_experts=128, top_k=8, scoring="softmax", norm_topk_prob=False)
MIXTRAL = RouterSpec(num_experts=8, top_k=2, scoring="softmax", norm_topk_prob=True)
DSV3 = RouterSpec(num_experts=256, top_k=8, scoring="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
                  n_group=8, topk_group=4, correction_bias=True, fp32_weight=True)
GLM = RouterSpec(num_experts=128, top_k=8, scoring="sigmoid", norm_topk_prob=True, routed_scaling_factor=1.8,
                 n_group=1, topk_group=1, correction_bias=True, fp32_weight=True)
SPECS = {"qwen3": QWEN3, "qwen3_raw": QWEN3_RAW, "mixtral": MIXTRAL, "dsv3": DSV3, "glm": GLM}


def _tri():
    from moet.kernels import router_triton
    return router_triton


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(torch.seed() % 2**31)


def _bias(spec: RouterSpec, g: torch.Generator) -> torch.Tensor | None:
    return torch.randn(spec.num_experts, generator=g) * 0.05 if spec.correction_bias else None


def _reference(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None):
    """route()'s torch ops on exactly these logits: x = logits, weight = I (an exact GEMV)."""
    eye = torch.eye(spec.num_experts, dtype=logits.dtype)
    return route(logits, eye, spec, bias)


def _selection(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None) -> torch.Tensor:
    """The fp32 values the experts are ranked by (softmax: the logits; sigmoid: score + bias)."""
    if spec.scoring == "softmax":
        return logits.float()
    s = logits.float().sigmoid()
    return s + bias if bias is not None else s


def _check(logits, spec, bias, ids, w, *, exact_sets: bool, rtol: float):
    rid, rw = _reference(logits, spec, bias)
    assert ids.dtype == torch.int64 and ids.shape == rid.shape
    assert w.dtype == rw.dtype and w.shape == rw.shape
    ids, w = ids.cpu(), w.cpu()
    sel = _selection(logits, spec, bias)
    v = sel.gather(1, ids)
    # documented order: descending value, lowest index first among equal values
    assert bool((v[:, :-1] >= v[:, 1:]).all())
    tied = v[:, :-1] == v[:, 1:]
    assert bool((ids[:, :-1] < ids[:, 1:])[tied].all())
    assert bool((ids.sort(1).values[:, 1:] != ids.sort(1).values[:, :-1]).all())        # distinct
    # a correct top-k of the same values (differs from torch's set only by exact ties) ...
    assert torch.equal(v.sort(1).values, sel.gather(1, rid).sort(1).values)
    same = (ids.sort(1).values == rid.sort(1).values).all(1)
    if exact_sets:                                 # ... and, without ties, torch's very set
        assert bool(same.all()), f"rows {torch.nonzero(~same).flatten().tolist()} chose another set"
    # weights per expert id, on the rows with the same set
    a = w.gather(1, ids.sort(1).indices)[same].float()
    b = rw.gather(1, rid.sort(1).indices)[same].float()
    torch.testing.assert_close(a, b, rtol=rtol, atol=0.0)


@pytest.mark.parametrize("t", [1, 5, 33])
@pytest.mark.parametrize("name", list(SPECS))
def test_router_matches_route_fp32(name, t):
    spec, g = SPECS[name], _gen()
    logits = torch.randn(t, spec.num_experts, generator=g) * 2
    bias = _bias(spec, g)
    ids, w = _tri().router_topk(logits.to(DEVICE), spec, None if bias is None else bias.to(DEVICE))
    _check(logits, spec, bias, ids, w, exact_sets=True, rtol=1e-6)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_raw"])
def test_router_softmax_bf16_logits(name):
    """bf16 logits (the GEMV's dtype on real models): bf16 weights, exact ties are common."""
    spec, g = SPECS[name], _gen()
    logits = (torch.randn(9, spec.num_experts, generator=g) * 2).to(torch.bfloat16)
    ids, w = _tri().router_topk(logits.to(DEVICE), spec)
    # fp32 weights agree within ~1e-6, so the bf16 roundings of them agree within one bf16 step (<= 2**-7 relative)
    _check(logits, spec, None, ids, w, exact_sets=False, rtol=2 ** -7)


@pytest.mark.parametrize("name", ["qwen3", "dsv3", "glm"])
def test_router_exact_ties_are_deterministic(name):
    """Rows drawn from a few distinct values: many exact ties, also between DeepSeek's groups."""
    spec, g = SPECS[name], _gen()
    e = spec.num_experts
    logits = torch.randint(-2, 3, (4, e), generator=g).float()
    logits[0] = 0.0                                                    # one row all equal
    logits[1, ::2] = -0.0                                              # -0.0 ties with +0.0
    bias = torch.randint(0, 2, (e,), generator=g).float() * 0.25 if spec.correction_bias else None
    dl, db = logits.to(DEVICE), None if bias is None else bias.to(DEVICE)
    ids, w = _tri().router_topk(dl, spec, db)
    ids2, w2 = _tri().router_topk(dl, spec, db)
    assert torch.equal(ids, ids2) and torch.equal(w, w2)
    if spec.n_group == 1:      # the documented order: by value, then by index (a stable sort)
        want = torch.sort(-_selection(logits, spec, bias), dim=1, stable=True).indices[:, :spec.top_k]
        assert torch.equal(ids.cpu(), want)
    _check(logits, spec, bias, ids, w, exact_sets=False, rtol=1e-6)


def test_router_unsupported_shapes_raise():
    tri = _tri()
    with pytest.raises(ConfigError, match="at most 512"):
        tri.router_topk(torch.zeros(1, 1024), RouterSpec(1024, 8, "softmax", True))
    with pytest.raises(ConfigError, match="top_k"):
        tri.router_topk(torch.zeros(1, 64), RouterSpec(64, 17, "softmax", True))
    with pytest.raises(ConfigError, match="cannot hold"):
        tri.router_topk(torch.zeros(1, 64), RouterSpec(64, 8, "sigmoid", True, n_group=16, topk_group=1))
    ids, w = tri.router_topk(torch.zeros(0, 128), QWEN3)                     # no tokens: no launch
    assert ids.shape == (0, 8) and w.shape == (0, 8)


def test_route_keeps_torch_ops_on_cpu():
    assert not router_mod._fused(torch.zeros(2, 8))


# ------------------------------------------------------------------------ sm_90 compile (no GPU)

_AOT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moet.kernels import router_triton as rt

fn = rt._router_kernel
cases = [  # (logits, weights, constexprs): Qwen3 (bf16), DeepSeek-V3 (groups), GLM-4.5 (E not a power of 2)
    ("*bf16", "*bf16", dict(E=128, K=8, G=1, TOPK_GROUP=1, GP=1, GSP=128, KP=8, SIGMOID=False, NORM=True,
                            HAS_BIAS=False, OUT_BF16=True)),
    ("*fp32", "*fp32", dict(E=256, K=8, G=8, TOPK_GROUP=4, GP=8, GSP=32, KP=8, SIGMOID=True, NORM=True,
                            HAS_BIAS=True, OUT_BF16=False)),
    ("*fp32", "*fp32", dict(E=160, K=8, G=1, TOPK_GROUP=1, GP=1, GSP=256, KP=8, SIGMOID=True, NORM=True,
                            HAS_BIAS=True, OUT_BF16=False)),
]
gemv = rt._router_gemv_kernel        # DeepSeek-V3 (H 7168, E 256), GLM-4.5 (H 5120, E 160): fp32 weights and
for h, e, bf16 in ((7168, 256, False), (5120, 160, False), (2048, 128, True)):   # out; Qwen3: bf16
    const = dict(H=h, E=e, BE=rt._GEMV_BE, BK=rt._GEMV_BK, OUT_BF16=bf16, PDL=False)
    wt = "*bf16" if bf16 else "*fp32"
    types = dict(x_ptr="*bf16", w_ptr=wt, out_ptr=wt, s_x="i32", s_w="i32")
    sig = {n: "constexpr" if n in const else types[n] for n in gemv.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
    k = triton.compile(ASTSource(fn=gemv, signature=sig, constexprs=const, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=rt._GEMV_WARPS))
    assert "ld.local" not in k.asm["ptx"]          # no local-memory arrays
    print("gemv", h, e, "cubin bytes", len(k.asm["cubin"]))
for lt, wt, const in cases:
    const = dict(const, ACCURATE=True, PDL=False)
    types = dict(logits_ptr=lt, bias_ptr="*fp32", ids_ptr="*i64", w_ptr=wt, s_lt="i32", scale="fp32")
    sig = {n: "constexpr" if n in const else types[n] for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))
    assert "__nv_expf" not in k.asm["ptx"]          # libdevice inlined, not left as a call
    print("router", const["E"], const["K"], "cubin bytes", len(k.asm["cubin"]))
"""


@requires_ptxas
def test_router_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", _AOT], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert sum(line.startswith("router") for line in r.stdout.splitlines()) == 3, r.stdout
    assert sum(line.startswith("gemv") for line in r.stdout.splitlines()) == 3, r.stdout


# ------------------------------------------------------------------------ GPU twin: real sizes

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

REAL = {  # (spec, hidden size): Qwen3-30B-A3B, Mixtral-8x7B, DeepSeek-V3, GLM-4.5
    "qwen3_30b": (RouterSpec(128, 8, "softmax", True), 2048),
    "mixtral": (RouterSpec(8, 2, "softmax", True), 4096),
    "dsv3": (RouterSpec(256, 8, "sigmoid", True, 2.5, 8, 4, True, True), 7168),
    "glm45": (RouterSpec(160, 8, "sigmoid", True, 2.5, 1, 1, True, True), 5120),
}


def _real_inputs(spec: RouterSpec, h: int, t: int, g: torch.Generator):
    x = (torch.randn(t, h, generator=g)).to(torch.bfloat16).cuda()
    wdtype = torch.float32 if spec.fp32_weight else torch.bfloat16
    weight = (torch.randn(spec.num_experts, h, generator=g) * h ** -0.5).to(wdtype).cuda()
    bias = (torch.randn(spec.num_experts, generator=g) * 0.05).cuda() if spec.correction_bias else None
    return x, weight, bias


def _torch_route(monkeypatch, *args):
    with monkeypatch.context() as m:
        m.setattr(router_mod, "_fused", lambda logits: False)
        return route(*args)


@requires_cuda
@pytest.mark.parametrize("t", [1, 64, 4096])
@pytest.mark.parametrize("name", list(REAL))
def test_route_cuda_matches_torch_route(name, t, monkeypatch):
    spec, h = REAL[name]
    x, weight, bias = _real_inputs(spec, h, t, _gen())
    ids, w = route(x, weight, spec, bias)                                # the kernel
    rid, rw = _torch_route(monkeypatch, x, weight, spec, bias)           # torch's ops on the GPU
    assert ids.dtype == rid.dtype and w.dtype == rw.dtype
    # the same logits on both sides (route() picks the GEMV by device and T for both), then the
    # same selection values
    if spec.scoring == "softmax" and t <= _tri().ROUTER_GEMV_MAX_TOKENS:
        logits = _tri().router_logits(x, weight, torch.bfloat16)
        ref = torch.nn.functional.linear(x, weight)                     # cuBLAS: the rounding, rarely
        assert float((logits.float() - ref.float()).norm() / ref.float().norm()) < 2 ** -8
    elif spec.scoring == "softmax":
        logits = torch.nn.functional.linear(x, weight)
    elif t <= _tri().ROUTER_GEMV_MAX_TOKENS:
        logits = _tri().router_logits_fp32(x, weight)
        ref = torch.nn.functional.linear(x.float(), weight.float())     # cuBLAS: last bits only
        assert float((logits - ref).norm() / ref.norm()) < 1e-6
    else:
        logits = torch.nn.functional.linear(x.float(), weight.float())
    sel = logits.float() if spec.scoring == "softmax" else logits.sigmoid() + (0 if bias is None else bias)
    v, rv = sel.gather(1, ids), sel.gather(1, rid)
    assert torch.equal(v.sort(1).values, rv.sort(1).values)             # a correct top-k
    assert bool((v[:, :-1] >= v[:, 1:]).all())
    assert bool((ids[:, :-1] < ids[:, 1:])[v[:, :-1] == v[:, 1:]].all())
    same = (ids.sort(1).values == rid.sort(1).values).all(1)
    kth = sel.topk(spec.top_k + 1, dim=1).values if spec.top_k < spec.num_experts else None
    if kth is not None and spec.n_group == 1:
        untied = kth[:, -2] != kth[:, -1]
        assert bool(same[untied].all())                                 # no tie at the cut: same set
    a = w.gather(1, ids.sort(1).indices)[same].float()
    b = rw.gather(1, rid.sort(1).indices)[same].float()
    rtol = 1e-6 if w.dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(a, b, rtol=rtol, atol=0.0)
    assert same.float().mean() > 0.95


@requires_cuda
@pytest.mark.parametrize("name", ["qwen3_30b", "dsv3"])
def test_route_cuda_graph_capture(name):
    spec, h = REAL[name]
    g = _gen()
    x, weight, bias = _real_inputs(spec, h, 4, g)
    eager = route(x, weight, spec, bias)                                 # compiles the kernel
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        route(x, weight, spec, bias)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = route(x, weight, spec, bias)
    graph.replay()
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])
    x.copy_(_real_inputs(spec, h, 4, g)[0])                              # new tokens, same buffers
    graph.replay()
    want = route(x, weight, spec, bias)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])


# ------------------------------------------------------------------------ the sigmoid routers' GEMV

@pytest.mark.parametrize("t,e,h", [(1, 16, 192), (3, 24, 512), (5, 8, 300)])
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32])
def test_router_logits_fp32_matches_float64(t, e, h, xdtype):
    """router_logits_fp32 = x.float() @ w.float().T within fp32 rounding (fresh random inputs,
    H not a multiple of the K tile, E not of the expert block), and bit-identical on a rerun."""
    g = _gen()
    x = torch.randn(t, h, generator=g).to(xdtype)
    w = torch.randn(e, h, generator=g) * h ** -0.5
    want = x.double() @ w.double().T
    got = _tri().router_logits_fp32(x.to(DEVICE), w.to(DEVICE))
    assert got.dtype == torch.float32 and got.shape == (t, e)
    rel = float((got.double().cpu() - want).norm() / want.norm())
    assert rel < 1e-6, rel
    assert torch.equal(got, _tri().router_logits_fp32(x.to(DEVICE), w.to(DEVICE)))


@pytest.mark.parametrize("t,e,h", [(1, 16, 192), (4, 24, 512)])
def test_router_logits_bf16_is_the_fp32_sum_rounded_once(t, e, h):
    """The softmax routers' form: bf16 x and weight, fp32 sums, one RNE rounding to bf16 -- the
    float64 product rounded to bf16 except where fp32 summation moved a value across a rounding
    boundary (within one bf16 ulp), and bit-identical on a rerun."""
    g = _gen()
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    w = (torch.randn(e, h, generator=g) * h ** -0.5).to(torch.bfloat16)
    exact = x.double() @ w.double().T
    got = _tri().router_logits(x.to(DEVICE), w.to(DEVICE), torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (t, e)
    got = got.cpu()
    ulp = exact.abs().clamp(min=2 ** -30).log2().floor().exp2() * 2 ** -7
    assert bool(((got.double() - exact).abs() <= ulp).all())
    assert (got == exact.to(torch.bfloat16)).float().mean() > 0.9
    assert torch.equal(got, _tri().router_logits(x.to(DEVICE), w.to(DEVICE), torch.bfloat16).cpu())
    with pytest.raises(ConfigError, match="out_dtype"):
        _tri().router_logits(x.to(DEVICE), w.to(DEVICE), torch.float16)


def test_route_softmax_decode_uses_the_gemv_kernel_bf16(monkeypatch):
    """A softmax router's bf16 decode batch on CUDA tensors goes to router_logits (bf16 out);
    larger batches, and other dtypes, to F.linear (CUDA claimed on CPU tensors, interpreted)."""
    if torch.cuda.is_available():
        pytest.skip("CPU interpreter form; test_route_cuda_matches_torch_route runs route() for real")
    rt, g = _tri(), _gen()
    spec = RouterSpec(16, 4, "softmax", True)
    calls = []
    real = rt.router_logits
    monkeypatch.setattr(rt, "router_logits", lambda x, w, d: (calls.append((x.shape[0], d)), real(x, w, d))[1])
    monkeypatch.setattr(router_mod, "_fused", lambda logits: True)
    w = (torch.randn(spec.num_experts, 64, generator=g) * 0.125).to(torch.bfloat16)
    for t, dtype in ((1, torch.bfloat16), (rt.ROUTER_GEMV_MAX_TOKENS + 1, torch.bfloat16), (1, torch.float32)):
        x = torch.randn(t, 64, generator=g).to(dtype)
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
            ids, wts = route(x, w.to(dtype), spec)
        logits = real(x, w, torch.bfloat16) if (t, dtype) == (1, torch.bfloat16) else \
            torch.nn.functional.linear(x, w.to(dtype))
        want = rt.router_topk(logits, spec)
        assert torch.equal(ids, want[0]) and torch.equal(wts, want[1])
    assert calls == [(1, torch.bfloat16)]


def test_route_uses_the_gemv_kernel_on_cuda_decode(monkeypatch):
    """route() hands a sigmoid router's decode batch (T <= ROUTER_GEMV_MAX_TOKENS) on CUDA
    tensors to router_logits_fp32 and larger batches to torch's F.linear; the selection after it
    is router_topk on those logits (CUDA claimed on CPU tensors; the kernels run interpreted)."""
    if torch.cuda.is_available():
        pytest.skip("CPU interpreter form; the GPU twin below runs route() for real")
    rt, g = _tri(), _gen()
    spec = GLM
    calls = []
    real = rt.router_logits_fp32
    monkeypatch.setattr(rt, "router_logits_fp32", lambda x, w: (calls.append(x.shape[0]), real(x, w))[1])
    monkeypatch.setattr(router_mod, "_fused", lambda logits: True)
    w = torch.randn(spec.num_experts, 64, generator=g) * 0.125
    bias = _bias(spec, g)
    for t in (1, rt.ROUTER_GEMV_MAX_TOKENS + 1):
        x = torch.randn(t, 64, generator=g).to(torch.bfloat16)
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
            ids, wts = route(x, w, spec, bias)
        logits = real(x, w) if t == 1 else torch.nn.functional.linear(x.float(), w)
        want = rt.router_topk(logits, spec, bias)
        assert torch.equal(ids, want[0]) and torch.equal(wts, want[1])
    assert calls == [1]
