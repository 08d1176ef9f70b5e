"""EngineConfig: every knob of the engine in one dataclass.

Each field is an `LLM(...)` keyword with the same name and a CLI flag with dashes
(`expert_format` -> `--expert-format`); `add_cli_arguments` / `from_cli_args` derive the flags
from the fields, so the two cannot drift. The help text lives in each field's metadata and
doubles as its documentation. Nothing is read from environment variables. `validate()` turns a
bad value into a ConfigError naming the field and the accepted values, before any file is opened.
"""
from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields

from moet.errors import ConfigError

EXPERT_FORMATS = ("w2", "fp4", "bf16")
DTYPES = ("auto", "bfloat16", "float16", "float32")
W2_ZERO_MODES = ("auto", "sign", "alt")
W2_SCALE_RULES = ("published", "mse")


def _knob(default, help: str, choices: tuple | None = None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class EngineConfig:
    model: str = field(metadata={"help": "checkpoint directory (Hugging Face layout: config.json + "
                                         "*.safetensors [+ index])"})
    tokenizer: str | None = _knob(None, "tokenizer directory; default: the checkpoint directory")
    expert_format: str = _knob(
        "w2", "how routed experts are held for compute: w2 (2-bit sign-symmetric code, SPEC 2.1), "
              "fp4 (NVFP4 layout: e2m1 + e4m3 block-16 scales + fp32 scale_2), or bf16 (the checkpoint's "
              "values decoded to the model dtype: the reference, most memory)", EXPERT_FORMATS)
    dtype: str = _knob(
        "auto", "activation / dense-weight dtype; auto = the checkpoint's torch_dtype for float "
                "checkpoints, bfloat16 for quantized (FP8 / NVFP4 / MXFP4) ones", DTYPES)
    device: str = _knob("auto", "auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    max_model_len: int | None = _knob(None, "longest prompt + generation in tokens; default: the "
                                            "config's max_position_embeddings")
    seed: int = _knob(0, "seed of the sampler when a request gives no seed of its own")
    w2_zero_mode: str = _knob(
        "auto", "sign rule for exact zeros when re-quantizing experts to W2 (moet.formats.w2): auto "
                "alternates them by K parity when >95 percent share one sign", W2_ZERO_MODES)
    w2_scale_rule: str = _knob(
        "published", "block exponent rule when re-quantizing experts to W2: published (round(log2(amax/6)), "
                     "the original design's) or mse (least squared error per block; docs/formats.md)", W2_SCALE_RULES)
    trust_remote_code: bool = _knob(False, "allow a tokenizer that ships its own Python code (e.g. Kimi-K2's "
                                           "tiktoken tokenizer); model code is never run, moet has its own")
    load_mtp: bool = _knob(True, "load the checkpoint's MTP layers (kept for speculative decoding); "
                                 "false saves their memory")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for f in fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices:
                raise ConfigError(f"{f.name}={value!r} is not supported; choose one of {', '.join(choices)}")
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model must be a checkpoint directory path")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"device={self.device!r} is not supported; use auto, cpu, cuda or cuda:N")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ConfigError(f"max_model_len={self.max_model_len!r} must be a positive integer or None")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def _parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


def add_cli_arguments(parser: argparse.ArgumentParser, *, positional_model: bool = True) -> None:
    """One flag per EngineConfig field (`model` is positional unless positional_model=False)."""
    for f in fields(EngineConfig):
        help_text = f.metadata.get("help", "")
        if f.name == "model" and positional_model:
            from moet.assets import default_model
            parser.add_argument("model", nargs="?", default=default_model(),
                                help=f"{help_text}; default: the shipped moet-tiny")
            continue
        default = None if f.default is MISSING else f.default
        t = str(f.type)  # annotations are strings here: "int | None", "bool", "str"
        kind = int if t.startswith("int") else _parse_bool if t == "bool" else str
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=default,
                            choices=f.metadata.get("choices"), metavar=None if f.metadata.get("choices") else "X",
                            help=f"{help_text} (default: {default})")


def from_cli_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{n: getattr(args, n) for n in EngineConfig.field_names() if hasattr(args, n)})
