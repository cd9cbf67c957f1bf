"""What every source format shares: the unit of a read, the candidate a read gives, media names,
and `SourceFormat`, the record a format module fills in (tasks/ingest/formats/__init__.py
registers them).

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

import json
import posixpath
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import fsspec

from configs.schema import SourceConfig
from tasks.ingest.listing import MASKS, Listed, Listing, companion_beside
from tasks.ingest.untrusted import Rejected, read_file

IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff"})
VIDEO_EXTENSIONS = frozenset({"mp4", "m4v", "mov", "webm", "mkv"})
MEDIA_EXTENSIONS = IMAGE_EXTENSIONS | VIDEO_EXTENSIONS
Limit = Callable[[str], int]  # the most bytes read of a file by its name (`untrusted.max_bytes`)
CHUNK = 1 << 20


@dataclass
class Candidate:
    """One image with its caption variants, or the reason (`problem`) it cannot be a sample."""

    source: str  # where it came from, e.g. s3://b/x.tar::00012.jpg or meta.jsonl:7
    format: str
    image: bytes | Path | None = None  # a video's bytes are in a local file (`read_file`), not in memory
    captions: list[str] | None = None
    problem: Rejected | None = None
    mask: bytes | None = None  # its loss mask's picture (a source's `masks: files` or `column`)
    # its reference images, in order, each with where it came from (a source's `references`)
    references: list[tuple[str, bytes]] = field(default_factory=list)


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


# reads a plan's arguments (after its kind) from `fs` as candidates of format `fmt`
PlanReader = Callable[[fsspec.AbstractFileSystem, str, SourceConfig, list, Limit], Iterator[Candidate]]


@dataclass(frozen=True)
class SourceFormat:
    """A dataset format, as its module declares it: how a source is told to be of it (`auto`), how
    its listing is cut into units and those counted, and how each kind of plan its units carry
    is read (plans are JSON, so a unit can be read on another worker)."""

    name: str  # what `dataset.sources[].format` calls it
    units: Callable[[Listing, SourceConfig], Iterator[Unit]]
    count: Callable[[Listing], int]  # how many units `units` yields, without making them (progress)
    reads: dict[str, PlanReader] = field(default_factory=dict)  # by a plan's first item, its kind
    extensions: tuple[str, ...] = ()  # a file source of it, by its extension
    # a folder source of it, by what the folder holds (asked in the registry's order); None: the
    # format of a folder that no other format claims
    holds: Callable[[Listing], bool] | None = None
    beside: bool = False  # a file source whose folder is listed with it (its rows name files there)


def refused(where: str, problem: Rejected) -> Unit:
    """A unit that reads nothing and gives one candidate: `where` cannot be a sample, and why."""
    return Unit("", 0, ["refused", where, problem.reason, problem.message])


def read_refused(fs: fsspec.AbstractFileSystem, fmt: str, source: SourceConfig, args: list,
                 limit: Limit) -> Iterator[Candidate]:
    where, reason, message = args
    yield Candidate(where, fmt, problem=Rejected(reason, message))


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


def read_media(fs: fsspec.AbstractFileSystem, path: str, limit: Limit, candidate: Candidate,
               companions: dict | None = None) -> None:
    """A picture's bytes into `candidate.image`, or a video's into a local file it names; with
    `companions` (what `companion_unit` planned), the bytes of the picture's mask file and of its
    reference files."""
    companions = companions or {}
    picture = limit("x.png")  # a mask or reference is a picture, whatever a row names it (ref.mp4)
    if "mask" in companions:
        candidate.mask = read_file(fs, companions["mask"], picture, "missing_mask")
    candidate.references = [(fs.unstrip_protocol(name), read_file(fs, name, picture, "missing_reference"))
                            for name in companions.get("references", [])]
    candidate.image = read_file(fs, path, limit(path), f"missing_{media_kind(path)}", on_disk=is_video_name(path))


def companion_unit(listing: Listing, source: SourceConfig, picture: str, where: str, plan: list,
                   *objects: Listed | None, mask: str | None = None, references: list[str] | None = None) -> Unit:
    """The unit reading `objects` (as listed; the picture or video at `picture` among them) by
    `plan`, with the companions its source reads from files: its mask, the one beside it in
    `mask_path` (masks: files) or `mask`, the file its row names (masks: column); its references,
    the one beside it in each folder of `reference_path` (references: files) or `references`, the
    files its row names (references: column). Their paths end the plan as one object and their
    listed entries the key, so a changed mask or reference is read again. Refused, reading nothing,
    when the source reads one and there is none."""
    companions, entries = {}, []
    stem = posixpath.basename(picture.rpartition(".")[0])
    if source.masks == "column":
        if mask is None:
            return refused(where, Rejected("missing_mask", f"the row names no mask in {source.mask_column!r}"))
        companions["mask"], entries = mask, [listing.entry(mask)]  # not there: missing_mask when read
    elif source.masks == "files":
        if (found := companion_beside(listing, MASKS, picture)) is None:
            return refused(where, Rejected("missing_mask", f"no mask {stem}.* in mask_path {source.mask_path!r} at "
                                                           "its relative path"))
        companions["mask"], entries = found.path, [found]
    if source.references == "column":
        if not references:
            return refused(where, Rejected("missing_reference",
                                           f"the row names no reference in {source.reference_column!r}"))
        companions["references"] = references
        entries += [listing.entry(name) for name in references]  # not there: missing_reference when read
    elif source.references == "files":
        found = [companion_beside(listing, slot, picture)
                 for slot in range(MASKS + 1, MASKS + 1 + len(source.reference_folders()))]
        for folder, entry in zip(source.reference_folders(), found):
            if entry is None:
                return refused(where, Rejected("missing_reference", f"no reference {stem}.* in reference_path "
                                                                    f"{folder!r} at its relative path"))
        companions["references"] = [entry.path for entry in found]
        entries += found
    if not companions:
        return Unit(*unit_of(*objects), plan)
    return Unit(*unit_of(*objects, *entries), [*plan, companions])


def count_files(suffix: str):
    """A count of the listing's files that end in `suffix`: one unit each."""
    return lambda listing: sum(1 for _ in listing.files(suffix))


def top_level(listing: Listing, suffix: str) -> bool:
    """Whether the folder itself (not a subfolder) holds a file ending in `suffix`."""
    return any("/" not in name[len(listing.root) + 1:] and name.endswith(suffix) for name, *_ in listing.files())
