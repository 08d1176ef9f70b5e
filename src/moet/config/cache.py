"""CacheConfig: the paged KV cache (its block size and dtype, how much memory it gets) and prefix
caching. `EngineConfig.cache`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moet.config.knobs import Section, knob
from moet.errors import ConfigError

KV_CACHE_DTYPES = ("auto", "bf16", "fp8", "nvfp4")


@dataclass(frozen=True)
class CacheConfig(Section):
    title: ClassVar[str] = "memory and KV cache"
    about: ClassVar[str] = ("How much GPU memory moet takes and how the KV cache is laid out in it. From Python: "
                            "`EngineConfig.cache` (`CacheConfig`).")

    block_size: int = knob(
        16, "tokens per KV cache block",
        doc="The KV cache's page size, a power of two; prefix caching shares whole blocks. Change it only to "
            "experiment with the attention kernels.")
    kv_cache_dtype: str = knob(
        "auto", "bf16, fp8 or nvfp4; auto: the model dtype", KV_CACHE_DTYPES,
        common=True, metavar="DTYPE",
        doc="auto: the model dtype. bf16: bfloat16. fp8: e4m3 with one dynamic scale per token and 128-element "
            "group, half of bf16's bytes, so twice the tokens fit, at a small change of the attention outputs. "
            "nvfp4: 4-bit e2m1 values with one e4m3 scale per token and 16 elements (MLA: the rope part in e4m3), "
            "under a third of bf16's bytes, so over three times the tokens fit, at a larger change of the "
            "attention outputs than fp8 (docs/kv-cache.md). Use fp8 or nvfp4 when the KV cache, not the weights, "
            "limits the batch size or the context.")
    gpu_memory_utilization: float = knob(
        0.9, "share of the GPU's memory moet may use", common=True, metavar="FRACTION",
        doc="Weights, activations and the KV cache together stay under this share of the GPU's memory; the KV "
            "cache gets what is left after the weights and a profiled forward pass of max_num_batched_tokens. "
            "Lower it when other processes share the GPU.")
    kv_cache_memory_gb: float | None = knob(
        None, "KV cache size in GiB (instead of --gpu-memory-utilization)", common=True,
        metavar="GIB",
        doc="A fixed KV cache size, overriding gpu_memory_utilization. On CPU the default is what max_num_seqs "
            "sequences of max_model_len tokens need, at most 4 GiB.")
    num_kv_blocks: int | None = knob(
        None, "exact number of KV cache blocks",
        doc="Overrides every memory budget; for tests and for reproducing a run exactly.")
    enable_prefix_caching: bool = knob(
        True, "reuse the KV cache of repeated prompt prefixes", common=True,
        doc="Full KV blocks are keyed by a chained hash of their tokens, so a prompt that starts like an "
            "earlier one (a system prompt, a chat history) skips that part of prefill. Turn it off to measure "
            "prefill, or when prompts never repeat.")

    def validate(self) -> None:
        super().validate()
        self._positive_int("block_size")
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size={self.block_size} must be a power of two (16 is usual)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ConfigError(f"kv_cache_memory_gb={self.kv_cache_memory_gb} must be positive (or unset)")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1):
            raise ConfigError(f"num_kv_blocks={self.num_kv_blocks!r} must be a positive integer (or unset)")
