"""Per-format readers of a listed source: folders, jsonl/csv metadata, parquet exports, webdataset tars.

A listed source (tasks/ingest/listing.py) is cut into `Unit`s in path order: what one read takes in
— an image and its caption file, a metadata row's image, one parquet file or one tar. A unit's
`key` names the objects it reads with their listed size and stamp, so an ingest that recorded the
key can take the unit's results from its record instead of reading it again. Reading a unit
streams `Candidate`s — one image with its caption variants, or the reason it cannot be one — one
item at a time (never a whole-dataset copy); ingest reads many units at once. Readers only find
the bytes and the captions, by the rules of tasks/ingest/untrusted.py (bounded reads, caption
sanitation, safe tar members); the image itself is checked when a candidate is examined
(tasks/ingest/examine.py). An archive that breaks off is `bad_archive`, the samples before the
break kept.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import posixpath
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import fsspec
import pyarrow.parquet as pq

from configs.schema import SourceConfig
from storage.store import PYTHON_BYTES
from tasks.ingest.listing import Listed, Listing
from tasks.ingest.untrusted import (MAX_CAPTION_BYTES, Rejected, caption_variants, copy_to_disk, member_problem,
                                    parse_json, read_file)

IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff"})
VIDEO_EXTENSIONS = frozenset({"mp4", "m4v", "mov", "webm", "mkv"})
MEDIA_EXTENSIONS = IMAGE_EXTENSIONS | VIDEO_EXTENSIONS
Limit = Callable[[str], int]  # the most bytes read of a file by its name (`untrusted.max_bytes`)
CAPTION_EXTENSIONS = ("txt", "caption")  # in order of preference
CHUNK = 1 << 20
PARQUET_BATCH_BYTES = 16 << 20  # media bytes a parquet batch holds as Python objects at most


@dataclass
class Candidate:
    """One image with its caption variants, or the reason (`problem`) it cannot be a sample."""

    source: str  # where it came from, e.g. s3://b/x.tar::00012.jpg or meta.jsonl:7
    format: str
    image: bytes | Path | None = None  # a video's bytes are in a local file (`read_file`), not in memory
    captions: list[str] | None = None
    problem: Rejected | None = None


class Unit(NamedTuple):
    """One read: `key` names the objects it reads as listed ("" when it reads nothing, or reads an
    object the listing does not hold: never taken from a record), `size` their listed bytes, `plan`
    what to read (JSON: a unit can be read on another worker, by `read_unit`)."""

    key: str
    size: int
    plan: list


def unit_of(*objects: Listed | None) -> tuple[str, int]:
    """The key and size of a unit reading `objects`: the key names each with its listed size and
    stamp ("" when one is not listed: never taken from a record), the size is their listed bytes."""
    listed = [entry for entry in objects if entry is not None]
    return "" if len(listed) < len(objects) else json.dumps([list(entry) for entry in listed]), sum(
        entry.size for entry in listed)


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
        return (sum(1 for file in listing.files() if is_image_name(file.path))
                + sum(1 for _ in listing.alone(CAPTION_EXTENSIONS, MEDIA_EXTENSIONS)))
    return sum(1 for _ in listing.files(".parquet" if listing.format == "parquet" else ".tar"))


def is_image_name(path: str) -> bool:
    """A picture's or a video's file name (a video gives clips: tasks/ingest/video.py)."""
    stem, dot, ext = path.rpartition(".")
    return bool(dot) and ext.lower() in MEDIA_EXTENSIONS


def is_video_name(path: str) -> bool:
    stem, dot, ext = path.rpartition(".")
    return bool(dot) and ext.lower() in VIDEO_EXTENSIONS


def media_kind(path: str) -> str:
    """What a file name says a source file holds: "video" or "image" (a picture)."""
    return "video" if is_video_name(path) else "image"


def folder_units(listing: Listing, source: SourceConfig) -> Iterator[Unit]:
    """Each picture or video with its caption file, then each caption file with neither beside it
    (a unit that reads nothing: its picture or video never arrived, or was removed)."""
    for image, captions in listing.files_beside(*CAPTION_EXTENSIONS):
        if is_image_name(image.path):
            caption = next(filter(None, captions), None)  # in order of preference
            yield Unit(*unit_of(image, caption) if caption else unit_of(image),
                       ["file", image.path, caption and caption.path])
    for caption in listing.alone(CAPTION_EXTENSIONS, MEDIA_EXTENSIONS):
        name = posixpath.basename(caption.path)
        yield Unit("", 0, ["refused", listing.fs.unstrip_protocol(caption.path), "orphan_caption",
                           f"no picture or video named {name.rpartition('.')[0]}.* beside {name}"])


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
    fs = listing.fs
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
              limit: Limit) -> Iterator[Candidate]:
    """The candidates of a unit's `plan`, read from `fs` (what `source_units` planned on the
    listing's filesystem, here or on another worker)."""
    kind, *args = plan
    if kind == "file":
        yield read_captioned_file(fs, fmt, *args, limit)
    elif kind == "image":
        path, where, captions = args
        candidate = Candidate(where, fmt, captions=captions)
        try:
            read_media(fs, path, limit, candidate)
        except Rejected as problem:
            candidate.problem = problem
        yield candidate
    elif kind == "refused":
        where, reason, message = args
        yield Candidate(where, fmt, problem=Rejected(reason, message))
    elif kind == "parquet":
        yield from read_parquet(fs, args[0], source, fmt)
    elif kind == "tar":
        yield from read_webdataset(fs, args[0], source, fmt, limit)


def read_captioned_file(fs: fsspec.AbstractFileSystem, fmt: str, file: str, caption_file: str | None,
                        limit: Limit) -> Candidate:
    """An image file of a folder and the caption file beside it."""
    candidate = Candidate(fs.unstrip_protocol(file), fmt)
    try:
        if caption_file is None:
            stem = posixpath.basename(file).rpartition(".")[0]
            raise Rejected("missing_caption", f"no {stem}.txt or .caption beside the {media_kind(file)}")
        candidate.captions = caption_variants(read_file(fs, caption_file, MAX_CAPTION_BYTES, "missing_caption"))
        read_media(fs, file, limit, candidate)
    except Rejected as problem:
        candidate.problem = problem
    return candidate


def read_media(fs: fsspec.AbstractFileSystem, path: str, limit: Limit, candidate: Candidate) -> None:
    """A picture's bytes into `candidate.image`, or a video's into a local file it names."""
    candidate.image = read_file(fs, path, limit(path), f"missing_{media_kind(path)}", on_disk=is_video_name(path))


def read_parquet(fs, file: str, source: SourceConfig, fmt: str) -> Iterator[Candidate]:
    """Parquet exports: image or video bytes (or a struct with `bytes`, as HF datasets writes) and
    caption(s). Arrow holds a row group's media column while its rows are read (about twice its
    bytes with pages streamed), so a batch is as many rows as fit in `PARQUET_BATCH_BYTES` (one
    video each), and ingest checks each cell's size."""
    # pages streamed CHUNK at a time, not a column chunk read whole first
    with fs.open(file, "rb") as handle, pq.ParquetFile(handle, buffer_size=CHUNK, pre_buffer=False) as parquet:
        missing = {source.image_column, source.caption_column} - set(parquet.schema_arrow.names)
        if missing:
            raise RuntimeError(f"dataset source {fs.unstrip_protocol(file)}: no column {sorted(missing)}")
        row = 0
        for batch in parquet.iter_batches(batch_size=parquet_batch_rows(parquet, source.image_column),
                                          columns=[source.image_column, source.caption_column], **PYTHON_BYTES):
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


def parquet_batch_rows(parquet: pq.ParquetFile, column: str) -> int:
    """Rows a batch: 64 small pictures, one video (the largest row group's bytes a row decide)."""
    metadata = parquet.metadata
    row_bytes = 0
    for group in range(metadata.num_row_groups):
        chunks = metadata.row_group(group)
        media = sum(chunks.column(i).total_uncompressed_size for i in range(chunks.num_columns)
                    if chunks.column(i).path_in_schema.split(".")[0] == column)
        row_bytes = max(row_bytes, media // max(chunks.num_rows, 1))
    return max(1, min(64, PARQUET_BATCH_BYTES // max(row_bytes, 1)))


def _read_member(archive: tarfile.TarFile, member: tarfile.TarInfo, limit: int = -1,
                 on_disk: bool = False) -> bytes | Path:
    """Up to `limit` + 1 bytes of a member's data (by default none), or with `on_disk` in a local
    temporary file (a video's: never held in memory); the rest is read through and dropped. Read
    here, a member that claims more data than the archive holds ends at the archive's real end,
    where tarfile's own skip would go on for as long as the header claims."""
    stream = None if member.issym() or member.islnk() else archive.extractfile(member)
    if stream is None:  # links, devices and folders hold no data
        return b""
    data = copy_to_disk(stream, limit + 1) if on_disk else stream.read(limit + 1)
    try:
        while stream.read(CHUNK):
            pass
    except BaseException:  # the archive breaks off in the member
        _discard(data)
        raise
    return data


def read_webdataset(fs, file: str, source: SourceConfig, fmt: str, limit: Limit) -> Iterator[Candidate]:
    """webdataset tars: adjacent members sharing a key (`x.jpg` or `x.mp4` + `x.txt` or `x.json`), streamed."""
    limits = {**{ext: limit(f"x.{ext}") for ext in MEDIA_EXTENSIONS}, "txt": MAX_CAPTION_BYTES,
              "json": MAX_CAPTION_BYTES}
    parts: dict[str, bytes | Path] = {}
    try:
        yield from _read_tar(fs, file, fs.unstrip_protocol(file), source, fmt, limits, parts)
    finally:  # what a group still holds when reading stops early (an error, or no more wanted)
        for part in parts.values():
            _discard(part)


def _read_tar(fs, file: str, url: str, source: SourceConfig, fmt: str, limits: dict[str, int],
              parts: dict[str, bytes | Path]) -> Iterator[Candidate]:
    """`read_webdataset`'s reading: `parts` holds the members of the group being read."""
    key, last = None, None
    try:
        with fs.open(file, "rb") as handle, tarfile.open(fileobj=handle, mode="r|*") as archive:
            for member in archive:
                if (problem := member_problem(member)) is not None:
                    yield Candidate(f"{url}::{member.name}", fmt, problem=problem)
                    _read_member(archive, member)
                elif member.isfile():
                    directory, base = posixpath.split(member.name)
                    stem, _, ext = base.partition(".")
                    member_key = f"{directory}/{stem}" if directory else stem
                    if member_key != key:
                        if key is not None:
                            yield from _tar_sample(url, key, parts, source, fmt)
                        key = member_key
                        parts.clear()
                    ext = ext.lower()
                    _discard(parts.get(ext))  # a second member of the same name: the last counts
                    parts[ext] = _read_member(archive, member, limits.get(ext, -1),  # unused parts: none
                                              on_disk=ext in VIDEO_EXTENSIONS)
                last = member.name
            # a tar ends in zero blocks; tarfile also stops, silently, at a header it cannot read
            if any(archive.fileobj.read(tarfile.RECORDSIZE)):
                raise tarfile.ReadError("a damaged header, or data after the end")
    except (tarfile.TarError, EOFError) as error:
        where = f"after {last}" if last else "from the start"
        yield Candidate(url, fmt, problem=Rejected("bad_archive", f"unreadable {where}: {error}"))
    if key is not None:
        yield from _tar_sample(url, key, parts, source, fmt)


def _discard(part: bytes | Path | None) -> None:
    """A member's data that no candidate takes: a video's local copy is removed."""
    if isinstance(part, Path):
        part.unlink(missing_ok=True)


def _tar_sample(url: str, key: str, parts: dict[str, bytes | Path], source: SourceConfig,
                fmt: str) -> Iterator[Candidate]:
    image_ext = next((ext for ext in parts if ext in MEDIA_EXTENSIONS), None)
    for ext, part in parts.items():
        if ext != image_ext:
            _discard(part)
    if image_ext is None:  # a caption whose picture or video is not in the archive; other strays are no sample
        caption = next((ext for ext in ("txt", "json") if ext in parts), None)
        if caption is not None:
            yield Candidate(f"{url}::{key}.{caption}", fmt, problem=Rejected(
                "orphan_caption", f"no picture or video named {key}.* beside {key}.{caption} in the archive"))
        return
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
