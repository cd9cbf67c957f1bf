"""Stage 4 — manifest: join dataset, text cache and latent cache; verify; record checksums.

The manifest is the only input of training. Its id is a hash of the dataset id and the encoders'
fingerprints (each text encoder's and the VAE's, plus the prompts), so it is known before it is built and a stage run alone
can find it. Every shard it names is checked against its committed sha256 here, and again by
training before use.
Output: `manifests/<manifest_id>.parquet` (one row per sample) and `manifests/<manifest_id>.json`.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from configs.schema import StorageConfig
from storage import layout
from storage.shards import LatentShard, RaggedShard
from storage.store import Store
from tasks.identity import manifest_id, prompts_cache_key, text_identity
from tasks.records import ManifestRecord

MANIFEST_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("variants", pa.int32()),
        ("text_shards", pa.list_(pa.string())),  # each text encoder's, in the manifest's `text_encoders` order
        ("latent_shard", pa.string()),
        ("bucket", pa.string()),
    ]
)


def build_manifest(
    storage: StorageConfig, dataset_id: str, text_fps: dict[str, str], vae_fp: str, prompts: list[str]
) -> ManifestRecord:
    """Write the manifest for a dataset encoded with the given fingerprints (each text encoder's,
    by name, and the VAE's); returns its record, with the store failures retried as its `work`.
    The committed manifest is its own cache (so the work is always this run's)."""
    store = Store(storage)
    this_id = manifest_id(dataset_id, text_fps, vae_fp, prompts)
    if (record := store.committed(layout.manifest(this_id))) is None:
        record = _write_manifest(store, this_id, dataset_id, text_fps, vae_fp, prompts)
    return {**manifest_record(record), "work": {"io_retries": len(store.retried)}}


def _write_manifest(store: Store, this_id: str, dataset_id: str, text_fps: dict[str, str], vae_fp: str,
                    prompts: list[str]) -> dict[str, Any]:
    """The manifest `this_id` (its rows, each shard checked against its commit record) committed;
    its commit record."""
    dataset = json.loads(store.read_verified(layout.dataset(dataset_id)))
    prompts_keys = {name: prompts_cache_key(fp, prompts) for name, fp in text_fps.items()}
    checksums = {key: store.verify(key)["sha256"] for key in prompts_keys.values()}
    rows, buckets, quarantined = [], Counter(), Counter()
    for shard in dataset["shards"]:
        image_key = layout.image_shard(shard["id"])
        text_keys = [layout.cache_shard("text", fp, shard["id"]) for fp in text_fps.values()]
        latent_key = layout.cache_shard("latents", vae_fp, shard["id"])
        checksums[image_key] = store.verify(image_key)["sha256"]
        for needed in (*text_keys, latent_key):  # checked in the read that is used below
            checksums[needed] = store.require(needed)["sha256"]
        # every encoder encodes the same caption variants: the first's rows stand for all
        text = RaggedShard(store.local_path(text_keys[0], checksums[text_keys[0]]))
        latents = LatentShard(store.local_path(latent_key, checksums[latent_key]))
        variants = Counter(row.rsplit("/", 1)[0] for row in text.rows)
        excluded = {q["sample_id"]: q["reason"] for q in latents.meta["quarantined"]}
        members = shard["samples"] if shard["samples"] is not None else sorted(set(variants) | set(latents.rows))
        for sample_id in members:
            if sample_id in excluded:  # the latent stage quarantined it, with its reason
                quarantined[excluded[sample_id]] += 1
                continue
            if sample_id not in latents or not variants[sample_id]:
                missing = "latents" if sample_id not in latents else "text embeddings"
                raise ValueError(f"sample {sample_id} of shard {shard['id']} has no {missing}")
            bucket = latents.rows[sample_id][0]
            buckets[bucket] += 1
            rows.append({"sample_id": sample_id, "variants": variants[sample_id], "text_shards": text_keys,
                         "latent_shard": latent_key, "bucket": bucket})

    table_key = layout.manifest_table(this_id)
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=MANIFEST_SCHEMA), buffer)
    table_record = store.commit(table_key, buffer.getvalue(), samples=len(rows))
    checksums[table_key] = table_record["sha256"]
    manifest = {
        "id": this_id, "dataset": dataset_id, "text_fingerprint": text_identity(text_fps),
        "text_fingerprints": text_fps, "text_encoders": list(text_fps), "vae_fingerprint": vae_fp, "prompts": prompts, "prompts_shards": prompts_keys,
        "table": table_key, "samples": len(rows),
        "buckets": dict(sorted(buckets.items())), "quarantined": dict(quarantined), "checksums": checksums,
    }
    return store.commit_json(layout.manifest(this_id), manifest, samples=len(rows), buckets=manifest["buckets"])


def manifest_record(commit: dict[str, Any]) -> ManifestRecord:
    """What the manifest stage returns, also when it ran elsewhere: the manifest's commit record
    (url, sha256, samples, buckets, committed_at) and its `amount`."""
    return {**commit, "amount": f"{commit['samples']} samples"}
