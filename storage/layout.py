"""The store's layout: the key of every artifact kind, in one place.

Keys are relative to the store root (`Store.url(key)` makes a URL). Content-addressed ids go in
(shard, dataset, manifest and run ids, encoder fingerprints); nothing else in precast spells a
path. `COMMITTED` lists the kinds that are only valid with a commit record beside them, which
`precast verify` checks.

    shards/images/<shard_id>.parquet
    datasets/<dataset_id>.json, datasets/<dataset_id>.report.json
    refs/datasets/<config hash>.json                          the latest dataset of a dataset config
    refs/datasets/<config hash>.sources.parquet               what that ingest read, for the next one
    refs/datasets/units-<units hash>.json                     the config whose record serves these units
    datasets/members/<sha256>.parquet                         which source each sample came from (several sources)
    staging/ingest/<partition id>.parquet                     a worker's examined partition, until merged
    cache/text/<fp>/<shard_id>.safetensors, prompts/<hash>.safetensors, numerics.json
    cache/latents/<fp>/<shard_id>.safetensors
    manifests/<manifest_id>.json, manifests/<manifest_id>.parquet
    runs/<run_id>/lineage.json, config.yaml, metrics.jsonl, loss_curve.png, progress.json, work.json, lease,
                  stages.json, tensorboard/, rendezvous/<attempt>/ (nodes meeting),
                  checkpoints/step-<8 digits>.safetensors, samples/step-<6 digits>.png,
                  adapter/ or transformer/
    prefect/results/                                          Prefect results and cache keys
"""

from __future__ import annotations

import os
import re

IMAGE_SHARDS = "shards/images"
RUNS = "runs"
PREFECT_RESULTS = "prefect/results"
CHECKPOINT_PREFIX = "checkpoints/step-"


# --- ingest ---------------------------------------------------------------------------------------
def image_shard(shard_id: str) -> str:
    return f"{IMAGE_SHARDS}/{shard_id}.parquet"


def dataset(dataset_id: str) -> str:
    return f"datasets/{dataset_id}.json"


def common_folder(urls: list[str]) -> str:
    """The folder (ending in "/") that holds every one of `urls`: what a list of them is shown
    relative to."""
    return os.path.commonprefix(urls).rpartition("/")[0] + "/"


def split_url(url: str, folder: str, expected: str) -> tuple[str, str]:
    """(store root URL, the rest after `<folder>/`) of a URL inside a store's `folder`: the one
    parser of URLs users give; `expected` is the shape the error names."""
    root, marker, rest = url.rstrip("/").rpartition(f"/{folder}/")
    if not marker or not rest:
        raise ValueError(f"{url}: expected {expected}")
    return root, rest


def parse_dataset(url: str) -> tuple[str, str]:
    """(store root URL, dataset id) of a dataset record's URL."""
    root, name = split_url(url, "datasets", "<root>/datasets/<dataset_id>.json")
    if not name.endswith(".json") or "/" in name:
        raise ValueError(f"{url}: expected <root>/datasets/<dataset_id>.json")
    return root, name.removesuffix(".json")


def parse_run(url: str) -> tuple[str, str]:
    """(store root URL, run key) of a run's URL or of its adapter/transformer URL."""
    root, rest = split_url(url, RUNS, f"<root>/{RUNS}/<run_id>")
    run = f"{RUNS}/{rest}"
    for part in ("adapter", "transformer"):
        run = run.removesuffix(f"/{RUN_PARTS[part]}")
    if run.count("/") != 1:
        raise ValueError(f"{url}: expected <root>/{RUNS}/<run_id>, or its adapter or transformer folder")
    return root, run


def dataset_report(dataset_id: str) -> str:
    """The report of the latest ingest that produced this dataset (quarantine included)."""
    return f"datasets/{dataset_id}.report.json"


def dataset_ref(config_hash: str) -> str:
    return f"refs/datasets/{config_hash}.json"


def dataset_members(sha256: str) -> str:
    """Which of a dataset config's sources each sample of its dataset came from (a config of
    several sources: the manifest reads it when training draws from them apart), by its content."""
    return f"datasets/members/{sha256}.parquet"


def units_ref(units_hash: str) -> str:
    """Which dataset config last recorded what these sources' units give (configs that differ only
    in their caption prefixes share it: `tasks.identity.units_hash`)."""
    return f"refs/datasets/units-{units_hash}.json"


def sources_record(config_hash: str) -> str:
    """What the latest ingest of a dataset config read: each unit's listed objects and outcomes."""
    return f"refs/datasets/{config_hash}.sources.parquet"


def ingest_partition(partition_id: str) -> str:
    """Outcomes and new images of a partition of a source examined on a worker, until the ingest
    that sent it merges them (then deleted)."""
    return f"staging/ingest/{partition_id}.parquet"


# --- caches: kind "text" (T5 embeddings) or "latents" (VAE posteriors), under the encoder's fingerprint ---
def cache(kind: str, fingerprint: str) -> str:
    return f"cache/{kind}/{fingerprint}"


def cache_shard(kind: str, fingerprint: str, shard_id: str) -> str:
    return f"{cache(kind, fingerprint)}/{shard_id}.safetensors"


def text_prompts(fingerprint: str, prompts_hash: str) -> str:
    """The empty caption and the sample prompts, encoded."""
    return f"{cache('text', fingerprint)}/prompts/{prompts_hash}.safetensors"


def text_numerics(fingerprint: str) -> str:
    """The fingerprint's precision check, measured once."""
    return f"{cache('text', fingerprint)}/numerics.json"


# --- manifests ------------------------------------------------------------------------------------
def manifest(manifest_id: str) -> str:
    return f"manifests/{manifest_id}.json"


def manifest_table(manifest_id: str) -> str:
    return f"manifests/{manifest_id}.parquet"


# --- runs ----------------------------------------------------------------------------------------
RUN_PARTS = {
    "lineage": "lineage.json",  # the run's commit record: written last, it says the run finished
    "config": "config.yaml",
    "metrics": "metrics.jsonl",
    "loss_curve": "loss_curve.png",
    "progress": "progress.json",  # relayed from rank 0 of a multi-process run
    "work": "work.json",  # the store failures the training processes retried (the stage's work)
    "stages": "stages.json",  # the pipeline summary of the flow run that trained it (the run page's)
    "tensorboard": "tensorboard",  # the TensorBoard event files (one per attempt)
    "lease": "lease",  # one trainer at a time
    "samples": "samples",
    "checkpoints": "checkpoints",
    "adapter": "adapter",  # trained weights: a PEFT adapter,
    "transformer": "transformer",  # or the whole transformer (diffusers)
}


def run(run_id: str) -> str:
    return f"{RUNS}/{run_id}"


def run_part(run: str, part: str) -> str:
    """The key of one of RUN_PARTS in a run (`run`: a run's key or path)."""
    return f"{run}/{RUN_PARTS[part]}"


def rendezvous(run: str, attempt: str) -> str:
    """The folder where the nodes of one training attempt meet (tasks/train/distributed.py)."""
    return f"{run}/rendezvous/{attempt}"


def sample(run: str, step: int, kind: str = "png") -> str:
    """A run's sample grid at `step` (png), or its samples' videos side by side (webp)."""
    return f"{run_part(run, 'samples')}/step-{step:06d}.{kind}"


def checkpoint(run: str, step: int) -> str:
    return f"{run}/{CHECKPOINT_PREFIX}{step:08d}.safetensors"


def checkpoint_step(key: str) -> int:
    return int(key.rsplit(CHECKPOINT_PREFIX, 1)[1].removesuffix(".safetensors"))


# keys that are only valid with a commit record beside them (`precast verify`)
COMMITTED = re.compile(
    rf"^({IMAGE_SHARDS}/[^/]+\.parquet"
    r"|cache/(text|latents)/[^/]+/[^/]+\.safetensors"
    r"|cache/text/[^/]+/prompts/[^/]+\.safetensors"
    r"|cache/text/[^/]+/numerics\.json"
    r"|manifests/[^/]+\.(parquet|json)"
    r"|datasets/[^/.]+\.json"
    r"|datasets/members/[^/]+\.parquet"
    rf"|{RUNS}/[^/]+/{CHECKPOINT_PREFIX}[^/]+\.safetensors"
    rf"|{RUNS}/[^/]+/{RUN_PARTS['lineage']})$"
)
