"""A checkpoint argument -> a local checkpoint directory.

moet reads checkpoints from the local disk and never downloads. A path that is a directory is
used as given. Anything else that reads like a Hugging Face repo id (`Qwen/Qwen3-30B-A3B`) is
looked up in the Hugging Face cache (HF_HUB_CACHE's layout, through huggingface_hub with network
access off), so a model fetched earlier with `hf download` / transformers is found where it is.
When there is no complete copy the error says how to download one.
"""
from __future__ import annotations

import os
import re

from moet.errors import CheckpointError

# owner/name as the Hub spells repo ids (letters, digits, '-', '_', '.'; no leading '.' or '-')
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9_][\w.-]*")
_WEIGHTS = ("model.safetensors.index.json", "model.safetensors")


def looks_like_repo_id(text: str) -> bool:
    return bool(_REPO_ID.fullmatch(text)) and not text.endswith((".", "-")) and ".." not in text


def cached_snapshot(repo_id: str, cache_dir: str | None = None) -> str | None:
    """The Hugging Face cache's snapshot directory of repo_id's default revision, or None
    (never touches the network)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        return None
    try:
        path = snapshot_download(repo_id, local_files_only=True, cache_dir=cache_dir)
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None
    return path if os.path.isdir(path) else None


def download_hint(repo_id: str) -> str:
    name = repo_id.rsplit("/", 1)[-1]
    return (f"download it first, e.g. `hf download {repo_id} --local-dir ~/models/{name}` (older huggingface_hub: "
            f"`huggingface-cli download {repo_id} --local-dir ~/models/{name}`), then pass that directory")


def resolve_checkpoint(path: str, cache_dir: str | None = None) -> str:
    """The checkpoint directory `path` names: the directory itself, else the Hugging Face cache's
    complete snapshot of the repo id `path`; else a CheckpointError that says what to do."""
    text = str(path)
    local = os.path.expanduser(text)
    if os.path.isdir(local):
        return local
    if os.path.exists(local):
        raise CheckpointError(f"{local}: not a directory; a checkpoint is a directory with config.json and "
                              "*.safetensors files")
    if not looks_like_repo_id(text):
        raise CheckpointError(f"{local}: checkpoint directory not found")
    snapshot = cached_snapshot(text, cache_dir)
    if snapshot is None:
        raise CheckpointError(f"{text}: no such directory, and the Hugging Face repo {text} is not in the local "
                              f"Hugging Face cache; moet reads local checkpoints only: {download_hint(text)}")
    if not (os.path.isfile(os.path.join(snapshot, "config.json"))
            and any(os.path.isfile(os.path.join(snapshot, w)) for w in _WEIGHTS)):
        raise CheckpointError(f"{text}: the Hugging Face cache holds only part of this repo ({snapshot} has no "
                              f"config.json or no weights); {download_hint(text)}")
    return snapshot
