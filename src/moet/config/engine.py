"""EngineConfig: the checkpoint (`model`) and the six sub-configs that hold every other knob.

    EngineConfig(model=path, max_num_seqs=8, expert_format="fp4")                 # flat keywords
    EngineConfig(model=path, cache=CacheConfig(block_size=32), max_num_seqs=8)   # sub-configs, or both
    config.cache.block_size, config.scheduler.max_num_seqs                       # what code reads

Every knob name is unique across the sub-configs, so a flat keyword names one knob of one
sub-config: that is how `LLM(path, max_num_seqs=8)` and the flat CLI flags (`--max-num-seqs`)
reach the grouped config. Flat keywords apply on top of the sub-configs given with them, which is
also what `dataclasses.replace(config, block_size=32)` relies on. A flat read (`config.block_size`)
still works, as a read-only view of the sub-config's knob, for code not yet moved to the grouped
form; new code reads the grouped form, which says where a knob lives.
"""
from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields, replace

from moet.config.cache import CacheConfig
from moet.config.gate import GateConfig
from moet.config.kernels import KernelConfig
from moet.config.knobs import Section
from moet.config.load import LoadConfig
from moet.config.scheduler import SchedulerConfig
from moet.config.store import StoreConfig
from moet.errors import ConfigError

# The sub-configs: EngineConfig's attribute -> its class, in `--help` and docs/config.md order.
SECTIONS: dict[str, type[Section]] = {
    "load": LoadConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "store": StoreConfig,
    "gate": GateConfig,
    "kernels": KernelConfig,
}
# Each knob's sub-config (a knob name is unique across them: checked at import below).
KNOB_SECTION: dict[str, str] = {f.name: name for name, cls in SECTIONS.items() for f in fields(cls)}
assert len(KNOB_SECTION) == sum(len(fields(cls)) for cls in SECTIONS.values()), "a knob name is in two sub-configs"


@dataclass(init=False)
class EngineConfig:
    model: str = field(metadata={
        "help": "checkpoint dir or Hugging Face repo id",
        "common": True, "metavar": "MODEL",
        "doc": "A Hugging Face checkpoint directory: config.json, the *.safetensors weights (with "
               "model.safetensors.index.json when sharded) and, usually, the tokenizer files. A repo id such "
               "as Qwen/Qwen3-30B-A3B works when the Hugging Face cache already holds a complete download "
               "of it (moet never downloads: `hf download REPO --local-dir DIR` does; on the command line a repo id "
               "is looked up in the cache, from Python pass the directory). `moet serve` and "
               "`moet generate` default to moet-tiny, the small model shipped in the package."})
    load: LoadConfig = field(default_factory=LoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)

    def __init__(self, model: str, *, load: LoadConfig | Mapping | None = None,
                 cache: CacheConfig | Mapping | None = None, scheduler: SchedulerConfig | Mapping | None = None,
                 store: StoreConfig | Mapping | None = None, gate: GateConfig | Mapping | None = None,
                 kernels: KernelConfig | Mapping | None = None, **knobs) -> None:
        unknown = [k for k in knobs if k not in KNOB_SECTION]
        if unknown:
            raise ConfigError(unknown_knobs_message(unknown))
        given = {"load": load, "cache": cache, "scheduler": scheduler, "store": store, "gate": gate,
                 "kernels": kernels}
        self.model = model
        for name, cls in SECTIONS.items():
            flat = {k: v for k, v in knobs.items() if KNOB_SECTION[k] == name}
            setattr(self, name, _section(name, cls, given[name], flat))
        self.validate()

    def validate(self) -> None:
        """The sub-configs checked themselves when they were made; what is left is the checkpoint."""
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model must be a checkpoint directory path")
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"{name} must be a {cls.__name__}")

    @classmethod
    def knob_fields(cls) -> tuple[Field, ...]:
        """Every knob's dataclass field, `model` first, then each sub-config's in SECTIONS order: what
        the CLI flags, the LLM keywords and docs/config.md are made from."""
        return (fields(cls)[0],) + tuple(f for sub in SECTIONS.values() for f in fields(sub))

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The flat knob names (`model` first): every LLM keyword."""
        return tuple(f.name for f in cls.knob_fields())

    def knob_values(self) -> dict[str, object]:
        """Every knob's value by its flat name: EngineConfig(**config.knob_values()) == config."""
        return {f.name: getattr(self, f.name) for f in self.knob_fields()}


def _section(name: str, cls: type[Section], given, flat: dict) -> Section:
    """One sub-config: the one given (a mapping is its keywords) with the flat keywords applied on top."""
    if given is None:
        return cls(**flat)
    if isinstance(given, cls):
        return replace(given, **flat) if flat else given
    if isinstance(given, Mapping):
        unknown = [k for k in given if KNOB_SECTION.get(k) != name]
        if unknown:
            raise ConfigError(unknown_knobs_message(unknown, where=cls.__name__))
        return cls(**{**given, **flat})
    raise ConfigError(f"{name}={given!r}: expected a {cls.__name__} (or a dict of its knobs)")


def unknown_knobs_message(names, where: str = "engine") -> str:
    """`unknown engine option max_num_seq (did you mean max_num_seqs?)`: each unknown name with the
    closest knob, where one is close; docs/config.md lists them all."""
    parts = []
    for n in names:
        if n in KNOB_SECTION:                           # a knob, given in the wrong sub-config's mapping
            parts.append(f"{n} (a knob of EngineConfig.{KNOB_SECTION[n]})")
            continue
        close = difflib.get_close_matches(str(n), list(KNOB_SECTION), n=1, cutoff=0.6)
        parts.append(f"{n} (did you mean {close[0]}?)" if close else str(n))
    s = "s" if len(parts) > 1 else ""
    return f"unknown {where} option{s} {', '.join(parts)}; docs/config.md lists every option"


def _flat_view(knob: str, section: str, doc: str) -> property:
    def get(self):
        return getattr(getattr(self, section), knob)
    get.__name__ = knob
    return property(get, doc=f"{doc} (read-only view of EngineConfig.{section}.{knob})")


# The flat reads (`config.block_size`): one read-only property per knob, made from the sub-configs'
# fields, so a knob added to a sub-config is readable flat with no second list to keep.
for _knob_name, _section_name in KNOB_SECTION.items():
    _f = SECTIONS[_section_name].__dataclass_fields__[_knob_name]
    setattr(EngineConfig, _knob_name, _flat_view(_knob_name, _section_name, _f.metadata.get("help", "")))
del _knob_name, _section_name, _f
