"""Ingest on workers: the staging protocol between the ingest (the coordinator) and a worker.

The coordinator sends a partition of a source's units (`[key, plan]`, as it listed them) through
`Partitions.run`; the worker reads and examines them with the same code as a local read
(`examine_partition`) and commits their outcomes and new images to the store as one staged parquet
file; the coordinator merges it (`unstage`) and deletes it (`merged_partition`). The staged key
names the partition's listed objects and the ingest's rules, so a partition staged already (a
retry, or a run that died before merging it) is not read again.
"""

from __future__ import annotations

import logging
import socket
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any

import fsspec
import av
import PIL
import pyarrow as pa
import pyarrow.parquet as pq

from configs.schema import DatasetConfig, StorageConfig
from storage import layout
from storage.fingerprint import hash_json
from storage.store import COMMIT_SUFFIX, ArtifactMissing, Damaged, Store
from tasks.identity import units_hash
from tasks.ingest.examine import Outcome, examine_unit, reading_threads, spill_image, video_decodes
from tasks.ingest.formats import Unit
from tasks.ingest.listing import source_options
from tasks.ingest.scheduler import in_order

log = logging.getLogger(__name__)

PARTITION_BYTES = 256 << 20  # a partition's listed bytes: what a worker stages for the ingest to fetch (a tar
                             # or parquet file larger than this is a partition of its own)
# with Pillow's and PyAV's versions, part of a staged partition's key: what decodes and normalises
# (2: clip frames timed to the container's precision, clip ids naming what a clip is; 3: outcomes say
# whether they are a video's; 4: masks from files, a masks: alpha picture without alpha its plain id;
# 5: clips take masks; 6: references)
STAGED_VERSION = 6
STAGED_PAGE = 64  # staged rows written and read at a time: each may hold an image
STAGED_COLUMNS = MappingProxyType({
    "unit": pa.int32(), "source": pa.string(), "format": pa.string(), "sample_id": pa.string(),
    "captions": pa.list_(pa.string()), "width": pa.int32(), "height": pa.int32(), "reason": pa.string(),
    "message": pa.string(), "spilled": pa.bool_(), "video": pa.bool_(), "role": pa.string(),
    "references": pa.list_(pa.string()), "image": pa.binary()})


@dataclass(frozen=True)
class Partitions:
    """Ingest on workers: `run(source index, format, [[key, plan], ...])` has a worker examine a
    partition of a source's units (`examine_partition`) and returns its staged key; `slots`
    partitions are examined at once, each of up to `size` units and PARTITION_BYTES."""

    run: Callable[[int, str, list[list]], str]
    slots: int
    size: int

    def full(self, units: list[Unit]) -> bool:
        return len(units) >= self.size or sum(unit.size for unit in units) >= PARTITION_BYTES


def examine_partition(storage: StorageConfig, dataset: DatasetConfig, index: int, fmt: str, units: list[list]) -> str:
    """A partition of source `index`'s units (`[key, plan]`, listed by the ingest that sent them)
    read and examined here, on a worker: each unit's outcomes, and the normalised bytes of each
    image it accepted, are committed to the store, one row per outcome (a unit that gave no
    candidate: one row without a source), for that ingest to merge (`unstage`). Returns the staged
    key. The key names the partition's listed objects and the ingest's rules, so a partition staged
    already (a retry, or a run that died before merging it) is not read again.

    A worker has no index of the store's shards at hand: it normalises every image it reads, also
    one a shard holds already (the same bytes again: normalising is deterministic)."""
    store = Store(storage)
    # the decoders' versions too: what they make of a file is what is staged
    key = layout.ingest_partition(hash_json([STAGED_VERSION, PIL.__version__, av.__version__, units_hash(dataset),
                                             index, fmt, units]))
    if store.committed(key) is not None:
        return key
    source = dataset.sources[index]
    fs, root = fsspec.core.url_to_fs(source.path, **source_options(source.path, storage))
    folders = {f"dataset source {source.path!r}": root}
    if source.masks == "files":
        folders[f"mask_path {source.mask_path!r}"] = fsspec.core.url_to_fs(
            source.mask_path, **source_options(source.mask_path, storage))[1]
    for folder in source.reference_folders():
        folders[f"reference_path {folder!r}"] = fsspec.core.url_to_fs(folder, **source_options(folder, storage))[1]
    for what, path in folders.items():
        if not fs.exists(path):  # not a sample's problem: this worker does not see it (a local path?)
            raise RuntimeError(f"{what} cannot be read on worker {socket.gethostname()}")
    threads = reading_threads(source.path, dataset)
    schema = pa.schema(STAGED_COLUMNS)
    with tempfile.TemporaryDirectory(prefix="precast-partition-") as folder, \
            ThreadPoolExecutor(threads, thread_name_prefix="ingest-read") as pool:
        spill = Path(folder)
        # new images wait on local disk, not in memory
        work = partial(examine_unit, fs, fmt, source, dataset=dataset, stored=lambda _: None,
                       keep=partial(spill_image, spill), decoding=video_decodes())
        local = spill / "partition.parquet"
        with pq.ParquetWriter(local, schema, compression="none") as writer:  # images are compressed already
            page: list[dict[str, Any]] = []
            read = lambda batch: pool.submit(lambda: [work(unit.plan) for unit in batch])  # noqa: E731
            examined = in_order(read, (Unit(key, 0, plan) for key, plan in units), lambda _: None, 4 * threads)
            for position, (_, outcomes, _) in enumerate(examined):
                page += [staged_row(spill, position, outcome) for outcome in outcomes or [None]]
                if len(page) >= STAGED_PAGE:
                    writer.write_table(pa.Table.from_pylist(page, schema=schema))
                    page = []
            writer.write_table(pa.Table.from_pylist(page, schema=schema))
        store.commit_file(local, key, units=len(units))
    return key


def staged_row(spill: Path, position: int, outcome: Outcome | None) -> dict[str, Any]:
    """A staged row: the outcome of the partition's unit `position` with its spilled image's bytes."""
    if outcome is None:  # a unit that gave no candidate
        return {"unit": position}
    image = (spill / outcome.sample_id).read_bytes() if outcome.spilled else None
    return {**vars(outcome), "unit": position, "image": image}


def merged_partition(partitions: Partitions, store: Store, index: int, fmt: str, keyed: list[list], spill: Path,
                     failed: threading.Event) -> list[list[Outcome]]:
    """The outcomes of keyed units (`[key, plan]` of source `index`) examined on a worker and merged
    here (`unstage`); none when the stage has `failed` meanwhile (the partition stays staged for the
    next run to take). A staged partition gone or damaged before it is merged is examined again."""
    for again in (False, True):
        key = partitions.run(index, fmt, keyed)
        if failed.is_set():  # left staged for the next run to take
            return []
        try:
            return unstage(store, key, len(keyed), spill)
        except (ArtifactMissing, Damaged) as error:
            if again:
                raise
            # another ingest of these sources merged it first, or a write of it was cut short
            log.warning("staged partition %s: %s; examined again", key, error)
            store.remove(key + COMMIT_SUFFIX)


def unstage(store: Store, key: str, count: int, spill: Path) -> list[list[Outcome]]:
    """The outcomes of a staged partition's `count` units, its images spilled as a read here
    spills them (checked against its commit record first); the staged partition is then deleted."""
    local = Path(store.local_path(key, cache_dir=spill))
    outcomes: list[list[Outcome]] = [[] for _ in range(count)]
    with pq.ParquetFile(local) as staged:
        for batch in staged.iter_batches(STAGED_PAGE):
            for row in batch.to_pylist():
                unit, image = row.pop("unit"), row.pop("image")
                if row["source"] is None:
                    continue
                if image is not None:
                    spill_image(spill, row["sample_id"], image)
                outcomes[unit].append(Outcome(**row))
    if not store.is_local:
        local.unlink()
    store.remove(key + COMMIT_SUFFIX)
    store.remove(key)
    return outcomes
