"""`webdataset`: tar files (or a folder of them) whose adjacent members share a key: `x.jpg` (or
`x.mp4`) with `x.txt` or `x.json`, streamed."""

from __future__ import annotations

import posixpath
import tarfile
from collections.abc import Iterator
from pathlib import Path

import fsspec

from configs.schema import MAX_REFERENCES, SourceConfig
from tasks.ingest.formats.base import (CHUNK, IMAGE_EXTENSIONS, MEDIA_EXTENSIONS, VIDEO_EXTENSIONS, Candidate, Limit, SourceFormat, Unit,
                                       count_files, top_level, unit_of)
from tasks.ingest.listing import Listing
from tasks.ingest.untrusted import (MAX_CAPTION_BYTES, Rejected, caption_variants, copy_to_disk, member_problem,
                                    parse_json)


def webdataset_units(listing: Listing, source: SourceConfig) -> Iterator[Unit]:
    for listed in listing.files(".tar"):
        yield Unit(*unit_of(listed), ["tar", listed.path])


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


def read_webdataset(fs: fsspec.AbstractFileSystem, fmt: str, source: SourceConfig, args: list,
                    limit: Limit) -> Iterator[Candidate]:
    """webdataset tars: adjacent members sharing a key (`x.jpg` or `x.mp4` + `x.txt` or `x.json`), streamed."""
    (file,) = args
    limits = {**{ext: limit(f"x.{ext}") for ext in MEDIA_EXTENSIONS}, "txt": MAX_CAPTION_BYTES,
              "json": MAX_CAPTION_BYTES}
    if source.references == "column":  # `x.reference.png`, `x.reference_2.png`, …
        limits.update({f"{name}.{ext}": limit(f"x.{ext}") for name in reference_members(source)
                       for ext in IMAGE_EXTENSIONS})
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
        if source.references == "column":
            candidate.references = tar_references(url, key, parts, source)
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


def reference_members(source: SourceConfig) -> list[str]:
    """The member names (before the picture's extension) of a sample's references, in order."""
    return [source.reference_column, *(f"{source.reference_column}_{n}" for n in range(2, MAX_REFERENCES + 1))]


def tar_references(url: str, key: str, parts: dict[str, bytes | Path], source: SourceConfig) -> list[tuple[str, bytes]]:
    """A sample's reference members, in order (they stop at the first number missing)."""
    found = []
    for name in reference_members(source):
        ext = next((ext for ext in IMAGE_EXTENSIONS if f"{name}.{ext}" in parts), None)
        if ext is None:
            break
        found.append((f"{url}::{key}.{name}.{ext}", parts[f"{name}.{ext}"]))
    if not found:
        raise Rejected("missing_reference", f"no {key}.{source.reference_column}.* picture in the archive")
    return found


WEBDATASET = SourceFormat("webdataset", webdataset_units, count_files(".tar"), {"tar": read_webdataset},
                          extensions=("tar",), holds=lambda listing: top_level(listing, ".tar"))
