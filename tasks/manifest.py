"""Stage 4 — manifest: join dataset, text cache and latent cache; record their checksums.

The manifest is the only input of training. Its id is a hash of the dataset id and the encoders'
fingerprints (each text encoder's and the VAE's, plus the prompts), so it is known before it is built and a stage run alone
can find it. Every shard it names must be committed, and its commit record's sha256 goes into the
manifest; training checks each shard's bytes against it before use. The manifest itself reads only
the cache shards' headers (which rows each holds), `MANIFEST_CONCURRENCY` shards at once, and no
image shard: of a million 1024² pictures' caches (about 2 TB) it reads at most 0.5 GB (64 KiB of
each of two caches per 256-image shard) instead of them and the image shards whole.
Output: `manifests/<manifest_id>.parquet` (one row per sample) and `manifests/<manifest_id>.json`.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from configs.schema import DatasetConfig, StorageConfig
from storage import layout
from storage.shards import read_parquet_bytes
from storage.store import Store
from tasks.identity import EMPTY, manifest_id, prompts_cache_key, text_identity
from tasks.records import ManifestRecord

MANIFEST_CONCURRENCY = 32  # shards whose commit records and headers are read at once (round trips)
MANIFEST_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("variants", pa.int32()),
        ("text_shards", pa.list_(pa.string())),  # each text encoder's, in the manifest's `text_encoders` order
        ("latent_shard", pa.string()),
        ("bucket", pa.string()),
        ("source", pa.int32()),  # the index of the dataset source it came from (0 while sources are one pool)
        # an edit pair's references, in order: their ids, the latent shards holding them and their buckets
        ("references", pa.list_(pa.string())),
        ("reference_shards", pa.list_(pa.string())),
        ("reference_buckets", pa.list_(pa.string())),
    ]
)


def build_manifest(
    storage: StorageConfig, dataset_id: str, text_fps: dict[str, str], vae_fp: str, prompts: list[str],
    mix: dict[str, Any] | None = None,
) -> ManifestRecord:
    """Write the manifest for a dataset encoded with the given fingerprints (each text encoder's,
    by name, and the VAE's), each sample with its source when training draws from the sources
    apart (`mix`: `tasks.identity.mix_identity`); returns its record, with the store failures
    retried as its `work`. The committed manifest is its own cache (so the work is always this run's)."""
    store = Store(storage)
    this_id = manifest_id(dataset_id, text_fps, vae_fp, prompts, mix)
    if (record := store.committed(layout.manifest(this_id))) is None:
        record = _write_manifest(store, this_id, dataset_id, text_fps, vae_fp, prompts, mix)
    return {**manifest_record(record), "work": {"io_retries": len(store.retried)}}


def _write_manifest(store: Store, this_id: str, dataset_id: str, text_fps: dict[str, str], vae_fp: str,
                    prompts: list[str], mix: dict[str, Any] | None) -> dict[str, Any]:
    """The manifest `this_id` (a row per sample of every shard, each shard committed) committed;
    its commit record."""
    dataset = json.loads(store.read_verified(layout.dataset(dataset_id)))
    source_of: dict[str, int] = {}
    if mix is not None and len(mix["paths"]) > 1:  # which source each sample came from, as ingest recorded it
        if mix["members"] is None:
            raise ValueError(f"dataset {dataset_id} was ingested before ingest recorded which source each sample "
                             "came from, and training draws from the sources apart: run ingest again (it reads no "
                             "unchanged file)")
        members = read_parquet_bytes(store.read_verified(layout.dataset_members(mix["members"]), mix["members"]))
        source_of = dict(zip(members.column("sample_id").to_pylist(), members.column("source").to_pylist()))
    prompts_keys = {name: prompts_cache_key(fp, prompts) for name, fp in text_fps.items()}
    checksums = {key: store.require(key)["sha256"] for key in prompts_keys.values()}
    rows, buckets, quarantined = [], Counter(), Counter()

    def text_keys(shard: dict[str, Any]) -> list[str]:
        return [layout.cache_shard("text", fp, shard["id"]) for fp in text_fps.values()]

    def latent_key(shard: dict[str, Any]) -> str:
        return layout.cache_shard("latents", vae_fp, shard["id"])

    def committed(shard: dict[str, Any]) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
        """One shard's checksums (its image shard's and its caches'), and the headers of its first
        text cache (every encoder encodes the same caption variants) and of its latent cache."""
        texts, latents = text_keys(shard), latent_key(shard)
        commits = {key: store.require(key) for key in (layout.image_shard(shard["id"]), *texts, latents)}
        return ({key: commit["sha256"] for key, commit in commits.items()},
                store.read_header(texts[0], commits[texts[0]]["size"]),
                store.read_header(latents, commits[latents]["size"]))

    with ThreadPoolExecutor(MANIFEST_CONCURRENCY) as pool:
        read = list(zip(dataset["shards"], pool.map(committed, dataset["shards"])))
    # edit pairs: where each reference's latents are, in whichever shard holds them as the dataset
    # counts it (a shard partly superseded may still hold a reference at a resolution since changed)
    current = {shard["id"]: None if shard["samples"] is None else set(shard["samples"]) for shard, _ in read}
    placed = {reference: (latent_key(shard), json.loads(latents["rows"])[reference][0])
              for shard, (_, _, latents) in read for reference in json.loads(latents["meta"]).get("reference_rows", [])
              if current[shard["id"]] is None or reference in current[shard["id"]]}
    for shard, (shard_checksums, text, latents) in read:
        checksums.update(shard_checksums)
        text_shards, latent_shard = text_keys(shard), latent_key(shard)
        # a sample's caption variants (not an edit pair's empty caption: `identity.EMPTY`)
        variants = Counter(row.rsplit("/", 1)[0] for row in json.loads(text["rows"]) if not row.endswith(f"/{EMPTY}"))
        latent_rows, meta = json.loads(latents["rows"]), json.loads(latents["meta"])
        excluded = {q["sample_id"]: q["reason"] for q in meta["quarantined"]}
        pairs = meta.get("references", {})
        members = shard["samples"] if shard["samples"] is not None else sorted(set(variants) | set(latent_rows))
        for sample_id in members:
            if sample_id in excluded:  # the latent stage quarantined it, with its reason
                quarantined[excluded[sample_id]] += 1
                continue
            if sample_id in placed:
                continue  # a reference: trained as its targets' condition, no sample of its own
            if sample_id not in latent_rows or not variants[sample_id]:
                missing = "latents" if sample_id not in latent_rows else "text embeddings"
                raise ValueError(f"sample {sample_id} of shard {shard['id']} has no {missing}")
            references = pairs.get(sample_id) or []
            if any(reference not in placed for reference in references):  # its reference's latents were quarantined
                quarantined["reference_latents"] += 1
                continue
            bucket = latent_rows[sample_id][0]
            buckets[bucket] += 1
            rows.append({"sample_id": sample_id, "variants": variants[sample_id], "text_shards": text_shards,
                         "latent_shard": latent_shard, "bucket": bucket, "source": source_of.get(sample_id, 0),
                         **({"references": references, "reference_shards": [placed[r][0] for r in references],
                             "reference_buckets": [placed[r][1] for r in references]} if references else {})})

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
    if mix is not None:  # how training draws from each source, and its samples here
        drawn = Counter(row["source"] for row in rows)
        counts = [drawn[index] for index in range(len(mix["paths"]))]
        sources = DatasetConfig(sources=[{"path": path, **settings} for path, settings in zip(mix["paths"], mix["mix"])])
        manifest["mix"] = sources.drawn(counts)
    return store.commit_json(layout.manifest(this_id), manifest, samples=len(rows), buckets=manifest["buckets"])


def manifest_record(commit: dict[str, Any]) -> ManifestRecord:
    """What the manifest stage returns, also when it ran elsewhere: the manifest's commit record
    (url, sha256, samples, buckets, committed_at) and its `amount`."""
    return {**commit, "amount": f"{commit['samples']} samples"}
