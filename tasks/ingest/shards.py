"""Image shards: what the store's committed shards hold, and new shards for the samples none holds.

Shards are append-only and content-addressed (`tasks.identity.image_shard_id`): a sample goes to a
new shard only when no shard holds it with the same captions and resolution, and shards are cut in
sample id order, so the same samples always make the same shards.
"""

from __future__ import annotations

import itertools
import json
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from configs.schema import DatasetConfig
from storage import layout
from storage.shards import pack_image_shard, read_image_shard, shard_id_of
from storage.store import Store
from tasks.identity import image_shard_id
from tasks.ingest.ledger import Ledger
from tasks.ingest.scan import Scan

# shards packed and committed at once: packing (pyarrow), hashing and writing release the GIL; each
# holds one shard's images in memory (shard_size × image size: 77 MB at 256 photos of 300 KB)
WRITERS = min(8, os.cpu_count() or 1)
# a sample's shard that holds its image with other captions or another resolution (its captions or
# its source's resolution changed), one rule for reading the image back and for the new shard's
# `pixels_from`, whose latents are copied where they crop alike: one of the same resolution, else of
# the config's (the commonest other), else the smallest shard id (SQLite's subquery cannot order by
# the outer row: the least of the two flags and the id, the flags cut off)
HOLDER = ("(SELECT substr(min((stored.resolution != samples.resolution) || (stored.resolution != 0) || shard), 3) "
          "FROM stored WHERE stored.sample_id = samples.sample_id)")


def read_index(store: Store, ledger: Ledger) -> None:
    """Every committed image shard's samples into the ledger's `stored` table."""
    for key in store.list(layout.IMAGE_SHARDS, ".parquet"):
        if store.committed(key) is None:
            continue
        table = read_image_shard(store.read_bytes(key), ["sample_id", "captions", "width", "height", "resolution"])
        ledger.run_many("INSERT OR REPLACE INTO stored VALUES (?, ?, ?, ?, ?, ?)",
                        ((row["sample_id"], json.dumps(row["captions"]), row["width"], row["height"], shard_id_of(key),
                          row.get("resolution") or 0) for row in table.to_pylist()))


def write_new_shards(store: Store, dataset: DatasetConfig, scan: Scan,
                     committed: Callable[[str], None] | None = None) -> tuple[int, dict[str, int]]:
    """Commit shards of the samples no shard holds with these captions, in sample id order,
    `committed(url)` after each; returns how many samples there were, and how many current samples
    each shard the dataset uses holds (every sample's shard is set in the ledger).

    This thread only cuts the shards (ids and captions from the ledger) and records them; the
    images are read, packed and committed by `WRITERS` threads, at most that many shards at once
    (each holds its shard's images in memory), so no one thread handles every image."""
    ledger = scan.ledger
    with ledger.transaction():
        ledger.run("UPDATE samples SET shard = (SELECT shard FROM stored WHERE stored.sample_id = samples.sample_id "
                   "AND stored.captions = samples.captions AND stored.resolution = samples.resolution)")
    new = ledger.one("SELECT count(*) FROM samples WHERE shard IS NULL")[0]
    place_references(ledger)
    spill_known_images(store, scan)
    writing: deque[tuple[Future, str, list[tuple]]] = deque()

    def written() -> None:  # the oldest shard in flight, once committed, recorded as its samples' shard
        future, shard_id, chunk = writing.popleft()
        future.result()
        ledger.run_many("UPDATE samples SET shard = ? WHERE sample_id = ?", ((shard_id, row[0]) for row in chunk))
        if committed is not None:
            committed(store.url(layout.image_shard(shard_id)))

    last = ("", "")
    with ThreadPoolExecutor(WRITERS, thread_name_prefix="ingest-write") as pool:
        try:
            # an image a shard holds with other captions or resolution: that shard, whose latents the
            # encoder copies where it crops alike
            while placed := list(ledger.rows(
                    f"SELECT samples.sample_id, captions, width, height, source, {HOLDER}, resolution, role, refs, place "
                    "FROM samples JOIN placing ON placing.sample_id = samples.sample_id WHERE shard IS NULL "
                    "AND (place, samples.sample_id) > (?, ?) ORDER BY place, samples.sample_id LIMIT ?",
                    (*last, dataset.shard_size))):
                last = placed[-1][-1], placed[-1][0]
                chunk = [row[:-1] for row in placed]
                shard_id = image_shard_id([(sample_id, json.loads(captions), resolution)
                                           for sample_id, captions, *_, resolution, _, _ in chunk])
                writing.append((pool.submit(write_shard, store, scan.spill, shard_id, chunk), shard_id, chunk))
                if len(writing) >= WRITERS:
                    written()
            while writing:
                written()
        except BaseException:
            pool.shutdown(cancel_futures=True)  # shards committed so far are whole; a re-run finds them
            raise
    return new, dict(ledger.rows("SELECT shard, count(*) FROM samples GROUP BY shard"))


def place_references(ledger) -> None:
    """Where each sample not yet in a shard goes (the temporary table `placing`): a sample by its own
    id, as shards were always cut; an edit pair's reference beside the first new target that names
    it, so a pair and its reference mostly share a shard (an encoder that sees the references reads
    them from its target's shard; another shard is read only where a shard ends between them, or
    for a reference stored before)."""
    with ledger.transaction():
        ledger.run("DROP TABLE IF EXISTS temp.placing")
        ledger.run("DROP TABLE IF EXISTS temp.firsts")
        ledger.run("CREATE TEMP TABLE placing (sample_id TEXT PRIMARY KEY, place TEXT NOT NULL)")
        ledger.run("INSERT INTO placing SELECT sample_id, sample_id FROM samples WHERE shard IS NULL")
        ledger.run("CREATE TEMP TABLE firsts (sample_id TEXT PRIMARY KEY, place TEXT NOT NULL)")
        ledger.run("INSERT INTO firsts SELECT value, min(samples.sample_id) FROM samples, json_each(samples.refs) "
                   "WHERE shard IS NULL GROUP BY value")
        ledger.run("UPDATE placing SET place = (SELECT place FROM firsts WHERE firsts.sample_id = placing.sample_id) "
                   "WHERE sample_id IN (SELECT sample_id FROM firsts)")
        ledger.run("CREATE INDEX temp.placing_order ON placing (place, sample_id)")


def write_shard(store: Store, spill: Path, shard_id: str, chunk: list[tuple]) -> None:
    """An image shard of `chunk`'s samples (`sample_id, captions, width, height, source, pixels_from,
    resolution, role, refs`, in the order `place_references` gives), their images read from the spill folder, committed
    unless it is already (the same records, from an ingest that knew other holders: its bytes stand)."""
    if store.committed(layout.image_shard(shard_id)) is not None:
        return
    rows = [{"sample_id": sample_id, "image": (spill / sample_id).read_bytes(), "width": width,
             "height": height, "captions": json.loads(captions), "source": source, "pixels_from": holder,
             "resolution": resolution or None, "role": role, "references": refs and json.loads(refs)}
            for sample_id, captions, width, height, source, holder, resolution, role, refs in chunk]
    store.commit(layout.image_shard(shard_id), pack_image_shard(rows), samples=len(chunk))


def spill_known_images(store: Store, scan: Scan) -> None:
    """Bytes of already-ingested images whose captions changed, from a shard that holds them."""
    wanted = scan.ledger.rows(f"SELECT {HOLDER} AS holder, sample_id FROM samples WHERE shard IS NULL AND NOT spilled "
                              "ORDER BY holder")
    for shard_id, group in itertools.groupby(wanted, key=lambda row: row[0]):
        ids = {sample_id for _, sample_id in group}
        table = read_image_shard(store.read_bytes(layout.image_shard(shard_id)), columns=["sample_id", "image"])
        for sample_id, image in zip(table.column("sample_id").to_pylist(), table.column("image").to_pylist()):
            if sample_id in ids:
                (scan.spill / sample_id).write_bytes(image)
