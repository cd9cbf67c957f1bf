"""The artifact store: one fsspec root, atomic writes, commit records.

Every artifact is written whole before it becomes visible (local: temp file + rename; object
stores: a single PUT, which is atomic), and counts as done only once its commit record
`<key>.done` — checksum, size and a small JSON payload — is written after it. Readers ask
`committed(key)` and ignore anything without a record, so a crash never leaves a half-written
artifact that looks finished.

Every storage operation is retried on transient errors (connection resets, timeouts, EIO,
throttling) with exponential backoff; one that keeps failing fails with the object's URL.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import random
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import fsspec
import fsspec.parquet
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from configs.schema import StorageConfig

COMMIT_SUFFIX = ".done"
# bytes read from a parquet object's end: what pyarrow reads for a footer (an image shard's is 2-7 KB)
PARQUET_FOOTER_SAMPLE = 64 << 10
# bytes read from a safetensors object's start for its header (a 256-image cache shard's is ~30 KB)
SAFETENSORS_HEADER_SAMPLE = 64 << 10
SAFETENSORS_MAX_HEADER = 100_000_000  # the library's own bound
TRANSIENT_ERRNOS = {errno.EIO, errno.EAGAIN, errno.EBUSY, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
                    errno.ECONNABORTED, errno.EPIPE}
log = logging.getLogger(__name__)

# Arrow reading Python-owned bytes (bytes, a Python file object) decodes in this thread, not on its
# pool: a pool thread lets go of the bytes when it is done, and one that does so while the
# interpreter exits (it needs the GIL) aborts the process ("terminate called without an active
# exception", exit 134 after a run that succeeded; one in three runs of a short ingest script)
PYTHON_BYTES = {"use_threads": False}

T = TypeVar("T")


class ArtifactMissing(FileNotFoundError):
    """A stage's input is not committed in the store."""


class Damaged(ValueError):
    """An artifact whose bytes no longer match its recorded sha256."""


class StorageUnavailable(OSError):
    """A storage operation kept failing with transient errors."""


class DiskFull(OSError):
    """A write to local disk found it (or its quota) full: the message names the file, the space
    the write needed and the space free there."""


def nearest_existing(path: str | Path) -> Path:
    """`path`, or the nearest folder above it that exists (what holds it once it is made)."""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def free_bytes(path: str | Path) -> int:
    """Bytes free on the filesystem that holds `path` (or would: its nearest existing folder)."""
    return shutil.disk_usage(nearest_existing(path)).free


class UnusableFolder(RuntimeError):
    """A per-user folder (a cache, Prefect's database) that cannot be had: no home to hold it, or
    a folder this user cannot write in. The message names the variable that moves it."""


# a write refused by the folder, not the disk's space: permissions, a read-only disk, a file where a folder should be
REFUSED_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR}


def home_problem() -> str | None:
    """Why the user's home directory cannot hold per-user folders, in words, or None when it can:
    HOME unset for a user the system does not know (a container's numeric user), or a HOME that
    is not a folder this user can write in (or create)."""
    home = os.path.expanduser("~")
    if not os.path.isabs(home):
        return f"HOME is unset and user {os.getuid()} has no entry in the system's user database"
    folder = nearest_existing(home)
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        return f"the home directory {home} is not a folder this user can write in"
    return None


def user_folder(variable: str, default: str, holds: str) -> Path:
    """The folder the environment variable `variable` names, else `default` (e.g. ".cache/precast")
    under the user's home; UnusableFolder naming `variable` when it is unset and the home cannot
    hold `holds` (words for what the folder is for)."""
    if os.environ.get(variable):
        return Path(os.environ[variable]).expanduser()
    if reason := home_problem():
        raise UnusableFolder(f"{reason}, so there is no ~/{default} for {holds}: set {variable} to a writable "
                             "folder (or HOME to a writable home)")
    return Path.home() / default


def refused_write(error: BaseException, folder: str | Path, moved_by: str) -> UnusableFolder | None:
    """The error to raise for `error` when it is a write that `folder` (or a path inside it)
    refused, naming `moved_by`, the settings that move the folder; else None."""
    if not isinstance(error, OSError) or error.errno not in REFUSED_ERRNOS or not error.filename:
        return None
    inside = os.path.abspath(folder)
    if os.path.commonpath([inside, os.path.abspath(error.filename)]) != inside:
        return None
    return UnusableFolder(f"{folder} cannot be written ({error.strerror}: {error.filename}): set {moved_by} to a "
                          "folder this user can write in")


def size_text(count: int) -> str:
    return f"{count / 1e6:,.1f} MB ({count:,} B)"


def disk_full(path: str | Path, needed: int | str | None, code: int = errno.ENOSPC) -> DiskFull:
    """The error for a write to `path` of `needed` (bytes, or words) that found no space: what it
    needed and what is free there, so the operator knows what to free."""
    need = f"it needs {size_text(needed)}" if isinstance(needed, int) else f"it needs {needed or 'more'}"
    return DiskFull(code, f"no space left on device for {path}: {need}, {size_text(free_bytes(path))} free there; "
                          "free some and run again (what was committed is kept)")


@contextlib.contextmanager
def space_for(path: str | Path, needed: int | str | Callable[[], int] | None,
              moved_by: str | None = None) -> Iterator[None]:
    """A write to local disk at `path` of `needed` bytes (a count, a callable giving it, or words):
    a full disk or quota (ENOSPC, EDQUOT) is raised as `disk_full`, and, where `moved_by` names
    the settings that move `path`, a write the folder refuses as `refused_write`; nothing else is
    touched."""
    try:
        yield
    except DiskFull:
        raise
    except OSError as error:
        if moved_by and (refused := refused_write(error, path, moved_by)):
            raise refused from error
        if error.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise disk_full(path, needed() if callable(needed) else needed, error.errno) from error


def is_transient(error: BaseException) -> bool:
    """Whether retrying the same storage operation may succeed (a missing or forbidden object never will)."""
    if isinstance(error, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    return isinstance(error, (ConnectionError, TimeoutError)) or (
        isinstance(error, OSError) and error.errno in TRANSIENT_ERRNOS)


FRESH_LISTINGS = {"use_listings_cache": False}

# how `storage.credentials_block` becomes fsspec options: set by the layer that knows where such
# blocks live (flows/ registers Prefect Secret blocks' on import); storage knows only the name
CredentialsResolver = Callable[[str], dict[str, Any]]
_credentials_resolver: CredentialsResolver | None = None


def register_credentials(resolver: CredentialsResolver | None) -> None:
    """Resolve `storage.credentials_block` names with `resolver(name) -> fsspec options` in this
    process (None: no resolver)."""
    global _credentials_resolver
    _credentials_resolver = resolver


def fsspec_options(config: StorageConfig) -> dict[str, Any]:
    """The fsspec options of the store: `options` plus the credentials of `credentials_block`.

    The credentials are resolved once per config object, by the registered resolver, and kept on
    it (`StorageConfig.credentials`, not a field: never in its JSON, so never in Prefect parameters,
    cache keys or logs). A process given the config pickled (a Dask worker, a spawned training
    process) gets them with it and needs no resolver of its own; one given the config as JSON (a
    child flow run) resolves them again with its own.

    Listings are never kept: fsspec shares one filesystem per options in a process and would answer
    a later list, check or read from a folder's earlier listing, so a long-lived process (a Dask
    worker, a training run) would miss what other processes wrote or removed since."""
    if config.credentials_block and config.credentials is None:
        if _credentials_resolver is None:
            raise ValueError(f"storage.credentials_block {config.credentials_block!r}: no credentials resolver in "
                             "this process (importing flows registers Prefect Secret blocks'; else call "
                             "storage.store.register_credentials)")
        credentials = _credentials_resolver(config.credentials_block)
        if not isinstance(credentials, dict):
            raise ValueError(f"storage.credentials_block {config.credentials_block!r} must hold a JSON object of "
                             "fsspec options")
        config.keep_credentials(credentials)
    return {**config.options, **(config.credentials or {}), **FRESH_LISTINGS}


class RangesRaise:
    """`fs`, except that a failed ranged read raises. fsspec's `cat_ranges` returns a failed
    range's exception in place of its bytes, which `fsspec.parquet` then slices: a connection
    reset became a TypeError that nothing retried."""

    def __init__(self, fs: fsspec.AbstractFileSystem):
        self.fs = fs

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fs, name)

    def cat_ranges(self, *args: Any, **kwargs: Any) -> list[bytes]:
        return self.fs.cat_ranges(*args, **{**kwargs, "on_error": "raise"})


class Store:
    def __init__(self, config: StorageConfig):
        self.config = config
        self.fs, root_path = fsspec.core.url_to_fs(config.root, **fsspec_options(config))
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.root_path = root_path.rstrip("/")
        self.root_url = self.fs.unstrip_protocol(self.root_path)
        self.retried: list[str] = []  # each transient failure retried (its URL): the stage's work counts them

    def check_reachable(self) -> None:
        """Fail now, naming the setting, if the root cannot be used (before any stage does work)."""
        try:
            if self.is_local:
                Path(self.root_path).mkdir(parents=True, exist_ok=True)
            else:
                self._io("reach", self.root_path, self.fs.exists, self.root_path)
        except Exception as error:
            raise ValueError(f"storage.root {self.config.root!r} cannot be reached: {error}") from error

    # --- naming -----------------------------------------------------------------------------
    def path(self, key: str) -> str:
        return f"{self.root_path}/{key}"

    def url(self, key: str) -> str:
        return self.fs.unstrip_protocol(self.path(key))

    def key(self, url: str) -> str:
        """The store key of a URL under this root (inverse of `url`)."""
        prefix = self.root_url + "/"
        if not url.startswith(prefix):
            raise ValueError(f"{url} is not inside the store {self.root_url}")
        return url[len(prefix):]

    def _io(self, action: str, path: str, operation: Callable[..., T], *args: Any) -> T:
        """`operation(*args)`, retried with exponential backoff while it fails transiently."""
        attempts, attempt = self.config.io_attempts, 1
        while True:
            try:
                return operation(*args)
            except Exception as error:
                if not is_transient(error):
                    raise
                url = self.fs.unstrip_protocol(path)
                if attempt == attempts:
                    raise StorageUnavailable(f"{action} {url} failed {attempts} times; last error: {error}") from error
                log.warning("%s %s failed (%s); retry %d of %d", action, url, error, attempt, attempts - 1)
                self.retried.append(url)  # append: atomic beside the other threads of this store
                # exponential backoff with jitter: the workers that one throttled bucket slowed down
                # do not all come back in the same instant
                cap = self.config.io_backoff_seconds * 2 ** (attempt - 1)
                time.sleep(cap / 2 + random.uniform(0, cap / 2))
                attempt += 1

    # --- reading ----------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self._io("check", self.path(key), self.fs.exists, self.path(key))

    def read_bytes(self, key: str) -> bytes:
        try:
            return self._io("read", self.path(key), self.fs.cat_file, self.path(key))
        except FileNotFoundError as error:
            raise ArtifactMissing(f"{self.url(key)} does not exist") from error

    def get_file(self, key: str, local: str | Path) -> None:
        """Download the object at `key` to a local file, streamed."""
        try:
            self._io("download", self.path(key), self.fs.get_file, self.path(key), str(local))
        except FileNotFoundError as error:
            raise ArtifactMissing(f"{self.url(key)} does not exist") from error

    def read_json(self, key: str) -> Any:
        return json.loads(self.read_bytes(key))

    def list(self, prefix: str, suffix: str = "") -> list[str]:
        """Keys directly under `prefix` ending in `suffix`, sorted."""
        try:
            names = self._io("list", self.path(prefix), self.fs.ls, self.path(prefix), False)
        except FileNotFoundError:
            return []
        keys = [f"{prefix}/{name.rstrip('/').rsplit('/', 1)[-1]}" for name in names]
        return sorted(key for key in keys if key.endswith(suffix))

    def find(self, prefix: str = "") -> list[str]:
        """Every key under `prefix` (the whole store by default), sorted."""
        path = self.path(prefix) if prefix else self.root_path
        return sorted(self.key(self.fs.unstrip_protocol(p)) for p in self._io("list", path, self.fs.find, path))

    def committed(self, key: str) -> dict[str, Any] | None:
        """The commit record of `key`, or None when the artifact is not (fully) written."""
        try:
            return self.read_json(key + COMMIT_SUFFIX)
        except ArtifactMissing:
            return None

    def require(self, key: str) -> dict[str, Any]:
        record = self.committed(key)
        if record is None:
            raise ArtifactMissing(f"{self.url(key)} is not committed; run the stage that produces it first")
        return record

    def require_all(self, keys: list[str], concurrency: int = 32) -> list[dict[str, Any]]:
        """`require` of many keys, `concurrency` requests at once (each costs a round trip)."""
        return self._each(self.require, keys, concurrency)

    def committed_all(self, keys: list[str], concurrency: int = 32) -> list[dict[str, Any] | None]:
        """`committed` of many keys, `concurrency` requests at once."""
        return self._each(self.committed, keys, concurrency)

    @staticmethod
    def _each(read: Callable[[str], T], keys: list[str], concurrency: int) -> list[T]:
        if len(keys) <= 1 or concurrency == 1:
            return [read(key) for key in keys]
        with ThreadPoolExecutor(min(concurrency, len(keys))) as pool:
            return list(pool.map(read, keys))

    def read_columns(self, key: str, columns: list[str]) -> pa.Table:
        """`columns` of a committed parquet artifact (those it has: older artifacts lack the columns
        added since), reading only its footer and those columns'
        byte ranges (a few ranged reads, not the object). A part cannot be checked against the
        object's sha256: the caller checks what it read against the artifact's content address."""
        self.require(key)
        path = self.path(key)
        try:  # the footer and the columns' ranges are fetched here, all at once
            file = self._io("read", path, lambda: fsspec.parquet.open_parquet_file(
                path, fs=RangesRaise(self.fs), columns=columns, engine="pyarrow",
                footer_sample_size=PARQUET_FOOTER_SAMPLE))
        except FileNotFoundError as error:
            raise ArtifactMissing(f"{self.url(key)} does not exist") from error
        except pa.ArrowException as error:  # a footer that does not parse
            raise Damaged(f"{self.url(key)} is damaged: {error}") from error
        try:  # from memory: an error now is in the bytes (pyarrow reports a page that does not decode as OSError)
            with file:
                return pq.ParquetFile(file).read(columns=columns, **PYTHON_BYTES)
        except (pa.ArrowException, OSError) as error:
            raise Damaged(f"{self.url(key)} is damaged: {error}") from error

    def read_header(self, key: str, size: int) -> dict[str, str]:
        """The `__metadata__` of a safetensors artifact of `size` bytes (its commit record's) from
        its header alone (`read_safetensors_header`)."""
        return self.read_safetensors_header(key, size)[0]["__metadata__"]

    def read_ranges(self, key: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Byte ranges [start, end) of an artifact, read all at once. As with `read_columns`, a part
        cannot be checked against the object's sha256."""
        path = self.path(key)
        try:
            return self._io("read", path, lambda: RangesRaise(self.fs).cat_ranges(
                [path] * len(ranges), [start for start, _ in ranges], [end for _, end in ranges]))
        except FileNotFoundError as error:
            raise ArtifactMissing(f"{self.url(key)} does not exist") from error

    def read_safetensors_header(self, key: str, size: int) -> tuple[dict[str, Any], int]:
        """The header of a safetensors artifact of `size` bytes (its commit record's) and where its
        data starts, from its header alone (one ranged read; two when the header is longer than
        SAFETENSORS_HEADER_SAMPLE), not its tensors. As with `read_columns`, a part cannot be
        checked against the object's sha256: whoever reads the tensors checks the whole (training
        does, before use). A length prefix past the object's end is damage, found before a read."""
        path = self.path(key)

        def read(start: int, end: int) -> bytes:
            try:
                # by keyword: s3fs's second positional parameter is the version id
                return self._io("read", path, lambda: self.fs.cat_file(path, start=start, end=end))
            except FileNotFoundError as error:
                raise ArtifactMissing(f"{self.url(key)} does not exist") from error

        head = read(0, min(size, SAFETENSORS_HEADER_SAMPLE))
        length = int.from_bytes(head[:8], "little")
        try:
            if len(head) < 8 or 8 + length > min(size, 8 + SAFETENSORS_MAX_HEADER):
                raise ValueError(f"its length prefix says {length} bytes, in an object of {size}")
            if 8 + length > len(head):
                head += read(len(head), 8 + length)
            header = json.loads(head[8 : 8 + length])
            if "__metadata__" not in header:  # every precast artifact has one
                raise KeyError("__metadata__")
            return header, 8 + length
        except (ValueError, KeyError, TypeError) as error:  # JSON errors and bad UTF-8 are ValueErrors
            raise Damaged(f"{self.url(key)} is damaged: its safetensors header does not parse ({error})") from error

    def read_verified(self, key: str, sha256: str | None = None) -> bytes:
        """The bytes of a committed artifact, checked against `sha256` (default: its commit record's)
        in the same read."""
        expected = sha256 or self.require(key)["sha256"]
        data = self.read_bytes(key)
        self._check(key, hashlib.sha256(data).hexdigest(), expected)
        return data

    def _check(self, key: str, digest: str, expected: str) -> None:
        if digest != expected:
            raise Damaged(f"{self.url(key)} is damaged: sha256 {digest} != committed {expected}")

    def verify(self, key: str) -> dict[str, Any]:
        """The commit record of `key` after checking the artifact's bytes against its checksum."""
        record = self.require(key)
        self._check(key, self.sha256(key), record["sha256"])
        return record

    def sha256(self, key: str) -> str:
        """The sha256 of the object at `key`, streamed."""
        return self._io("read", self.path(key), sha256_stream, self.fs, self.path(key))

    def local_path(self, key: str, sha256: str | None = None, cache_dir: str | Path | None = None) -> str:
        """A local file holding the committed artifact at `key`, its bytes checked against `sha256`
        (default: its commit record's): the file itself on local roots, else a cached download,
        fetched again when the cached copy differs. What the caller reads is what was checked.

        Only content-addressed artifacts are read this way, so a good cached copy never goes stale.
        """
        expected = sha256 or self.require(key)["sha256"]
        if self.is_local:
            self._check(key, file_sha256(self.path(key)), expected)
            return self.path(key)
        cache = Path(cache_dir or user_folder("PRECAST_CACHE", ".cache/precast", "local copies of remote artifacts"))
        target = cache / hashlib.sha256(self.url(key).encode()).hexdigest()[:32] / key.rsplit("/", 1)[-1]
        if target.exists() and file_sha256(target) == expected:
            return str(target)
        partial = target.with_name(f".{target.name}.{uuid.uuid4().hex}")
        try:
            with space_for(target, lambda: self.fs.size(self.path(key))):
                target.parent.mkdir(parents=True, exist_ok=True)
                self._io("download", self.path(key), self.fs.get_file, self.path(key), str(partial))
            self._check(key, file_sha256(partial), expected)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
        return str(target)

    def local_paths(self, checksums: dict[str, str], concurrency: int = 16,
                    cache_dir: str | Path | None = None) -> dict[str, str]:
        """`local_path` of many artifacts (key: sha256), `concurrency` at once: their round trips,
        downloads and hashing overlap (hashlib lets go of the GIL), instead of one after another."""
        keys = sorted(checksums)
        return dict(zip(keys, self._each(lambda key: self.local_path(key, checksums[key], cache_dir), keys,
                                         concurrency)))

    # --- writing ----------------------------------------------------------------------------
    def write_bytes(self, key: str, data: bytes) -> None:
        """Write `data` so that readers see either nothing or all of it."""
        path = self.path(key)
        if self.is_local:
            replace_local(path, lambda partial: Path(partial).write_bytes(data), len(data))
        else:
            self._io("write", path, self.fs.pipe_file, path, data)

    def create(self, key: str, data: bytes) -> bool:
        """Write `data` only if nothing is at `key` yet; True if this call wrote it. Atomic on local
        disks (hard link) and S3 (conditional PUT): of two racing callers exactly one wins."""
        path = self.path(key)
        if not self.is_local:
            try:
                self._io("create", path, lambda: self.fs.pipe_file(path, data, mode="create"))
                return True
            except FileExistsError:
                return False
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        partial = f"{path}.partial-{uuid.uuid4().hex}"
        Path(partial).write_bytes(data)
        try:
            os.link(partial, path)
            return True
        except FileExistsError:
            return False
        finally:
            os.remove(partial)

    def remove(self, key: str) -> None:
        """Delete the object at `key` (nothing if it is already gone)."""
        try:
            self._io("delete", self.path(key), self.fs.rm_file, self.path(key))
        except FileNotFoundError:
            pass

    def write_json(self, key: str, obj: Any) -> None:
        self.write_bytes(key, json_bytes(obj))

    def commit(self, key: str, data: bytes, **record: Any) -> dict[str, Any]:
        """Write an artifact and then its commit record; returns the record (with url, sha256, size)."""
        self.write_bytes(key, data)
        return self._record(key, hashlib.sha256(data).hexdigest(), len(data), record)

    def commit_file(self, local: str | Path, key: str, **record: Any) -> dict[str, Any]:
        """`commit` of a local file's bytes, uploaded streamed (`put_file`)."""
        self.put_file(local, key)
        return self._record(key, file_sha256(local), os.path.getsize(local), record)

    def _record(self, key: str, sha256: str, size: int, record: dict[str, Any]) -> dict[str, Any]:
        full = {"url": self.url(key), "sha256": sha256, "size": size, "committed_at": round(time.time(), 3), **record}
        self.write_json(key + COMMIT_SUFFIX, full)
        return full

    def commit_first(self, key: str, data: bytes, **record: Any) -> bytes:
        """Commit `data` at `key` unless another writer created it first: racing writers of one key
        all end up committing the first one's bytes, which this returns."""
        if not self.create(key, data):
            data = self.read_bytes(key)
        self.commit(key, data, **record)
        return data

    def commit_json(self, key: str, obj: Any, **record: Any) -> dict[str, Any]:
        return self.commit(key, json_bytes(obj), **record)

    def put_file(self, local: str | Path, key: str) -> None:
        """Upload a local file atomically (same guarantee as write_bytes), streamed: an object store
        shows an upload only once it is complete."""
        path = self.path(key)
        if self.is_local:
            replace_local(path, lambda partial: shutil.copyfile(local, partial), os.path.getsize(local))
        else:
            self._io("write", path, self.fs.put_file, str(local), path)


def replace_local(path: str, fill: Callable[[str], Any], needed: int | None = None) -> None:
    """`fill(partial)` writes a file (of `needed` bytes) beside `path`, which is synced and then
    renamed onto `path`: readers see the old file or the whole new one, even after a crash; a full
    disk leaves neither, and says so (`space_for`)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    partial = f"{path}.partial-{uuid.uuid4().hex}"
    try:
        with space_for(path, needed):
            fill(partial)
            with open(partial, "rb") as handle:
                os.fsync(handle.fileno())
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


def json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True).encode()


def file_sha256(path: str | Path) -> str:
    return sha256_stream(fsspec.filesystem("file"), str(path))


def sha256_stream(fs: fsspec.AbstractFileSystem, path: str, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with fs.open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()
