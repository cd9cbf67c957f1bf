"""The flow's executor of the stages (`FlowExecutor`): each runs here or on another work pool, and waits.

Here: the stage's Prefect task(s), one per shard for the encoders, in this process's threads or on
the stage's worker processes (flows/workers.py). Elsewhere (`execution.placement`): the stage's
deployment via `run_deployment`, for the encoders one child flow run per group of shards
(`max_parallel_shards` groups, or one that sends them all to `execution.cluster`), each with an
idempotency key so a retried parent never starts duplicates; a child that did not complete fails
the stage with its state message. Either way the outputs are read back from the store, the ground
truth, so a stage that ran on another node is used exactly like one that ran here; an encoder's
work (workers, model loads, shards) comes back as its children's `<stage>-work` artifacts.
"""

from __future__ import annotations

import contextvars
import json
import time
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from prefect import Task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.context import FlowRunContext
from prefect.deployments import run_deployment
from prefect.filesystems import RemoteFileSystem

from configs.schema import PipelineConfig
from flows.stage_tasks import (
    device_slot, encode_latents_task, encode_prompts_task, encode_text_task, ingest_partition_task, ingest_task,
    manifest_task, measure_numerics_task, train_task, training_progress,
)
from flows.progress import StageProgress, followed, reporter
from flows.workers import OnWorkers, in_threads, stage_executor
from storage import layout
from storage.fingerprint import hash_json
from storage.shards import shard_id_of
from storage.store import Store
from tasks.encode.latents import latent_cache_record
from tasks.encode.text import encoding_report, encoding_totals, text_cache_record
from tasks.ingest.report import mix_markdown, report_markdown
from tasks.ingest.stage import latest_dataset
from tasks.ingest.staging import Partitions
from tasks.manifest import manifest_record
from tasks.families import Family, family_of
from tasks.identity import (manifest_id, mix_identity, prompts_cache_key, sample_prompts, text_fingerprints,
                            vae_fingerprint)
from tasks.records import CacheRecord, DatasetRecord, EncodingWork, ManifestRecord, RunRecord
from tasks.runner import Shards
from tasks.runs.page import RunPage, loss_text
from tasks.train import finished_run, run_for


@dataclass
class Plan:
    """What one pipeline (or stage) run derives from its config, each computed once and only when
    first needed: the store, the model's family, the encoders' fingerprints (hashing a model's files, or asking the
    hub; a stage that does not need them never computes them) and Prefect's result storage."""

    config: PipelineConfig

    @cached_property
    def store(self) -> Store:
        return Store(self.config.storage)

    @cached_property
    def family(self) -> Family:
        return family_of(self.config.model)

    @cached_property
    def text_fps(self) -> dict[str, str]:
        return text_fingerprints(self.config.model, self.config.text_encoding)

    @cached_property
    def prompts(self) -> list[str]:
        """The sample prompts as the caches and the manifest name them (`identity.sample_prompts`)."""
        return sample_prompts(self.config)

    @cached_property
    def vae_fp(self) -> str:
        return vae_fingerprint(self.config.model, self.config.latent_encoding)

    @cached_property
    def results(self) -> Path | str:
        """Prefect result (and cache key) storage under `<root>/prefect/results`."""
        if self.store.is_local:
            return Path(self.store.path(layout.PREFECT_RESULTS))
        # a remote location must be a saved block; its name comes from the root and its settings
        # hold only the non-secret options (a RemoteFileSystem block shows its settings in the
        # UI), so Prefect's own result I/O takes credentials from the worker's environment or role
        name = f"precast-results-{hash_json(self.store.root_url, chars=12)}"
        block = RemoteFileSystem(basepath=self.store.url(layout.PREFECT_RESULTS), settings=self.config.storage.options)
        try:
            saved = RemoteFileSystem.load(name)
        except ValueError:  # none yet
            saved = None
        # written only when missing or changed: every stage's flow run (a shard's, on a worker) gets
        # here, and writes at once contend for the server's database (SQLite answers "locked", the
        # client backs off 2, 4, 8, 16 s: a stage 30 s late)
        if saved is None or (saved.basepath, saved.settings) != (block.basepath, block.settings):
            block.save(name, overwrite=True)
        return f"remote-file-system/{name}"

    def configured(self, task: Task) -> Task:
        execution = self.config.execution
        return task.with_options(retries=execution.retries, retry_delay_seconds=execution.retry_delay_seconds,
                                 result_storage=self.results)


def placed(config: PipelineConfig, stage: str) -> str | None:
    """The deployment that runs `stage`, or None to run it in this flow."""
    target = config.execution.placement.get(stage, "local")
    return None if target == "local" else target


def run_elsewhere(config: PipelineConfig, deployment: str, stage: str, shards: list[str] | None = None,
                  node: int | None = None) -> Any:
    """Run `stage` (for `shards`, or as training node `node`) as a child flow run of `deployment`,
    wait for it and return it."""
    parent = FlowRunContext.get()
    part = (f"node-{node}" if node is not None else "all" if shards is None else "prepare" if not shards
            else hash_json(shards, chars=12))
    # the child runs everything in place: it must not place stages again
    local = config.model_copy(update={"execution": config.execution.model_copy(update={"placement": {}})})
    parameters = {"name": stage, "config": local.model_dump(mode="json"), "shards": shards}
    if node is not None:  # the nodes of one attempt share its id: this parent's flow run
        parameters.update(node=node, attempt=str(parent.flow_run.id))
    child = run_deployment(
        deployment, parameters=parameters,
        idempotency_key=f"{parent.flow_run.id}:{stage}:{part}" if parent else None, timeout=None,
        flow_run_name=f"{stage}-{part}", poll_interval=1,  # the next stage starts a second after, not five
    )
    if not child.state or not child.state.is_completed():
        state = child.state.type.value if child.state else "unknown"
        raise RuntimeError(f"stage {stage} on {deployment} (flow run {child.name}) ended {state}: "
                           f"{child.state.message if child.state else ''}")
    return child


def run_shards_elsewhere(config: PipelineConfig, store: Store, deployment: str, stage: str, urls: list[str],
                         keys: Callable[[str], list[str]], earlier: tuple[Any, ...] = ()
                         ) -> tuple[EncodingWork, dict[str, dict[str, Any]]]:
    """The shards in `max_parallel_shards` groups, one child flow run each, all at once: each child
    runs on a worker of the pool (a node) and encodes its group in place, on that node's workers,
    each loading the model once. With `execution.cluster` one child sends every shard to the
    cluster, whose workers span the nodes. A group whose every shard is cached (every artifact its
    child commits, `keys(url)`) starts no child, so a night with nothing new wakes no node of the
    pool (each child is a process that imports the model libraries, on a node the pool may have to
    start); the groups are those of every shard, so a retried parent finds the children it
    started (their idempotency keys). Raises the first failure; returns the stage's work
    (`children_work`, with the `earlier` children's loads and shards, and the artifacts of the
    groups found cached) and every shard's commit records by key, read at once before and after."""
    every = [key for url in urls for key in keys(url)]
    found = dict(zip(every, store.committed_all(every)))
    count = 1 if config.execution.cluster else min(len(urls), config.execution.max_parallel_shards)
    groups = [urls[index::count] for index in range(count)] if urls else []
    todo = [group for group in groups if any(found[key] is None for url in group for key in keys(url))]
    cached = [url for group in groups if group not in todo for url in group]
    with followed(stage, len(urls), done=len(cached)):
        children = in_threads(lambda group: run_elsewhere(config, deployment, stage, group), todo, max(len(todo), 1))
    missing = [key for key, record in found.items() if record is None]
    found.update(zip(missing, store.require_all(missing)))
    work = children_work(stage, children, earlier)
    return {**work, "shards_cached": work["shards_cached"] + sum(len(keys(url)) for url in cached)}, found


def publish_work(stage: str, work: EncodingWork) -> None:
    """An encoding stage's work as a table artifact of its flow run: a parent whose stage ran in
    child flow runs on other nodes reads its children's (`children_work`)."""
    create_table_artifact(key=f"{stage}-work", table=[work], description=f"{stage}: workers, model loads, shards")


def children_work(stage: str, children: Sequence[Any], earlier: Sequence[Any] = ()) -> EncodingWork:
    """The work of `stage` in these child flow runs, summed: the workers of `children`, the model
    loads and shards of `earlier` ones too."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    runs = [run.id for run in [*children, *earlier]]
    found = ArtifactFilter(key=ArtifactFilterKey(any_=[f"{stage}-work"]),
                           flow_run_id=ArtifactFilterFlowRunId(any_=runs))
    with get_client(sync_client=True) as client:
        tables = {artifact.flow_run_id: json.loads(artifact.data)[0]
                  for artifact in (client.read_artifacts(artifact_filter=found) if runs else [])}
    work = {name: sum(table.get(name, 0) for table in tables.values())
            for name in ("model_loads", "shards_encoded", "shards_cached", "samples_encoded", "samples_copied",
                         "io_retries")}
    return {"workers": sum(tables[run.id]["workers"] for run in children if run.id in tables), **work}


@dataclass
class FlowExecutor:
    """The runner's executor in a flow (`tasks.runner.Executor`): each stage as its Prefect task(s)
    here, or as child flow runs of its deployment elsewhere (`execution.placement`), whose outputs
    are read back from the store. `shards`: an encoder's image shard URLs (None: all of the
    dataset's; []: only the text encoder's prompts and precision check, which always come first,
    measured on the dataset's first shard); `node` and `attempt`: this train stage is one node of a
    multi-node run (training.distribution.nodes)."""

    plan: Plan
    shards: list[str] | None = None
    node: int | None = None
    attempt: str | None = None

    @property
    def config(self) -> PipelineConfig:
        return self.plan.config

    @property
    def store(self) -> Store:
        return self.plan.store

    def ingest(self, committed: Callable[[str], None] | None = None) -> DatasetRecord:
        plan, config = self.plan, self.plan.config
        if deployment := placed(config, "ingest"):
            with followed("ingest"):
                run_elsewhere(config, deployment, "ingest")
            return stored_dataset(plan)
        with stage_executor(config.execution, "cpu", plan.configured, "ingest") as run:
            partitions, workers = ingest_partitions(config, run) if isinstance(run, OnWorkers) else (None, 1)
            record = plan.configured(ingest_task)(config.storage, config.dataset, progress=reporter("ingest", "files"),
                                                  partitions=partitions, committed=committed)
        record["work"]["workers"] = workers
        report = plan.store.read_json(plan.store.key(record["report"]))
        markdown = report_markdown(report)
        counted = [source["path"] for source in report.get("sources", [])]
        if config.dataset.mix is not None and counted == [source.path for source in config.dataset.sources]:
            # the dataset's report serves every mix of its sources: this run's is shown beside it
            markdown += "\n\n" + mix_markdown(config.dataset.drawn([s["samples"] for s in report["sources"]]))
        create_markdown_artifact(markdown=markdown, key="ingest-report", description=f"ingest of dataset {record['id']}")
        return record

    def encode_text(self, shards: Shards) -> CacheRecord:
        plan, config, store, fingerprints = self.plan, self.plan.config, self.plan.store, self.plan.text_fps
        began = time.monotonic()
        dataset, every = shards.dataset(), shards.urls()
        urls = every if self.shards is None else self.shards
        if deployment := placed(config, "encode-text"):
            # the prompts and the precision checks, before the shards fan out (unless committed)
            prepared = None not in store.committed_all([key for fp in fingerprints.values() for key in (
                prompts_cache_key(fp, plan.prompts), layout.text_numerics(fp))])
            earlier = () if prepared else (run_elsewhere(config, deployment, "encode-text", []),)

            def shard_key(url: str, fp: str) -> str:
                return layout.cache_shard("text", fp, shard_id_of(url))

            work, found = run_shards_elsewhere(
                config, store, deployment, "encode-text", urls,
                lambda url: [shard_key(url, fp) for fp in fingerprints.values()], earlier)
            prompts = {name: store.require(prompts_cache_key(fp, plan.prompts))
                       for name, fp in fingerprints.items()}
            records = [{**found[shard_key(url, fp)], "encoder": name}
                       for url in urls for name, fp in fingerprints.items()]
        else:
            args = (config.storage, config.model, config.text_encoding, fingerprints)
            with stage_executor(config.execution, config.text_encoding.device, plan.configured, "encode-text") as run:
                prompts = run.one(encode_prompts_task, *args, plan.prompts, config.training.samples.references or None)
                run.one(measure_numerics_task, *args, dataset["id"], every[0] if every else None)  # before any shard
                # from the stage's start (its models loaded since): shards, and the samples whose captions
                # they hold when it encodes them all
                progress = StageProgress("encode-text", len(urls), "shards", started=began,
                                         items=dataset["samples"] if self.shards is None else None,
                                         item_unit="captioned samples")
                shards = run.map(encode_text_task, urls, *args, dataset["id"],  # each shard's records: one per encoder
                                 completed=lambda records: progress.advance(1, records[0].get("samples", 0)))
                records = [record for records in shards for record in records]
                progress.close()
                work = run.work(records)
            publish_work("encode-text", work)
        record = text_cache_record(store, fingerprints, prompts, records)
        create_markdown_artifact(key="text-encoding", markdown=encoding_report(record["shards"]),
                                 description=encoding_totals(record["shards"]))
        return {**record, "work": work}

    def encode_latents(self, shards: Shards) -> CacheRecord:
        """Each shard as ingest commits it (here or on the stage's workers; placed on another pool,
        the dataset's shards once it is complete)."""
        plan, config, store, fingerprint = self.plan, self.plan.config, self.plan.store, self.plan.vae_fp
        began = time.monotonic()
        if deployment := placed(config, "encode-latents"):
            urls = shards.urls() if self.shards is None else self.shards
            work, found = run_shards_elsewhere(
                config, store, deployment, "encode-latents", urls,
                lambda url: [layout.cache_shard("latents", fingerprint, shard_id_of(url))])
            records = list(found.values())
        else:
            with stage_executor(config.execution, config.latent_encoding.device, plan.configured,
                                "encode-latents") as run:
                # counted as ingest commits them
                progress = StageProgress("encode-latents", None, "shards", started=began)

                def given(urls: Iterable[str]) -> Iterator[str]:
                    for url in urls:
                        progress.grow(1)
                        yield url
                    # an edit pair's references are encoded beside the samples (and counted with them)
                    counted = shards.dataset()
                    progress.settle(counted["samples"] + counted.get("references", 0) if self.shards is None else None)
                records = run.map(encode_latents_task, given(shards if self.shards is None else self.shards),
                                  config.storage, config.model, config.latent_encoding, fingerprint,
                                  completed=lambda record: progress.advance(1, record["samples"]))
                progress.close()
                work = run.work(records)
            publish_work("encode-latents", work)
            records = shards.in_order(records) if self.shards is None else records
        return {**latent_cache_record(store, fingerprint, records), "work": work}

    def manifest(self, dataset: DatasetRecord) -> ManifestRecord:
        plan, config = self.plan, self.plan.config
        if deployment := placed(config, "manifest"):
            run_elsewhere(config, deployment, "manifest")
            return stored_manifest(plan)
        return plan.configured(manifest_task)(config.storage, dataset["id"], plan.text_fps, plan.vae_fp,
                                              plan.prompts,
                                              mix_identity(config.dataset, dataset.get("members")))

    def train(self, manifest: ManifestRecord) -> RunRecord:
        """Train here, or on the train deployment: one child flow run per node of `training.distribution.nodes`,
        all at once (a node's child gets its `node` index and the `attempt` id the nodes share)."""
        plan, config, nodes = self.plan, self.plan.config, self.plan.config.training.distribution.nodes
        if deployment := placed(config, "train"):
            # a run finished already wakes no node (its adapter named by init_from is read where it trains)
            if config.training.init_from in ("none", "latest") and (record := run_of(plan, manifest)[1]) is not None:
                return record
            with followed("train", label="training"):
                in_threads(lambda index: run_elsewhere(config, deployment, "train", node=index if nodes > 1 else None),
                           list(range(nodes)), nodes)
            return stored_run(plan, manifest)
        task = plan.configured(train_task)
        if nodes > 1:  # a retried node alone cannot rejoin its peers: a re-run retries them all, and resumes
            task = task.with_options(retries=0)
        with device_slot(config.training.device):
            return task(config.storage, config.model, config.training, manifest["url"], progress=training_progress(),
                        node=self.node or 0, attempt=self.attempt)


def ingest_partitions(config: PipelineConfig, run: OnWorkers) -> tuple[Partitions, int]:
    """Ingest on workers: it lists and merges, the workers read and decode, a partition each;
    returns the partitions and how many workers read them."""
    # a partition is a task run of this flow run, beside ingest's: sent from within ingest's own
    # context, it would carry ingest's parameters (this very callable) to the worker
    flow_context = contextvars.copy_context()
    examine = partial(run.one, ingest_partition_task, config.storage, config.dataset)
    threads = [worker["nthreads"] for worker in run.workers().values()]
    partitions = Partitions(lambda *args: flow_context.copy().run(examine, *args), slots=sum(threads),
                            size=config.dataset.partition_size)
    return partitions, len(threads)


def check_nodes_placed(config: PipelineConfig) -> None:
    """Training on several nodes needs the train deployment, whose work pool's workers are the nodes:
    refused before any stage runs."""
    if config.training.distribution.nodes > 1 and not placed(config, "train"):
        raise ValueError(f"training.distribution.nodes is {config.training.distribution.nodes}: set "
                         "execution.placement.train to the train deployment (e.g. precast-stage/train), whose work "
                         "pool's workers are the nodes")


def publish_run_page(plan: Plan, record: RunRecord, stages: list[dict[str, str]] | None = None) -> None:
    """The `training-run` artifact: the run page of `record`'s run. `stages`, the summary of the
    pipeline run that trained it, is kept in the run folder for every later reader of the page."""
    run = plan.store.key(record["run"])
    if stages is not None:
        plan.store.write_json(layout.run_part(run, "stages"), stages)
    page = RunPage.read(plan.store, run)
    create_markdown_artifact(key="training-run", markdown=page.markdown(),
                             description=f"{page.record['steps']} steps; loss {loss_text(page.record)}")


def stored_dataset(plan: Plan) -> DatasetRecord:
    return latest_dataset(plan.config.storage, plan.config.dataset)


def stored_manifest(plan: Plan) -> ManifestRecord:
    dataset = stored_dataset(plan)
    this_id = manifest_id(dataset["id"], plan.text_fps, plan.vae_fp, plan.prompts,
                          mix_identity(plan.config.dataset, dataset.get("members")))
    return manifest_record(plan.store.require(layout.manifest(this_id)))


# what a stage run alone (flows.pipeline.stage) is given of each earlier stage: its stored record
STORED = {"ingest": stored_dataset, "manifest": stored_manifest}


def run_of(plan: Plan, manifest: ManifestRecord) -> tuple[str, RunRecord | None]:
    """The run folder these inputs train, and its record if it is finished (found by its id, as
    train finds it)."""
    config, store = plan.config, plan.store
    run, _ = run_for(store, config.model, config.training, store.read_json(store.key(manifest["url"]))["id"],
                     plan.family)
    return run, finished_run(store, run)


def stored_run(plan: Plan, manifest: ManifestRecord) -> RunRecord:
    """The record of the run a train child finished."""
    run, record = run_of(plan, manifest)
    if record is None:
        raise FileNotFoundError(f"{plan.store.url(run)} is not finished: its train child ended without committing it")
    return record
