"""Examining a candidate: what it becomes (an `Outcome`), a sample or quarantined with a reason.

Each image is hashed and checked in the thread that read it (Pillow decodes without holding the
GIL), by the rules of tasks/ingest/untrusted.py; a new image is normalised and spilled to local
disk, where its shard is written from, so it does not wait in memory. The same code examines a
unit in the ingest's process and on a worker (tasks/ingest/staging.py).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import fsspec

from configs.schema import DatasetConfig, SourceConfig
from storage.fingerprint import sha256_bytes
from tasks.ingest.formats import Candidate, read_unit
from tasks.ingest.listing import is_remote
from tasks.ingest.untrusted import Rejected, check_geometry, max_image_bytes, normalise_image, printable


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


def examine(candidate: Candidate, dataset: DatasetConfig, stored: Callable[[str], tuple[int, int] | None],
            keep: Callable[[str, bytes], None]) -> Outcome:
    """One candidate checked: hashed, its geometry checked, and a new image (one `stored` does not
    give the size of) decoded, normalised and handed to `keep` under its sample id. Never raises:
    one bad file never fails the stage."""
    outcome = Outcome(printable(candidate.source), candidate.format)
    try:
        if candidate.problem is not None:
            raise candidate.problem
        if not candidate.image:
            raise Rejected("empty_file", "zero bytes")
        outcome.sample_id = sha256_bytes(candidate.image)
        if (size := stored(outcome.sample_id)) is not None:  # validated when first ingested; only the rules may have changed
            outcome.width, outcome.height = size
            check_geometry(outcome.width, outcome.height, dataset)
        else:
            image, outcome.width, outcome.height = normalise_image(candidate.image, dataset)
            keep(outcome.sample_id, image)
            outcome.spilled = True
        # variants are a set (training picks one at random): sorted, so line order or which
        # duplicate came first never changes a sample's identity
        outcome.captions = sorted(set(candidate.captions))
    except Rejected as problem:
        outcome.reason, outcome.message = problem.reason, printable(problem.message)
    except Exception as error:  # one bad file never fails the stage
        outcome.reason, outcome.message = "error", printable(f"{type(error).__name__}: {error}")
    if outcome.reason is not None:
        outcome.sample_id = outcome.captions = None
        outcome.spilled = False
    return outcome


def spill_image(spill: Path, sample_id: str, image: bytes) -> None:
    """A new image into the spill folder, where its shard is written from (two duplicates may
    spill at once)."""
    partial = spill / f"{sample_id}.{uuid.uuid4().hex}"
    partial.write_bytes(image)
    partial.replace(spill / sample_id)


def examine_unit(fs: fsspec.AbstractFileSystem, fmt: str, source: SourceConfig, plan: list, dataset: DatasetConfig,
                 stored: Callable[[str], tuple[int, int] | None], keep: Callable[[str, bytes], None]) -> list[Outcome]:
    """A unit's candidates (its `plan` read from `fs`), each examined."""
    return [examine(candidate, dataset, stored, keep)
            for candidate in read_unit(fs, fmt, source, plan, max_image_bytes(dataset))]


def reading_threads(path: str, dataset: DatasetConfig) -> int:
    """Reads in flight for a source: a local disk has no request latency to hide, so more threads
    than cores would only contend."""
    return dataset.read_concurrency if is_remote(path) else min(dataset.read_concurrency, os.cpu_count() or 1)
