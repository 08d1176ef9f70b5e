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


class RequestError(ConfigError):
    """One request's parameters cannot run on this model (a stop token id outside the
    vocabulary, a seed torch cannot take, ...). `param` names the request field, so the server
    can answer 400 with OpenAI's `param` set; refused before the request reaches the scheduler."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param

    def __reduce__(self):
        # pickled by EngineProcess's child: keep `param` (Exception's default keeps args only)
        return (_rebuild_request_error, (type(self), str(self), self.param))


def _rebuild_request_error(cls, message: str, param: str | None) -> "RequestError":
    return cls(message, param=param)


class RequestFailed(MoetError):
    """One request failed inside the engine (a fault in its own part of a step: its sampling
    row, logprobs, detokenization, output); the engine finished it alone and serves on. Not the
    client's doing: the server answers 500 internal_error."""


class PackError(MoetError):
    """A pack file (moet.store) is corrupt, truncated or incomplete; the message names the flag
    that verifies or rebuilds it."""
