"""How a knob is declared, and the checks the sub-configs share.

A knob is a dataclass field whose metadata carries everything the faces need: its `help` (the
one `--help` line), its `doc` (what it does and when to change it: docs/config.md), its `choices`,
whether `--help` shows it without `--help-all` (`common`) and how its value is written there
(`metavar`). The sub-config a knob is declared in decides its `--help` group and its section of
docs/config.md, so a knob has one home.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

from moet.errors import ConfigError


def knob(default, help: str, choices: tuple | None = None, *, doc: str = "", common: bool = False,
         metavar: str | None = None):
    return field(default=default, metadata={"help": help, "choices": choices, "doc": doc, "common": common,
                                            "metavar": metavar})


@dataclass(frozen=True)
class Section:
    """Base of the sub-configs (LoadConfig, CacheConfig, ...): a frozen value, checked when it is
    made, so an EngineConfig never holds a sub-config with a bad value. `title` is the sub-config's
    `--help` group and docs/config.md section; `about` is that section's first paragraph."""

    title: ClassVar[str]
    about: ClassVar[str]

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Every knob with choices holds one of them; a sub-config adds its own rules after this."""
        for f in fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices:
                raise ConfigError(f"{f.name}={value!r} is not supported; choose one of {', '.join(choices)}")

    def _positive_int(self, *names: str) -> None:
        for name in names:
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}={v!r} must be a positive integer")
