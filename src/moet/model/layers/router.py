"""Routing rules: which k experts each token uses and with what weights. Mirrors transformers'
routers op for op (the chosen set must match exactly; near-ties decide it).

On CUDA tensors everything after the router GEMV is one Triton kernel
(moet.kernels.router_triton.router_topk: same set, same weights, its own fixed slot order:
descending score, lowest expert index first on ties), and the sigmoid routers' fp32 GEMV of a
decode batch is one more (router_triton.router_logits_fp32); on CPU the torch ops below, which
the tests compare with transformers op for op. Picked by device, like kernels/attention_ops.py.
"""
from __future__ import annotations

import importlib.util
from functools import lru_cache

import torch
import torch.nn.functional as F

from moet.checkpoint.spec import RouterSpec


@lru_cache(maxsize=1)
def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


@lru_cache(maxsize=1)
def _gemv_max_tokens() -> int:
    from moet.kernels.router_triton import ROUTER_GEMV_MAX_TOKENS
    return ROUTER_GEMV_MAX_TOKENS


def _fused(logits: torch.Tensor) -> bool:
    """True when the selection after the GEMV runs as the Triton kernel (CUDA tensors)."""
    return logits.device.type == "cuda" and _have_triton()


def route(x: torch.Tensor, weight: torch.Tensor, spec: RouterSpec,
          correction_bias: torch.Tensor | None = None,
          logit_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], router weight [E, H] -> (topk_ids int64 [T, k], topk_weights [T, k]).
    logit_bias [E]: the router Linear's bias (gpt-oss), in the logits for choice and weights."""
    if spec.scoring == "sqrtsoftplus":
        # DeepSeek-V4: sqrt(softplus(logit)) in fp32; the bias steers the choice only; the chosen
        # scores renormalised (+1e-20) and scaled
        scores = F.softplus(F.linear(x.float(), weight.float())).sqrt()
        choice = scores + correction_bias if correction_bias is not None else scores
        ids = torch.topk(choice, k=spec.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, ids)
        return ids, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * spec.routed_scaling_factor
    if spec.scoring == "softmax":
        # Mixtral / Qwen3-MoE: softmax over all experts (fp32), top-k, optional renormalise;
        # gpt-oss's softmax over the top-k logits is this with renormalisation
        bf16 = x.dtype == weight.dtype == torch.bfloat16
        if x.is_cuda and _have_triton() and x.shape[0] <= _gemv_max_tokens() and bf16:
            from moet.kernels.router_triton import router_logits
            logits = router_logits(x, weight, torch.bfloat16)   # one launch; bf16 out, as F.linear's
            if logit_bias is not None:
                logits = logits + logit_bias
        else:
            logits = F.linear(x, weight, logit_bias)
        if _fused(logits):
            from moet.kernels.router_triton import router_topk
            return router_topk(logits, spec)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        w, ids = torch.topk(probs, spec.top_k, dim=-1)
        if spec.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return ids, w.to(logits.dtype)
    # DeepSeek-V3 / GLM: sigmoid scores in fp32; the correction bias steers the choice only;
    # group-limited: keep the topk_group groups whose best-2 sum is largest.
    if x.is_cuda and _have_triton() and x.shape[0] <= _gemv_max_tokens():
        from moet.kernels.router_triton import router_logits_fp32
        logits = router_logits_fp32(x, weight)     # one launch instead of cast + cuBLAS's two
    else:
        logits = F.linear(x.float(), weight.float())
    if _fused(logits):
        from moet.kernels.router_triton import router_topk
        return router_topk(logits, spec, correction_bias)
    scores = logits.sigmoid()
    choice = scores + correction_bias if correction_bias is not None else scores
    e, g = spec.num_experts, spec.n_group
    if g > 1:
        group_scores = choice.view(-1, g, e // g).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=spec.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, g, e // g).reshape(-1, e)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=spec.top_k, dim=-1, sorted=False)[1]
    w = scores.gather(1, ids)
    if spec.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, w * spec.routed_scaling_factor
