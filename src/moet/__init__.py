"""moet: serve Mixture-of-Experts LLMs too big for the GPU.

Routed experts are re-quantized to a sign-symmetric 2-bit code (moet.formats.w2), FP4 copies
of hot experts repair precision, and experts that do not fit live on disk behind a pinned host
arena and a GPU expert cache. See docs/architecture.md.
"""
from __future__ import annotations

__version__ = "0.1.0"

from moet.errors import CheckpointError, ConfigError, FormatError, MoetError

__all__ = ["__version__", "MoetError", "FormatError", "CheckpointError", "ConfigError",
           "LLM", "SamplingParams", "StructuredOutputsParams", "EngineConfig"]


def __getattr__(name: str):
    # Lazy: `import moet` and `moet --help` must not import torch or transformers.
    if name == "LLM":
        from moet.llm import LLM
        return LLM
    if name == "SamplingParams":
        from moet.sampling_params import SamplingParams
        return SamplingParams
    if name == "StructuredOutputsParams":
        from moet.sampling_params import StructuredOutputsParams
        return StructuredOutputsParams
    if name == "EngineConfig":
        from moet.config import EngineConfig
        return EngineConfig
    raise AttributeError(f"module 'moet' has no attribute {name!r}")
