"""The MoE router after its GEMV as ONE Triton kernel: scores, (group-limited) top-k, renormalise,
scale (and, for the sigmoid routers' fp32 GEMV at decode, router_logits_fp32: the GEMV itself). `router_topk(logits, spec, correction_bias)` returns what moet.model.layers.router.route
returns for the same logits; route() calls it for CUDA tensors (the torch ops stay on CPU, where
the tests compare them op for op with transformers). Importing this module needs triton.

One program per token row, one warp: the whole row (E <= 512 experts) lives in registers.

Softmax path (Qwen3-MoE, Mixtral): the experts are SELECTED on the fp32 logits, not on the
probabilities: softmax is monotonic, so the set is the one torch.topk picks on the fp32 softmax
(the only difference: two logits close enough that their fp32 probabilities round to the same
value are a tie for torch and not for us; either answer is a correct top-k). Weights: the fp32
softmax (max-subtracted exp / sum) at the chosen experts, divided by their sum if norm_topk_prob,
then cast to the logits' dtype (bf16 rounds to nearest even, as torch's .to()).

Sigmoid path (DeepSeek-V3, GLM-4.5): scores = 1 / (1 + exp(-logit)) in fp32, choice = scores +
e_score_correction_bias; with n_group > 1 each group's score is the sum of its two best choices
and only the topk_group best groups stay eligible; top-k on choice; weights = the scores (not the
choice) at the chosen experts, / (their sum + 1e-20) if norm_topk_prob, * routed_scaling_factor;
fp32 weights. The selection must run on the very fp32 values torch compares: on CUDA the exp is
libdevice's expf (what torch's CUDA sigmoid calls) and the division IEEE round-to-nearest
(tl.math.div_rn; Triton's `/` is approximate on NVIDIA), so scores and choice are torch's bits.
Group scores add the two decoded fp32 values, as torch's topk(2).sum() does.

Top-k: k rounds of (max, lowest index among equal maxima, remove), done as ONE int64 max
reduction per round on a key = (order-preserving int32 image of the fp32 value) << 32 |
(1024 - index): the largest key is the largest value and, among equal values, the lowest index.
-0.0 is folded into +0.0 first, so they tie as they do for torch. Deterministic.

OUTPUT ORDER (fixed, not torch.topk's): slot j of a row holds the j-th largest selection value
(softmax: logit; sigmoid: score + bias), the lowest expert index first among equal values. The
MoE kernels combine the k slots in slot order, so this fixed order makes the result reproducible;
the chosen SET equals torch's whenever the k-th and (k+1)-th values differ.

No host synchronisation and fixed-size outputs: CUDA-graph capturable. NaN logits are not
supported (torch.topk ranks NaN above everything; this kernel does not).
"""
from __future__ import annotations

import os
from typing import Protocol

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from moet.errors import ConfigError
from moet.kernels.kv_write_triton import _bf16_rne
from moet.kernels.pdl import pdl_enter, pdl_launch


class RoutingRule(Protocol):
    """The routing rule the kernel applies: the fields it reads of moet.checkpoint.spec.RouterSpec.
    Kernels sit beside the data flow and import no checkpoint code: any object with these
    fields will do (read-only, as RouterSpec is frozen)."""
    @property
    def num_experts(self) -> int: ...
    @property
    def top_k(self) -> int: ...
    @property
    def scoring(self) -> str: ...                    # "softmax" | "sigmoid"
    @property
    def norm_topk_prob(self) -> bool: ...
    @property
    def routed_scaling_factor(self) -> float: ...
    @property
    def n_group(self) -> int: ...
    @property
    def topk_group(self) -> int: ...


MAX_EXPERTS = 512
MAX_TOP_K = 16
_NEG_KEY = tl.constexpr(-(2 ** 63))       # below every real key: removed / not eligible


@triton.jit
def _exp(x, ACCURATE: tl.constexpr):
    # libdevice's expf is what torch's CUDA kernels call; the interpreter has no libdevice
    if ACCURATE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _key(v, idx, ok):
    """fp32 v, int32 idx -> int64 key ordered by (v, -idx); _NEG_KEY where not ok."""
    v = tl.where(v == 0.0, 0.0, v)                    # -0.0 -> +0.0: they compare equal
    b = v.to(tl.int32, bitcast=True)
    o = tl.where(b < 0, b ^ 0x7FFFFFFF, b)            # int order == float order
    k = (o.to(tl.int64) << 32) | (1024 - idx).to(tl.int64)       # > 0 for every index < 1024
    return tl.where(ok, k, _NEG_KEY)


@triton.jit
def _key_value(k):
    """The fp32 value a key was made from."""
    o = (k >> 32).to(tl.int32)
    b = tl.where(o < 0, o ^ 0x7FFFFFFF, o)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _router_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, s_lt, scale,
                   E: tl.constexpr, K: tl.constexpr, G: tl.constexpr, TOPK_GROUP: tl.constexpr,
                   GP: tl.constexpr, GSP: tl.constexpr, KP: tl.constexpr,
                   SIGMOID: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                   OUT_BF16: tl.constexpr, ACCURATE: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    GS: tl.constexpr = E // G
    # the row as [groups, experts per group] (one group unless group-limited)
    g = tl.arange(0, GP)
    j = tl.arange(0, GSP)
    idx = g[:, None] * GS + j[None, :]                                   # int32 [GP, GSP]
    valid = (g[:, None] < G) & (j[None, :] < GS)
    row = logits_ptr + t * s_lt
    logit = tl.load(row + idx, mask=valid, other=0.0).to(tl.float32)

    if SIGMOID:
        score = tl.math.div_rn(tl.full(logit.shape, 1.0, tl.float32), 1.0 + _exp(-logit, ACCURATE))
        if HAS_BIAS:
            sel = score + tl.load(bias_ptr + idx, mask=valid, other=0.0).to(tl.float32)
        else:
            sel = score
    else:
        sel = logit                                    # softmax is monotonic: select on the logits
    key = _key(sel, idx, valid)

    if G > 1:
        # group score = best + second best choice of the group; keep the TOPK_GROUP best groups
        b1 = tl.max(key, axis=1)
        b2 = tl.max(tl.where(key == b1[:, None], _NEG_KEY, key), axis=1)
        gkey = _key(_key_value(b1) + _key_value(b2), g, g < G)
        keep = g < 0
        for _r in tl.static_range(TOPK_GROUP):
            gb = tl.max(gkey, axis=0)
            keep = keep | (gkey == gb)
            gkey = tl.where(gkey == gb, _NEG_KEY, gkey)
        key = tl.where(keep[:, None], key, _NEG_KEY)

    kr = tl.arange(0, KP)
    ids = tl.zeros([KP], dtype=tl.int32)
    for r in tl.static_range(K):
        best = tl.max(key)                                               # whole row
        ids = tl.where(kr == r, 1024 - best.to(tl.int32), ids)
        key = tl.where(key == best, _NEG_KEY, key)

    kmask = kr < K
    lsel = tl.load(row + ids, mask=kmask, other=0.0).to(tl.float32)    # the chosen logits again
    if SIGMOID:
        w = tl.math.div_rn(tl.full(lsel.shape, 1.0, tl.float32), 1.0 + _exp(-lsel, ACCURATE))
        if NORM:
            w = tl.math.div_rn(w, tl.zeros_like(w) + (tl.sum(tl.where(kmask, w, 0.0), axis=0) + 1e-20))
        w = w * scale
    else:
        m = tl.max(tl.where(valid, logit, float("-inf")))
        total = tl.sum(tl.where(valid, _exp(logit - m, ACCURATE), 0.0))
        w = tl.math.div_rn(_exp(lsel - m, ACCURATE), tl.zeros_like(lsel) + total)
        if NORM:
            w = tl.math.div_rn(w, tl.zeros_like(w) + tl.sum(tl.where(kmask, w, 0.0), axis=0))
    tl.store(ids_ptr + t * K + kr, ids.to(tl.int64), mask=kmask)
    if OUT_BF16:
        tl.store(w_ptr + t * K + kr, _bf16_rne(w), mask=kmask)
    else:
        tl.store(w_ptr + t * K + kr, w.to(w_ptr.dtype.element_ty), mask=kmask)


# ------------------------------------------------------------------ the sigmoid routers' GEMV

# Each token's programs read the whole [E, H] weight (from L2 after the first: DeepSeek-V3's is
# 7.3 MB), so T tokens cost T weight reads; cuBLAS's GEMM reads it once. Small decode batches only.
ROUTER_GEMV_MAX_TOKENS = 4
# One expert row per program (E programs per token: 128-256 of the H200's 132 SMs pull bytes at
# once) and the whole row in one 4,096-wide tile of 8 warps: a 2 MB GEMV is latency-bound, so
# one round trip to HBM beats a pipelined loop. On the H200 (a graph of all layers' routers, T = 1,
# GLM-4.5-Air and DeepSeek-V3 shapes) it beat 1,024-wide tiles of 4 warps and took under half the
# time of torch's cast + cuBLAS (docs/kernels.md, router). (The first form, 4 rows per program and
# 256-wide tiles, was no faster than cuBLAS in the engine.)
_GEMV_BE, _GEMV_BK, _GEMV_WARPS = 1, 4096, 8


@triton.jit
def _router_gemv_kernel(x_ptr, w_ptr, out_ptr, s_x, s_w, H: tl.constexpr, E: tl.constexpr, BE: tl.constexpr,
                        BK: tl.constexpr, OUT_BF16: tl.constexpr, PDL: tl.constexpr):
    """out[t, e] = sum_h float(x[t, h]) * w[e, h] in fp32 for BE experts of one token: per lane
    partial sums over the K tiles in order, then one tree sum per expert (fixed order); stored
    as fp32, or rounded once to bf16 (RNE) as a bf16 GEMV's output is."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    rows = tl.program_id(1) * BE + tl.arange(0, BE)
    rmask = rows < E
    acc = tl.zeros((BE, BK), tl.float32)
    for k0 in range(0, H, BK):
        ks = k0 + tl.arange(0, BK)
        kmask = ks < H
        xv = tl.load(x_ptr + t * s_x + ks, mask=kmask, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + rows[:, None] * s_w + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        acc += wv.to(tl.float32) * xv[None, :]
    if OUT_BF16:
        tl.store(out_ptr + t * E + rows, _bf16_rne(tl.sum(acc, axis=1)), mask=rmask)
    else:
        tl.store(out_ptr + t * E + rows, tl.sum(acc, axis=1), mask=rmask)


def router_logits_fp32(x: torch.Tensor, weight: torch.Tensor, **launch) -> torch.Tensor:
    """The sigmoid routers' F.linear(x.float(), weight.float()) (router_logits, fp32 out)."""
    return router_logits(x, weight, torch.float32, **launch)


def router_logits(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype = torch.float32, *,
                  rows_per_program: int | None = None, block_k: int | None = None,
                  num_warps: int | None = None) -> torch.Tensor:
    """A router's logits for a decode batch as one launch: out_dtype fp32 is the sigmoid routers'
    F.linear(x.float(), weight.float()) (torch's is a cast of x plus cuBLAS's two-kernel fp32
    GEMV: three launches per MoE layer in a launch-bound decode step); bf16 is the softmax
    routers' bf16 F.linear(x, weight) (fp32 sums rounded once, as cuBLAS's). x [T, H] (bf16 /
    fp16 / fp32), weight [E, H] (fp32 or bf16, read as it is stored) -> [T, E] in out_dtype.
    The fp32 sums are in another order than cuBLAS's, so logits may differ in the last bits
    (as cuBLAS's and the CPU's do); reruns are bit-identical.
    rows_per_program / block_k / num_warps override the launch (for benchmarks and tests)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ConfigError(f"router gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    t, h = x.shape
    e = weight.shape[0]
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ConfigError(f"router gemv: out_dtype {out_dtype} unsupported (float32, bfloat16)")
    out = torch.empty(t, e, dtype=out_dtype, device=x.device)
    if t:
        be = rows_per_program or _GEMV_BE
        bk = min(block_k or _GEMV_BK, triton.next_power_of_2(h))
        _router_gemv_kernel[(t, triton.cdiv(e, be))](x, weight, out, x.stride(0), weight.stride(0),
                                                   H=h, E=e, BE=be, BK=bk, OUT_BF16=out_dtype == torch.bfloat16,
                                                   num_warps=num_warps or _GEMV_WARPS,
                                                   **pdl_launch(x))
    return out


def _check(spec: RoutingRule, e: int) -> None:
    k, g = spec.top_k, spec.n_group
    if e != spec.num_experts:
        raise ConfigError(f"router (triton): logits have {e} experts, the router spec says {spec.num_experts}")
    if not 1 <= e <= MAX_EXPERTS:
        raise ConfigError(f"router (triton): one program holds a whole row of at most {MAX_EXPERTS} experts, "
                          f"got {e}; route such models with the torch path")
    if not 1 <= k <= min(MAX_TOP_K, e):
        raise ConfigError(f"router (triton): top_k must be in 1..min({MAX_TOP_K}, num_experts), got {k}")
    if spec.scoring not in ("softmax", "sigmoid"):
        raise ConfigError(f"router (triton): unknown scoring {spec.scoring!r} (softmax | sigmoid)")
    if spec.scoring == "sigmoid" and g > 1:
        if e % g or e // g < 2:
            raise ConfigError(f"router (triton): {e} experts do not split into n_group={g} groups of >= 2")
        if not 1 <= spec.topk_group <= g or spec.topk_group * (e // g) < k:
            raise ConfigError(f"router (triton): topk_group={spec.topk_group} of n_group={g} groups "
                              f"({e // g} experts each) cannot hold top_k={k} experts")


def router_topk(logits: torch.Tensor, spec: RoutingRule,
                correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (bf16, fp16 or fp32; the router GEMV's output) -> (ids int64 [T, k],
    weights [T, k]): weights in the logits' dtype for softmax scoring, fp32 for sigmoid (as
    route()). Slots ordered by descending selection value, lowest expert index first on ties."""
    if logits.dim() != 2:
        raise ConfigError(f"router (triton): logits must be [T, E], got shape {tuple(logits.shape)}")
    t, e = logits.shape
    _check(spec, e)
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ConfigError(f"router (triton): logits dtype {logits.dtype} unsupported (bf16, fp16, fp32)")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    sigmoid = spec.scoring == "sigmoid"
    k = spec.top_k
    g = spec.n_group if sigmoid and spec.n_group > 1 else 1
    out_dtype = torch.float32 if sigmoid else logits.dtype
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    w = torch.empty(t, k, dtype=out_dtype, device=logits.device)
    if t == 0:
        return ids, w
    has_bias = sigmoid and correction_bias is not None
    if has_bias:
        if correction_bias.numel() != e:
            raise ConfigError(f"router (triton): correction bias has {correction_bias.numel()} entries, "
                              f"expected {e}")
        bias = correction_bias.reshape(e)
        bias = bias if bias.is_contiguous() else bias.contiguous()
    else:
        bias = logits                                                    # any pointer; never read
    accurate = logits.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
    _router_kernel[(t,)](
        logits, bias, ids, w, logits.stride(0), float(spec.routed_scaling_factor if sigmoid else 1.0),
        E=e, K=k, G=g, TOPK_GROUP=spec.topk_group if g > 1 else 1,
        GP=triton.next_power_of_2(g), GSP=triton.next_power_of_2(e // g), KP=triton.next_power_of_2(k),
        SIGMOID=sigmoid, NORM=bool(spec.norm_topk_prob), HAS_BIAS=has_bias,
        OUT_BF16=out_dtype == torch.bfloat16, ACCURATE=accurate, num_warps=1, **pdl_launch(logits))
    return ids, w
