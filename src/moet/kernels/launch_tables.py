"""The repository's JSON launch tables (moe_configs.json, attention_configs.json beside this file):
`{"version": 1, "devices": {device name: {...}}}`. A missing file reads as an empty table, so a
checkout without one runs every kernel on its defaults."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=8)
def read_table(path: str) -> dict:
    p = Path(path)
    if not p.exists():
        return {"version": 1, "devices": {}}
    return json.loads(p.read_text())
