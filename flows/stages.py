"""Flow-level stage runners: each submits its Prefect task(s) and waits for every result.

The pipeline flow chains them; the stage flow runs one alone, taking its inputs from the store.
Results and cache keys live on the store root, so a cache hit works from any node that sees it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import Task
from prefect.artifacts import create_markdown_artifact
from prefect.filesystems import RemoteFileSystem

from configs.schema import PipelineConfig
from storage.fingerprint import hash_json
from storage.store import Store
from tasks.encode_latents import encode_latents_task
from tasks.encode_text import encode_prompts_task, encode_text_task, encoding_report
from tasks.ingest import ingest_task, latest_dataset
from tasks.manifest import manifest_id, manifest_key, manifest_task
from tasks.models import text_encoder_fingerprint, vae_fingerprint
from tasks.train import train_task


def configured(task: Task, config: PipelineConfig) -> Task:
    return task.with_options(
        retries=config.execution.retries,
        retry_delay_seconds=config.execution.retry_delay_seconds,
        result_storage=result_storage(config),
    )


def result_storage(config: PipelineConfig) -> Path | str:
    """Prefect result (and cache key) storage under `<root>/prefect/results`."""
    store = Store(config.storage)
    if store.is_local:
        return Path(store.path("prefect/results"))
    # a remote location must be a saved block; its name is derived from the root, never secrets
    name = f"precast-results-{hash_json(store.root_url, chars=12)}"
    RemoteFileSystem(basepath=store.url("prefect/results"), settings=config.storage.options).save(name, overwrite=True)
    return f"remote-file-system/{name}"


def bounded_map(task: Task, items: list[Any], limit: int, *args: Any) -> list[Any]:
    """Run `task(*args, item)` for each item, at most `limit` at once; raises the first failure."""
    futures, results = [], []
    for item in items:
        if len(futures) - len(results) >= limit:
            results.append(futures[len(results)].result())
        futures.append(task.submit(*args, item))
    return results + [future.result() for future in futures[len(results):]]


def run_ingest(config: PipelineConfig) -> dict[str, Any]:
    return configured(ingest_task, config)(config.storage, config.dataset)


def run_encode_text(config: PipelineConfig, dataset: dict[str, Any]) -> dict[str, Any]:
    fingerprint = text_encoder_fingerprint(config.model, config.text_encoding)
    args = (config.storage, config.model, config.text_encoding, fingerprint)
    prompts = configured(encode_prompts_task, config)(*args, config.training.sample_prompts)
    shards = bounded_map(configured(encode_text_task, config), shard_urls(config, dataset),
                         config.execution.max_parallel_shards, *args)
    create_markdown_artifact(key="text-encoding", markdown=encoding_report(shards))
    return {"url": Store(config.storage).url(f"cache/text/{fingerprint}"), "prompts": prompts, "shards": shards}


def run_encode_latents(config: PipelineConfig, dataset: dict[str, Any]) -> dict[str, Any]:
    fingerprint = vae_fingerprint(config.model, config.latent_encoding)
    shards = bounded_map(configured(encode_latents_task, config), shard_urls(config, dataset),
                         config.execution.max_parallel_shards, config.storage, config.model,
                         config.latent_encoding, fingerprint)
    return {"url": Store(config.storage).url(f"cache/latents/{fingerprint}"), "shards": shards}


def run_manifest(config: PipelineConfig, dataset: dict[str, Any]) -> dict[str, Any]:
    text_fp = text_encoder_fingerprint(config.model, config.text_encoding)
    vae_fp = vae_fingerprint(config.model, config.latent_encoding)
    return configured(manifest_task, config)(config.storage, dataset["id"], text_fp, vae_fp,
                                             config.training.sample_prompts)


def run_train(config: PipelineConfig, manifest: dict[str, Any]) -> dict[str, Any]:
    return configured(train_task, config)(config.storage, config.model, config.training, manifest["url"])


def shard_urls(config: PipelineConfig, dataset: dict[str, Any]) -> list[str]:
    store = Store(config.storage)
    return [store.url(f"shards/images/{shard['id']}.parquet") for shard in dataset["shards"]]


def stored_dataset(config: PipelineConfig) -> dict[str, Any]:
    return latest_dataset(config.storage, config.dataset)


def stored_manifest(config: PipelineConfig) -> dict[str, Any]:
    dataset = stored_dataset(config)
    text_fp = text_encoder_fingerprint(config.model, config.text_encoding)
    vae_fp = vae_fingerprint(config.model, config.latent_encoding)
    key = manifest_key(manifest_id(dataset["id"], text_fp, vae_fp, config.training.sample_prompts))
    return Store(config.storage).require(key)
