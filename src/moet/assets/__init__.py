"""Files shipped inside the package: the moet-tiny checkpoint (see moet-tiny/MODEL_CARD.md)."""
from __future__ import annotations

from pathlib import Path

MOET_TINY = Path(__file__).resolve().parent / "moet-tiny"


def default_model() -> str:
    """The model served when none is named: the shipped moet-tiny."""
    return str(MOET_TINY)
