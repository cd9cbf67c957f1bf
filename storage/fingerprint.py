"""Content hashes: sample ids, shard ids, model and stage fingerprints.

A fingerprint covers everything that changes a stage's output, so a cache path containing it is
never stale: change the weights, the tokenizer, max_length or a dtype and the path changes.
"""

from __future__ import annotations

import errno
import functools
import glob
import hashlib
import json
import os
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

ID_CHARS = 20  # 80 bits: collision-free for any realistic number of shards, runs or manifests
SHA256_HEX = re.compile(r"[0-9a-f]{64}")


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


def file_sha256(file: Path) -> str:
    stat = file.stat()
    return _file_digest(str(file), stat.st_size, stat.st_mtime_ns)


def cached_sha256(file: Path) -> str:
    """sha256 of a file of a hub cache snapshot. The cache stores a file as a blob named by its
    ETag, which for an LFS file (every weight file) is the sha256 of its content: a cached 19 GB
    T5 is not read again. Other blobs are named by their git sha1 and are small: they are hashed."""
    blob = file.resolve()
    if blob.parent.name == "blobs" and SHA256_HEX.fullmatch(blob.name):
        return blob.name
    return file_sha256(file)


def hash_folder(folder: str | Path, digest: Callable[[Path], str] = file_sha256) -> dict[str, str]:
    """sha256 of every file below `folder` (as `digest` finds it), keyed by relative path."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    return {file.relative_to(folder).as_posix(): digest(file)
            for file in sorted(p for p in folder.rglob("*") if p.is_file())}


HUB_CACHE_SETTINGS = "HF_HOME (or HF_HUB_CACHE)"  # what moves the hub cache (~/.cache/huggingface/hub)


def hub_cache_refused(error: BaseException):
    """`storage.store.refused_write` for the hub cache: the error naming HF_HOME when `error` is a
    write the hub cache refused, else None."""
    from huggingface_hub import constants

    from storage.store import refused_write

    return refused_write(error, constants.HF_HUB_CACHE, HUB_CACHE_SETTINGS)


def _not_a_folder(path: str) -> str:
    return f"model.path {path!r} is not a folder on {socket.gethostname()}"


def check_hub_id(path: str) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        raise FileNotFoundError(f"model.path {path!r} is neither an existing folder on {socket.gethostname()} "
                                "nor a hub id (owner/name)") from None


def local_component(path: str, subfolder: str) -> Path:
    """`path/subfolder` of a model folder on this machine."""
    local = Path(path) / subfolder
    if not local.is_dir():
        raise FileNotFoundError(f"model.path {path}: has no {subfolder}/ folder (expected the diffusers hub layout)")
    return local


def component_fingerprint(path: str, subfolders: list[str], revision: str | None = None) -> dict[str, Any]:
    """{component: {relative path: sha256}} of the given model components: a local folder's files
    hashed, or a hub id's from the hub's metadata (`hub_files`), the same for the same files."""
    if os.path.exists(path):
        return {sub: hash_folder(local_component(path, sub)) for sub in subfolders}
    check_hub_id(path)
    return hub_files(path, subfolders, revision)


def hub_files(path: str, subfolders: list[str], revision: str | None = None) -> dict[str, dict[str, str]]:
    """The sha256 of each file of the components of hub id `path`, without downloading a weight:
    every call is pinned to the commit `revision` resolves to, a file in LFS has its sha256 in the
    hub's listing (weights are in LFS: a repo's default .gitattributes puts every weight format
    there, and the hub takes no other file over 10 MB), and only the small rest (configs, tokenizer
    files) is downloaded, into the hub cache, where the workers' `from_pretrained` finds it. The
    commit itself is left out: a commit that changes no file of a component (a README edit) must
    not re-encode, and a local copy of the same files must share its caches. Offline, or when the
    hub cannot answer, the cached snapshot answers."""
    from huggingface_hub import HfApi, RepoFile, is_offline_mode, snapshot_download

    if is_offline_mode():
        return {sub: cached_files(path, sub, revision, "offline mode is on (HF_HUB_OFFLINE)") for sub in subfolders}
    api = HfApi()
    try:
        commit = api.resolve_revision(path, revision=revision)  # also cached in refs/, for offline runs
        listing = {sub: [entry for entry in api.list_repo_tree(path, sub, recursive=True, revision=commit.resolved)
                         if isinstance(entry, RepoFile)] for sub in subfolders}
        small = [glob.escape(entry.path) for entries in listing.values() for entry in entries if entry.lfs is None]
        small.append("model_index.json")  # names the model's family: read by every process that loads it
        # snapshot_download also caches the commit's listing, which tells an offline run what its
        # snapshot lacks
        snapshot = Path(snapshot_download(path, revision=commit, allow_patterns=small))
    except Exception as error:  # unreachable, unknown repo or component: the cache may still know
        from huggingface_hub import constants

        from storage.store import disk_full

        if refused := hub_cache_refused(error):  # the machine's fault
            raise refused from error
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise disk_full(constants.HF_HUB_CACHE, "room for the model's small files", error.errno) from error
        reason = f"the hub's listing could not be read ({type(error).__name__}: {error})"
        return {sub: cached_files(path, sub, revision, reason) for sub in subfolders}
    return {sub: {entry.path[len(sub) + 1:]: entry.lfs.sha256 if entry.lfs else file_sha256(snapshot / entry.path)
                  for entry in entries}
            for sub, entries in listing.items()}


def cached_files(path: str, subfolder: str, revision: str | None, hub_unusable: str) -> dict[str, str]:
    """`hub_files` of one component from the hub cache's snapshot of `revision`, without reading a
    weight file (`cached_sha256`); refused when the cache knows the snapshot lacks a file of it."""
    from huggingface_hub import snapshot_download

    try:
        snapshot = snapshot_download(path, revision=revision, allow_patterns=[f"{subfolder}/*"], local_files_only=True)
        return hash_folder(Path(snapshot) / subfolder, digest=cached_sha256)
    except Exception as error:
        raise FileNotFoundError(
            f"{_not_a_folder(path)}, and as a hub id its {subfolder}/ could not be fingerprinted: {hub_unusable}, "
            f"and the hub cache has no complete snapshot of it ({type(error).__name__}: {error})") from error
