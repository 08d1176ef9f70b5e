"""The paged KV cache: layout as plain tensors, slot mapping, and the KV write (torch reference).

Pages ("blocks") of `block_size` tokens; a sequence owns a list of block ids (its row of the
block table) and token i of the sequence lives in block `table[i // block_size]` at offset
`i % block_size`. A write addresses tokens by slot, as vLLM does:
    slot = block_id * block_size + offset        (int64; -1 = skip this token, e.g. padding)

Per layer, by attention kind (byte layouts: docs/kv-cache.md):
    GQA  k [num_blocks, block_size, kv_heads, head_dim], v [..., kv_heads, v_head_dim]
    MLA  one row per token: latent (kv_lora_rank, after kv_a_layernorm) then the rotated key
         slice (rope_dim) -- the weight-absorbed decode reads nothing else.
Formats (`KVFormat.name`):
    "auto"      the model dtype (bf16 when serving; fp32 in exactness tests), as vLLM's "auto"
    "fp8_e4m3"  e4m3fn data + fp32 scales, scale="tensor" (one static scale per layer and K/V,
                default 1.0, a calibrated checkpoint k_scale/v_scale can be loaded into it) or
                scale="block" (one dynamic scale per token per `group` elements: amax / 448).
                MLA with block scales is DeepSeek's fp8_ds_mla row, 656 B/token at R=512, P=64.
    "nvfp4"     e2m1 codes, two per byte (even element in the low nibble, as formats/nvfp4),
                one e4m3 scale per token per 16 consecutive elements (NVFP4's block), and one
                static fp32 scale_2 per layer and part (GQA: K, V; MLA: latent, rope), default
                1.0, outside the pages. GQA: K and V per head; MLA: the latent in nvfp4 and the
                rope part in e4m3 (scale_2[1]), a 352 B row at R=512, P=64 (SPEC 3). Callers
                only ever hand the layer object to write_*/paged_* and never touch its fields.
Why block scales are per token, not per page: a page fills one token at a time; a page scale
would have to grow (re-quantizing the page) whenever a later token's amax exceeds it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moet.errors import ConfigError
from moet.formats import nvfp4 as _nvfp4
from moet.formats.fp8 import E4M3_MAX, to_e4m3

KV_FORMATS = ("auto", "fp8_e4m3", "nvfp4")
SCALE_KINDS = ("tensor", "block")
NVFP4_BLOCK = _nvfp4.BLOCK                 # elements per e4m3 scale (NVFP4's block of 16)
# the --kv-cache-dtype names (config/cache.py's KV_CACHE_DTYPES) that kv_format_for maps to formats
KV_CACHE_DTYPE_NAMES = ("auto", "bf16", "fp8", "nvfp4")


@dataclass(frozen=True)
class KVFormat:
    name: str = "auto"
    scale: str = "tensor"                  # fp8 only: "tensor" | "block"
    group: int = 128                       # fp8 "block": elements per scale (clipped to head_dim)
    dtype: torch.dtype = torch.bfloat16    # "auto" data; MLA fp8-block rope; the dequantized dtype

    def __post_init__(self):
        if self.name not in KV_FORMATS:
            raise ConfigError(f"kv cache format {self.name!r} is not supported (choose from {KV_FORMATS})")
        if self.name == "fp8_e4m3" and self.scale not in SCALE_KINDS:
            raise ConfigError(f"fp8 kv cache scale {self.scale!r}: choose from {SCALE_KINDS}")
        if self.group <= 0:
            raise ConfigError(f"fp8 kv cache scale group must be positive, got {self.group}")

    @property
    def is_fp8(self) -> bool:
        return self.name == "fp8_e4m3"

    @property
    def block_scaled(self) -> bool:
        return self.is_fp8 and self.scale == "block"

    @property
    def is_nvfp4(self) -> bool:
        return self.name == "nvfp4"


def _groups(dim: int, fmt: KVFormat) -> int:
    if fmt.is_nvfp4:
        if dim % NVFP4_BLOCK:
            raise ConfigError(f"nvfp4 kv cache: dim {dim} is not a multiple of the block size {NVFP4_BLOCK}")
        return dim // NVFP4_BLOCK
    g = min(fmt.group, dim)
    if dim % g:
        raise ConfigError(f"fp8 kv cache: dim {dim} is not a multiple of the scale group {g}")
    return dim // g


@dataclass(slots=True)
class GQALayerKV:
    fmt: KVFormat
    k: torch.Tensor                  # [NB, BS, Hkv, D]   fmt.dtype or float8_e4m3fn; nvfp4: uint8 [.., D/2]
    v: torch.Tensor                  # [NB, BS, Hkv, Dv]
    k_scale: torch.Tensor | None     # fp8: fp32 [1] (tensor) or [NB, BS, Hkv, D/group] (block);
    v_scale: torch.Tensor | None     # nvfp4: float8_e4m3fn [NB, BS, Hkv, D/16]
    scale_2: torch.Tensor | None = None  # nvfp4: fp32 [2], the per-layer scale of K's and V's block scales

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]

    @property
    def head_dim(self) -> int:
        return self.k.shape[-1] * (2 if self.fmt.is_nvfp4 else 1)

    @property
    def v_head_dim(self) -> int:
        return self.v.shape[-1] * (2 if self.fmt.is_nvfp4 else 1)


@dataclass(slots=True)
class MLALayerKV:
    """`buffer` owns the bytes; latent/rope/latent_scale are views into it, so a token's whole
    row is contiguous (fp8 block: the fp8_ds_mla row, latent | fp32 scales | rope; nvfp4: codes |
    e4m3 block scales | e4m3 rope)."""
    fmt: KVFormat
    buffer: torch.Tensor             # [NB, BS, row] (auto: fmt.dtype; fp8 tensor: e4m3; fp8 block, nvfp4: uint8)
    latent: torch.Tensor             # [NB, BS, R] (nvfp4: uint8 codes [NB, BS, R/2])
    rope: torch.Tensor               # [NB, BS, P]
    latent_scale: torch.Tensor | None  # fp8 tensor: fp32 [1] (latent and rope); block: [NB, BS, R/group];
                                       # nvfp4: e4m3 [NB, BS, R/16]
    scale_2: torch.Tensor | None = None  # nvfp4: fp32 [2], the latent's per-layer scale_2 and the rope's scale
    # DeepSeek Sparse Attention's index keys of a layer that runs an indexer, addressed by slot
    # (kernels/sparse_attention.IndexKeys); None: no indexer
    index_keys: object | None = None

    @property
    def block_size(self) -> int:
        return self.buffer.shape[1]

    @property
    def num_blocks(self) -> int:
        return self.buffer.shape[0]

    @property
    def kv_lora_rank(self) -> int:
        return self.latent.shape[-1] * (2 if self.fmt.is_nvfp4 else 1)


def _nvfp4_bytes(dim: int, fmt: KVFormat) -> int:
    """One nvfp4 vector of `dim` elements: dim / 2 code bytes + dim / 16 e4m3 scales."""
    return dim // 2 + _groups(dim, fmt)


def gqa_bytes_per_token(kv_heads: int, head_dim: int, v_head_dim: int, fmt: KVFormat) -> int:
    """Per layer. Used for capacity planning (blocks that fit in free memory)."""
    if fmt.is_nvfp4:
        return kv_heads * (_nvfp4_bytes(head_dim, fmt) + _nvfp4_bytes(v_head_dim, fmt))
    if not fmt.is_fp8:
        return kv_heads * (head_dim + v_head_dim) * fmt.dtype.itemsize
    scales = 4 * kv_heads * (_groups(head_dim, fmt) + _groups(v_head_dim, fmt)) if fmt.block_scaled else 0
    return kv_heads * (head_dim + v_head_dim) + scales


def mla_bytes_per_token(kv_lora_rank: int, rope_dim: int, fmt: KVFormat) -> int:
    if fmt.is_nvfp4:                     # codes | e4m3 block scales | e4m3 rope
        return _nvfp4_bytes(kv_lora_rank, fmt) + rope_dim
    if not fmt.is_fp8:
        return (kv_lora_rank + rope_dim) * fmt.dtype.itemsize
    if fmt.block_scaled:
        return kv_lora_rank + 4 * _groups(kv_lora_rank, fmt) + rope_dim * fmt.dtype.itemsize
    return kv_lora_rank + rope_dim


def _attention_dims(attention) -> tuple[int, ...]:
    """The dims a KV format quantizes along, for an AttentionSpec: MLA's latent, GQA's K and V."""
    if attention.kind == "mla":
        return (attention.kv_lora_rank,)
    return (attention.head_dim, attention.v_head_dim)


def _fits(attention, fmt: KVFormat) -> bool:
    """Whether this AttentionSpec's dims can hold `fmt` (the rules new_*_layer enforce)."""
    if attention.kind == "v4":                  # DeepSeek-V4's cache keeps the model dtype for now
        return not (fmt.is_fp8 or fmt.is_nvfp4)
    dims = _attention_dims(attention)
    if fmt.is_nvfp4:
        return all(d % NVFP4_BLOCK == 0 for d in dims)
    if fmt.block_scaled:
        if any(d % min(fmt.group, d) for d in dims):
            return False
        if attention.kind == "mla":             # the fp8_ds_mla row's typed views
            return dims[0] % 4 == 0 and mla_bytes_per_token(dims[0], attention.qk_rope_head_dim, fmt) % 4 == 0
    return True


def kv_cache_dtypes_for(attention) -> tuple[str, ...]:
    """The --kv-cache-dtype names this AttentionSpec can use: auto and bf16 always; fp8 where each
    quantized dim is a multiple of its scale group (128, or the whole dim when shorter; MLA's
    fp8_ds_mla row also needs 4-byte-aligned parts); nvfp4 where each is a multiple of 16."""
    return tuple(n for n in KV_CACHE_DTYPE_NAMES if _fits(attention, kv_format_for(n, torch.bfloat16)))


def _dtype_name(fmt: KVFormat) -> str:
    return {"fp8_e4m3": "fp8", "nvfp4": "nvfp4"}.get(fmt.name, "auto")


def check_kv_format(attention, fmt: KVFormat) -> None:
    """One-line ConfigError when this attention cannot hold `fmt` (a dim the format's scale
    blocks do not divide), naming the dtypes it can use."""
    if _fits(attention, fmt):
        return
    what = (f"kv_lora_rank {attention.kv_lora_rank}" if attention.kind == "mla" else
            f"head_dim {attention.head_dim} / v_head_dim {attention.v_head_dim}")
    raise ConfigError(f"--kv-cache-dtype {_dtype_name(fmt)} does not fit this model's {attention.kind.upper()} "
                      f"attention ({what}); it can use {', '.join(kv_cache_dtypes_for(attention))}")


def kv_format_for(kv_cache_dtype: str, model_dtype: torch.dtype, attention=None) -> KVFormat:
    """--kv-cache-dtype -> the cache's KVFormat (model_dtype: the "auto" dtype, and the dtype
    quantized caches dequantize to); with an AttentionSpec, checked against it (check_kv_format)."""
    if kv_cache_dtype == "auto":
        fmt = KVFormat("auto", dtype=model_dtype)
    elif kv_cache_dtype == "bf16":
        fmt = KVFormat("auto", dtype=torch.bfloat16)
    elif kv_cache_dtype == "fp8":
        # dynamic per-token-group scales: correct without calibrated k/v scales
        fmt = KVFormat("fp8_e4m3", scale="block", dtype=model_dtype)
    elif kv_cache_dtype == "nvfp4":
        fmt = KVFormat("nvfp4", dtype=model_dtype)
    else:
        raise ConfigError(f"kv_cache_dtype={kv_cache_dtype!r}: choose {', '.join(KV_CACHE_DTYPE_NAMES)}")
    if attention is not None:
        check_kv_format(attention, fmt)
    return fmt


def kv_layer_bytes_per_token(attention, fmt: KVFormat) -> int:
    """Per attention layer for an AttentionSpec (checkpoint/spec.py): the sizing that runs before
    a model exists (CausalLM.kv_bytes_per_token is this times its attention layers). A format
    the attention cannot hold is a ConfigError naming the dtypes it can (check_kv_format)."""
    check_kv_format(attention, fmt)
    if attention.kind == "v4":
        raise ValueError("DeepSeek-V4's cache differs per layer: CompressedAttentionSpec.cache_widths")
    if attention.kind == "mla":
        return mla_bytes_per_token(attention.kv_lora_rank, attention.qk_rope_head_dim, fmt)
    return gqa_bytes_per_token(attention.num_kv_heads, attention.head_dim, attention.v_head_dim, fmt)


def new_gqa_layer(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, v_head_dim: int,
                  fmt: KVFormat, device: torch.device | str = "cpu") -> GQALayerKV:
    if fmt.is_nvfp4:
        shape = (num_blocks, block_size, kv_heads)
        k = torch.zeros(*shape, head_dim // 2, dtype=torch.uint8, device=device)
        v = torch.zeros(*shape, v_head_dim // 2, dtype=torch.uint8, device=device)
        ks = torch.zeros(*shape, _groups(head_dim, fmt), dtype=torch.float8_e4m3fn, device=device)
        vs = torch.zeros(*shape, _groups(v_head_dim, fmt), dtype=torch.float8_e4m3fn, device=device)
        return GQALayerKV(fmt, k, v, ks, vs, torch.ones(2, dtype=torch.float32, device=device))
    data = torch.float8_e4m3fn if fmt.is_fp8 else fmt.dtype
    k = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=data, device=device)
    v = torch.zeros(num_blocks, block_size, kv_heads, v_head_dim, dtype=data, device=device)
    ks = vs = None
    if fmt.block_scaled:
        ks = torch.ones(num_blocks, block_size, kv_heads, _groups(head_dim, fmt), dtype=torch.float32, device=device)
        vs = torch.ones(num_blocks, block_size, kv_heads, _groups(v_head_dim, fmt), dtype=torch.float32, device=device)
    elif fmt.is_fp8:
        ks = torch.ones(1, dtype=torch.float32, device=device)
        vs = torch.ones(1, dtype=torch.float32, device=device)
    return GQALayerKV(fmt, k, v, ks, vs)


def new_mla_layer(num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int, fmt: KVFormat,
                  device: torch.device | str = "cpu") -> MLALayerKV:
    r, p = kv_lora_rank, rope_dim
    if fmt.is_nvfp4:
        # r/2 code bytes | r/16 e4m3 block scales | p e4m3 rope: all byte-sized, no alignment rule
        ng = _groups(r, fmt)
        buf = torch.zeros(num_blocks, block_size, mla_bytes_per_token(r, p, fmt), dtype=torch.uint8, device=device)
        latent = buf[..., :r // 2]
        scale = buf[..., r // 2:r // 2 + ng].view(torch.float8_e4m3fn)
        rope = buf[..., r // 2 + ng:].view(torch.float8_e4m3fn)
        return MLALayerKV(fmt, buf, latent, rope, scale, torch.ones(2, dtype=torch.float32, device=device))
    if not fmt.is_fp8 or not fmt.block_scaled:
        data = torch.float8_e4m3fn if fmt.is_fp8 else fmt.dtype
        buf = torch.zeros(num_blocks, block_size, r + p, dtype=data, device=device)
        scale = torch.ones(1, dtype=torch.float32, device=device) if fmt.is_fp8 else None
        return MLALayerKV(fmt, buf, buf[..., :r], buf[..., r:], scale)
    # fp8_ds_mla row: r e4m3 bytes | 4 * r/group fp32 scale bytes | p rope values in fmt.dtype.
    # Views need each part's byte offset and the row length to be multiples of its itemsize.
    ng = _groups(r, fmt)
    row = mla_bytes_per_token(r, p, fmt)
    if r % 4 or row % 4:
        raise ConfigError(f"fp8 block-scaled MLA cache needs kv_lora_rank and the row ({row} B) to be multiples of 4")
    buf = torch.zeros(num_blocks, block_size, row, dtype=torch.uint8, device=device)
    latent = buf[..., :r].view(torch.float8_e4m3fn)
    scale = buf[..., r:r + 4 * ng].view(torch.float32)
    rope = buf[..., r + 4 * ng:].view(fmt.dtype)
    scale.fill_(1.0)
    return MLALayerKV(fmt, buf, latent, rope, scale)


# ---------------------------------------------------------------------------- quantization

def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | None, group: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., D] -> (e4m3 [..., D], per-group fp32 scales [..., D/g]) when scale is None (block),
    else (e4m3 of x / scale, None) with the given per-tensor scale. Saturates at +-448."""
    xf = x.float()
    if scale is not None:
        return to_e4m3(xf / scale), None
    d = xf.shape[-1]
    g = min(group, d)
    xg = xf.unflatten(-1, (d // g, g))
    amax = xg.abs().amax(dim=-1)
    # an all-zero group keeps scale 1 (any scale encodes it exactly; avoids 0/0).
    # IEEE division by a tensor, never by the Python number: on CUDA, torch turns `t / 448.0`
    # (a CPU scalar divisor) into t * fl(1/448), one bit off amax / 448 for some amax, and the
    # Triton write (tl.math.div_rn) must reproduce these bytes on every device
    s = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    return to_e4m3(xg / s[..., None]).flatten(-2), s


def quantize_nvfp4(x: torch.Tensor, scale_2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes uint8 [..., D/2], e4m3 block scales [..., D/16]) with the layer's
    fp32 scale_2 (one element): formats.nvfp4's arithmetic (scale = e4m3(amax16 / (6 scale_2)),
    codes = e2m1(x / (scale scale_2)), both nearest even and saturating; a block whose scale
    is 0 stores signed zeros). float32; the Triton write reproduces these bytes."""
    return _nvfp4.quantize_blocks(x, scale_2)


def dequantize_nvfp4(codes: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """codes uint8 [..., D/2], e4m3 scales [..., D/16], scale_2 -> float32 [..., D]."""
    return _nvfp4.dequantize_blocks(codes, scale, scale_2)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 [..., D] and fp32 scale ([1] or [..., D/g]) -> float32 [..., D]."""
    qf = q.float()
    if scale.numel() == 1:
        return qf * scale.reshape(())
    d, ng = qf.shape[-1], scale.shape[-1]
    return (qf.unflatten(-1, (ng, d // ng)) * scale[..., None]).flatten(-2)


# ---------------------------------------------------------------------------- writes

def _valid(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    keep = slot_mapping >= 0
    return keep, slot_mapping[keep].long()


def _store(dst: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
    # dst [NB, BS, ...] viewed as [NB * BS, ...]; one index_put per tensor. Slots must be
    # distinct (the block manager's contract); duplicates would make the winner unspecified.
    dst.flatten(0, 1)[slots] = src.to(dst.dtype)


def write_gqa_kv(cache: GQALayerKV, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k [T, Hkv, D], v [T, Hkv, Dv] (rotated, normed: exactly what attention reads), slot_mapping
    int [T] -> stored in place; slot -1 is skipped."""
    keep, slots = _valid(slot_mapping)
    k, v = k[keep], v[keep]
    fmt = cache.fmt
    if fmt.is_nvfp4:
        for src, codes, scales, s2 in ((k, cache.k, cache.k_scale, cache.scale_2[0:1]),
                                       (v, cache.v, cache.v_scale, cache.scale_2[1:2])):
            q, s = quantize_nvfp4(src, s2)
            _store(codes, slots, q)
            _store(scales, slots, s)
        return
    if not fmt.is_fp8:
        _store(cache.k, slots, k)
        _store(cache.v, slots, v)
        return
    if fmt.block_scaled:
        qk, sk = quantize_fp8(k, None, fmt.group)
        qv, sv = quantize_fp8(v, None, fmt.group)
        _store(cache.k_scale, slots, sk)
        _store(cache.v_scale, slots, sv)
    else:
        qk, _ = quantize_fp8(k, cache.k_scale, fmt.group)
        qv, _ = quantize_fp8(v, cache.v_scale, fmt.group)
    _store(cache.k, slots, qk)
    _store(cache.v, slots, qv)


def write_mla_kv(cache: MLALayerKV, latent: torch.Tensor, k_rope: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """latent [T, R] (after kv_a_layernorm), k_rope [T, P] (rotated), slot_mapping int [T]."""
    keep, slots = _valid(slot_mapping)
    latent, k_rope = latent[keep], k_rope[keep]
    fmt = cache.fmt
    if fmt.is_nvfp4:
        q, s = quantize_nvfp4(latent, cache.scale_2[0:1])
        _store(cache.latent, slots, q)
        _store(cache.latent_scale, slots, s)
        _store(cache.rope, slots, quantize_fp8(k_rope, cache.scale_2[1:2], NVFP4_BLOCK)[0])
        return
    if not fmt.is_fp8:
        _store(cache.latent, slots, latent)
        _store(cache.rope, slots, k_rope)
    elif fmt.block_scaled:
        q, s = quantize_fp8(latent, None, fmt.group)
        _store(cache.latent, slots, q)
        _store(cache.latent_scale, slots, s)
        _store(cache.rope, slots, k_rope)          # rope stays in fmt.dtype (fp8_ds_mla)
    else:
        _store(cache.latent, slots, quantize_fp8(latent, cache.latent_scale, fmt.group)[0])
        _store(cache.rope, slots, quantize_fp8(k_rope, cache.latent_scale, fmt.group)[0])


def round_trip_gqa(k: torch.Tensor, v: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """k [T, Hkv, D], v [T, Hkv, Dv] -> what a paged cache of `fmt` gives back for them (float32):
    the write and the read above through a one-page layer, so a contiguous reference can hold
    exactly the values the engine's cache holds."""
    t, h = k.shape[0], k.shape[1]
    layer = new_gqa_layer(1, t, h, k.shape[-1], v.shape[-1], fmt, k.device)
    blocks = torch.zeros(1, dtype=torch.long, device=k.device)
    write_gqa_kv(layer, k, v, torch.arange(t, device=k.device))
    return read_gqa_kv(layer, blocks, t)


def round_trip_mla(latent: torch.Tensor, k_rope: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """latent [T, R], k_rope [T, P] -> what a paged MLA cache of `fmt` gives back (float32)."""
    t = latent.shape[0]
    layer = new_mla_layer(1, t, latent.shape[-1], k_rope.shape[-1], fmt, latent.device)
    blocks = torch.zeros(1, dtype=torch.long, device=latent.device)
    write_mla_kv(layer, latent, k_rope, torch.arange(t, device=latent.device))
    return read_mla_kv(layer, blocks, t)


# ---------------------------------------------------------------------------- reads (reference)

def _gather(t: torch.Tensor, blocks: torch.Tensor, n: int) -> torch.Tensor:
    """The first n tokens of a sequence whose pages are `blocks`: t [NB, BS, ...] -> [n, ...]."""
    bs = t.shape[1]
    need = math.ceil(n / bs)
    return t[blocks[:need].long()].flatten(0, 1)[:n]


def read_gqa_kv(cache: GQALayerKV, blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first n tokens, dequantized to float32: ([n, Hkv, D], [n, Hkv, Dv])."""
    k, v = _gather(cache.k, blocks, n), _gather(cache.v, blocks, n)
    if cache.fmt.is_nvfp4:
        return (dequantize_nvfp4(k, _gather(cache.k_scale, blocks, n), cache.scale_2[0:1]),
                dequantize_nvfp4(v, _gather(cache.v_scale, blocks, n), cache.scale_2[1:2]))
    if not cache.fmt.is_fp8:
        return k.float(), v.float()
    if cache.fmt.block_scaled:
        return (dequantize_fp8(k, _gather(cache.k_scale, blocks, n)),
                dequantize_fp8(v, _gather(cache.v_scale, blocks, n)))
    return dequantize_fp8(k, cache.k_scale), dequantize_fp8(v, cache.v_scale)


def read_mla_kv(cache: MLALayerKV, blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first n tokens, dequantized to float32: (latent [n, R], rope [n, P])."""
    return dequantize_mla_rows(cache, lambda t: _gather(t, blocks, n))


def read_mla_positions(cache: MLALayerKV, blocks: torch.Tensor, positions: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens at `positions` (int64, any shape [...]), dequantized to float32:
    (latent [..., R], rope [..., P]); only those rows are read."""
    bs = cache.latent.shape[1]
    pages, rows = blocks.long()[positions // bs], positions % bs
    return dequantize_mla_rows(cache, lambda t: t[pages, rows])


def dequantize_mla_rows(cache: MLALayerKV, take) -> tuple[torch.Tensor, torch.Tensor]:
    """(latent, rope) float32 of the rows `take` picks out of each [NB, BS, ...] cache tensor (a
    function of the tensor: the same rows of the latent, its scales and the rope)."""
    lat, rope = take(cache.latent), take(cache.rope)
    if cache.fmt.is_nvfp4:
        return (dequantize_nvfp4(lat, take(cache.latent_scale), cache.scale_2[0:1]),
                dequantize_fp8(rope, cache.scale_2[1:2]))
    if not cache.fmt.is_fp8:
        return lat.float(), rope.float()
    if cache.fmt.block_scaled:
        return dequantize_fp8(lat, take(cache.latent_scale)), rope.float()
    return dequantize_fp8(lat, cache.latent_scale), dequantize_fp8(rope, cache.latent_scale)
