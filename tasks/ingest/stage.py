"""Stage 1 — ingest: any source format → validated, content-addressed parquet shards.

`sample_id` is the sha256 of the source image bytes; a shard's id is the hash of its sorted
(sample id, captions, and its source's resolution where it has one) records. Shards are
append-only: a re-run over the same sources writes nothing and yields the same dataset id; new
samples, and samples whose captions or source resolution changed, go to new shards holding only them. Images already in a shard are not decoded again. A dataset version lists
its shards (and, for a shard only partly current, which of its samples). A bad input never fails
the stage: it is quarantined with a reason code; an unreachable source fails it, naming the source.

Each source is listed once (tasks/ingest/listing.py) and read as units (tasks/ingest/formats/),
`read_concurrency` at once or a partition at a time on workers (tasks/ingest/scan.py,
tasks/ingest/staging.py), each image hashed and checked in the reading thread
(tasks/ingest/examine.py, by the rules of tasks/ingest/untrusted.py). The units and what each
became are recorded beside the dataset ref (tasks/ingest/record.py); the next ingest of the same
sources and rules takes every unit whose objects are listed unchanged (path, size, ETag or mtime)
from that record instead of reading it, so a nightly run reads only new or rewritten objects.
Outcomes are merged in listing order, so duplicates, quarantine and shards are what one
sequential pass would give. Everything the stage keeps while it runs (listings, the last record,
samples, outcomes) is a table of its ledger (tasks/ingest/ledger.py) on local disk, so memory does not
grow with the number of objects.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from configs.schema import DatasetConfig, StorageConfig
from storage import layout
from storage.store import Store, file_sha256
from tasks.identity import config_hash, dataset_id as dataset_id_of, units_hash
from tasks.ingest.ledger import PAGE, Ledger
from tasks.ingest.record import read_sources_record, reuse_units, write_sources_record
from tasks.ingest.report import ingest_report
from tasks.ingest.scan import Scan, scan_sources
from tasks.ingest.shards import read_index, write_new_shards
from tasks.ingest.staging import Partitions

# `layout.dataset_members`: a row per sample of the dataset, sorted by sample id
MEMBERS_SCHEMA = pa.schema([("sample_id", pa.string()), ("source", pa.int32())])


def ingest(storage: StorageConfig, dataset: DatasetConfig, progress: Callable[[int, int], None] | None = None,
           partitions: Partitions | None = None, committed: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Ingest every source; returns the dataset's record (`dataset_record`), what was new, and what
    was read (`work`); `progress(units done, units listed)` as the sources are read,
    `committed(url)` as each new image shard is committed (an encoder may start on it). With
    `partitions` the sources' units are read and examined on workers, a partition each."""
    store = Store(storage)
    with tempfile.TemporaryDirectory(prefix="precast-ingest-") as folder:
        spill = Path(folder)
        ledger = Ledger(spill)
        try:
            previous = read_sources_record(store, dataset, ledger)
            if previous is None:  # no earlier ingest of this config: every shard of the store counts
                read_index(store, ledger)
                reuse_units(store, dataset, ledger)
            scan = scan_sources(storage, dataset, ledger, spill, progress, partitions)
            samples = scan.samples()
            if not samples:
                raise RuntimeError(f"no usable samples in {[s.path for s in dataset.sources]}: "
                                   f"{scan.count('quarantined')} quarantined")
            new, members = write_new_shards(store, dataset, scan, committed)
            dataset_id = commit_dataset(store, dataset, ledger, members, samples, scan.count("samples") - samples)
            per_source, members_sha = commit_members(store, dataset, scan, spill)
            quarantine = [dict(zip(("source", "format", "reason", "message"), row)) for row in ledger.rows(
                "SELECT source, format, reason, message FROM quarantined ORDER BY position")]
            report = {"dataset": dataset_id, **ingest_report(scan), "quarantine": quarantine,
                      # what ingest knows of each source, true for every config of this dataset (how
                      # training draws from them is the manifest's: `mix_markdown`)
                      "sources": [{"path": source.path, "samples": count}
                                  for source, count in zip(dataset.sources, per_source)]}
            write_if_changed(store, layout.dataset_report(dataset_id), report)
            write_if_changed(store, layout.dataset_ref(config_hash(dataset)), {"dataset": dataset_id, **(
                {"members": members_sha} if members_sha else {})})
            record_file = write_sources_record(ledger)
            if file_sha256(record_file) != previous:
                store.put_file(record_file, layout.sources_record(config_hash(dataset)))
            write_if_changed(store, layout.units_ref(units_hash(dataset)), {"config": config_hash(dataset)})
        finally:
            ledger.close()
    work = {"bytes_read": scan.bytes_read, "units_read": scan.units_read, "units_reused": scan.units_reused,
            "io_retries": len(store.retried)}
    return {**dataset_record(store, dataset_id, dataset.read_concurrency), "members": members_sha,
            "new_shards": -(-new // dataset.shard_size), "new_samples": new, "work": work}


def commit_dataset(store: Store, dataset: DatasetConfig, ledger: Ledger, members: dict[str, int],
                   samples: int, references: int) -> str:
    """The dataset version of the shards `members` counts the current rows of (`samples` samples,
    and `references` references of paired ones), committed unless it is already; returns its id."""
    shards = []
    commits = store.require_all([layout.image_shard(shard_id) for shard_id in sorted(members)],
                                dataset.read_concurrency)
    for shard_id, commit in zip(sorted(members), commits):
        # null means "the whole shard"; a list names the current samples of a partly superseded shard
        whole = members[shard_id] == commit["samples"]
        shards.append({"id": shard_id, "samples": None if whole else [
            sample_id for (sample_id,) in ledger.rows(
                "SELECT sample_id FROM samples WHERE shard = ? ORDER BY sample_id", (shard_id,))]})
    dataset_id = dataset_id_of(shards)
    record = {"id": dataset_id, "shards": shards, "samples": samples, **({"references": references} if references else {}),
              "sources": [s.path for s in dataset.sources]}
    if store.committed(layout.dataset(dataset_id)) is None:  # an unchanged dataset writes nothing
        store.commit_json(layout.dataset(dataset_id), record, samples=samples)
    return dataset_id


def commit_members(store: Store, dataset: DatasetConfig, scan: Scan, spill: Path) -> tuple[list[int], str | None]:
    """The samples of each source; with several sources, which one each sample came from
    (`layout.dataset_members`, what the manifest reads when training draws from them apart),
    written a page at a time through a file in `spill` and committed unless it is, and its sha256
    (None for one source). Keyed by its content: a sample that moves to another source changes it,
    whatever the dataset's id."""
    if len(dataset.sources) == 1:
        return [scan.samples()], None
    counts = [0] * len(dataset.sources)
    local = spill / "members.parquet"
    with pq.ParquetWriter(local, MEMBERS_SCHEMA, compression="zstd") as writer:
        page: list[tuple[str, int]] = []
        for sample_id, source in scan.members():
            counts[source] += 1
            page.append((sample_id, source))
            if len(page) == PAGE:
                writer.write_table(_members_table(page))
                page.clear()
        if page:
            writer.write_table(_members_table(page))
    sha = file_sha256(local)
    if store.committed(layout.dataset_members(sha)) is None:
        store.commit_file(local, layout.dataset_members(sha), samples=sum(counts))
    return counts, sha


def _members_table(page: list[tuple[str, int]]) -> pa.Table:
    return pa.table({"sample_id": [m[0] for m in page], "source": [m[1] for m in page]}, schema=MEMBERS_SCHEMA)


def write_if_changed(store: Store, key: str, obj: Any) -> None:
    if not store.exists(key) or store.read_json(key) != obj:
        store.write_json(key, obj)


def dataset_record(store: Store, dataset_id: str, concurrency: int = 32) -> dict[str, Any]:
    """What ingest returns for a committed dataset version, also when it ran elsewhere: the record
    (id, shards, samples, sources) with its URL, report, quarantined count, and the fields every
    stage's record has: `url`, `amount` and `committed_at` (its newest output's commit time)."""
    key = layout.dataset(dataset_id)
    record = {**json.loads(store.read_verified(key)), "url": store.url(key)}
    commits = [store.require(key)] + store.require_all([layout.image_shard(s["id"]) for s in record["shards"]],
                                                       concurrency)
    report = store.read_json(layout.dataset_report(dataset_id))
    references = f" and {record['references']} references" if record.get("references") else ""
    return {**record, "report": store.url(layout.dataset_report(dataset_id)), "quarantined": report["quarantined"],
            "amount": f"{record['samples']} samples{references} in {len(record['shards'])} shards",
            "committed_at": max(c["committed_at"] for c in commits)}


def latest_dataset(storage: StorageConfig, dataset: DatasetConfig) -> dict[str, Any]:
    """The dataset record last ingested for this config (what `precast stage` starts from)."""
    store = Store(storage)
    ref = layout.dataset_ref(config_hash(dataset))
    if not store.exists(ref):
        raise FileNotFoundError(f"no dataset ingested yet for these sources in {store.root_url}; run ingest first")
    found = store.read_json(ref)
    return {**dataset_record(store, found["dataset"]), "members": found.get("members")}
