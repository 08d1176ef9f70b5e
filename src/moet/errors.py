"""Error types a user can cause. Every message says what was wrong, where, and how to fix it.

Library code raises these (never a bare ValueError for user-caused problems) so the CLI and
the server can print one clear line instead of a traceback.
"""
from __future__ import annotations


class MoetError(Exception):
    """Base class of every error moet raises for a problem the user can fix."""


class FormatError(MoetError):
    """A tensor does not match the number format it claims (shape, dtype, NaN/Inf, truncation)."""


class CheckpointError(MoetError):
    """A checkpoint directory is missing files, is unsupported, or disagrees with its config."""


class ConfigError(MoetError):
    """An EngineConfig / CLI value is invalid or the machine cannot satisfy it."""


class PackError(MoetError):
    """A pack file (moet.store) is corrupt, truncated or incomplete; the message names the flag
    that verifies or rebuilds it."""
