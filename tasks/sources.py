"""Dataset source readers: folders, jsonl/csv metadata, parquet exports, webdataset tars.

Each reader streams `Candidate`s — one image with its caption variants, or the reason it cannot be
one — from any fsspec URL, one item at a time (never a whole-dataset copy). Validation of the
image itself happens in ingest; readers only find the bytes and the captions.
"""

from __future__ import annotations

import csv
import io
import json
import posixpath
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
import pyarrow.parquet as pq

from configs.schema import SourceConfig

IMAGE_EXTENSIONS = {"jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff"}
CAPTION_EXTENSIONS = ("txt", "caption")  # in order of preference


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


def caption_variants(value: Any) -> list[str]:
    """Caption variants from a caption file's bytes, a string (one variant per non-empty line) or a
    list of strings; whitespace-normalised. Raises Rejected for missing, empty or non-UTF-8 text."""
    if value is None:
        raise Rejected("missing_caption", "no caption")
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8-sig")
        except UnicodeDecodeError as error:
            raise Rejected("caption_encoding", f"caption is not UTF-8: {error}") from error
    if isinstance(value, str):
        lines = value.removeprefix("\ufeff").splitlines()
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        lines = list(value)
    else:
        raise Rejected("missing_caption", f"caption is a {type(value).__name__}, not text")
    if any("\udc80" <= ch <= "\udcff" for line in lines for ch in line):  # undecodable bytes (surrogateescape)
        raise Rejected("caption_encoding", "caption is not UTF-8")
    variants = [" ".join(line.split()) for line in lines if line.strip()]
    if not variants:
        raise Rejected("empty_caption", "caption has no text")
    return list(dict.fromkeys(variants))


def open_source(source: SourceConfig, options: dict[str, Any]) -> tuple[fsspec.AbstractFileSystem, str]:
    try:
        fs, root = fsspec.core.url_to_fs(source.path, **options)
        if not fs.exists(root):
            raise FileNotFoundError(root)
    except Exception as error:  # an unreachable source fails the stage, naming it
        raise RuntimeError(f"dataset source {source.path!r} cannot be read: {error}") from error
    return fs, root.rstrip("/")


def detect_format(fs: fsspec.AbstractFileSystem, root: str) -> str:
    """`auto`: by the file's extension, or by what a folder holds."""
    if not fs.isdir(root):
        ext = root.rsplit(".", 1)[-1].lower()
        formats = {"jsonl": "jsonl", "csv": "csv", "parquet": "parquet", "tar": "webdataset"}
        if ext not in formats:
            raise RuntimeError(f"dataset source {root!r}: cannot tell its format from the extension .{ext}")
        return formats[ext]
    names = {posixpath.basename(p) for p in fs.ls(root, detail=False)}
    if "metadata.jsonl" in names:
        return "jsonl"
    if "metadata.csv" in names:
        return "csv"
    if any(n.endswith(".parquet") for n in names):
        return "parquet"
    if any(n.endswith(".tar") for n in names):
        return "webdataset"
    return "folder"


def read_source(source: SourceConfig, options: dict[str, Any]) -> Iterator[Candidate]:
    fs, root = open_source(source, options)
    fmt = source.format if source.format != "auto" else detect_format(fs, root)
    readers = {"folder": read_folder, "jsonl": read_metadata, "csv": read_metadata, "parquet": read_parquet,
               "webdataset": read_webdataset}
    yield from readers[fmt](fs, root, source, fmt)


def source_files(fs: fsspec.AbstractFileSystem, root: str, suffix: str = "") -> list[str]:
    files = [root] if not fs.isdir(root) else sorted(fs.find(root))
    return [f for f in files if f.endswith(suffix)]


def read_folder(fs, root: str, source: SourceConfig, fmt: str) -> Iterator[Candidate]:
    files = source_files(fs, root)
    present = set(files)
    for file in files:
        stem, dot, ext = file.rpartition(".")
        if not dot or ext.lower() not in IMAGE_EXTENSIONS:
            continue
        candidate = Candidate(fs.unstrip_protocol(file), fmt)
        caption_file = next((f"{stem}.{e}" for e in CAPTION_EXTENSIONS if f"{stem}.{e}" in present), None)
        try:
            if caption_file is None:
                raise Rejected("missing_caption", f"no {posixpath.basename(stem)}.txt or .caption beside the image")
            candidate.captions = caption_variants(fs.cat_file(caption_file))
            candidate.image = fs.cat_file(file)
        except Rejected as problem:
            candidate.problem = problem
        yield candidate


def read_metadata(fs, root: str, source: SourceConfig, fmt: str) -> Iterator[Candidate]:
    """HF imagefolder style: metadata.jsonl / metadata.csv with `file_name` and a caption column;
    image paths are relative to the metadata file."""
    meta = root if not fs.isdir(root) else f"{root}/metadata.{fmt}"
    base = posixpath.dirname(meta)
    # surrogateescape keeps a row with bad bytes readable so only that row is quarantined
    text = fs.cat_file(meta).decode("utf-8", errors="surrogateescape").removeprefix("\ufeff")
    if fmt == "jsonl":
        rows = enumerate(text.splitlines(), start=1)
        records = ((n, line) for n, line in rows if line.strip())
    else:
        records = enumerate(csv.DictReader(io.StringIO(text)), start=2)
    for line_number, record in records:
        candidate = Candidate(f"{fs.unstrip_protocol(meta)}:{line_number}", fmt)
        try:
            if isinstance(record, str):
                try:
                    record = json.loads(record)
                except json.JSONDecodeError as error:
                    raise Rejected("bad_metadata", f"line is not JSON: {error}") from error
            if not isinstance(record, dict) or not record.get(source.file_column):
                raise Rejected("bad_metadata", f"no {source.file_column!r} field")
            name = str(record[source.file_column])
            if name.startswith("/") or ".." in name.split("/"):
                raise Rejected("unsafe_path", f"{name!r} points outside the metadata folder")
            candidate.source = fs.unstrip_protocol(f"{base}/{name}")
            candidate.captions = caption_variants(record.get(source.caption_column))
            try:
                candidate.image = fs.cat_file(f"{base}/{name}")
            except FileNotFoundError as error:
                raise Rejected("missing_image", f"{name} does not exist") from error
        except Rejected as problem:
            candidate.problem = problem
        yield candidate


def read_parquet(fs, root: str, source: SourceConfig, fmt: str) -> Iterator[Candidate]:
    """Parquet exports: image bytes (or a struct with `bytes`, as HF datasets writes) and caption(s)."""
    for file in source_files(fs, root, ".parquet"):
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
    return None


def read_webdataset(fs, root: str, source: SourceConfig, fmt: str) -> Iterator[Candidate]:
    """webdataset tars: adjacent members sharing a key (`x.jpg` + `x.txt` or `x.json`), streamed."""
    for file in source_files(fs, root, ".tar"):
        url = fs.unstrip_protocol(file)
        with fs.open(file, "rb") as handle, tarfile.open(fileobj=handle, mode="r|*") as archive:
            key, parts = None, {}
            for member in archive:
                if (problem := _member_problem(member)) is not None:
                    yield Candidate(f"{url}::{member.name}", fmt, problem=problem)
                    continue
                if not member.isfile():
                    continue
                directory, base = posixpath.split(member.name)
                stem, _, ext = base.partition(".")
                member_key = f"{directory}/{stem}" if directory else stem
                if member_key != key:
                    if key is not None:
                        yield from _tar_sample(url, key, parts, source, fmt)
                    key, parts = member_key, {}
                parts[ext.lower()] = archive.extractfile(member).read()
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
            try:
                meta = json.loads(parts["json"])
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise Rejected("bad_metadata", f"{key}.json is not JSON: {error}") from error
            candidate.captions = caption_variants(meta.get(source.caption_column) if isinstance(meta, dict) else None)
        else:
            raise Rejected("missing_caption", f"no {key}.txt or {key}.json in the archive")
    except Rejected as problem:
        candidate.problem = problem
    yield candidate
