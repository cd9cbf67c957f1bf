"""Image shards: what the store's committed shards hold, and new shards for the samples none holds.

Shards are append-only and content-addressed (`tasks.identity.image_shard_id`): a sample goes to a
new shard only when no shard holds it with the same captions, and shards are cut in sample id order,
so the same samples always make the same shards.
"""

from __future__ import annotations

import itertools
import json

from configs.schema import DatasetConfig
from storage import layout
from storage.shards import pack_image_shard, read_image_shard, shard_id_of
from storage.store import Store
from tasks.identity import image_shard_id
from tasks.ingest.ledger import Ledger
from tasks.ingest.scan import Scan


def read_index(store: Store, ledger: Ledger) -> None:
    """Every committed image shard's samples into the ledger's `stored` table."""
    for key in store.list(layout.IMAGE_SHARDS, ".parquet"):
        if store.committed(key) is None:
            continue
        table = read_image_shard(store.read_bytes(key), columns=["sample_id", "captions", "width", "height"])
        ledger.run_many("INSERT OR REPLACE INTO stored VALUES (?, ?, ?, ?, ?)",
                        ((row["sample_id"], json.dumps(row["captions"]), row["width"], row["height"], shard_id_of(key))
                         for row in table.to_pylist()))


def write_new_shards(store: Store, dataset: DatasetConfig, scan: Scan) -> tuple[int, dict[str, int]]:
    """Commit shards of the samples no shard holds with these captions, in sample id order; returns
    how many there were, and how many current samples each shard the dataset uses holds (every
    sample's shard is set in the ledger)."""
    ledger = scan.ledger
    with ledger.transaction():
        ledger.run("UPDATE samples SET shard = (SELECT shard FROM stored WHERE stored.sample_id = samples.sample_id "
                   "AND stored.captions = samples.captions)")
    new = ledger.one("SELECT count(*) FROM samples WHERE shard IS NULL")[0]
    spill_known_images(store, scan)
    last = ""
    while True:
        chunk = list(ledger.rows("SELECT sample_id, captions, width, height, source FROM samples "
                                 "WHERE shard IS NULL AND sample_id > ? ORDER BY sample_id LIMIT ?",
                                 (last, dataset.shard_size)))
        if not chunk:
            break
        last = chunk[-1][0]
        shard_id = image_shard_id([(sample_id, json.loads(captions)) for sample_id, captions, *_ in chunk])
        rows = [{"sample_id": sample_id, "image": (scan.spill / sample_id).read_bytes(), "width": width,
                 "height": height, "captions": json.loads(captions), "source": source}
                for sample_id, captions, width, height, source in chunk]
        store.commit(layout.image_shard(shard_id), pack_image_shard(rows), samples=len(chunk))
        ledger.run_many("UPDATE samples SET shard = ? WHERE sample_id = ?", ((shard_id, row[0]) for row in chunk))
    return new, dict(ledger.rows("SELECT shard, count(*) FROM samples GROUP BY shard"))


def spill_known_images(store: Store, scan: Scan) -> None:
    """Bytes of already-ingested images whose captions changed, from a shard that holds them."""
    wanted = scan.ledger.rows("SELECT (SELECT shard FROM stored WHERE stored.sample_id = samples.sample_id LIMIT 1) "
                              "AS holder, sample_id FROM samples WHERE shard IS NULL AND NOT spilled ORDER BY holder")
    for shard_id, group in itertools.groupby(wanted, key=lambda row: row[0]):
        ids = {sample_id for _, sample_id in group}
        table = read_image_shard(store.read_bytes(layout.image_shard(shard_id)), columns=["sample_id", "image"])
        for sample_id, image in zip(table.column("sample_id").to_pylist(), table.column("image").to_pylist()):
            if sample_id in ids:
                (scan.spill / sample_id).write_bytes(image)
