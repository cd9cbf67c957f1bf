"""The dataset formats, each a module of its own that declares a `SourceFormat` (how a source is
told to be of it, how its listing is cut into units and counted, how its units are read),
registered here, in the order `auto` asks them; the ingest stage asks this registry and never
names a format. A format added later joins by `register`, before the folder format (the one a
folder nothing else claims is of)."""

from __future__ import annotations

from collections.abc import Iterator

import fsspec

from configs.schema import SourceConfig
from tasks.ingest.formats.base import (IMAGE_EXTENSIONS, MEDIA_EXTENSIONS, VIDEO_EXTENSIONS, Candidate, Limit,
                                       SourceFormat, Unit, is_image_name, is_video_name, read_refused)
from tasks.ingest.formats.folder import FOLDER
from tasks.ingest.formats.metadata import CSV, JSONL
from tasks.ingest.formats.parquet import PARQUET
from tasks.ingest.formats.webdataset import WEBDATASET
from tasks.ingest.listing import Listing

__all__ = ["FORMATS", "IMAGE_EXTENSIONS", "MEDIA_EXTENSIONS", "VIDEO_EXTENSIONS", "Candidate", "SourceFormat", "Unit",
           "count_units", "file_format", "folder_format", "is_image_name", "is_video_name", "read_unit", "register",
           "source_units"]

FORMATS: dict[str, SourceFormat] = {fmt.name: fmt for fmt in (JSONL, CSV, PARQUET, WEBDATASET, FOLDER)}


def register(fmt: SourceFormat) -> None:
    """Adds `fmt` to the formats `auto` asks, after those before it and before the folder format."""
    *claiming, fallback = FORMATS.values()
    FORMATS.clear()
    FORMATS.update({f.name: f for f in (*claiming, fmt, fallback)})


def file_format(root: str) -> str:
    """`auto` for a file: by its extension."""
    ext = root.rsplit(".", 1)[-1].lower()
    for fmt in FORMATS.values():
        if ext in fmt.extensions:
            return fmt.name
    raise RuntimeError(f"dataset source {root!r}: cannot tell its format from the extension .{ext}")


def folder_format(listing: Listing) -> str:
    """`auto` for a folder: by what the folder itself holds."""
    return next((fmt.name for fmt in FORMATS.values() if fmt.holds and fmt.holds(listing)),
                next(fmt.name for fmt in FORMATS.values() if fmt.holds is None))


def source_units(listing: Listing, source: SourceConfig) -> Iterator[Unit]:
    """The units of a listed source, in the order their candidates count (first of duplicates)."""
    yield from FORMATS[listing.format].units(listing, source)


def count_units(listing: Listing) -> int:
    """How many units `source_units` yields, without making them (the progress bar's total)."""
    return FORMATS[listing.format].count(listing)


def read_unit(fs: fsspec.AbstractFileSystem, fmt: str, source: SourceConfig, plan: list,
              limit: Limit) -> Iterator[Candidate]:
    """The candidates of a unit's `plan`, read from `fs` (what `source_units` planned on the
    listing's filesystem, here or on another worker)."""
    kind, *args = plan
    reader = read_refused if kind == "refused" else FORMATS[fmt].reads[kind]
    yield from reader(fs, fmt, source, args, limit)
