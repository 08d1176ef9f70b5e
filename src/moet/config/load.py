"""LoadConfig: what is loaded from the checkpoint and how it becomes the model in memory: the
tokenizer, the dtypes, the device, the format the routed experts are stored in for compute (and the
W2 quantizer's options), the MTP layers. `EngineConfig.load`; the checkpoint path itself is
`EngineConfig.model`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moet.config.knobs import Section, knob
from moet.errors import ConfigError

EXPERT_FORMATS = ("w2", "fp4", "bf16")
DTYPES = ("auto", "bfloat16", "float16", "float32")
W2_ZERO_MODES = ("auto", "sign", "alt")
W2_SCALE_RULES = ("published", "mse")


@dataclass(frozen=True)
class LoadConfig(Section):
    title: ClassVar[str] = "model"
    about: ClassVar[str] = ("The checkpoint, and how it is loaded: tokenizer, dtypes, device, the format routed "
                            "experts are stored in for compute. From Python: `EngineConfig.load` (`LoadConfig`); "
                            "the checkpoint itself is `EngineConfig.model`.")

    tokenizer: str | None = knob(
        None, "tokenizer directory (default: the checkpoint's)", metavar="PATH",
        doc="Where the tokenizer is loaded from. Set it when the checkpoint directory has no tokenizer files, "
            "or to use another tokenizer of the same vocabulary.")
    expert_format: str = knob(
        "w2", "how routed experts are stored for compute", EXPERT_FORMATS, common=True,
        doc="w2: a 2-bit sign-symmetric code (2.25 bits per weight), the smallest, so the most experts fit "
            "on the GPU; it costs some quality (docs/formats.md). fp4: the NVFP4 layout (4.5 bits per "
            "weight), close to the checkpoint's quality at twice W2's memory. bf16: the checkpoint's values "
            "decoded to the model dtype, the reference, the most memory. Pick fp4 when quality matters more "
            "than memory, bf16 to compare against the reference.")
    dtype: str = knob(
        "auto", "activation dtype: bfloat16, float16, float32", DTYPES,
        common=True, metavar="DTYPE",
        doc="auto: the checkpoint's torch_dtype for float checkpoints, bfloat16 for quantized ones (FP8, "
            "NVFP4, MXFP4). float32 gives reference numbers on CPU; float16 only for models trained for it.")
    device: str = knob(
        "auto", "auto, cpu, cuda or cuda:N", common=True, metavar="DEVICE",
        doc="auto: cuda when a GPU is visible, else cpu. cuda:N picks one GPU of several; cpu runs without a "
            "GPU (slow: for tests and small models).")
    trust_remote_code: bool = knob(
        False, "run a tokenizer's own Python code", common=True,
        doc="Needed by checkpoints whose tokenizer is Python code in the repository (Kimi-K2's tiktoken "
            "tokenizer, for one). Only the tokenizer's code runs: moet never runs model code from a checkpoint.")
    load_mtp: bool = knob(
        True, "load the MTP (multi-token prediction) layers",
        doc="MTP layers are kept for speculative decoding. --no-load-mtp saves their memory.")
    w2_zero_mode: str = knob(
        "auto", "W2 quantizer: the sign of exact zeros", W2_ZERO_MODES,
        doc="W2 has no zero level: an exact zero becomes the smallest level of one sign. sign keeps each zero's "
            "sign bit; alt alternates the sign along K (no bias); auto uses alt when nearly all of a tensor's "
            "zeros share one sign, else sign. Change it only to study the quantizer (docs/formats.md).")
    w2_scale_rule: str = knob(
        "published", "W2 quantizer: the block scale rule", W2_SCALE_RULES,
        doc="published: each block's exponent is round(log2(amax / 6)), the format's original rule; mse: the "
            "exponent with the least squared error per block (slower to quantize). docs/formats.md has both.")

    def validate(self) -> None:
        super().validate()
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"device={self.device!r} is not supported; use auto, cpu, cuda or cuda:N")
