"""The natural-text part of the corpus, read from the training machine at run time: Python
source from the standard library and site-packages, and prose from package metadata and
docs (METADATA, .md, .rst, .txt).

Deterministic: directories are walked in sorted order, duplicates (same bytes) are dropped,
the surviving files are shuffled with the recipe's seed and taken until the byte caps. The
same machine image therefore gives the same corpus; another machine gives a similar one.
Held-out stdlib files (moet.probe.code_data.is_heldout) never enter the corpus.
"""
from __future__ import annotations

import hashlib
import os
import random
import site
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from moet.probe.code_data import is_heldout, read_source, stdlib_root

TEXT_SUFFIXES = (".md", ".rst", ".txt")


@dataclass
class Corpus:
    code: list[str]           # one string per file
    text: list[str]
    code_files: int
    text_files: int
    code_bytes: int
    text_bytes: int


def _roots() -> list[Path]:
    roots = {Path(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}
    roots |= {Path(p) for p in site.getsitepackages()}
    return sorted(r for r in roots if r.is_dir())


def _walk(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        out.extend(Path(dirpath) / f for f in sorted(filenames))
    return out


def list_files() -> tuple[list[Path], list[Path]]:
    """(code paths, text paths) in a deterministic order."""
    std = stdlib_root()
    code = [p for rel, p in _stdlib_train(std)]
    text: list[Path] = []
    for root in _roots():
        for p in _walk(root):
            if p.suffix == ".py":
                code.append(p)
            elif p.suffix in TEXT_SUFFIXES or p.name == "METADATA":
                text.append(p)
    return code, text


def _stdlib_train(std: Path) -> list[tuple[str, Path]]:
    out = []
    for p in _walk(std):
        rel = str(p.relative_to(std))
        if p.suffix == ".py" and not rel.startswith(("site-packages", "dist-packages")) and not is_heldout(rel):
            out.append((rel, p))
    return out


def _read_text(p: Path) -> str | None:
    text = read_source(p)
    if text is None or p.name.upper().startswith(("LICENSE", "COPYING", "NOTICE")):
        return None
    return text


def _take(paths: list[Path], reader, cap_bytes: int, rng: random.Random, workers: int) -> tuple[list[str], int]:
    order = list(paths)
    rng.shuffle(order)
    seen, out, total = set(), [], 0
    # Read in chunks in parallel (I/O bound), consume in the shuffled order (deterministic).
    with ThreadPoolExecutor(workers) as pool:
        for i in range(0, len(order), 512):
            for text in pool.map(reader, order[i:i + 512]):
                if text is None:
                    continue
                h = hashlib.blake2b(text.encode(), digest_size=16).digest()
                if h in seen:
                    continue
                seen.add(h)
                out.append(text)
                total += len(text)
                if total >= cap_bytes:
                    return out, total
    return out, total


def build(seed: int, code_bytes: int, text_bytes: int, workers: int = 16) -> Corpus:
    code_paths, text_paths = list_files()
    rng = random.Random(seed)
    code, cb = _take(code_paths, read_source, code_bytes, rng, workers)
    text, tb = _take(text_paths, _read_text, text_bytes, rng, workers)
    return Corpus(code, text, len(code), len(text), cb, tb)
