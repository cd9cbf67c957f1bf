"""`flaky://`: an fsspec filesystem that wraps another and makes its storage misbehave on purpose.

For rehearsing outages before they happen: point `storage.root` at `flaky://<path>` (the wrapped
filesystem is `target_protocol`, local by default) and every operation fails with a transient
error (connection reset) with probability `fail_rate`; for writes, half of those failures come
*after* the write went through, like a lost response, so retries must be idempotent. Paths
matching a `permanent` glob fail every time (EIO). `injected` counts the failures by operation.

    storage:
      root: flaky:///data/store
      options: {fail_rate: 0.1, seed: 0, permanent: ["*/cache/latents/*"]}
"""

from __future__ import annotations

import errno
import fnmatch
import random
import threading
from collections import Counter
from typing import Any

import fsspec
from fsspec.spec import AbstractFileSystem

from storage.store import FRESH_LISTINGS


class FlakyFileSystem(AbstractFileSystem):
    protocol = "flaky"

    def __init__(self, target_protocol: str = "file", target_options: dict[str, Any] | None = None,
                 fail_rate: float = 0.0, permanent: list[str] | tuple[str, ...] = (), seed: int = 0, **kwargs: Any):
        super().__init__(**kwargs)
        if not 0 <= fail_rate < 1:
            raise ValueError(f"flaky fail_rate must be in [0, 1), got {fail_rate}")
        # the store's listing setting holds for what this wraps
        listings = {key: kwargs[key] for key in FRESH_LISTINGS if key in kwargs}
        self.target = fsspec.filesystem(target_protocol, **{**listings, **(target_options or {})})
        self.fail_rate, self.permanent = fail_rate, tuple(permanent)
        self.injected: Counter[str] = Counter()
        self._random, self._lock = random.Random(seed), threading.Lock()

    def _fault(self, operation: str, path: str, applied: bool = False) -> None:
        """Raise for this call, or not. `applied`: the write already happened (a lost response)."""
        if any(fnmatch.fnmatch(path, pattern) for pattern in self.permanent):
            if not applied:
                raise OSError(errno.EIO, f"injected permanent failure: {operation} {path}")
            return
        with self._lock:
            roll = self._random.random()
        if roll < self.fail_rate and (roll < self.fail_rate / 2) == applied:
            self.injected[operation] += 1
            raise ConnectionResetError(errno.ECONNRESET, f"injected transient failure: {operation} {path}")

    def _read(self, operation: str, path: str, call, *args: Any, **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        self._fault(operation, path)
        return call(path, *args, **kwargs)

    def _write(self, operation: str, path: str, call, *args: Any, **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        self._fault(operation, path)
        result = call(path, *args, **kwargs)
        self._fault(operation, path, applied=True)
        return result

    # reads
    def ls(self, path, detail=True, **kwargs):
        return self._read("ls", path, self.target.ls, detail=detail, **kwargs)

    def find(self, path, maxdepth=None, withdirs=False, detail=False, **kwargs):
        # one listing call, as on object stores (fsspec's generic walk would swallow the errors)
        return self._read("ls", path, self.target.find, maxdepth=maxdepth, withdirs=withdirs, detail=detail, **kwargs)

    def info(self, path, **kwargs):
        return self._read("info", path, self.target.info, **kwargs)

    def exists(self, path, **kwargs):
        return self._read("exists", path, self.target.exists, **kwargs)

    def cat_file(self, path, start=None, end=None, **kwargs):
        return self._read("read", path, self.target.cat_file, start=start, end=end, **kwargs)

    def get_file(self, rpath, lpath, **kwargs):
        return self._read("read", rpath, self.target.get_file, lpath, **kwargs)

    def _open(self, path, mode="rb", **kwargs):
        return self._read("read" if "r" in mode else "write", path, self.target._open, mode, **kwargs)

    # writes
    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        # not atomic like S3's conditional PUT; enough for rehearsing failures
        if mode == "create" and self.target.exists(self._strip_protocol(path)):
            raise FileExistsError(path)
        return self._write("write", path, self.target.pipe_file, value, **kwargs)

    def put_file(self, lpath, rpath, **kwargs):
        return self._write("write", rpath, lambda path, *a, **k: self.target.put_file(lpath, path, *a, **k), **kwargs)

    def rm_file(self, path):
        return self._write("delete", path, self.target.rm_file)

    def mkdir(self, path, create_parents=True, **kwargs):
        return self.target.mkdir(self._strip_protocol(path), create_parents=create_parents, **kwargs)

    def makedirs(self, path, exist_ok=False):
        return self.target.makedirs(self._strip_protocol(path), exist_ok=exist_ok)
