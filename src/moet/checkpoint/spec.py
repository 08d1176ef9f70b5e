"""ModelSpec: everything moet needs to know about one checkpoint's architecture, read from its
config.json as a plain dict (not through transformers' config classes: Kimi-K2 and other
remote-code checkpoints name their own model_type, and we must not execute their code).

One builder per family turns a config dict into a ModelSpec: dimensions, which layers are
dense or MoE, the attention kind, the rope, the routing rule and how tensors are named on disk.
The model (moet.model) is built from the spec alone.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from moet.errors import CheckpointError


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
    sliding_window: int | None = None
    scale: float = 1.0                # softmax scale (MLA + YaRN: includes mscale**2)
    # MLA only
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0


@dataclass(frozen=True)
class RouterSpec:
    num_experts: int
    top_k: int
    scoring: str                      # "softmax" (Mixtral, Qwen3-MoE) | "sigmoid" (DeepSeek-V3, GLM)
    norm_topk_prob: bool
    routed_scaling_factor: float = 1.0
    n_group: int = 1                  # group-limited top-k (DeepSeek-V3): keep topk_group groups
    topk_group: int = 1
    correction_bias: bool = False     # e_score_correction_bias: added for choice, not for weights
    fp32_weight: bool = False         # router matmul in fp32 (DeepSeek/GLM keep gate.weight in fp32)


@dataclass(frozen=True)
class ModelSpec:
    family: str                       # "deepseek_v3" | "glm4_moe" | "qwen3_moe" | "mixtral"
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
    hidden_act: str = "silu"
    swiglu_limit: float | None = None  # clamp gate (max) and up (+-) in fp32 before SiLU-mul
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # on-disk name -> moet name rewrites, applied in order (re.sub); see canonical_name
    renames: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    # ---------------------------------------------------------------- counts

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

def _get(cfg: dict, key: str, default=None, *, required: bool = False):
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if required:
        raise CheckpointError(f"config.json: required field {key!r} is missing")
    return default


def _first(cfg: dict, *keys: str):
    """The first of several aliases present (transformers renames some fields on save)."""
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    raise CheckpointError(f"config.json: required field {keys[0]!r} is missing")


def _rope(cfg: dict, dim: int, *, interleave: bool = False) -> RopeSpec:
    """Rope parameters from either the transformers-5 `rope_parameters` dict or the older
    top-level `rope_theta` + `rope_scaling` fields (what most released checkpoints have)."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    for k, v in scaling.items():
        params.setdefault(k, v)
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "linear", "yarn"):
        raise CheckpointError(f"config.json: rope type {rope_type!r} is not supported (supported: default, linear, yarn)")
    return RopeSpec(
        dim=dim, theta=float(theta), rope_type=rope_type, factor=float(params.get("factor", 1.0) or 1.0),
        original_max_position_embeddings=params.get("original_max_position_embeddings",
                                                    cfg.get("max_position_embeddings")),
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)),
        interleave=interleave,
    )


def _partial_rotary(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)


def _eos(cfg: dict) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _dtype(cfg: dict) -> str:
    return str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16").replace("torch.", "")


def _first_k_dense_kinds(cfg: dict, n: int) -> tuple[str, ...]:
    kinds = cfg.get("mlp_layer_types")
    if kinds:
        if len(kinds) < n:
            raise CheckpointError(f"config.json: mlp_layer_types has {len(kinds)} entries for {n} layers")
        return tuple("moe" if k in ("sparse", "moe") else "dense" for k in kinds[:n])
    k = int(_get(cfg, "first_k_dense_replace", 0))
    freq = int(_get(cfg, "moe_layer_freq", 1))
    return tuple("moe" if i >= k and i % freq == 0 else "dense" for i in range(n))


def _common(cfg: dict, family: str) -> dict:
    return dict(
        family=family,
        architecture=cfg["architectures"][0],
        vocab_size=int(_get(cfg, "vocab_size", required=True)),
        hidden_size=int(_get(cfg, "hidden_size", required=True)),
        num_layers=int(_get(cfg, "num_hidden_layers", required=True)),
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", False)),
        max_position_embeddings=int(_get(cfg, "max_position_embeddings", 4096)),
        hidden_act=str(_get(cfg, "hidden_act", "silu")),
        swiglu_limit=_get(cfg, "swiglu_limit"),
        torch_dtype=_dtype(cfg),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos(cfg),
    )


# ---------------------------------------------------------------------------- families

def deepseek_v3_spec(cfg: dict) -> ModelSpec:
    base = _common(cfg, "deepseek_v3")
    heads = int(_get(cfg, "num_attention_heads", required=True))
    nope, rope_d = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    rope = _rope(cfg, rope_d, interleave=bool(cfg.get("rope_interleave", True)))
    scale = (nope + rope_d) ** -0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = _yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * m * m
    attn = AttentionSpec(
        kind="mla", num_heads=heads, num_kv_heads=heads, head_dim=nope + rope_d,
        v_head_dim=int(cfg["v_head_dim"]), o_bias=bool(cfg.get("attention_bias", False)),
        qkv_bias=bool(cfg.get("attention_bias", False)), scale=scale,
        q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=nope, qk_rope_head_dim=rope_d,
    )
    return _sigmoid_routed_moe_spec(cfg, base, attn, rope)


def _sigmoid_routed_moe_spec(cfg: dict, base: dict, attn: "AttentionSpec", rope) -> ModelSpec:
    """The MoE half shared by DeepSeek-V3 and GLM-4.5: sigmoid scores + e_score_correction_bias,
    group-limited top-k, routed_scaling_factor, shared experts, first_k_dense_replace, MTP."""
    router = RouterSpec(
        num_experts=int(_first(cfg, "n_routed_experts", "num_local_experts")), top_k=int(cfg["num_experts_per_tok"]),
        scoring="sigmoid", norm_topk_prob=bool(_get(cfg, "norm_topk_prob", True)),
        routed_scaling_factor=float(_get(cfg, "routed_scaling_factor", 1.0)),
        n_group=int(_get(cfg, "n_group", 1)), topk_group=int(_get(cfg, "topk_group", 1)),
        correction_bias=True, fp32_weight=True,
    )
    moe_i = int(cfg["moe_intermediate_size"])
    return ModelSpec(
        **base, layer_kinds=_first_k_dense_kinds(cfg, base["num_layers"]), intermediate_size=int(cfg["intermediate_size"]),
        moe_intermediate_size=moe_i, shared_intermediate_size=moe_i * int(_get(cfg, "n_shared_experts", 0)),
        attention=attn, rope=rope, router=router,
        num_mtp_layers=int(_get(cfg, "num_nextn_predict_layers", _get(cfg, "num_mtp_layers", 0))),
    )


def glm4_moe_spec(cfg: dict) -> ModelSpec:
    base = _common(cfg, "glm4_moe")
    heads = int(_get(cfg, "num_attention_heads", required=True))
    head_dim = int(_get(cfg, "head_dim", base["hidden_size"] // heads))
    attn = AttentionSpec(
        kind="gqa", num_heads=heads, num_kv_heads=int(_get(cfg, "num_key_value_heads", heads)),
        head_dim=head_dim, v_head_dim=head_dim, qkv_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=bool(cfg.get("use_qk_norm", False)), scale=head_dim ** -0.5,
    )
    rope = _rope(cfg, int(head_dim * _partial_rotary({"partial_rotary_factor": 0.5, **cfg})))
    return _sigmoid_routed_moe_spec(cfg, base, attn, rope)


def qwen3_moe_spec(cfg: dict) -> ModelSpec:
    base = _common(cfg, "qwen3_moe")
    n = base["num_layers"]
    heads = int(_get(cfg, "num_attention_heads", required=True))
    head_dim = int(_get(cfg, "head_dim", base["hidden_size"] // heads))
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    attn = AttentionSpec(
        kind="gqa", num_heads=heads, num_kv_heads=int(_get(cfg, "num_key_value_heads", heads)),
        head_dim=head_dim, v_head_dim=head_dim, qkv_bias=bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)), qk_norm=True, sliding_window=window,
        scale=head_dim ** -0.5,
    )
    n_experts = int(_first(cfg, "num_experts", "num_local_experts"))
    only = set(cfg.get("mlp_only_layers") or [])
    step = int(_get(cfg, "decoder_sparse_step", 1))
    kinds = tuple("moe" if i not in only and n_experts > 0 and (i + 1) % step == 0 else "dense" for i in range(n))
    router = RouterSpec(num_experts=n_experts, top_k=int(cfg["num_experts_per_tok"]), scoring="softmax",
                        norm_topk_prob=bool(_get(cfg, "norm_topk_prob", False)))
    return ModelSpec(
        **base, layer_kinds=kinds, intermediate_size=int(_get(cfg, "intermediate_size", 0)),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]), shared_intermediate_size=0,
        attention=attn, rope=_rope(cfg, head_dim), router=router,
    )


def mixtral_spec(cfg: dict) -> ModelSpec:
    base = _common(cfg, "mixtral")
    n = base["num_layers"]
    heads = int(_get(cfg, "num_attention_heads", required=True))
    head_dim = int(_get(cfg, "head_dim", base["hidden_size"] // heads))
    attn = AttentionSpec(
        kind="gqa", num_heads=heads, num_kv_heads=int(_get(cfg, "num_key_value_heads", heads)),
        head_dim=head_dim, v_head_dim=head_dim, sliding_window=cfg.get("sliding_window"), scale=head_dim ** -0.5,
    )
    router = RouterSpec(num_experts=int(_get(cfg, "num_local_experts", required=True)),
                        top_k=int(cfg["num_experts_per_tok"]), scoring="softmax", norm_topk_prob=True)
    return ModelSpec(
        **base, layer_kinds=("moe",) * n, intermediate_size=0,
        moe_intermediate_size=int(cfg["intermediate_size"]), shared_intermediate_size=0,
        attention=attn, rope=_rope(cfg, head_dim), router=router,
        # Mixtral checkpoints name the MoE block block_sparse_moe and the expert projections
        # w1 (gate), w3 (up), w2 (down).
        renames=((r"\.block_sparse_moe\.", ".mlp."), (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
                 (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
                 (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj.")),
    )


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    import math
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


# architectures[0] -> builder. Kimi-K2 ships DeepseekV3ForCausalLM with model_type "kimi_k2".
FAMILIES = {
    "DeepseekV3ForCausalLM": deepseek_v3_spec,
    "Glm4MoeForCausalLM": glm4_moe_spec,
    "Qwen3MoeForCausalLM": qwen3_moe_spec,
    "MixtralForCausalLM": mixtral_spec,
}


# model_type -> architecture, for configs without an `architectures` field
MODEL_TYPES = {"deepseek_v3": "DeepseekV3ForCausalLM", "kimi_k2": "DeepseekV3ForCausalLM",
               "glm4_moe": "Glm4MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}


def spec_from_config(cfg: dict, where: str = "config.json") -> ModelSpec:
    archs = cfg.get("architectures") or []
    if not archs and cfg.get("model_type") in MODEL_TYPES:
        cfg = {**cfg, "architectures": [MODEL_TYPES[cfg["model_type"]]]}
        archs = cfg["architectures"]
    if not archs:
        raise CheckpointError(f"{where}: no 'architectures' field; supported: {', '.join(FAMILIES)}")
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
    if a.num_heads % a.num_kv_heads:
        raise bad(f"num_attention_heads={a.num_heads} is not a multiple of num_key_value_heads={a.num_kv_heads}")
    if s.rope.dim % 2 or s.rope.dim > a.head_dim:
        raise bad(f"rotary dimension {s.rope.dim} must be even and at most head_dim={a.head_dim}")
    if len(s.layer_kinds) != s.num_layers:
        raise bad(f"{len(s.layer_kinds)} layer kinds for num_hidden_layers={s.num_layers}")
