"""Examining a candidate: what it becomes (`Outcome`s), a sample or quarantined with a reason.

Each image is hashed and checked in the thread that read it (Pillow decodes without holding the
GIL), by the rules of tasks/ingest/untrusted.py; a new image is normalised and spilled to local
disk, where its shard is written from, so it does not wait in memory. A video becomes its clips,
a sample each (tasks/ingest/video.py; FFmpeg decodes without holding the GIL either), or is
quarantined whole. The same code examines a unit in the ingest's process and on a worker
(tasks/ingest/staging.py).
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import fsspec

from configs.schema import DatasetConfig, SourceConfig
from storage.fingerprint import sha256_bytes
from storage.store import DiskFull, space_for
from tasks.ingest.formats import Candidate, is_video_name, read_unit
from tasks.ingest.listing import is_remote
from tasks.ingest.untrusted import (Rejected, check_geometry, max_bytes, max_image_bytes, normalise_image,
                                    picture_has_alpha, printable)
from tasks.ingest.video import is_video, read_video


NOT_A_CONTAINER = "not an mp4, mov, webm or mkv container"  # a file named as a video, and no picture either
# appended to a picture's bytes for its sample id when its alpha is its loss mask (`masks: alpha`),
# and before the sha256 of its mask file's bytes (`masks: files` or `column`)
ALPHA_MASKED = b"\0precast: alpha is the loss mask"
MASK_FILE = b"\0precast: the loss mask of a file "
# appended to a reference's bytes for its id, so a picture that is a reference is never the same
# row as that picture as a sample; and before the ids of a target's references, for its sample id
REFERENCE = b"\0precast: a reference image"
REFERENCES = b"\0precast: made from the references "


@dataclass
class Outcome:
    """What one candidate became: a sample (its image spilled when it was new), or quarantined."""

    source: str
    format: str
    sample_id: str | None = None
    captions: list[str] | None = None
    width: int = 0
    height: int = 0
    reason: str | None = None
    message: str | None = None
    spilled: bool = False
    # from a video (a clip, or why it gave none): read again when CLIPS_VERSION changes; None: not
    # known (recorded before outcomes said so)
    video: bool | None = False
    role: str | None = None  # "reference": a target's reference image, no sample of its own
    references: list[str] | None = None  # a target's references' ids, in order


def examine(candidate: Candidate, dataset: DatasetConfig, stored: Callable[[str], tuple[int, int] | None],
            keep: Callable[[str, bytes], None], decoding: AbstractContextManager, alpha: bool = False) -> list[Outcome]:
    """One candidate checked: hashed, its geometry checked, and a new image (one `stored` does not
    give the size of) decoded, normalised and handed to `keep` under its sample id; a video, each
    of its clips, decoded while `decoding` is held (a bound on the videos decoded at once). With
    `alpha` (its source's `masks: alpha`) a picture keeps its alpha channel as its loss mask, under
    an id of its own (ALPHA_MASKED): the same file is another sample with its mask than without.
    Never raises: one bad file never fails the stage."""
    outcome = Outcome(printable(candidate.source), candidate.format)
    try:
        if candidate.problem is not None:
            raise candidate.problem
        data = candidate.image
        size = data.stat().st_size if isinstance(data, Path) else len(data or b"")
        if not size:
            raise Rejected("empty_file", "zero bytes")
        if is_video(data[:8] if isinstance(data, bytes) else _head(data)):
            outcome.video = True
            if candidate.references:
                raise Rejected("reference_on_clip", "a video cannot have references: edit training takes pictures")
            if size > dataset.video.max_bytes:
                raise Rejected("too_large", f"over video.max_bytes={dataset.video.max_bytes}")
            captions = sorted(set(candidate.captions))
            with decoding:
                return [Outcome(outcome.source, outcome.format, sample_id, captions, width, height, spilled=new,
                                video=True)
                        for sample_id, width, height, new in read_video(data, dataset, stored, keep, candidate.mask)]
        if isinstance(data, Path):  # named a video, and no container: a picture at most
            if size > max_image_bytes(dataset):
                raise Rejected("bad_video", NOT_A_CONTAINER)
            data = data.read_bytes()
        references, new = examine_references(candidate, dataset, stored)
        outcome.references = [reference.sample_id for reference in references] or None
        outcome.sample_id = picture_id(data, alpha, candidate.mask, outcome.references)
        if (size := stored(outcome.sample_id)) is not None:  # validated when first ingested; only the rules may have changed
            outcome.width, outcome.height = size
            check_geometry(outcome.width, outcome.height, dataset)
        else:
            try:
                image, outcome.width, outcome.height = normalise_image(data, dataset, alpha, candidate.mask)
            except Rejected as problem:  # named a video, and its bytes are no container and no picture
                if problem.reason == "not_image" and is_video_name(candidate.source):
                    raise Rejected("bad_video", NOT_A_CONTAINER) from problem
                raise
            keep(outcome.sample_id, image)
            outcome.spilled = True
        # variants are a set (training picks one at random): sorted, so line order or which
        # duplicate came first never changes a sample's identity
        outcome.captions = sorted(set(candidate.captions))
        for sample_id, image in new.items():  # kept only once their target is
            keep(sample_id, image)
        return [outcome, *references]
    except Rejected as problem:
        outcome.reason, outcome.message = problem.reason, printable(problem.message)
    except DiskFull:  # the machine's fault, not the file's: quarantined, the image would be lost for good
        raise
    except Exception as error:  # one bad file never fails the stage
        outcome.reason, outcome.message = "error", printable(f"{type(error).__name__}: {error}")
    outcome.sample_id = outcome.captions = outcome.references = None
    outcome.spilled = False
    return [outcome]


def examine_references(candidate: Candidate, dataset: DatasetConfig, stored: Callable[[str], tuple[int, int] | None]
                       ) -> tuple[list[Outcome], dict[str, bytes]]:
    """A candidate's references, each checked as any picture is, as outcomes of the role
    "reference" whose id is the hash of its bytes, salted (REFERENCE), and the normalised bytes of
    those no shard holds yet, by id. Raises Rejected naming the first that cannot be one
    (bad_reference, with its own reason)."""
    found, new = [], {}
    for number, (where, data) in enumerate(candidate.references, start=1):
        reference = Outcome(printable(where), candidate.format, sha256_bytes(data + REFERENCE), [], role="reference")
        try:
            if (size := stored(reference.sample_id)) is not None:
                reference.width, reference.height = size
                check_geometry(reference.width, reference.height, dataset)
            else:
                new[reference.sample_id], reference.width, reference.height = normalise_image(data, dataset)
                reference.spilled = True
        except Rejected as problem:
            raise Rejected("bad_reference", f"reference {number}, {where}: {problem.reason}: {problem.message}") from problem
        found.append(reference)
    return found, new


def picture_id(data: bytes, alpha: bool, mask: bytes | None, references: list[str] | None = None) -> str:
    """A picture's sample id: the hash of its bytes, and of its mask's (a file's, or its alpha where
    its source keeps alpha and it has some: a picture without alpha is the same sample either way),
    and of its references' ids, in order (a target with other references is another sample)."""
    if mask is not None:
        data = data + MASK_FILE + sha256_bytes(mask).encode()
    elif alpha and picture_has_alpha(data):
        data = data + ALPHA_MASKED
    if references:
        data = data + REFERENCES + ",".join(references).encode()
    return sha256_bytes(data)


def spill_image(spill: Path, sample_id: str, image: bytes) -> None:
    """A new image into the spill folder, where its shard is written from (two duplicates may
    spill at once)."""
    partial = spill / f"{sample_id}.{uuid.uuid4().hex}"
    try:
        with space_for(spill / sample_id, len(image)):
            partial.write_bytes(image)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.replace(spill / sample_id)


def examine_unit(fs: fsspec.AbstractFileSystem, fmt: str, source: SourceConfig, plan: list, dataset: DatasetConfig,
                 stored: Callable[[str], tuple[int, int] | None], keep: Callable[[str, bytes], None],
                 decoding: AbstractContextManager) -> list[Outcome]:
    """A unit's candidates (its `plan` read from `fs`), each examined; a video file copied to local
    disk to be read is removed once examined."""
    def limit(name: str) -> int:
        return max_bytes(dataset, is_video_name(name))

    outcomes: list[Outcome] = []
    for candidate in read_unit(fs, fmt, source, plan, limit):
        try:
            outcomes += examine(candidate, dataset, stored, keep, decoding, source.masks == "alpha")
        finally:
            if isinstance(candidate.image, Path):
                candidate.image.unlink(missing_ok=True)
    return outcomes


def video_decodes() -> threading.BoundedSemaphore:
    """The bound on videos decoded at once by one ingest process or partition: one a core (each
    holds its clips' frames in flight, about 0.4 GB for a 4K clip, and FFmpeg decodes a video on
    several threads already), however many files are read at once to hide an object store's latency."""
    return threading.BoundedSemaphore(os.cpu_count() or 1)


def _head(file: Path) -> bytes:
    with file.open("rb") as handle:
        return handle.read(8)


def reading_threads(path: str, dataset: DatasetConfig) -> int:
    """Reads in flight for a source: a local disk has no request latency to hide, so more threads
    than cores would only contend."""
    return dataset.read_concurrency if is_remote(path) else min(dataset.read_concurrency, os.cpu_count() or 1)
