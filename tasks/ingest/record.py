"""The incremental sources record: what the last ingest of these sources and rules read.

Beside the dataset ref, ingest records every unit's key (its objects' path, listed size and stamp)
with what it became, and where each sample's bytes are (`layout.sources_record`). The next ingest
of the same sources and rules loads it into its ledger and takes every unit whose key is unchanged
from it (`known_outcomes`) instead of reading the unit again.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from configs.schema import DatasetConfig
from storage import layout
from storage.store import Store, file_sha256
from tasks.identity import config_hash, units_hash
from tasks.ingest.examine import Outcome
from tasks.ingest.formats import VIDEO_EXTENSIONS
from tasks.ingest.ledger import Ledger
from tasks.ingest.video import CLIPS_VERSION

log = logging.getLogger(__name__)

RECORD_PAGE = 10_000  # record rows written and read at a time
RECORD_COLUMNS = MappingProxyType({
    "kind": pa.string(), "key": pa.string(), "source": pa.string(), "format": pa.string(), "sample_id": pa.string(),
    "captions": pa.list_(pa.string()), "width": pa.int32(), "height": pa.int32(), "reason": pa.string(),
    "message": pa.string(), "shard": pa.string(), "video": pa.bool_(), "resolution": pa.int32(), "role": pa.string(),
    "references": pa.list_(pa.string())})


def write_sources_record(ledger: Ledger) -> Path:
    """The units this ingest read or reused with their outcomes ("unit" rows; a unit that gave no
    candidate is one row without a source), and where each sample's bytes are ("member" rows), as
    a parquet file in the ledger's folder, written a page at a time."""
    path = ledger.folder / "sources-record.parquet"
    schema = pa.schema(RECORD_COLUMNS, metadata={"clips_version": str(CLIPS_VERSION)})
    with pq.ParquetWriter(path, schema, compression="zstd") as writer:
        records = record_rows(ledger)
        while page := list(itertools.islice(records, RECORD_PAGE)):
            writer.write_table(pa.Table.from_pylist([{name: row.get(name) for name in RECORD_COLUMNS}
                                                     for row in page], schema=schema))
    return path


def record_rows(ledger: Ledger) -> Iterator[dict[str, Any]]:
    """The record's rows: every unit's outcomes in listing order, then every sample's shard."""
    for key, outcomes in ledger.rows("SELECT key, outcomes FROM units ORDER BY position"):
        rows = json.loads(outcomes)  # a unit that held nothing is recorded too, so it is not read again
        yield from ({"kind": "unit", "key": key, **o} for o in rows) if rows else [{"kind": "unit", "key": key}]
    for sample_id, captions, width, height, shard, resolution in ledger.rows(
            "SELECT sample_id, captions, width, height, shard, resolution FROM samples ORDER BY position"):
        yield {"kind": "member", "sample_id": sample_id, "captions": json.loads(captions), "width": width,
               "height": height, "shard": shard, "resolution": resolution or None}


def read_sources_record(store: Store, dataset: DatasetConfig, ledger: Ledger) -> str | None:
    """The last ingest's record of this config into the ledger: what each unit became (`known`)
    and where each of its samples is (`stored`, as `read_index` gives for every shard). Returns
    the record's sha256, None when there is none. Units whose samples were in shards deleted since
    are dropped from both: they are read again."""
    key = layout.sources_record(config_hash(dataset))
    return _read_record(store, key, dataset, ledger, members=True) if store.exists(key) else None


def reuse_units(store: Store, dataset: DatasetConfig, ledger: Ledger) -> None:
    """For a config not ingested yet, with `stored` read from every shard: what each unit gave, from
    the record of another config of the same units (`units_hash`: one with other caption
    prefixes), when there is one; units whose samples no shard holds are read again."""
    if not store.exists(alias := layout.units_ref(units_hash(dataset))):
        return
    if not store.exists(record := layout.sources_record(store.read_json(alias)["config"])):  # deleted since
        return
    _read_record(store, record, dataset, ledger, members=False)
    with ledger.transaction():
        ledger.run("DELETE FROM known WHERE key IN (SELECT key FROM known WHERE sample_id IS NOT NULL AND "
                   "sample_id NOT IN (SELECT sample_id FROM stored))")


def _read_record(store: Store, key: str, dataset: DatasetConfig, ledger: Ledger, members: bool) -> str:
    """The sources record at `key` into the ledger (its members too, with `members`); its sha256."""
    local = ledger.folder / "last-sources-record.parquet"
    store.get_file(key, local)
    position = 0
    with pq.ParquetFile(local) as record:
        for batch in record.iter_batches(RECORD_PAGE):
            units, stored = [], []
            for row in batch.to_pylist():
                captions = row["captions"] if row["captions"] is None else json.dumps(row["captions"])
                if row["kind"] == "member":
                    stored.append((row["sample_id"], captions, row["width"], row["height"], row["shard"],
                                   row.get("resolution") or 0))
                else:
                    position += 1
                    units.append((row["key"], position, row["source"], row["format"], row["sample_id"], captions,
                                  row["width"], row["height"], row["reason"], row["message"], False, row.get("video"),
                                  row.get("role"), row.get("references") and json.dumps(row["references"])))
            ledger.run_many("INSERT INTO known VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", units)
            if members:
                ledger.run_many("INSERT OR REPLACE INTO stored VALUES (?, ?, ?, ?, ?, ?)", stored)
        made = (record.schema_arrow.metadata or {}).get(b"clips_version", b"1").decode()
    if made != str(CLIPS_VERSION):  # clips made another way: every unit that read a video is read again
        # (a record from before outcomes said so: what names a video, and every parquet file)
        named = " OR ".join(["lower(source) LIKE ? OR lower(key) LIKE ?"] * len(VIDEO_EXTENSIONS))
        with ledger.transaction():
            ledger.run(f"DELETE FROM known WHERE key IN (SELECT key FROM known WHERE video OR (video IS NULL AND "
                       f"(format = 'parquet' OR {named})))",
                       tuple(pattern for ext in sorted(VIDEO_EXTENSIONS) for pattern in (f"%.{ext}", f"%.{ext}%")))
    with ledger.transaction():  # videos refused masks before clips took them: read again
        ledger.run("DELETE FROM known WHERE key IN (SELECT key FROM known WHERE reason = 'mask_on_clip')")
    forget_deleted_shards(store, dataset, ledger)
    return file_sha256(local)


def forget_deleted_shards(store: Store, dataset: DatasetConfig, ledger: Ledger) -> None:
    """Drops what the record says of shards deleted since (checked with one commit read per shard):
    the units whose samples they held are read again."""
    shards = [shard for (shard,) in ledger.rows("SELECT DISTINCT shard FROM stored ORDER BY shard")]
    commits = store.committed_all([layout.image_shard(shard) for shard in shards], dataset.read_concurrency)
    if gone := [shard for shard, commit in zip(shards, commits) if commit is None]:
        # someone deleted shards the record points at: what they held is read from the sources again
        log.warning("%d image shard(s) of the last ingest are gone (%s): their samples are read again",
                    len(gone), ", ".join(gone[:3]) + (", …" if len(gone) > 3 else ""))
        with ledger.transaction():
            for shard in gone:
                ledger.run("DELETE FROM known WHERE key IN (SELECT known.key FROM known JOIN stored "
                           "ON known.sample_id = stored.sample_id WHERE stored.shard = ?)", (shard,))
                ledger.run("DELETE FROM stored WHERE shard = ?", (shard,))


def known_outcomes(ledger: Ledger, key: str) -> list[Outcome] | None:
    """The outcomes the last ingest recorded for a unit, None if it did not record the unit (they
    were spilled then, not now: a reused outcome's image is in a shard)."""
    rows = ledger.all("SELECT source, format, sample_id, captions, width, height, reason, message, video, role, refs "
                      "FROM known WHERE key = ? ORDER BY position", (key,))
    if not rows:
        return None
    return [Outcome(source, fmt, sample_id, captions and json.loads(captions), width, height, reason, message,
                    video=None if video is None else bool(video), role=role, references=refs and json.loads(refs))
            for source, fmt, sample_id, captions, width, height, reason, message, video, role, refs in rows
            if source is not None]
