"""ModelSpec: everything moet needs to know about one checkpoint's architecture, read from its
config.json as a plain dict (not through transformers' config classes: Kimi-K2 and other
remote-code checkpoints name their own model_type, and we must not execute their code).

One builder per family turns a config dict into a ModelSpec: dimensions, which layers are
dense or MoE, the attention kind, the rope, the routing rule and how tensors are named on disk.
The model (moet.model) is built from the spec alone.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

from moet.errors import CheckpointError, ConfigError


# Tensors of an MTP block that are not part of its decoder layer (DeepSeek-V3 layout).
MTP_OWN_PREFIXES = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")


@dataclass(frozen=True)
class RopeSpec:
    dim: int                          # rotated dims per head (partial rotary: < head_dim)
    theta: float
    rope_type: str = "default"        # "default" | "linear" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    interleave: bool = False          # DeepSeek: rotary pairs are (x0, x1), (x2, x3), ...


@dataclass(frozen=True)
class AttentionSpec:
    kind: str                         # "gqa" | "mla"
    num_heads: int
    num_kv_heads: int
    head_dim: int                     # q/k head dim (MLA: nope + rope)
    v_head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    qk_norm_per_head: bool = True     # False (MiniMax-M2): q / k normed across all their heads at once
    output_gate: bool = False         # Qwen3.5: q_proj also gives a per-head gate, out * sigmoid(gate)
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] | None = None   # per layer: windowed? (gpt-oss alternates); None = all
    sinks: bool = False               # gpt-oss: a learned per-head logit in every softmax's denominator
    scale: float = 1.0                # softmax scale (MLA + YaRN: includes mscale**2)
    # MLA only
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0


@dataclass(frozen=True)
class SparseAttentionSpec:
    """DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): a lightning indexer scores every cached
    position for each query (ReLU'd dot products of its own small heads, weighted per head from
    the hidden state) and the MLA attention reads only the `top_k` best. `layer_types[i]`:
    "full" runs layer i's own indexer, "shared" reuses the selection of the last full layer
    before it (GLM-5's cross-layer sharing). MTP layers run their own indexer."""
    num_heads: int                    # index_n_heads
    head_dim: int                     # index_head_dim; its first rope_dim dims are rotated
    top_k: int                        # index_topk
    rope_dim: int                     # the MLA's qk_rope_head_dim
    layer_types: tuple[str, ...]
    rope_interleave: bool = True      # GLM-5: interleaved pairs as its MLA; DeepSeek-V3.2: half-split

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5


@dataclass(frozen=True)
class CompressedAttentionSpec:
    """DeepSeek-V4's attention schedule. Every layer attends to a sliding window of its own keys
    (K = V: one shared head, rope'd, `window` positions including the query's own) with a per-head
    attention sink; `layer_types[i]` "sliding" stops there, "csa" (compressed sparse attention)
    adds one compressed key per `csa_rate` tokens, built from two overlapping windows and chosen
    per query by a lightning indexer (`index_top_k` of them), "hca" (heavily compressed) adds one
    per `hca_rate` tokens, all of them. Compressed keys and CSA / HCA layers' own q / kv rotate
    with `compress_rope` (its own theta, YaRN); sliding layers with the model's rope. The output
    is de-rotated at the query's position and projected in `o_groups` groups of rank
    `o_lora_rank` before o_b. See model/deepseek_v4.py."""
    layer_types: tuple[str, ...]      # per layer: "sliding" | "csa" | "hca"
    window: int
    csa_rate: int
    hca_rate: int
    index_heads: int
    index_head_dim: int
    index_top_k: int
    o_groups: int
    o_lora_rank: int
    compress_rope: RopeSpec
    hash_layers: tuple[int, ...]      # MoE layers routed by a token-id table (tid2eid), not learned

    def cache_widths(self, layer: int, head_dim: int) -> dict[str, int]:
        """The per-token rows of layer `layer`'s paged cache (model/deepseek_v4.py V4LayerKV), by
        name: the sliding key; a compressor's two projections and its compressed key (kept at
        each window's first slot); the indexer's three likewise."""
        kind, d, di = self.layer_types[layer], head_dim, self.index_head_dim
        out = {"kv": d}
        if kind != "sliding":
            w = 2 * d if kind == "csa" else d
            out.update(entries_kv=w, entries_gate=w, entries=d)
        if kind == "csa":
            out.update(index_entries_kv=2 * di, index_entries_gate=2 * di, index_entries=di)
        return out

    def cache_elements_per_token(self, head_dim: int) -> int:
        return sum(sum(self.cache_widths(i, head_dim).values()) for i in range(len(self.layer_types)))


@dataclass(frozen=True)
class HyperConnectionSpec:
    """Manifold-constrained hyper-connections (DeepSeek-V4): `streams` copies of the residual
    stream, mixed around every sublayer by a Sinkhorn-normalised matrix (`sinkhorn_iters`)."""
    streams: int
    sinkhorn_iters: int
    eps: float


@dataclass(frozen=True)
class LinearAttentionSpec:
    """Gated DeltaNet layers (Qwen3.5-MoE) between full-attention ones: `layer_types[i]` is
    "linear" (a gated DeltaNet: a short causal depthwise conv over q / k / v, then the gated delta
    rule's recurrent state of value_heads x key_head_dim x value_head_dim, carried per sequence)
    or "full" (the model's gated GQA). See model/layers/gated_deltanet.py."""
    layer_types: tuple[str, ...]
    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_heads * self.key_head_dim + self.value_heads * self.value_head_dim


@dataclass(frozen=True)
class RouterSpec:
    num_experts: int
    top_k: int
    scoring: str                      # "softmax" (Mixtral, Qwen3-MoE) | "sigmoid" (DeepSeek-V3, GLM)
    #                                   | "sqrtsoftplus" (DeepSeek-V4: sqrt(softplus(logit)))
    norm_topk_prob: bool
    routed_scaling_factor: float = 1.0
    n_group: int = 1                  # group-limited top-k (DeepSeek-V3): keep topk_group groups
    topk_group: int = 1
    correction_bias: bool = False     # e_score_correction_bias: added for choice, not for weights
    logit_bias: bool = False          # gpt-oss: the router is a Linear with a bias (choice and weights)
    fp32_weight: bool = False         # router matmul in fp32 (DeepSeek/GLM keep gate.weight in fp32)


@dataclass(frozen=True)
class ModelSpec:
    family: str                       # "deepseek_v3" | "glm4_moe" | "qwen3_moe" | "mixtral" | "glm_moe_dsa" | "deepseek_v32"
    #                                   | "deepseek_v4" | "minimax_m2" | "gpt_oss"
    architecture: str                 # config.json's architectures[0]
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_kinds: tuple[str, ...]      # per layer: "dense" | "moe"
    intermediate_size: int            # dense MLP layers
    moe_intermediate_size: int        # one routed expert
    shared_intermediate_size: int     # 0 = no shared expert
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    attention: AttentionSpec
    rope: RopeSpec
    router: RouterSpec
    num_mtp_layers: int = 0
    sparse_attention: SparseAttentionSpec | None = None   # DSA (GLM-5); None = dense attention
    compressed_attention: CompressedAttentionSpec | None = None   # DeepSeek-V4
    hyper_connections: HyperConnectionSpec | None = None          # DeepSeek-V4
    linear_attention: LinearAttentionSpec | None = None           # Qwen3.5-MoE's gated DeltaNet layers
    norm_offset: float = 0.0          # Qwen3.5: RMSNorm weights stored as offsets from 1 (scale = 1 + w)
    shared_expert_gate: bool = False  # Qwen3.5: the shared expert's output times sigmoid(a Linear of x)
    ignored: tuple[str, ...] = ()     # canonical-name patterns of tensors no module reads (a vision tower)
    hidden_act: str = "silu"
    swiglu_limit: float | None = None  # clamp gate (max) and up (+-) in fp32 before SiLU-mul
    # gpt-oss's expert activation: gate * sigmoid(alpha * gate) * (up + 1) after the clamp, with
    # per-expert biases on gate_up and down (ModelSpec.expert_bias); None = SiLU(gate) * up
    swiglu_alpha: float | None = None
    expert_bias: bool = False
    # "stacked": fused expert tensors as gate_up [E, 2I, H] (gate rows first) and down [E, H, I];
    # "gpt_oss": gate and up rows interleaved, float tensors stored transposed ([E, H, 2I], [E, I, H])
    fused_expert_layout: str = "stacked"
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # on-disk name -> moet name rewrites, applied in order (re.sub); see canonical_name
    renames: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    # ---------------------------------------------------------------- counts

    def layer_attention(self, layer: int) -> AttentionSpec:
        """Layer `layer`'s attention: the model's, without the window where sliding_layers says
        the layer attends to the full context."""
        a = self.attention
        if a.sliding_window is None or a.sliding_layers is None or a.sliding_layers[layer]:
            return a
        return replace(a, sliding_window=None, sliding_layers=None)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == "moe"]

    def expert_params(self) -> int:
        """Weights of one routed expert (gate + up + down)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def canonical_name(self, disk_name: str) -> str:
        """A tensor's name as moet's modules call it (one convention for every family):
        model.layers.{i}.mlp.experts.{e}.{gate_proj|up_proj|down_proj}.weight for experts, and
        mtp.{j}.* for MTP layer j (stored on disk as model.layers.{num_layers + j}.*)."""
        name = disk_name
        for pattern, repl in self.renames:
            name = re.sub(pattern, repl, name)
        m = re.match(r"model\.layers\.(\d+)\.(.*)$", name)
        if m and int(m.group(1)) >= self.num_layers:
            rest = m.group(2)
            if not rest.startswith(MTP_OWN_PREFIXES):
                rest = "layer." + rest  # the MTP block's decoder layer
            name = f"mtp.{int(m.group(1)) - self.num_layers}.{rest}"
        return name


@dataclass(frozen=True, slots=True)
class ExpertRef:
    """A routed-expert tensor, by canonical name: per-expert (expert = e, proj = gate_proj |
    up_proj | down_proj) or transformers-style fused over experts (expert = None, proj =
    gate_up_proj [E, 2I, H] with gate rows first | down_proj [E, H, I])."""
    layer: int | None        # decoder layer, or None for an MTP block
    mtp: int | None          # MTP block index
    expert: int | None
    proj: str


_LAYER_PREFIX = r"^(?:model\.layers\.(\d+)|mtp\.(\d+)\.layer)\.mlp\.experts\."
_PER_EXPERT = re.compile(_LAYER_PREFIX + r"(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(_LAYER_PREFIX + r"(gate_up_proj|down_proj)$")


def expert_ref(canonical: str) -> ExpertRef | None:
    """Which routed expert a canonical tensor name belongs to; None for every other tensor
    (shared experts are `shared_experts.*` and never match)."""
    if m := _PER_EXPERT.match(canonical):
        return ExpertRef(_int(m.group(1)), _int(m.group(2)), int(m.group(3)), m.group(4))
    if m := _FUSED.match(canonical):
        return ExpertRef(_int(m.group(1)), _int(m.group(2)), None, m.group(3))
    return None


def _int(s: str | None) -> int | None:
    return None if s is None else int(s)


# ---------------------------------------------------------------------------- helpers

# Every number read from config.json goes through _int / _float: a wrong type, a non-integer, a
# value out of range or not finite is one CheckpointError naming the field (spec_from_config puts
# the file's path in place of "config.json"), never a ValueError / ZeroDivisionError deep in the
# model code later.
_REQUIRED = object()


def _bad(key: str, v, want: str) -> CheckpointError:
    return CheckpointError(f"config.json: {key}={v!r} {want}")


def _get(cfg: dict, key: str, default=None, *, required: bool = False):
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if required:
        raise CheckpointError(f"config.json: required field {key!r} is missing")
    return default


def _as_int(key: str, v, lo: int | None) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise _bad(key, v, "must be an integer")
    v = int(v)
    if lo is not None and v < lo:
        raise _bad(key, v, f"must be at least {lo}")
    return v


def _cint(cfg: dict, key: str, default=_REQUIRED, *, lo: int | None = 1):
    """cfg[key] as an int >= lo (None: no bound); `default` when absent or null (required when
    no default is given). Integral floats (64.0) pass; strings, bools and fractions do not."""
    v = cfg.get(key)
    if v is None:
        if default is _REQUIRED:
            raise CheckpointError(f"config.json: required field {key!r} is missing")
        return default
    return _as_int(key, v, lo)


def _first_int(cfg: dict, *keys: str, lo: int | None = 1) -> int:
    """The first of several aliases present (transformers renames some fields on save)."""
    for k in keys:
        if cfg.get(k) is not None:
            return _as_int(k, cfg[k], lo)
    raise CheckpointError(f"config.json: required field {keys[0]!r} is missing")


def _float(cfg: dict, key: str, default=_REQUIRED, *, positive: bool = False, nonneg: bool = False):
    """cfg[key] as a finite float (> 0 with positive, >= 0 with nonneg); `default` when absent."""
    v = cfg.get(key)
    if v is None:
        if default is _REQUIRED:
            raise CheckpointError(f"config.json: required field {key!r} is missing")
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(key, v, "must be a finite number")
    if positive and not v > 0:
        raise _bad(key, v, "must be greater than 0")
    if nonneg and v < 0:
        raise _bad(key, v, "must not be negative")
    return float(v)


def _bool(cfg: dict, key: str, default: bool) -> bool:
    v = cfg.get(key)
    if v is None:
        return default
    if not isinstance(v, (bool, int)) or isinstance(v, int) and not isinstance(v, bool) and v not in (0, 1):
        raise _bad(key, v, "must be true or false")
    return bool(v)


def _dict(cfg: dict, key: str) -> dict:
    v = cfg.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise _bad(key, v, "must be an object")
    return v


def _rope(cfg: dict, dim: int, *, interleave: bool = False) -> RopeSpec:
    """Rope parameters from either the transformers-5 `rope_parameters` dict or the older
    top-level `rope_theta` + `rope_scaling` fields (what most released checkpoints have)."""
    params = dict(_dict(cfg, "rope_parameters"))
    for k, v in _dict(cfg, "rope_scaling").items():
        params.setdefault(k, v)
    params.setdefault("rope_theta", cfg.get("rope_theta"))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "linear", "yarn"):
        raise CheckpointError(f"config.json: rope type {rope_type!r} is not supported (supported: default, linear, yarn)")
    opt = lambda k, **kw: _float(params, k, None, **kw)    # noqa: E731
    orig = _cint(params, "original_max_position_embeddings", None)
    return RopeSpec(
        dim=dim, theta=_float(params, "rope_theta", 10000.0, positive=True), rope_type=rope_type,
        factor=_float(params, "factor", 1.0, positive=True),
        original_max_position_embeddings=orig if orig is not None else _cint(cfg, "max_position_embeddings", None),
        beta_fast=opt("beta_fast") or 32.0, beta_slow=opt("beta_slow") or 1.0,
        mscale=opt("mscale"), mscale_all_dim=opt("mscale_all_dim"),
        attention_factor=opt("attention_factor", positive=True), truncate=_bool(params, "truncate", True),
        interleave=interleave,
    )


def _partial_rotary(cfg: dict) -> float:
    params = _dict(cfg, "rope_parameters")
    src = params if params.get("partial_rotary_factor") is not None else cfg
    f = _float(src, "partial_rotary_factor", 1.0, positive=True)
    if f > 1:
        raise _bad("partial_rotary_factor", f, "must be in (0, 1]")
    return f


def _token_ids(cfg: dict, key: str) -> tuple[int, ...]:
    v = cfg.get(key)
    if v is None:
        return ()
    ids = v if isinstance(v, list) else [v]
    return tuple(_as_int(key, t, 0) for t in ids)


def _eos(cfg: dict) -> tuple[int, ...]:
    return _token_ids(cfg, "eos_token_id")


def _dtype(cfg: dict) -> str:
    return str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16").replace("torch.", "")


def _first_k_dense_kinds(cfg: dict, n: int) -> tuple[str, ...]:
    kinds = cfg.get("mlp_layer_types")
    if kinds:
        if not isinstance(kinds, list):
            raise _bad("mlp_layer_types", kinds, "must be a list")
        if len(kinds) < n:
            raise CheckpointError(f"config.json: mlp_layer_types has {len(kinds)} entries for {n} layers")
        return tuple("moe" if k in ("sparse", "moe") else "dense" for k in kinds[:n])
    k = _cint(cfg, "first_k_dense_replace", 0, lo=0)
    freq = _cint(cfg, "moe_layer_freq", 1)
    return tuple("moe" if i >= k and i % freq == 0 else "dense" for i in range(n))


def _head_dim(cfg: dict, hidden: int, heads: int) -> int:
    """head_dim, or hidden_size / num_attention_heads when the config leaves it out."""
    if cfg.get("head_dim") is not None:
        return _cint(cfg, "head_dim")
    if hidden % heads:
        raise CheckpointError(f"config.json: hidden_size={hidden} is not a multiple of num_attention_heads={heads} "
                              "and no head_dim is given")
    return hidden // heads


def _common(cfg: dict, family: str) -> dict:
    swiglu = _float(cfg, "swiglu_limit", None, positive=True)
    bos = _token_ids(cfg, "bos_token_id")
    return dict(
        family=family,
        architecture=cfg["architectures"][0],
        vocab_size=_cint(cfg, "vocab_size"),
        hidden_size=_cint(cfg, "hidden_size"),
        num_layers=_cint(cfg, "num_hidden_layers"),
        rms_norm_eps=_float(cfg, "rms_norm_eps", 1e-6, positive=True),
        tie_word_embeddings=_bool(cfg, "tie_word_embeddings", False),
        max_position_embeddings=_cint(cfg, "max_position_embeddings", 4096),
        hidden_act=str(_get(cfg, "hidden_act", "silu")),
        swiglu_limit=swiglu,
        torch_dtype=_dtype(cfg),
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=_eos(cfg),
    )


# ---------------------------------------------------------------------------- families

def deepseek_v3_spec(cfg: dict) -> ModelSpec:
    base = _common(cfg, "deepseek_v3")
    heads = _cint(cfg, "num_attention_heads")
    nope, rope_d = _cint(cfg, "qk_nope_head_dim", lo=0), _cint(cfg, "qk_rope_head_dim")
    rope = _rope(cfg, rope_d, interleave=_bool(cfg, "rope_interleave", True))
    scale = (nope + rope_d) ** -0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = _yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * m * m
    attn = AttentionSpec(
        kind="mla", num_heads=heads, num_kv_heads=heads, head_dim=nope + rope_d,
        v_head_dim=_cint(cfg, "v_head_dim"), o_bias=_bool(cfg, "attention_bias", False),
        qkv_bias=_bool(cfg, "attention_bias", False), scale=scale,
        q_lora_rank=_cint(cfg, "q_lora_rank", None), kv_lora_rank=_cint(cfg, "kv_lora_rank"),
        qk_nope_head_dim=nope, qk_rope_head_dim=rope_d,
    )
    return _sigmoid_routed_moe_spec(cfg, base, attn, rope)


def glm_moe_dsa_spec(cfg: dict) -> ModelSpec:
    """GLM-5: DeepSeek-V3's MLA (interleaved rope) and sigmoid-routed MoE, plus DSA's indexer
    (interleaved rope too), whose selection "shared" layers reuse."""
    n = _cint(cfg, "num_hidden_layers")
    types = cfg.get("indexer_types")
    if types is None and cfg.get("index_topk_pattern") is not None:
        pattern = cfg["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    if types is None:                 # transformers' default schedule from index_topk_freq / offset
        freq = max(_cint(cfg, "index_topk_freq", 1), 1)
        offset = _cint(cfg, "index_skip_topk_offset", 2, lo=0)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    return _dsa_spec(cfg, "glm_moe_dsa", types, rope_interleave=True)


def deepseek_v32_spec(cfg: dict) -> ModelSpec:
    """DeepSeek-V3.2: DeepSeek-V3 plus DSA, every layer its own indexer, whose rope is half-split
    (not interleaved like the MLA's)."""
    return _dsa_spec(cfg, "deepseek_v32", ["full"] * _cint(cfg, "num_hidden_layers"), rope_interleave=False)


def _dsa_spec(cfg: dict, family: str, types, *, rope_interleave: bool) -> ModelSpec:
    if cfg.get("q_lora_rank") is None:
        raise CheckpointError(f"config.json: q_lora_rank is required for {cfg['architectures'][0]} (the DSA "
                              "indexer reads the compressed query)")
    spec = deepseek_v3_spec({**cfg, "rope_interleave": True})
    n = spec.num_layers
    if not isinstance(types, list) or len(types) < n or any(t not in ("full", "shared") for t in types[:n]):
        raise _bad("indexer_types", types, f"must list 'full' or 'shared' for each of the {n} layers")
    if types[0] != "full":
        raise _bad("indexer_types", types[:4], "must start with 'full' (a shared layer reuses an earlier full one)")
    dsa = SparseAttentionSpec(num_heads=_cint(cfg, "index_n_heads", 32), head_dim=_cint(cfg, "index_head_dim", 128),
                              top_k=_cint(cfg, "index_topk", 2048), rope_dim=spec.attention.qk_rope_head_dim,
                              layer_types=tuple(types[:n]), rope_interleave=rope_interleave)
    if dsa.head_dim < dsa.rope_dim:
        raise _bad("index_head_dim", dsa.head_dim, f"must be at least qk_rope_head_dim={dsa.rope_dim}")
    return replace(spec, family=family, sparse_attention=dsa)


def _sigmoid_routed_moe_spec(cfg: dict, base: dict, attn: "AttentionSpec", rope) -> ModelSpec:
    """The MoE half shared by DeepSeek-V3 and GLM-4.5: sigmoid scores + e_score_correction_bias,
    group-limited top-k, routed_scaling_factor, shared experts, first_k_dense_replace, MTP."""
    router = RouterSpec(
        num_experts=_first_int(cfg, "n_routed_experts", "num_local_experts"), top_k=_cint(cfg, "num_experts_per_tok"),
        scoring="sigmoid", norm_topk_prob=_bool(cfg, "norm_topk_prob", True),
        routed_scaling_factor=_float(cfg, "routed_scaling_factor", 1.0, positive=True),
        n_group=_cint(cfg, "n_group", 1), topk_group=_cint(cfg, "topk_group", 1),
        correction_bias=True, fp32_weight=True,
    )
    moe_i = _cint(cfg, "moe_intermediate_size")
    mtp = _cint(cfg, "num_nextn_predict_layers", None, lo=0)
    return ModelSpec(
        **base, layer_kinds=_first_k_dense_kinds(cfg, base["num_layers"]),
        intermediate_size=_cint(cfg, "intermediate_size"),
        moe_intermediate_size=moe_i, shared_intermediate_size=moe_i * _cint(cfg, "n_shared_experts", 0, lo=0),
        attention=attn, rope=rope, router=router,
        num_mtp_layers=mtp if mtp is not None else _cint(cfg, "num_mtp_layers", 0, lo=0),
    )


def _gqa(cfg: dict, base: dict, **kw) -> AttentionSpec:
    heads = _cint(cfg, "num_attention_heads")
    head_dim = _head_dim(cfg, base["hidden_size"], heads)
    return AttentionSpec(kind="gqa", num_heads=heads, num_kv_heads=_cint(cfg, "num_key_value_heads", heads),
                         head_dim=head_dim, v_head_dim=head_dim, scale=head_dim ** -0.5, **kw)


def glm4_moe_spec(cfg: dict) -> ModelSpec:
    base = _common(cfg, "glm4_moe")
    bias = _bool(cfg, "attention_bias", False)
    attn = _gqa(cfg, base, qkv_bias=bias, qk_norm=_bool(cfg, "use_qk_norm", False))
    rope = _rope(cfg, int(attn.head_dim * _partial_rotary({"partial_rotary_factor": 0.5, **cfg})))
    return _sigmoid_routed_moe_spec(cfg, base, attn, rope)


def qwen3_moe_spec(cfg: dict) -> ModelSpec:
    base = _common(cfg, "qwen3_moe")
    n = base["num_layers"]
    bias = _bool(cfg, "attention_bias", False)
    window = _cint(cfg, "sliding_window", None) if _bool(cfg, "use_sliding_window", False) else None
    attn = _gqa(cfg, base, qkv_bias=bias, o_bias=bias, qk_norm=True, sliding_window=window)
    n_experts = _first_int(cfg, "num_experts", "num_local_experts")
    only_layers = cfg.get("mlp_only_layers") or []
    if not isinstance(only_layers, list):
        raise _bad("mlp_only_layers", only_layers, "must be a list of layer indices")
    only = {_as_int("mlp_only_layers", x, 0) for x in only_layers}
    step = _cint(cfg, "decoder_sparse_step", 1)
    kinds = tuple("moe" if i not in only and (i + 1) % step == 0 else "dense" for i in range(n))
    router = RouterSpec(num_experts=n_experts, top_k=_cint(cfg, "num_experts_per_tok"), scoring="softmax",
                        norm_topk_prob=_bool(cfg, "norm_topk_prob", False))
    return ModelSpec(
        **base, layer_kinds=kinds, intermediate_size=_cint(cfg, "intermediate_size", 0, lo=0),
        moe_intermediate_size=_cint(cfg, "moe_intermediate_size"), shared_intermediate_size=0,
        attention=attn, rope=_rope(cfg, attn.head_dim), router=router,
    )


def mixtral_spec(cfg: dict) -> ModelSpec:
    base = _common(cfg, "mixtral")
    n = base["num_layers"]
    attn = _gqa(cfg, base, sliding_window=_cint(cfg, "sliding_window", None))
    router = RouterSpec(num_experts=_cint(cfg, "num_local_experts"),
                        top_k=_cint(cfg, "num_experts_per_tok"), scoring="softmax", norm_topk_prob=True)
    return ModelSpec(
        **base, layer_kinds=("moe",) * n, intermediate_size=0,
        moe_intermediate_size=_cint(cfg, "intermediate_size"), shared_intermediate_size=0,
        attention=attn, rope=_rope(cfg, attn.head_dim), router=router,
        # Mixtral checkpoints name the MoE block block_sparse_moe and the expert projections
        # w1 (gate), w3 (up), w2 (down).
        renames=((r"\.block_sparse_moe\.", ".mlp."), (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
                 (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
                 (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj.")),
    )


def minimax_m2_spec(cfg: dict) -> ModelSpec:
    """MiniMax-M2: GQA with q and k RMS-normed across all their heads, partial rotary (rotary_dim)
    in halves; every layer MoE, sigmoid scores + e_score_correction_bias, the top-k renormalised,
    no shared expert; Mixtral's tensor names (block_sparse_moe, w1 / w3 / w2)."""
    base = _common(cfg, "minimax_m2")
    n = base["num_layers"]
    attn = _gqa(cfg, base, qk_norm=_bool(cfg, "use_qk_norm", True), qk_norm_per_head=False)
    rd = _cint(cfg, "rotary_dim", None)
    rope = _rope(cfg, rd if rd is not None else int(attn.head_dim * _partial_rotary(cfg)))
    router = RouterSpec(num_experts=_first_int(cfg, "num_local_experts", "n_routed_experts"),
                        top_k=_cint(cfg, "num_experts_per_tok"), scoring="sigmoid", norm_topk_prob=True,
                        correction_bias=True)
    return ModelSpec(
        **base, layer_kinds=("moe",) * n, intermediate_size=0,
        moe_intermediate_size=_cint(cfg, "intermediate_size"), shared_intermediate_size=0,
        attention=attn, rope=rope, router=router,
        renames=((r"\.block_sparse_moe\.", ".mlp."), (r"\.mlp\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias"),
                 (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
                 (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
                 (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj.")),
    )


def _layer_types(types, n: int, known: dict) -> tuple:
    """config.json's layer_types (one per layer) mapped through `known`; a length or a type moet
    does not build is one line naming it."""
    if not isinstance(types, list) or len(types) != n:
        raise _bad("layer_types", types, f"must be a list of {n} layer types")
    unknown = sorted({str(t) for t in types} - set(known))
    if unknown:
        raise CheckpointError(f"config.json: layer type {unknown[0]!r} is not supported "
                              f"(supported: {', '.join(known)})")
    return tuple(known[t] for t in types)


_QWEN35_LAYER_TYPES = {"linear_attention": "linear", "full_attention": "full"}


def qwen3_5_moe_spec(cfg: dict) -> ModelSpec:
    """Qwen3.5-MoE's text model: gated DeltaNet layers (linear_attention) between gated GQA ones
    (full_attention: q_proj gives each head a sigmoid output gate; q / k RMS-normed per head,
    partial rotary); every layer MoE (softmax top-k, renormalised) with a shared expert behind its
    own sigmoid gate; RMSNorm weights stored as offsets from 1. A multimodal checkpoint's text
    model is read from text_config and model.language_model.*; its vision tower is not loaded."""
    text = _dict(cfg, "text_config")
    if text:
        cfg = {**text, "architectures": cfg.get("architectures"), **{k: cfg[k] for k in ("tie_word_embeddings",)
                                                                    if k in cfg and k not in text}}
    base = _common(cfg, "qwen3_5_moe")
    n = base["num_layers"]
    types = _layer_types(cfg.get("layer_types"), n, _QWEN35_LAYER_TYPES)
    attn = _gqa(cfg, base, qkv_bias=_bool(cfg, "attention_bias", False), o_bias=_bool(cfg, "attention_bias", False),
                qk_norm=True, output_gate=True)
    linear = LinearAttentionSpec(
        layer_types=types, key_heads=_cint(cfg, "linear_num_key_heads"),
        value_heads=_cint(cfg, "linear_num_value_heads"), key_head_dim=_cint(cfg, "linear_key_head_dim"),
        value_head_dim=_cint(cfg, "linear_value_head_dim"), conv_kernel=_cint(cfg, "linear_conv_kernel_dim", 4))
    if linear.value_heads % linear.key_heads:
        raise CheckpointError(f"config.json: linear_num_value_heads={linear.value_heads} is not a multiple of "
                              f"linear_num_key_heads={linear.key_heads}")
    router = RouterSpec(num_experts=_first_int(cfg, "num_experts", "num_local_experts"),
                        top_k=_cint(cfg, "num_experts_per_tok"), scoring="softmax", norm_topk_prob=True)
    return ModelSpec(
        **base, layer_kinds=("moe",) * n, intermediate_size=0,
        moe_intermediate_size=_cint(cfg, "moe_intermediate_size"),
        shared_intermediate_size=_cint(cfg, "shared_expert_intermediate_size", 0, lo=0),
        attention=attn, rope=_rope(cfg, int(attn.head_dim * _partial_rotary(cfg))), router=router,
        linear_attention=linear, norm_offset=1.0, shared_expert_gate=True,
        renames=((r"^model\.language_model\.", "model."), (r"\.linear_attn\.", ".self_attn."),
                 (r"\.mlp\.shared_expert\.", ".mlp.shared_experts.")),
        # the vision tower and the MTP block (not built) are left on disk
        ignored=(r"^model\.visual\.", r"^mtp\."),
    )


_GPT_OSS_LAYER_TYPES = {"sliding_attention": True, "full_attention": False}


def gpt_oss_spec(cfg: dict) -> ModelSpec:
    """gpt-oss: GQA with q / k / v / o biases and a learned sink per head, sliding (window 128) and
    full layers alternating (layer_types), YaRN rope in halves; every layer MoE: a router Linear
    with a bias, softmax over the top-k logits, experts with biases and the clamped
    gate * sigmoid(alpha gate) * (up + 1) activation; fused expert tensors (gpt_oss layout),
    MXFP4 as published. config.json's hidden_act names SiLU and is not what the experts run."""
    base = _common(cfg, "gpt_oss")
    base["hidden_act"] = "silu"
    n = base["num_layers"]
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    bias = _bool(cfg, "attention_bias", True)
    attn = _gqa(cfg, base, qkv_bias=bias, o_bias=bias, sliding_window=_cint(cfg, "sliding_window", 128),
                sliding_layers=_layer_types(types, n, _GPT_OSS_LAYER_TYPES), sinks=True)
    router = RouterSpec(num_experts=_first_int(cfg, "num_local_experts", "num_experts"),
                        top_k=_cint(cfg, "num_experts_per_tok"), scoring="softmax", norm_topk_prob=True,
                        logit_bias=True)
    return ModelSpec(
        **{**base, "rms_norm_eps": _float(cfg, "rms_norm_eps", 1e-5, positive=True),
           "swiglu_limit": _float(cfg, "swiglu_limit", 7.0, positive=True)},
        layer_kinds=("moe",) * n, intermediate_size=0,
        moe_intermediate_size=_cint(cfg, "intermediate_size"), shared_intermediate_size=0,
        attention=attn, rope=_rope(cfg, attn.head_dim), router=router,
        swiglu_alpha=_float(cfg, "swiglu_alpha", 1.702, positive=True), expert_bias=True,
        fused_expert_layout="gpt_oss",
        renames=((r"\.mlp\.router\.", ".mlp.gate."),
                 (r"\.mlp\.experts\.(gate_up|down)_proj_bias$", r".mlp.\1_bias")),
    )


# DeepSeek-V4 checkpoints name tensors as DeepSeek's reference code does (transformers writes them so
# too, under "model."): moet's modules keep those names inside a layer, with moet's conventions for
# the layer / MoE / norm parts (experts per expert as gate / up / down, the router under mlp.gate)
_V4_RENAMES = (
    (r"^(?:model\.)?embed(?:_tokens)?\.weight$", "model.embed_tokens.weight"),
    (r"^(?:model\.)?head\.weight$", "lm_head.weight"),
    (r"^(?:model\.)?norm\.weight$", "model.norm.weight"),
    (r"^(?:model\.)?hc_head[._](?:hc_)?(fn|base|scale)$", r"model.hc_head.\1"),
    (r"^(?:model\.)?layers\.(\d+)\.", r"model.layers.\1."),
    (r"\.ffn\.experts\.(\d+)\.w1\.", r".mlp.experts.\1.gate_proj."),
    (r"\.ffn\.experts\.(\d+)\.w3\.", r".mlp.experts.\1.up_proj."),
    (r"\.ffn\.experts\.(\d+)\.w2\.", r".mlp.experts.\1.down_proj."),
    (r"\.ffn\.shared_experts\.w1\.", ".mlp.shared_experts.gate_proj."),
    (r"\.ffn\.shared_experts\.w3\.", ".mlp.shared_experts.up_proj."),
    (r"\.ffn\.shared_experts\.w2\.", ".mlp.shared_experts.down_proj."),
    (r"\.ffn\.gate\.bias$", ".mlp.gate.e_score_correction_bias"),
    (r"\.ffn\.gate\.", ".mlp.gate."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
)
_V4_LAYER_TYPES = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
                   "heavily_compressed_attention": "hca"}


def deepseek_v4_spec(cfg: dict) -> ModelSpec:
    """DeepSeek-V4 (transformers' deepseek_v4 config; legacy `compress_ratios` / `num_hash_layers`
    / `qk_rope_head_dim` / `rope_scaling` keys as the released config.json has them)."""
    base = _common(cfg, "deepseek_v4")
    n = base["num_layers"]
    heads, head_dim = _cint(cfg, "num_attention_heads"), _cint(cfg, "head_dim", 512)
    rd = _cint(cfg, "qk_rope_head_dim", None)
    if rd is None:
        rd = int(head_dim * _float(cfg, "partial_rotary_factor", 64 / 512, positive=True))
    rates = _dict(cfg, "compress_rates")
    csa = _cint(rates, "compressed_sparse_attention", None) or _cint(cfg, "compress_rate_csa", 4)
    hca = _cint(rates, "heavily_compressed_attention", None) or _cint(cfg, "compress_rate_hca", 128)
    if cfg.get("layer_types") is not None:
        raw = cfg["layer_types"]
        if not isinstance(raw, list) or len(raw) < n or any(t not in _V4_LAYER_TYPES for t in raw[:n]):
            raise _bad("layer_types", raw, f"a list of {n} of {', '.join(_V4_LAYER_TYPES)}")
        types = tuple(_V4_LAYER_TYPES[t] for t in raw[:n])
    elif cfg.get("compress_ratios") is not None:
        raw = cfg["compress_ratios"]
        by_ratio = {0: "sliding", 4: "csa", 128: "hca"}
        if not isinstance(raw, list) or len(raw) < n or any(r not in by_ratio for r in raw[:n]):
            raise _bad("compress_ratios", raw, f"a list of at least {n} of 0, 4, 128")
        types = tuple(by_ratio[r] for r in raw[:n])
    else:                                   # transformers' default schedule
        types = ("hca", "hca")[:n] + tuple("csa" if i % 2 else "hca" for i in range(max(0, n - 2)))
    if cfg.get("mlp_layer_types") is not None:
        raw = cfg["mlp_layer_types"]
        if not isinstance(raw, list) or len(raw) < n or any(t not in ("hash_moe", "moe") for t in raw[:n]):
            raise _bad("mlp_layer_types", raw, f"a list of {n} of hash_moe, moe")
        hashed = tuple(i for i in range(n) if raw[i] == "hash_moe")
    else:
        hashed = tuple(range(min(n, _cint(cfg, "num_hash_layers", 3, lo=0))))
    rope_cfg = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling")}
    params = _dict(cfg, "rope_parameters")
    nested = "main" in params or "compress" in params
    main = _rope({**rope_cfg, "rope_parameters": params.get("main", {}) if nested else {}}, rd, interleave=True)
    scaling = params.get("compress", {}) if nested else {**_dict(cfg, "rope_scaling"), **params}
    scaling = {**scaling, "rope_theta": scaling.get("rope_theta") or _float(cfg, "compress_rope_theta", 160000.0)}
    scaling.setdefault("attention_factor", 1.0)         # V4 keeps cos / sin unscaled under YaRN
    compress = _rope({**rope_cfg, "rope_parameters": scaling}, rd, interleave=True)
    window = _cint(cfg, "sliding_window", 128, lo=2)
    attn = AttentionSpec(kind="v4", num_heads=heads, num_kv_heads=1, head_dim=head_dim, v_head_dim=head_dim,
                         sliding_window=window, scale=head_dim ** -0.5, q_lora_rank=_cint(cfg, "q_lora_rank", 1024),
                         qk_rope_head_dim=rd)
    comp = CompressedAttentionSpec(
        layer_types=types, window=window, csa_rate=csa, hca_rate=hca, index_heads=_cint(cfg, "index_n_heads", 64),
        index_head_dim=_cint(cfg, "index_head_dim", 128), index_top_k=_cint(cfg, "index_topk", 512),
        o_groups=_cint(cfg, "o_groups", 8), o_lora_rank=_cint(cfg, "o_lora_rank", 1024), compress_rope=compress,
        hash_layers=hashed)
    if heads % comp.o_groups:
        raise _bad("o_groups", comp.o_groups, f"must divide num_attention_heads={heads}")
    if comp.index_head_dim < rd:
        raise _bad("index_head_dim", comp.index_head_dim, f"must be at least the rope dim {rd}")
    experts = _first_int(cfg, "n_routed_experts", "num_local_experts")
    inter = _first_int(cfg, "moe_intermediate_size", "intermediate_size")
    router = RouterSpec(num_experts=experts, top_k=_cint(cfg, "num_experts_per_tok", 6), scoring="sqrtsoftplus",
                        norm_topk_prob=True, routed_scaling_factor=_float(cfg, "routed_scaling_factor", 1.5,
                                                                          positive=True),
                        correction_bias=True, fp32_weight=True)
    hc = HyperConnectionSpec(streams=_cint(cfg, "hc_mult", 4), sinkhorn_iters=_cint(cfg, "hc_sinkhorn_iters", 20),
                             eps=_float(cfg, "hc_eps", 1e-6, positive=True))
    return ModelSpec(**{**base, "swiglu_limit": _float(cfg, "swiglu_limit", 10.0, positive=True)},
                     layer_kinds=("moe",) * n, intermediate_size=0, moe_intermediate_size=inter,
                     shared_intermediate_size=inter, attention=attn, rope=main, router=router,
                     # the checkpoint's MTP layers: counted so the loader skips their tensors
                     # (DeepseekV4LM builds none yet)
                     num_mtp_layers=_cint(cfg, "num_nextn_predict_layers", 0, lo=0),
                     compressed_attention=comp, hyper_connections=hc, renames=_V4_RENAMES)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    import math
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


# architectures[0] -> builder. Kimi-K2 ships DeepseekV3ForCausalLM with model_type "kimi_k2".
FAMILIES = {
    "DeepseekV3ForCausalLM": deepseek_v3_spec,
    "Glm4MoeForCausalLM": glm4_moe_spec,
    "Qwen3MoeForCausalLM": qwen3_moe_spec,
    "MixtralForCausalLM": mixtral_spec,
    "GlmMoeDsaForCausalLM": glm_moe_dsa_spec,
    "DeepseekV32ForCausalLM": deepseek_v32_spec,
    "DeepseekV4ForCausalLM": deepseek_v4_spec,
    "MiniMaxM2ForCausalLM": minimax_m2_spec,
    "GptOssForCausalLM": gpt_oss_spec,
    "Qwen3_5MoeForCausalLM": qwen3_5_moe_spec,
    "Qwen3_5MoeForConditionalGeneration": qwen3_5_moe_spec,
}


# model_type -> architecture, for configs without an `architectures` field
MODEL_TYPES = {"deepseek_v3": "DeepseekV3ForCausalLM", "kimi_k2": "DeepseekV3ForCausalLM",
               "glm4_moe": "Glm4MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
               "glm_moe_dsa": "GlmMoeDsaForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM",
               "deepseek_v4": "DeepseekV4ForCausalLM", "minimax_m2": "MiniMaxM2ForCausalLM",
               "gpt_oss": "GptOssForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
               "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}


def spec_from_config(cfg: dict, where: str = "config.json") -> ModelSpec:
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{where}: not a JSON object")
    archs = cfg.get("architectures") or []
    if not archs and cfg.get("model_type") in MODEL_TYPES:
        cfg = {**cfg, "architectures": [MODEL_TYPES[cfg["model_type"]]]}
        archs = cfg["architectures"]
    if not archs:
        raise CheckpointError(f"{where}: no 'architectures' field; supported: {', '.join(FAMILIES)}")
    if not isinstance(archs, list) or not isinstance(archs[0], str):
        raise CheckpointError(f"{where}: architectures={archs!r} must be a list of class names")
    arch = archs[0]
    if arch not in FAMILIES:
        raise CheckpointError(f"{where}: architecture {arch} is not supported; supported: {', '.join(FAMILIES)}")
    try:
        spec = FAMILIES[arch](cfg)
        _validate(spec)
        return spec
    except KeyError as exc:
        raise CheckpointError(f"{where}: required field {exc.args[0]!r} for {arch} is missing") from None
    except CheckpointError as exc:
        raise CheckpointError(str(exc).replace("config.json", where, 1)) from None
    except (TypeError, ValueError, ZeroDivisionError, OverflowError) as exc:
        # a value of a shape no check above anticipated: still one line, with the file
        raise CheckpointError(f"{where}: a value does not fit {arch} ({type(exc).__name__}: {exc})") from None


def resolve_max_model_len(spec: ModelSpec, requested: int | None, allow_long: bool,
                          where: str = "config.json") -> int:
    """max_model_len for an engine: `requested`, else the trained context
    (max_position_embeddings). Beyond the trained context only with allow_long (vLLM's rule:
    positions past it are extrapolated and outputs may be wrong)."""
    trained = spec.max_position_embeddings
    if requested is None:
        return trained
    if requested > trained and not allow_long:
        raise ConfigError(f"max_model_len={requested} exceeds the trained context of the model "
                          f"(max_position_embeddings={trained} in {where}); lower --max-model-len to at most "
                          f"{trained}, or pass --allow-long-max-model-len to accept outputs past it that may "
                          "be wrong")
    return requested


def _validate(s: ModelSpec) -> None:
    """Config values the model code relies on; each failure names the config field."""
    def bad(msg: str) -> CheckpointError:
        return CheckpointError(f"config.json: {msg}")

    r, a = s.router, s.attention
    if s.hidden_act != "silu":
        raise bad(f"hidden_act {s.hidden_act!r} is not supported (only silu / SwiGLU)")
    if not 0 < r.top_k <= r.num_experts:
        raise bad(f"num_experts_per_tok={r.top_k} must be in 1..{r.num_experts} (the number of experts)")
    if r.num_experts % r.n_group or not 0 < r.topk_group <= r.n_group:
        raise bad(f"n_group={r.n_group} / topk_group={r.topk_group} do not divide {r.num_experts} experts")
    if r.n_group > 1 and r.top_k > r.topk_group * (r.num_experts // r.n_group):
        raise bad(f"num_experts_per_tok={r.top_k} exceeds the experts of topk_group={r.topk_group} groups")
    if a.num_kv_heads > a.num_heads or a.num_heads % a.num_kv_heads:
        raise bad(f"num_attention_heads={a.num_heads} is not a multiple of num_key_value_heads={a.num_kv_heads}")
    if s.rope.dim < 2 or s.rope.dim % 2 or s.rope.dim > a.head_dim:
        src = (f"qk_rope_head_dim={s.rope.dim}" if a.kind == "mla" else
               f"head_dim={a.head_dim} (hidden_size={s.hidden_size} / num_attention_heads={a.num_heads} unless "
               "head_dim is given) x partial_rotary_factor")
        raise bad(f"rotary dimension {s.rope.dim} from {src} must be even, at least 2 and at most head_dim")
    if a.kind == "mla" and a.q_lora_rank is not None and a.q_lora_rank < 1:
        raise bad(f"q_lora_rank={a.q_lora_rank} must be at least 1 (or null)")
    if len(s.layer_kinds) != s.num_layers:
        raise bad(f"{len(s.layer_kinds)} layer kinds for num_hidden_layers={s.num_layers}")
    if "dense" in s.layer_kinds and s.intermediate_size < 1:
        raise bad(f"intermediate_size={s.intermediate_size} must be at least 1 (layers "
                  f"{[i for i, k in enumerate(s.layer_kinds) if k == 'dense'][:4]} are dense MLPs)")
    if s.rope.original_max_position_embeddings is not None and s.rope.original_max_position_embeddings < 1:
        raise bad("original_max_position_embeddings must be at least 1")


_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def check_against_weights(s: ModelSpec, tensors: dict, where: str = "config.json") -> None:
    """The config's dimensions against a few tensors' headers (embedding, LM head, the first dense
    MLP and the first router), before anything is allocated from them: a config that disagrees
    with the weights (e.g. a vocab_size or intermediate_size too large) would otherwise first show
    as an allocation failure of the model. `tensors`: {on-disk name: TensorInfo}. Quantized
    tensors (other shapes on disk) are left to the loader's checks."""
    by_canon = {s.canonical_name(n): info for n, info in tensors.items()}
    dense = next((i for i, k in enumerate(s.layer_kinds) if k == "dense"), None)
    moe = next((i for i, k in enumerate(s.layer_kinds) if k == "moe"), None)
    want = [("model.embed_tokens.weight", (s.vocab_size, s.hidden_size), "vocab_size / hidden_size"),
            ("lm_head.weight", (s.vocab_size, s.hidden_size), "vocab_size / hidden_size")]
    if dense is not None:
        want.append((f"model.layers.{dense}.mlp.down_proj.weight", (s.hidden_size, s.intermediate_size),
                     "hidden_size / intermediate_size"))
    if moe is not None:
        want.append((f"model.layers.{moe}.mlp.gate.weight", (s.router.num_experts, s.hidden_size),
                     "the expert count (n_routed_experts / num_experts / num_local_experts) / hidden_size"))
    for name, shape, fields in want:
        info = by_canon.get(name)
        if info is None or info.dtype not in _FLOAT_DTYPES or tuple(info.shape) == shape:
            continue
        raise CheckpointError(f"{where}: {fields} disagree with the weights: {info.file}: tensor {info.name} has "
                              f"shape {list(info.shape)}, config.json implies {list(shape)}")
