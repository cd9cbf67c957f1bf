"""Content hashes: sample ids, shard ids, model and stage fingerprints.

A fingerprint covers everything that changes a stage's output, so a cache path containing it is
never stale: change the weights, the tokenizer, max_length or a dtype and the path changes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import socket
from pathlib import Path
from typing import Any

ID_CHARS = 20  # 80 bits: collision-free for any realistic number of shards, runs or manifests


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def hash_json(obj: Any, chars: int = ID_CHARS) -> str:
    """Short hash of a JSON-able object, independent of dict ordering."""
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return sha256_bytes(canonical.encode())[:chars]


@functools.lru_cache(maxsize=256)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    # size and mtime are part of the cache key so an edited file is hashed again
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def hash_folder(folder: str | Path) -> dict[str, str]:
    """sha256 of every file below `folder`, keyed by relative path."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    digests = {}
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        stat = file.stat()
        digests[file.relative_to(folder).as_posix()] = _file_digest(str(file), stat.st_size, stat.st_mtime_ns)
    return digests


def resolve_model_folder(path: str, subfolder: str, revision: str | None = None) -> Path:
    """Local folder of one component: `path/subfolder` on disk, else the hub snapshot of it."""
    local = Path(path) / subfolder
    if local.is_dir():
        return local
    if os.path.exists(path):
        raise FileNotFoundError(f"model.path {path}: has no {subfolder}/ folder (expected the PixArt-Sigma hub layout)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        raise FileNotFoundError(f"model.path {path!r} is neither an existing folder on {socket.gethostname()} "
                                "nor a hub id (owner/name)") from None
    try:
        snapshot = snapshot_download(path, revision=revision, allow_patterns=[f"{subfolder}/*"])
    except Exception as error:  # offline, unknown repo, no access: all say the same to the user
        raise FileNotFoundError(f"model.path {path!r} is not a folder on {socket.gethostname()}, and as a hub id "
                                f"its {subfolder}/ could not be fetched: {type(error).__name__}: {error}") from error
    return Path(snapshot) / subfolder


def component_fingerprint(path: str, subfolders: list[str], revision: str | None = None) -> dict[str, Any]:
    """Hashes of the files of the given model components."""
    return {sub: hash_folder(resolve_model_folder(path, sub, revision)) for sub in subfolders}
