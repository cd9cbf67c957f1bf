"""Flow-level stage runners: each runs its stage here or on another work pool, and waits.

Here: the stage's Prefect task(s), one per shard for the encoders, bounded by
`execution.max_parallel_shards`. Elsewhere (`execution.placement`): the stage's deployment via
`run_deployment`, one child flow run per shard for the encoders, each with an idempotency key so a
retried parent never starts duplicates; a child that did not complete fails the stage with its
state message. Either way the outputs are read back from the store, the ground truth, so a stage
that ran on another node is used exactly like one that ran here.
"""

from __future__ import annotations

import contextvars
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from prefect import Task
from prefect.artifacts import create_markdown_artifact
from prefect.context import FlowRunContext
from prefect.deployments import run_deployment
from prefect.filesystems import RemoteFileSystem
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.utilities.callables import get_call_parameters

from configs.schema import PipelineConfig
from storage import layout
from storage.fingerprint import hash_json
from storage.shards import shard_id_of
from storage.store import Store
from tasks.encode_latents import encode_latents_task
from tasks.encode_text import (
    encode_prompts_task, encode_text_task, encoding_report, measure_numerics_task, prompts_cache_key,
)
from tasks.ingest import ingest_task, latest_dataset
from tasks.manifest import manifest_id, manifest_task
from tasks.models import text_encoder_fingerprint, vae_fingerprint
from tasks.train import run_id_for, train_task


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
        return Path(store.path(layout.PREFECT_RESULTS))
    # a remote location must be a saved block; its name comes from the root and its settings hold
    # only the non-secret options (a RemoteFileSystem block shows its settings in the UI), so
    # Prefect's own result I/O takes credentials from the worker's environment or role
    name = f"precast-results-{hash_json(store.root_url, chars=12)}"
    RemoteFileSystem(basepath=store.url(layout.PREFECT_RESULTS), settings=config.storage.options).save(
        name, overwrite=True)
    return f"remote-file-system/{name}"


def bounded_map(task: Task, items: list[Any], limit: int, *args: Any) -> list[Any]:
    """Run `task(*args, item)` for each item, at most `limit` at once; raises the first failure.

    One at a time runs in this thread. Parallel threads live only as long as this stage: a thread
    that ran torch keeps an OpenMP team, and while libgomp manages more threads than there are
    cores it puts idle workers to sleep after every parallel region, which made every later
    stage (training) run twice as slow beside the flow's own, never-closed task runner."""
    if limit == 1:
        return [task(*args, item) for item in items]
    with ThreadPoolTaskRunner(max_workers=limit) as runner:
        futures = [runner.submit(task, get_call_parameters(task.fn, (*args, item), {})) for item in items]
        return [future.result() for future in futures]


def placed(config: PipelineConfig, stage: str) -> str | None:
    """The deployment that runs `stage`, or None to run it in this flow."""
    target = config.execution.placement.get(stage, "local")
    return None if target == "local" else target


def run_elsewhere(config: PipelineConfig, deployment: str, stage: str, shards: list[str] | None = None) -> None:
    """Run `stage` (for `shards`) as a child flow run of `deployment` and wait for it."""
    parent = FlowRunContext.get()
    part = "all" if shards is None else "prepare" if not shards else hash_json(shards, chars=12)
    # the child runs everything in place: it must not place stages again
    local = config.model_copy(update={"execution": config.execution.model_copy(update={"placement": {}})})
    child = run_deployment(
        deployment, parameters={"name": stage, "config": local.model_dump(mode="json"), "shards": shards},
        idempotency_key=f"{parent.flow_run.id}:{stage}:{part}" if parent else None, timeout=None,
        flow_run_name=f"{stage}-{part}",
    )
    if not child.state or not child.state.is_completed():
        state = child.state.type.value if child.state else "unknown"
        raise RuntimeError(f"stage {stage} on {deployment} (flow run {child.name}) ended {state}: "
                           f"{child.state.message if child.state else ''}")


def run_shards_elsewhere(config: PipelineConfig, deployment: str, stage: str, urls: list[str]) -> None:
    """One child flow run per shard, at most `max_parallel_shards` at once; raises the first failure."""
    with ThreadPoolExecutor(max_workers=config.execution.max_parallel_shards) as pool:
        # each thread gets a copy of this flow's context, so children are linked to it as subflows
        futures = [pool.submit(contextvars.copy_context().run, run_elsewhere, config, deployment, stage, [url])
                   for url in urls]
        for future in futures:
            future.result()


def run_ingest(config: PipelineConfig) -> dict[str, Any]:
    if deployment := placed(config, "ingest"):
        run_elsewhere(config, deployment, "ingest")
        return stored_dataset(config)
    return configured(ingest_task, config)(config.storage, config.dataset)


def run_encode_text(config: PipelineConfig, dataset: dict[str, Any], shards: list[str] | None = None) -> dict[str, Any]:
    """`shards`: only these image shards (None: all of the dataset's; []: only the prompts and the
    precision check, which always come first, measured on the dataset's first shard)."""
    fingerprint = text_encoder_fingerprint(config.model, config.text_encoding)
    store = Store(config.storage)
    every = shard_urls(config, dataset)
    urls = every if shards is None else shards
    if deployment := placed(config, "encode-text"):
        run_elsewhere(config, deployment, "encode-text", [])  # before the shards fan out
        run_shards_elsewhere(config, deployment, "encode-text", urls)
        prompts = store.require(prompts_cache_key(fingerprint, config.training.sample_prompts))
        records = [store.require(layout.cache_shard("text", fingerprint, shard_id_of(url))) for url in urls]
    else:
        args = (config.storage, config.model, config.text_encoding, fingerprint)
        prompts = configured(encode_prompts_task, config)(*args, config.training.sample_prompts)
        configured(measure_numerics_task, config)(*args, every[0] if every else None)
        records = bounded_map(configured(encode_text_task, config), urls, config.execution.max_parallel_shards, *args)
    create_markdown_artifact(key="text-encoding", markdown=encoding_report(records))
    return {"url": store.url(layout.cache("text", fingerprint)), "prompts": prompts, "shards": records}


def run_encode_latents(
    config: PipelineConfig, dataset: dict[str, Any], shards: list[str] | None = None
) -> dict[str, Any]:
    fingerprint = vae_fingerprint(config.model, config.latent_encoding)
    store = Store(config.storage)
    urls = shard_urls(config, dataset) if shards is None else shards
    if deployment := placed(config, "encode-latents"):
        run_shards_elsewhere(config, deployment, "encode-latents", urls)
        records = [store.require(layout.cache_shard("latents", fingerprint, shard_id_of(url))) for url in urls]
    else:
        records = bounded_map(configured(encode_latents_task, config), urls, config.execution.max_parallel_shards,
                              config.storage, config.model, config.latent_encoding, fingerprint)
    return {"url": store.url(layout.cache("latents", fingerprint)), "shards": records}


def run_manifest(config: PipelineConfig, dataset: dict[str, Any]) -> dict[str, Any]:
    if deployment := placed(config, "manifest"):
        run_elsewhere(config, deployment, "manifest")
        return stored_manifest(config)
    text_fp = text_encoder_fingerprint(config.model, config.text_encoding)
    vae_fp = vae_fingerprint(config.model, config.latent_encoding)
    return configured(manifest_task, config)(config.storage, dataset["id"], text_fp, vae_fp,
                                             config.training.sample_prompts)


def run_train(config: PipelineConfig, manifest: dict[str, Any]) -> dict[str, Any]:
    if deployment := placed(config, "train"):
        run_elsewhere(config, deployment, "train")
        return stored_run(config, manifest)
    return configured(train_task, config)(config.storage, config.model, config.training, manifest["url"])


def shard_urls(config: PipelineConfig, dataset: dict[str, Any]) -> list[str]:
    store = Store(config.storage)
    return [store.url(layout.image_shard(shard["id"])) for shard in dataset["shards"]]


def stored_dataset(config: PipelineConfig) -> dict[str, Any]:
    return latest_dataset(config.storage, config.dataset)


def stored_manifest(config: PipelineConfig) -> dict[str, Any]:
    dataset = stored_dataset(config)
    text_fp = text_encoder_fingerprint(config.model, config.text_encoding)
    vae_fp = vae_fingerprint(config.model, config.latent_encoding)
    key = layout.manifest(manifest_id(dataset["id"], text_fp, vae_fp, config.training.sample_prompts))
    return Store(config.storage).require(key)


def stored_run(config: PipelineConfig, manifest: dict[str, Any]) -> dict[str, Any]:
    """The commit record of the run a train child finished (found by its id, as train finds it)."""
    from tasks.train import initial_adapter

    store = Store(config.storage)
    this_manifest = store.read_json(store.key(manifest["url"]))["id"]
    explicit = config.training.init_from not in ("none", "latest")
    init = initial_adapter(store, config.storage, config.model, config.training) if explicit else None
    run = layout.run(run_id_for(this_manifest, config.model, config.training, init))
    return store.require(layout.run_part(run, "lineage"))
