"""The records the stages hand each other: what each stage returns, typed.

Each is a plain JSON dict (Prefect persists it as JSON; a stage that ran on another node is read
back from the store into the same shape), typed here so a reader knows its fields without reading
the stage that makes it. Every stage's record has `url` (its output), `amount` (how much, in
words) and `committed_at` (its newest output's commit time, which tells the summary whether the
stage ran or was cached). Who fills each:

| record | made by |
| --- | --- |
| `DatasetRecord` | `tasks.ingest.stage.dataset_record` (and `ingest`, which adds what was new and `work`) |
| `CacheRecord` | `tasks.encode.text.text_cache_record`, `tasks.encode.latents.latent_cache_record` (the runner or the flow adds `work`) |
| `ManifestRecord` | `tasks.manifest.manifest_record` |
| `RunRecord` | `tasks.train.finished_run` |
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict


class Commit(TypedDict):
    """A commit record (`storage.store.Store.commit`), before the fields its writer adds."""

    url: str
    sha256: str
    size: int
    committed_at: float


# --- ingest -------------------------------------------------------------------------------------
class DatasetShard(TypedDict):
    id: str
    samples: list[str] | None  # None: the whole shard; else the current samples of a partly superseded one


class IngestWork(TypedDict):
    """What ingest read: bytes and source units, and the units taken from the last ingest's record."""

    bytes_read: int
    units_read: int
    units_reused: int
    workers: NotRequired[int]  # the flow's: workers that read the sources (absent in the runner's)
    io_retries: NotRequired[int]  # transient store failures retried (throttling, resets, timeouts)


class DatasetRecord(TypedDict):
    id: str
    shards: list[DatasetShard]
    samples: int
    sources: list[str]
    url: str
    report: str  # the ingest report's URL
    quarantined: int
    amount: str
    committed_at: float
    # the sha256 of ingest's record of which source each sample came from (None with one source;
    # absent from a dataset record read by its id alone)
    members: NotRequired[str | None]
    # ingest's own return only: a dataset read back from the store (a stage run alone, ingest run
    # elsewhere) has none of these
    new_shards: NotRequired[int]
    new_samples: NotRequired[int]
    work: NotRequired[IngestWork]


# --- encode-text, encode-latents ----------------------------------------------------------------
class EncodingWork(TypedDict):
    """What an encoding stage cost (`tasks.encode.models.encoding_work`)."""

    workers: int
    model_loads: int
    shards_encoded: int  # committed during this run
    shards_cached: int  # found committed already
    samples_encoded: NotRequired[int]  # by the encoder, in the shards committed during this run
    samples_copied: NotRequired[int]  # latents copied from a shard holding the same image (re-captioned)
    io_retries: NotRequired[int]  # transient store failures its shards retried
    feed_wait: NotRequired[float]  # the latent encoder: share of its encoding spent waiting for pixels


class PromptsCommit(Commit):
    rows: int
    captions: int


class TextShardCommit(Commit):
    shard: str
    encoder: str  # the family's text encoder it holds the outputs of
    rows: int  # caption variants, `<sample_id>/<variant>`
    captions: int  # distinct captions
    samples: int
    tokens: int
    truncated: int
    numerics: dict[str, Any]  # the fingerprint's precision check


class LatentShardCommit(Commit):
    shard: str
    samples: int
    clips: NotRequired[int]  # of them clips of more than one frame (shards committed before it was counted: none)
    quarantined: list[dict[str, str]]  # sample_id, reason, message
    buckets: dict[str, int]  # samples per bucket
    copied: NotRequired[int]  # of the samples, those whose latents came from a shard holding their image
    seconds: NotRequired[float]  # encoding it took, from its first batch's decoding to the last latent
    feed_wait_seconds: NotRequired[float]  # of which the VAE waited for decoded pixels


class CacheRecord(TypedDict):
    """A text or latent cache: its URL and the commit record of each of its shards."""

    url: str
    shards: list[TextShardCommit] | list[LatentShardCommit]
    amount: str
    committed_at: float
    # text caches: each encoder's cache URL and its empty caption and sample prompts, by encoder
    caches: NotRequired[dict[str, str]]
    prompts: NotRequired[dict[str, PromptsCommit]]
    work: NotRequired[EncodingWork]  # added by whoever ran the shards (runner or flow)


# --- manifest, train -----------------------------------------------------------------------------
class StoreWork(TypedDict):
    """What the manifest and training cost beyond their outputs: the store's transient failures
    retried during this run (a result found finished counts only the reads that found it)."""

    io_retries: int


class ManifestRecord(Commit):
    """The manifest's commit record; its JSON at `url` holds the id, checksums and the table's key."""

    samples: int
    buckets: dict[str, int]
    amount: str
    work: NotRequired[StoreWork]  # the stage's own return only, as a dataset's


def manifest_encoders(manifest: dict[str, Any]) -> dict[str, str]:
    """A manifest's text encoders by name, in its rows' order (`text_encoders`: the JSON's objects
    are stored with sorted keys), each with its prompts shard's key (a manifest written before
    families had several encoders names T5's alone)."""
    if "prompts_shards" not in manifest:
        return {"t5": manifest["prompts_shard"]}
    return {name: manifest["prompts_shards"][name] for name in manifest.get("text_encoders", manifest["prompts_shards"])}


def text_shards_of(row: dict[str, Any]) -> list[str]:
    """A manifest row's text cache shards, in `manifest_encoders`' order."""
    return row["text_shards"] if "text_shards" in row else [row["text_shard"]]


class RunRecord(TypedDict):
    """The commit record of a finished run's lineage, its `url` replaced by the weights' URL."""

    url: str  # the weights: `adapter` or `transformer`, whichever the run wrote
    sha256: str
    size: int
    committed_at: float
    run: str  # the run folder's URL
    samples: list[str]  # URLs of the sample grids
    sample_videos: NotRequired[list[str]]  # a run on clips: its samples as animated WebP
    model: dict[str, Any]
    weights: NotRequired[str]  # which weights it trained: "adapter" or "transformer" (`weights_of`)
    adapter: str | None  # the LoRA's folder URL (method lora), else None
    transformer: str | None  # the whole transformer's folder URL (method full), else None
    finished: float
    steps: int
    resumed_from: int
    seconds: float
    first_loss: float  # the mean over the first `loss_window` steps
    final_loss: float  # the mean over the last `loss_window` steps
    loss_window: NotRequired[int]  # absent in runs published before it was recorded
    validation_loss: float | None
    amount: str
    work: NotRequired[StoreWork]  # the stage's own return only


Record = DatasetRecord | CacheRecord | ManifestRecord | RunRecord
Work = IngestWork | EncodingWork | StoreWork

# every stage's record by stage name, what `tasks.runner.run_stages` returns; "seconds": each
# stage's wall time; the runner's own run adds the encoders' fingerprints
Records = TypedDict("Records", {
    "ingest": DatasetRecord, "encode-text": CacheRecord, "encode-latents": CacheRecord, "manifest": ManifestRecord,
    "train": RunRecord, "seconds": dict[str, float], "text_fingerprints": dict[str, str], "vae_fingerprint": str,
}, total=False)
