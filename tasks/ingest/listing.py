"""Listing a dataset source: once, streamed into the ingest's ledger.

A source is listed once (names, sizes and ETags or modification times from the listing itself) and
streamed into the ledger (tasks/ingest/ledger.py, on disk: a listing of millions of objects is never
held in memory): on S3 one flat listing consumed a page of 1,000 at a time (`walk_s3`), on a local
disk a directory entry at a time (`walk_local`), on other filesystems through fsspec's `find`. A
source whose format is `auto` gets its format here, from its name or what its folder holds; an
unreachable source fails the stage, naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import posixpath
import queue
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import fsspec
from fsspec.implementations.local import LocalFileSystem

from configs.schema import MAX_REFERENCES, SourceConfig, StorageConfig
from storage.store import DiskFull, fsspec_options
from tasks.ingest.ledger import Ledger, decode_path, encode_path


class Listed(NamedTuple):
    path: str
    size: int
    stamp: str


@dataclass
class Listing:
    """A source listed once: its filesystem, root and format; its objects (every object under the
    root, or the root file and what lies beside it, each with its size and stamp: ETag, else
    modification time) are rows of the ledger's `objects` table under the source's `index`."""

    fs: fsspec.AbstractFileSystem
    root: str
    format: str
    ledger: Ledger
    index: int

    def entry(self, path: str) -> Listed | None:
        """The listed object at `path`, None if the listing does not hold it."""
        found = self.ledger.one("SELECT size, stamp FROM objects WHERE source = ? AND path = ?",
                                (self.index, encode_path(path)))
        return found and Listed(path, *found)

    def files(self, suffix: str = "") -> Iterator[Listed]:
        """The objects under the root (or the root file) ending in `suffix`, in path order."""
        for data, size, mark in self.ledger.rows("SELECT path, size, stamp FROM objects WHERE source = ? "
                                                 "ORDER BY path", (self.index,)):
            path = decode_path(data)
            if path.endswith(suffix) and (path == self.root or path.startswith(self.root + "/")):
                yield Listed(path, size, mark)

    def files_beside(self, *extensions: str) -> Iterator[tuple[Listed, list[Listed | None]]]:
        """Every object under the root in path order, with the object beside it (same path up to
        the last dot) of each extension, or None: one query, where a lookup per object would cost
        a round trip to SQLite each."""
        joins = "".join(f" LEFT JOIN objects e{n} INDEXED BY objects_stem ON e{n}.source = o.source AND e{n}.stem = o.stem AND e{n}.ext = ?"
                        for n in range(len(extensions)))
        columns = "".join(f", e{n}.path, e{n}.size, e{n}.stamp" for n in range(len(extensions)))
        query = f"SELECT o.path, o.size, o.stamp{columns} FROM objects o{joins} WHERE o.source = ? ORDER BY o.path"
        for row in self.ledger.rows(query, (*extensions, self.index)):
            path = decode_path(row[0])
            if path.startswith(self.root + "/"):
                beside = [None if row[at] is None else Listed(decode_path(row[at]), *row[at + 1:at + 3])
                          for at in range(3, len(row), 3)]
                yield Listed(path, *row[1:3]), beside

    def alone(self, extensions: tuple[str, ...], partners: frozenset[str]) -> Iterator[Listed]:
        """The objects under the root with one of `extensions` and no object beside them with one
        of `partners` (in any case), in path order: a caption file whose picture or video is gone."""
        marks = ", ".join("?" * len(extensions))
        kinds = ", ".join("?" * len(partners))
        query = (f"SELECT o.path, o.size, o.stamp FROM objects o WHERE o.source = ? AND o.ext IN ({marks}) AND NOT EXISTS "
                 f"(SELECT 1 FROM objects p INDEXED BY objects_stem WHERE p.source = o.source AND p.stem = o.stem "
                 f"AND lower(p.ext) IN ({kinds})) ORDER BY o.path")
        for data, size, mark in self.ledger.rows(query, (self.index, *extensions, *sorted(partners))):
            path = decode_path(data)
            if path.startswith(self.root + "/"):
                yield Listed(path, size, mark)

    def local_copy(self, path: str) -> str:
        """A local file holding `path` (itself on a local disk), so it can be read more than once."""
        if isinstance(self.fs, LocalFileSystem):
            return path
        copy = self.ledger.folder / f"source-{self.index}.{hashlib.sha256(encode_path(path)).hexdigest()[:16]}"
        if not copy.exists():
            self.fs.get_file(path, str(copy))
        return str(copy)


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def source_options(path: str, storage: StorageConfig) -> dict[str, Any]:
    """Remote sources share the store's fsspec options (endpoint, region); local ones need none."""
    return fsspec_options(storage) if is_remote(path) else {}


def stamp(info: dict[str, Any]) -> str:
    """What changes when an object is rewritten: its ETag on object stores, else its mtime."""
    return str(info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") or "")


def list_source(source: SourceConfig, options: dict[str, Any], ledger: Ledger, index: int) -> Listing:
    """One listing of the source (a metadata file's folder, for the images beside it) into the
    ledger; an unreachable source fails the stage, naming it."""
    from tasks.ingest.formats import FORMATS, file_format, folder_format  # which read listings

    try:
        fs, root = fsspec.core.url_to_fs(source.path, **options)
        root = root.rstrip("/")
        info = fs.info(root)
        is_folder = info["type"] == "directory"
        fmt = source.format if source.format != "auto" or is_folder else file_format(root)
        if is_folder or FORMATS[fmt].beside:
            objects = walk_objects(fs, root if is_folder else posixpath.dirname(root))
        else:
            objects = iter([(root, int(info.get("size") or 0), stamp(info))])
        ledger.run_many("INSERT OR REPLACE INTO objects VALUES (?, ?, ?, ?, ?, ?)",
                        ((index, encode_path(path), size, mark, encode_path(path.rpartition(".")[0]),
                          path.rpartition(".")[2]) for path, size, mark in objects))
    except DiskFull:  # this machine's disk, not the source
        raise
    except Exception as error:  # an unreachable source fails the stage, naming it
        raise RuntimeError(f"dataset source {source.path!r} cannot be read: {error}") from error
    listing = Listing(fs, root, fmt, ledger, index)
    if listing.format == "auto":
        listing.format = folder_format(listing)
    base = root if is_folder else posixpath.dirname(root)
    for kind, rules, reading in (("masks", MASK_FORMATS, source.masks), ("references", REFERENCE_FORMATS,
                                                                           source.references)):
        if reading in rules and listing.format not in rules[reading]:
            raise RuntimeError(f"dataset source {source.path!r}: {kind}: {reading} reads {kind} for "
                               f"{', '.join(rules[reading])} sources, not {listing.format}")
    if source.masks == "files":
        list_companions(listing, source, "mask_path", source.mask_path, MASKS, base, options)
    for slot, folder in enumerate(source.reference_folders(), start=MASKS + 1):
        list_companions(listing, source, "reference_path", folder, slot, base, options)
    return listing


# the source formats each way of reading masks, and references, from outside the picture serves
MASK_FORMATS = {"files": ("folder", "jsonl", "csv"), "column": ("jsonl", "csv", "parquet")}
REFERENCE_FORMATS = {"files": ("folder", "jsonl", "csv"), "column": ("jsonl", "csv", "parquet", "webdataset")}
MASKS = 0  # the companion slot of a source's mask folder; its reference folders are slots 1, 2, …


def companions_of(index: int, slot: int) -> int:
    """Where the ledger's `objects` table holds companion folder `slot` of source `index` (its mask
    folder, or one of its reference folders): below every source's own index."""
    return -1 - index * (MAX_REFERENCES + 1) - slot


def list_companions(listing: Listing, source: SourceConfig, name: str, url: str, slot: int, base: str,
                    options: dict[str, Any]) -> None:
    """A companion folder of the source (its `mask_path`, or a folder of its `reference_path`,
    named `name` in errors) listed into the ledger under `companions_of(index, slot)`, each picture
    with the stem its target has under `base` (the folder the source's names are relative to: the
    companion a/x.png has the stem of the picture a/x.jpg), so a picture finds it by the stem index."""
    from tasks.ingest.formats import IMAGE_EXTENSIONS

    try:
        fs, folder = fsspec.core.url_to_fs(url, **options)
        folder = folder.rstrip("/")
        if fs.protocol != listing.fs.protocol:  # read with the source's filesystem, here or on a worker
            raise ValueError("it is not on the source's filesystem")
        if fs.info(folder)["type"] != "directory":
            raise ValueError("it is not a folder")
        if listing.format == "folder" and (folder + "/").startswith(listing.root + "/"):
            raise ValueError("it lies inside the source folder, whose pictures it would be read as")
        found = ((path, size, mark) for path, size, mark in walk_objects(fs, folder)
                 if path.rpartition(".")[2].lower() in IMAGE_EXTENSIONS)
        listing.ledger.run_many("INSERT OR REPLACE INTO objects VALUES (?, ?, ?, ?, ?, ?)",
                                ((companions_of(listing.index, slot), encode_path(path), size, mark,
                                  encode_path(base + path[len(folder):].rpartition(".")[0]), path.rpartition(".")[2])
                                 for path, size, mark in found))
    except DiskFull:
        raise
    except Exception as error:
        raise RuntimeError(f"dataset source {source.path!r}: {name} {url!r} cannot be read: {error}") from error


def companion_beside(listing: Listing, slot: int, picture: str) -> Listed | None:
    """The picture of companion folder `slot` beside the picture at `picture` (a path under the
    folder the source's names are relative to), None when the folder holds none: of several
    (a/x.png, a/x.jpg), the first by path."""
    found = listing.ledger.one("SELECT path, size, stamp FROM objects INDEXED BY objects_stem WHERE source = ? "
                               "AND stem = ? ORDER BY path LIMIT 1",
                               (companions_of(listing.index, slot), encode_path(picture.rpartition(".")[0])))
    return found and Listed(decode_path(found[0]), *found[1:])


def walk_objects(fs: fsspec.AbstractFileSystem, folder: str) -> Iterator[tuple[str, int, str]]:
    """(path, size, stamp) of every object under `folder`, streamed (in no particular order): S3 a
    page of 1,000 at a time, a local disk a directory entry at a time; other filesystems through
    fsspec's `find`, which holds the whole listing at once."""
    if isinstance(fs, LocalFileSystem):
        yield from walk_local(folder)
    elif type(fs).__name__ == "S3FileSystem":
        yield from walk_s3(fs, folder)
    else:
        for path, entry in fs.find(folder, detail=True).items():
            if entry.get("type", "file") != "directory":
                yield path, int(entry.get("size") or 0), stamp(entry)


def walk_local(folder: str) -> Iterator[tuple[str, int, str]]:
    """As fsspec lists a local folder: links and special files are objects (a link's size is its
    target's), folders that cannot be opened are skipped."""
    pending = [folder]
    while pending:
        directory = pending.pop()
        try:
            entries = os.scandir(directory)
        except OSError:
            continue
        with entries:
            for entry in entries:
                path = f"{directory}/{entry.name}"
                try:
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(path)
                        continue
                    own = entry.stat(follow_symlinks=False)
                    size = own.st_size
                    if entry.is_symlink():
                        try:
                            size = entry.stat(follow_symlinks=True).st_size
                        except OSError:
                            size = 0
                except OSError:
                    continue
                yield path, size, str(own.st_mtime)


def walk_s3(fs: fsspec.AbstractFileSystem, folder: str) -> Iterator[tuple[str, int, str]]:
    """One flat listing (no delimiter: a request per 1,000 objects), consumed a page at a time on
    s3fs's event loop through its own paginated lister, so no full listing is ever held."""
    bucket, key, _ = fs.split_path(folder)
    pages: queue.Queue = queue.Queue(maxsize=4)

    async def produce() -> None:
        page = []
        async for entry in fs._iterdir(bucket, delimiter="", prefix=f"{key}/" if key else ""):
            if entry["type"] != "directory" and not entry["name"].endswith("/"):
                page.append((entry["name"], int(entry.get("size") or 0), stamp(entry)))
            if len(page) == 1000:
                await asyncio.to_thread(pages.put, page)
                page = []
        await asyncio.to_thread(pages.put, page)
        await asyncio.to_thread(pages.put, None)

    listing = asyncio.run_coroutine_threadsafe(produce(), fs.loop)
    try:
        while True:
            try:
                page = pages.get(timeout=0.1)
            except queue.Empty:
                if listing.done() and pages.empty():
                    break
                continue
            if page is None:
                break
            yield from page
        listing.result()  # the listing's own error, if it failed
    finally:
        listing.cancel()
        while not listing.done() or not pages.empty():  # a producer blocked on a full queue is let go
            with contextlib.suppress(queue.Empty):
                pages.get(timeout=0.01)
