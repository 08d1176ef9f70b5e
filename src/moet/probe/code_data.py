"""Which Python sources are training data and which are held out.

One rule, shared by the training recipe (tools/train_tiny) and the probes: a standard-library
file is held out when the CRC32 of its path relative to the stdlib root is 0 mod 16. The rule
depends only on the relative path, so it picks the same files on every machine with the same
Python version; site-packages are never held out (the probes read only the stdlib, which every
machine has).
"""
from __future__ import annotations

import os
import sysconfig
import zlib
from pathlib import Path

HOLDOUT_MOD = 16
MAX_FILE_BYTES = 400_000
MIN_FILE_BYTES = 200


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    return zlib.crc32(relpath.replace(os.sep, "/").encode()) % HOLDOUT_MOD == 0


def _ok(text: str) -> bool:
    # Skip generated / minified files: they teach nothing and dominate by bytes.
    lines = text.count("\n") + 1
    return len(text) / lines < 120 and "\x00" not in text


def read_source(path: Path) -> str | None:
    try:
        size = path.stat().st_size
        if not MIN_FILE_BYTES <= size <= MAX_FILE_BYTES:
            return None
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return text if _ok(text) else None


def stdlib_files(heldout: bool) -> list[tuple[str, Path]]:
    """Sorted (relative path, path) of stdlib .py files outside site-packages, held out or not."""
    root = stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for f in sorted(filenames):
            if f.endswith(".py"):
                p = Path(dirpath) / f
                rel = str(p.relative_to(root))
                if is_heldout(rel) == heldout:
                    out.append((rel, p))
    return sorted(out)


def heldout_texts(max_files: int | None = None, min_chars: int = 2000) -> list[tuple[str, str]]:
    """(relpath, text) of held-out stdlib files that read cleanly, in sorted order. Test
    files are skipped: they are mostly data tables, not representative code."""
    out = []
    for rel, p in stdlib_files(heldout=True):
        if "/test" in "/" + rel.replace(os.sep, "/"):
            continue
        text = read_source(p)
        if text and len(text) >= min_chars:
            out.append((rel, text))
            if max_files is not None and len(out) >= max_files:
                break
    return out
