"""Dataset source readers: folders, jsonl/csv metadata, parquet exports, webdataset tars.

A source is listed once (names, sizes and ETags or modification times from the listing itself),
streamed into the ingest's ledger (tasks/ingest/ledger.py, on disk: a listing of millions of objects is
never held in memory), and cut into `Unit`s in path order: what one read takes in — an image and its caption file, a metadata row's
image, one parquet file or one tar. A unit's `key` names the objects it reads with their listed
size and stamp, so an ingest that recorded the key can take the unit's results from its record
instead of reading it again. Reading a unit streams `Candidate`s — one image with its caption
variants, or the reason it cannot be one — one item at a time (never a whole-dataset copy); ingest
reads many units at once. Validation of the image itself happens in ingest; readers only find the
bytes and the captions.

Inputs are untrusted, so no read is unbounded: an image is read to at most `max_image_bytes` + 1
bytes (enough for ingest to call it `too_large`), a caption file to MAX_CAPTION_BYTES + 1
(`caption_too_long`), and a local FIFO or device is never opened (`special_file`). Captions lose
terminal escape sequences and invisible bidi/zero-width characters, other control characters become
spaces, whitespace is collapsed, and what is left empty is `empty_caption`. A variant longer than
MAX_CAPTION_CHARS quarantines the sample (`caption_too_long`) rather than being cut: T5 reads only
the first few hundred tokens anyway, so a caption that long is a broken file (a mis-parsed CSV, a
binary dump), not a description worth keeping part of. In a tar, links, devices and members named
outside it are `unsafe_member`, archives inside it `nested_archive` (never opened), and an archive
that breaks off is `bad_archive`, the samples before the break kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import hashlib
import io
import itertools
import json
import os
import posixpath
import queue
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import fsspec
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from configs.schema import SourceConfig
from tasks.ingest.ledger import Ledger, decode_path, encode_path

IMAGE_EXTENSIONS = {"jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff"}
CAPTION_EXTENSIONS = ("txt", "caption")  # in order of preference
ARCHIVE_EXTENSIONS = {"tar", "tgz", "zip"}
MAX_CAPTION_CHARS = 10_000  # per variant: about 2,500 T5 tokens, where PixArt reads 120 to 300
MAX_CAPTION_BYTES = 1 << 20  # a caption file, member or cell, all variants together
CHUNK = 1 << 20

# ECMA-48 escape sequences (colours, cursor moves, OSC titles and links): invisible in a terminal
ANSI_ESCAPE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])")
# characters that only hide or reorder text: bidi controls (Trojan Source), zero-width space, word
# joiner, soft hyphen, BOM; ZWJ and ZWNJ stay (emoji sequences, Indic and Persian scripts)
INVISIBLE = re.compile("[\u00ad\u061c\u200b\u200e\u200f\u202a-\u202e\u2060\u2066-\u2069\ufeff]")
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
SURROGATE = re.compile("[\ud800-\udfff]")  # undecodable bytes (surrogateescape), or a lone half of a pair


class Rejected(Exception):
    """An input that cannot become a sample; `reason` is a stable code, `message` the detail."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message


@dataclass
class Candidate:
    source: str  # where it came from, e.g. s3://b/x.tar::00012.jpg or meta.jsonl:7
    format: str
    image: bytes | None = None
    captions: list[str] | None = None
    problem: Rejected | None = None


def printable(text: str) -> str:
    """`text` with control, invisible and undecodable characters escaped (`\\x1b`, `\\u202e`,
    `\\udcff`): names and messages reach logs, terminals, reports and parquet (which needs UTF-8)."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode() for ch in text)


def clean_caption(line: str) -> str:
    """One variant: escape sequences and invisible characters dropped, other control characters
    read as spaces (a NUL or a stray separator still parts two words), whitespace collapsed."""
    return " ".join(CONTROL.sub(" ", INVISIBLE.sub("", ANSI_ESCAPE.sub("", line))).split())


def caption_variants(value: Any) -> list[str]:
    """Caption variants from a caption file's bytes, a string (one variant per non-empty line) or a
    list of strings; cleaned. Raises Rejected for missing, empty, non-UTF-8 or absurdly long text."""
    if value is None:
        raise Rejected("missing_caption", "no caption")
    if isinstance(value, bytes):
        if len(value) > MAX_CAPTION_BYTES:
            raise Rejected("caption_too_long", f"caption is over {MAX_CAPTION_BYTES} bytes")
        try:
            value = value.decode("utf-8-sig")
        except UnicodeDecodeError as error:
            raise Rejected("caption_encoding", f"caption is not UTF-8: {error}") from error
    if isinstance(value, str):
        lines = value.splitlines()
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        lines = list(value)
    else:
        raise Rejected("missing_caption", f"caption is a {type(value).__name__}, not text")
    if any(SURROGATE.search(line) for line in lines):
        raise Rejected("caption_encoding", "caption is not UTF-8")
    variants = [v for v in map(clean_caption, lines) if v]
    if not variants:
        raise Rejected("empty_caption", "caption has no text")
    if max(map(len, variants)) > MAX_CAPTION_CHARS:
        raise Rejected("caption_too_long", f"a caption variant is over {MAX_CAPTION_CHARS} characters")
    return list(dict.fromkeys(variants))


def read_file(fs: fsspec.AbstractFileSystem, path: str, limit: int, missing: str) -> bytes:
    """At most `limit` + 1 bytes of a file: enough to tell it is over the limit, never more. A local
    FIFO or device is refused unopened: reading one would block or never end. A file that is not
    there (or a link to nothing) is Rejected with the reason `missing`."""
    name = posixpath.basename(path)
    try:
        if isinstance(fs, LocalFileSystem) and fs.info(path)["type"] != "file":  # info follows links
            raise Rejected("special_file", f"{name} is not a regular file")
        return fs.cat_file(path, start=0, end=limit + 1)
    except FileNotFoundError as error:
        raise Rejected(missing, f"{name} does not exist") from error


def parse_json(text: str | bytes, what: str) -> Any:
    """Lenient JSON (raw control characters in strings are cleaned later); Rejected when it is not
    JSON, nests too deep, or holds a number too long to convert."""
    try:
        return json.loads(text, strict=False)
    except (ValueError, RecursionError) as error:
        raise Rejected("bad_metadata", f"{what} is not JSON: {error}") from error


class Unit(NamedTuple):
    """One read: `key` names the objects it reads as listed ("" when it reads nothing, or reads an
    object the listing does not hold: never taken from a record), `size` their listed bytes, `plan`
    what to read (JSON: a unit can be read on another worker, by `read_unit`)."""

    key: str
    size: int
    plan: list


class Listed(NamedTuple):
    path: str
    size: int
    stamp: str


def unit_of(*objects: Listed | None) -> tuple[str, int]:
    """The key and size of a unit reading `objects`: the key names each with its listed size and
    stamp ("" when one is not listed: never taken from a record), the size is their listed bytes."""
    listed = [entry for entry in objects if entry is not None]
    return "" if len(listed) < len(objects) else json.dumps([list(entry) for entry in listed]), sum(
        entry.size for entry in listed)


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

    def local_copy(self, path: str) -> str:
        """A local file holding `path` (itself on a local disk), so it can be read more than once."""
        if isinstance(self.fs, LocalFileSystem):
            return path
        copy = self.ledger.folder / f"source-{self.index}.{hashlib.sha256(encode_path(path)).hexdigest()[:16]}"
        if not copy.exists():
            self.fs.get_file(path, str(copy))
        return str(copy)


def stamp(info: dict[str, Any]) -> str:
    """What changes when an object is rewritten: its ETag on object stores, else its mtime."""
    return str(info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") or "")


def list_source(source: SourceConfig, options: dict[str, Any], ledger: Ledger, index: int) -> Listing:
    """One listing of the source (a metadata file's folder, for the images beside it) into the
    ledger; an unreachable source fails the stage, naming it."""
    try:
        fs, root = fsspec.core.url_to_fs(source.path, **options)
        root = root.rstrip("/")
        info = fs.info(root)
        is_folder = info["type"] == "directory"
        fmt = source.format if source.format != "auto" or is_folder else format_of(root)
        if is_folder or fmt in ("jsonl", "csv"):
            objects = walk_objects(fs, root if is_folder else posixpath.dirname(root))
        else:
            objects = iter([(root, int(info.get("size") or 0), stamp(info))])
        ledger.run_many("INSERT OR REPLACE INTO objects VALUES (?, ?, ?, ?, ?, ?)",
                        ((index, encode_path(path), size, mark, encode_path(path.rpartition(".")[0]),
                          path.rpartition(".")[2]) for path, size, mark in objects))
    except Exception as error:  # an unreachable source fails the stage, naming it
        raise RuntimeError(f"dataset source {source.path!r} cannot be read: {error}") from error
    listing = Listing(fs, root, fmt, ledger, index)
    if listing.format == "auto":
        listing.format = folder_format(listing)
    return listing


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


def format_of(root: str) -> str:
    """`auto` for a file: by its extension."""
    ext = root.rsplit(".", 1)[-1].lower()
    formats = {"jsonl": "jsonl", "csv": "csv", "parquet": "parquet", "tar": "webdataset"}
    if ext not in formats:
        raise RuntimeError(f"dataset source {root!r}: cannot tell its format from the extension .{ext}")
    return formats[ext]


def folder_format(listing: Listing) -> str:
    """`auto` for a folder: by what the folder itself holds."""
    if listing.entry(f"{listing.root}/metadata.jsonl"):
        return "jsonl"
    if listing.entry(f"{listing.root}/metadata.csv"):
        return "csv"
    found = {name.rsplit(".", 1)[-1] for name, *_ in listing.files()
             if "/" not in name[len(listing.root) + 1:] and name.endswith((".parquet", ".tar"))}
    return "parquet" if "parquet" in found else "webdataset" if "tar" in found else "folder"


def source_units(listing: Listing, source: SourceConfig) -> Iterator[Unit]:
    """The units of a listed source, in the order their candidates count (first of duplicates)."""
    readers = {"folder": folder_units, "jsonl": metadata_units, "csv": metadata_units, "parquet": parquet_units,
               "webdataset": webdataset_units}
    yield from readers[listing.format](listing, source)


def count_units(listing: Listing) -> int:
    """How many units `source_units` yields, without making them (the progress bar's total)."""
    if listing.format in ("jsonl", "csv"):
        return 1 + sum(1 for _ in metadata_records(listing, metadata_file(listing)))
    if listing.format == "folder":
        return sum(1 for file in listing.files() if is_image_name(file.path))
    return sum(1 for _ in listing.files(".parquet" if listing.format == "parquet" else ".tar"))


def is_image_name(path: str) -> bool:
    stem, dot, ext = path.rpartition(".")
    return bool(dot) and ext.lower() in IMAGE_EXTENSIONS


def folder_units(listing: Listing, source: SourceConfig) -> Iterator[Unit]:
    for image, captions in listing.files_beside(*CAPTION_EXTENSIONS):
        if is_image_name(image.path):
            caption = next(filter(None, captions), None)  # in order of preference
            yield Unit(*unit_of(image, caption) if caption else unit_of(image),
                       ["file", image.path, caption and caption.path])


def metadata_file(listing: Listing) -> str:
    fmt = listing.format
    return listing.root if listing.root.endswith(f".{fmt}") else f"{listing.root}/metadata.{fmt}"


def metadata_records(listing: Listing, meta: str) -> Iterator[tuple[int, str | dict | Rejected]]:
    """(line or row number, the line, row or the reason it cannot be read) of a metadata file,
    streamed from a local copy (it is read twice: to count and to ingest). Undecodable bytes ride
    along as surrogates (surrogateescape), so only the row that holds them is quarantined."""
    with open(listing.local_copy(meta), "rb") as handle:
        if listing.format == "jsonl":  # JSON Lines ends lines at \n only: JSON strings may hold U+2028 or \x85
            for number, line in enumerate(handle, start=1):
                text = line.removesuffix(b"\n").decode("utf-8", errors="surrogateescape")
                text = text.removeprefix("\ufeff") if number == 1 else text
                if text.strip():
                    yield number, text
            return
        text = io.TextIOWrapper(handle, encoding="utf-8-sig", errors="surrogateescape", newline="\n")
        # csv stops at a bad row, so it is read row by row (a field over csv's size limit, often a
        # quote left open, costs only that row)
        reader = csv.DictReader(text)
        for number in itertools.count(2):
            try:
                yield number, next(reader)
            except StopIteration:
                return
            except csv.Error as error:
                yield number, Rejected("bad_metadata", f"row cannot be read: {error}")


def metadata_units(listing: Listing, source: SourceConfig) -> Iterator[Unit]:
    """HF imagefolder style: metadata.jsonl / metadata.csv with `file_name` and a caption column;
    image paths are relative to the metadata file. The metadata file is read here (a row's unit is
    its image, keyed with its captions); a row that cannot be a sample is a unit that reads nothing."""
    fs, fmt = listing.fs, listing.format
    meta = metadata_file(listing)
    base = posixpath.dirname(meta)
    records = metadata_records(listing, meta)
    yield Unit("", unit_of(listing.entry(meta))[1], ["none"])  # what reading the metadata cost
    for line_number, record in records:
        where = f"{fs.unstrip_protocol(meta)}:{line_number}"
        try:
            if isinstance(record, Rejected):
                raise record
            if isinstance(record, str):
                record = parse_json(record, "line")
            if not isinstance(record, dict) or not record.get(source.file_column):
                raise Rejected("bad_metadata", f"no {source.file_column!r} field")
            name = str(record[source.file_column])
            if name.startswith("/") or ".." in name.split("/"):
                raise Rejected("unsafe_path", f"{name!r} points outside the metadata folder")
            if "\x00" in name:
                raise Rejected("unsafe_path", f"{name!r} holds a NUL byte")
            where = fs.unstrip_protocol(f"{base}/{name}")
            captions = caption_variants(record.get(source.caption_column))
        except Rejected as problem:
            yield Unit("", 0, ["refused", where, problem.reason, problem.message])
            continue
        key, size = unit_of(listing.entry(f"{base}/{name}"))
        yield Unit(key and json.dumps([key, captions]), size, ["image", f"{base}/{name}", where, captions])


def parquet_units(listing: Listing, source: SourceConfig) -> Iterator[Unit]:
    for listed in listing.files(".parquet"):
        yield Unit(*unit_of(listed), ["parquet", listed.path])


def webdataset_units(listing: Listing, source: SourceConfig) -> Iterator[Unit]:
    for listed in listing.files(".tar"):
        yield Unit(*unit_of(listed), ["tar", listed.path])


def read_unit(fs: fsspec.AbstractFileSystem, fmt: str, source: SourceConfig, plan: list,
              max_image_bytes: int) -> Iterator[Candidate]:
    """The candidates of a unit's `plan`, read from `fs` (what `source_units` planned on the
    listing's filesystem, here or on another worker)."""
    kind, *args = plan
    if kind == "file":
        yield read_captioned_file(fs, fmt, *args, max_image_bytes)
    elif kind == "image":
        path, where, captions = args
        candidate = Candidate(where, fmt, captions=captions)
        try:
            candidate.image = read_file(fs, path, max_image_bytes, "missing_image")
        except Rejected as problem:
            candidate.problem = problem
        yield candidate
    elif kind == "refused":
        where, reason, message = args
        yield Candidate(where, fmt, problem=Rejected(reason, message))
    elif kind == "parquet":
        yield from read_parquet(fs, args[0], source, fmt)
    elif kind == "tar":
        yield from read_webdataset(fs, args[0], source, fmt, max_image_bytes)


def read_captioned_file(fs: fsspec.AbstractFileSystem, fmt: str, file: str, caption_file: str | None,
                        max_image_bytes: int) -> Candidate:
    """An image file of a folder and the caption file beside it."""
    candidate = Candidate(fs.unstrip_protocol(file), fmt)
    try:
        if caption_file is None:
            stem = posixpath.basename(file.rpartition(".")[0])
            raise Rejected("missing_caption", f"no {stem}.txt or .caption beside the image")
        candidate.captions = caption_variants(read_file(fs, caption_file, MAX_CAPTION_BYTES, "missing_caption"))
        candidate.image = read_file(fs, file, max_image_bytes, "missing_image")
    except Rejected as problem:
        candidate.problem = problem
    return candidate


def read_parquet(fs, file: str, source: SourceConfig, fmt: str) -> Iterator[Candidate]:
    """Parquet exports: image bytes (or a struct with `bytes`, as HF datasets writes) and caption(s).
    A batch's cells are in memory already, so ingest checks their size."""
    with fs.open(file, "rb") as handle:
        parquet = pq.ParquetFile(handle)
        missing = {source.image_column, source.caption_column} - set(parquet.schema_arrow.names)
        if missing:
            raise RuntimeError(f"dataset source {fs.unstrip_protocol(file)}: no column {sorted(missing)}")
        row = 0
        for batch in parquet.iter_batches(batch_size=64, columns=[source.image_column, source.caption_column]):
            for image, caption in zip(*(batch.column(i).to_pylist() for i in range(2))):
                candidate = Candidate(f"{fs.unstrip_protocol(file)}#{row}", fmt)
                row += 1
                try:
                    candidate.captions = caption_variants(caption)
                    candidate.image = image.get("bytes") if isinstance(image, dict) else image
                    if candidate.image is None:
                        raise Rejected("missing_image", "no image bytes in the row")
                except Rejected as problem:
                    candidate.problem = problem
                yield candidate


def _member_problem(member: tarfile.TarInfo) -> Rejected | None:
    if member.issym() or member.islnk():
        return Rejected("unsafe_member", f"{member.name} is a link")
    if member.name.startswith("/") or ".." in member.name.split("/"):
        return Rejected("unsafe_member", f"{member.name} points outside the archive")
    if not (member.isfile() or member.isdir()):
        return Rejected("unsafe_member", f"{member.name} is a device, FIFO or unknown type")
    if ARCHIVE_EXTENSIONS & set(posixpath.basename(member.name).lower().split(".")[1:]):
        return Rejected("nested_archive", f"{member.name} is an archive inside the archive: not opened")
    return None


def _read_member(archive: tarfile.TarFile, member: tarfile.TarInfo, limit: int = -1) -> bytes:
    """Up to `limit` + 1 bytes of a member's data (by default none); the rest is read through and
    dropped. Read here, a member that claims more data than the archive holds ends at the archive's
    real end, where tarfile's own skip would go on for as long as the header claims."""
    stream = None if member.issym() or member.islnk() else archive.extractfile(member)
    if stream is None:  # links, devices and folders hold no data
        return b""
    data = stream.read(limit + 1)
    while stream.read(CHUNK):
        pass
    return data


def read_webdataset(fs, file: str, source: SourceConfig, fmt: str, max_image_bytes: int) -> Iterator[Candidate]:
    """webdataset tars: adjacent members sharing a key (`x.jpg` + `x.txt` or `x.json`), streamed."""
    limits = {**dict.fromkeys(IMAGE_EXTENSIONS, max_image_bytes), "txt": MAX_CAPTION_BYTES, "json": MAX_CAPTION_BYTES}
    url = fs.unstrip_protocol(file)
    key, parts, last = None, {}, None
    try:
        with fs.open(file, "rb") as handle, tarfile.open(fileobj=handle, mode="r|*") as archive:
            for member in archive:
                if (problem := _member_problem(member)) is not None:
                    yield Candidate(f"{url}::{member.name}", fmt, problem=problem)
                    _read_member(archive, member)
                elif member.isfile():
                    directory, base = posixpath.split(member.name)
                    stem, _, ext = base.partition(".")
                    member_key = f"{directory}/{stem}" if directory else stem
                    if member_key != key:
                        if key is not None:
                            yield from _tar_sample(url, key, parts, source, fmt)
                        key, parts = member_key, {}
                    ext = ext.lower()
                    parts[ext] = _read_member(archive, member, limits.get(ext, -1))  # unused parts: none
                last = member.name
            # a tar ends in zero blocks; tarfile also stops, silently, at a header it cannot read
            if any(archive.fileobj.read(tarfile.RECORDSIZE)):
                raise tarfile.ReadError("a damaged header, or data after the end")
    except (tarfile.TarError, EOFError) as error:
        where = f"after {last}" if last else "from the start"
        yield Candidate(url, fmt, problem=Rejected("bad_archive", f"unreadable {where}: {error}"))
    if key is not None:
        yield from _tar_sample(url, key, parts, source, fmt)


def _tar_sample(url: str, key: str, parts: dict[str, bytes], source: SourceConfig, fmt: str) -> Iterator[Candidate]:
    image_ext = next((ext for ext in parts if ext in IMAGE_EXTENSIONS), None)
    if image_ext is None:
        return  # a group with no image (stray metadata) is not a sample
    candidate = Candidate(f"{url}::{key}.{image_ext}", fmt, image=parts[image_ext])
    try:
        if "txt" in parts:
            candidate.captions = caption_variants(parts["txt"])
        elif "json" in parts:
            if len(parts["json"]) > MAX_CAPTION_BYTES:
                raise Rejected("bad_metadata", f"{key}.json is over {MAX_CAPTION_BYTES} bytes")
            meta = parse_json(parts["json"], f"{key}.json")
            candidate.captions = caption_variants(meta.get(source.caption_column) if isinstance(meta, dict) else None)
        else:
            raise Rejected("missing_caption", f"no {key}.txt or {key}.json in the archive")
    except Rejected as problem:
        candidate.problem = problem
    yield candidate
