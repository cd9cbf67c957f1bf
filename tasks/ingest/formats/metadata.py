"""`jsonl` and `csv`: HF imagefolder-style metadata (`metadata.jsonl` / `metadata.csv`) with a file
name and a caption column a row, the files beside it."""

from __future__ import annotations

import csv
import io
import itertools
import json
import posixpath
from collections.abc import Iterator

import fsspec

from configs.schema import MAX_REFERENCES, SourceConfig
from tasks.ingest.formats.base import Candidate, Limit, SourceFormat, Unit, companion_unit, read_media, refused, unit_of
from tasks.ingest.listing import Listing
from tasks.ingest.untrusted import Rejected, caption_variants, parse_json


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
            path = f"{base}/{relative_name(record[source.file_column])}"
            where = fs.unstrip_protocol(path)
            captions = caption_variants(record.get(source.caption_column))
            # the row's mask file (masks: column) and reference files (references: column); a row
            # without them is refused by `companion_unit`
            mask = (f"{base}/{relative_name(record[source.mask_column])}"
                    if source.masks == "column" and record.get(source.mask_column) else None)
            references = ([f"{base}/{relative_name(name)}" for name in reference_names(record, source)]
                          if source.references == "column" else None)
        except Rejected as problem:
            yield refused(where, problem)
            continue
        unit = companion_unit(listing, source, path, where, ["image", path, where, captions], listing.entry(path),
                              mask=mask, references=references)
        yield unit._replace(key=unit.key and json.dumps([unit.key, captions]))


def reference_names(record: dict, source: SourceConfig) -> list[str]:
    """The reference file names a row gives: in `reference_column` one name or a list of them, then
    one in each of `<reference_column>_2`, `_3`, … (a csv row's further references; musubi-tuner's
    control_path_N)."""
    value = record.get(source.reference_column)
    names = list(value) if isinstance(value, list) else [] if value in (None, "") else [value]
    number = 2
    while record.get(f"{source.reference_column}_{number}") not in (None, ""):
        names.append(record[f"{source.reference_column}_{number}"])
        number += 1
    if not all(isinstance(name, str) and name for name in names):
        raise Rejected("bad_metadata", f"{source.reference_column!r} is not a file name or a list of them")
    if len(names) > MAX_REFERENCES:
        raise Rejected("bad_metadata", f"{source.reference_column!r} names {len(names)} references, more than "
                                       f"{MAX_REFERENCES}")
    return names


def relative_name(value) -> str:
    """A file name a row gives, relative to the metadata file's folder, normalised (./a.png,
    a//b.png: the listed a.png, a/b.png). Raises Rejected for one that leaves that folder."""
    name = str(value)
    if name.startswith("/") or ".." in name.split("/"):
        raise Rejected("unsafe_path", f"{name!r} points outside the metadata folder")
    if "\x00" in name:
        raise Rejected("unsafe_path", f"{name!r} holds a NUL byte")
    return posixpath.normpath(name)


def count_metadata(listing: Listing) -> int:
    return 1 + sum(1 for _ in metadata_records(listing, metadata_file(listing)))


def read_row(fs: fsspec.AbstractFileSystem, fmt: str, source: SourceConfig, args: list,
             limit: Limit) -> Iterator[Candidate]:
    """A metadata row's picture or video, with the captions the row gave."""
    path, where, captions, *companions = args
    candidate = Candidate(where, fmt, captions=captions)
    try:
        read_media(fs, path, limit, candidate, *companions)
    except Rejected as problem:
        candidate.problem = problem
    yield candidate


def read_nothing(fs: fsspec.AbstractFileSystem, fmt: str, source: SourceConfig, args: list,
                 limit: Limit) -> Iterator[Candidate]:
    """The metadata file's own unit: it was read when the units were made."""
    return iter(())


def _metadata_format(name: str) -> SourceFormat:
    return SourceFormat(name, metadata_units, count_metadata, {"image": read_row, "none": read_nothing},
                        extensions=(name,),
                        holds=lambda listing: bool(listing.entry(f"{listing.root}/metadata.{name}")),
                        beside=True)


JSONL, CSV = _metadata_format("jsonl"), _metadata_format("csv")
