"""Stage 5 — train: a LoRA adapter on the family's transformer (or the whole transformer) from cached
features only. The finished run if there is one; else the run's lease, and training processes that
each build a `Trainer` (`tasks/train/trainer.py`) and fit it. `runs/<run_id>/` holds config.yaml,
metrics.jsonl, adapter/ (PEFT) or transformer/, samples/, and lineage.json: the commit record, last.
"""

from __future__ import annotations

import json
import logging
import time
from functools import partial
from typing import Any

from configs.schema import ModelConfig, StorageConfig, TrainingConfig
from storage import layout
from storage.lease import Lease
from storage.store import Store
from tasks.families import Family, family_of
from tasks.runs.folder import run_record, weights_of
from tasks.runs.sampling import check_steps
from tasks.train.data import CachedFeatures
from tasks.train.distributed import Launcher
from tasks.train.init import initial_adapter, run_for
from tasks.train.loss import Objective
from tasks.train.metrics import Progress
from tasks.train.trainer import Job, Trainer

log = logging.getLogger(__name__)
LEASE_POLL_SECONDS = 2.0


def finished_run(store: Store, run: str) -> dict[str, Any] | None:
    """What train returns for a finished run, also when it ran elsewhere (None: not finished): the
    lineage's commit record with the fields every stage's record has — `url` (the weights),
    `amount` and `committed_at`."""
    if (record := run_record(store, run)) is None:
        return None
    return {**record, "url": record[weights_of(record)],
            "amount": f"{record['steps']} steps, loss {record['first_loss']:.3f} → {record['final_loss']:.3f}"}


def check_training(model: ModelConfig, training: TrainingConfig, family: Family | None = None) -> None:
    """Refuse, naming the setting, what the model's family cannot train or sample of `training`: a
    loss weighting its schedule lacks, image-to-video training and sample first frames without
    an image-to-video pipeline, sample references without an edit pipeline, or sample prompts
    without references for a family whose text encoder reads each with one, or a single sample
    step where the scheduler makes it NaN. The runner checks before any stage, so a refused run has
    not ingested or encoded for nothing. A model this process cannot read is left to the first stage
    that reads it, which names itself (and may run where the model is); `family`: the model's, resolved."""
    try:
        family = family or family_of(model)
    except (OSError, ValueError):
        return
    Objective.of(model, training, family)
    setting, pictures = training.samples.pictures()
    if pictures:
        family.sampler.picture_pipeline_class(setting)
    if training.samples.prompts and not training.samples.references and any(
            spec.processor is not None for spec in family.text.encoders):
        raise ValueError(f"training.samples.references: {family.name} reads each sample prompt with its reference "
                         "picture; give one a prompt (or no training.samples.prompts)")
    if training.samples.prompts:
        check_steps(model, family, training.samples.steps, "training.samples.steps")


def train(
    storage: StorageConfig, model: ModelConfig, training: TrainingConfig, manifest_url: str,
    progress: Progress | None = None, node: int = 0, attempt: str | None = None,
) -> dict[str, Any]:
    """Train (or resume, or return the finished run), and return its record with the store failures
    retried as its `work`; `progress(step, steps, loss, validation_loss)`
    after each step (the validation loss is None at steps without one). With `training.distribution.nodes` > 1,
    every node calls this with its `node` index and the `attempt` id they share (a new one for each
    attempt: a re-run resumes from the last checkpoint)."""
    family = family_of(model)  # resolved once, here: the trainer's processes resolve it in theirs
    check_training(model, training, family)
    store = Store(storage)
    manifest = json.loads(store.read_verified(store.key(manifest_url)))
    run, init = run_for(store, model, training, manifest["id"], family)
    if (record := finished_run(store, run)) is not None:
        return with_work(record, store)
    if training.distribution.nodes > 1 and attempt is None:
        raise ValueError(f"training.distribution.nodes is {training.distribution.nodes}: train on several nodes "
                         "through the pipeline flow with execution.placement.train, which gives each node its index "
                         "and the attempt id they share")
    if not 0 <= node < training.distribution.nodes:
        raise ValueError(f"node {node} is not one of training.distribution.nodes ({training.distribution.nodes})")
    if node == 0 and training.init_from == "latest":  # resolved only now that this run is known to be
        init = initial_adapter(store, model, training, family)  # unfinished; DDP gives the other nodes rank 0's weights
    job = Job(storage, model, training, manifest, run, init)
    launch = partial(Launcher(store, run, training, node, attempt).launch, partial(train_process, job),
                     partial(finished_run, store, run))
    if node > 0:  # node 0 holds the run's lease and publishes where to join; the others join it
        fetch_for_node(store, training, manifest, family)
        return launch()
    # one trainer per run: another pipeline training it already is waited for, not raced
    lease = Lease(store, layout.run_part(run, "lease"))
    while not lease.acquire():
        if (record := finished_run(store, run)) is not None:
            return with_work(record, store)
        log.info("run %s is being trained by %s; waiting for it", store.url(run), lease.holder())
        time.sleep(LEASE_POLL_SECONDS)
    try:  # unless it finished while we waited
        if (record := finished_run(store, run)) is not None:
            return with_work(record, store)
        fetch_for_node(store, training, manifest, family)
        record = launch(progress, lease)
        return with_work(record, store, store.read_json(layout.run_part(run, "work"))["io_retries"])
    finally:
        lease.release()


def fetch_for_node(store: Store, training: TrainingConfig, manifest: dict[str, Any], family: Family) -> None:
    """Every cache shard of a remote store fetched into this node's cache and checked once, before
    the node's `training.distribution.processes` processes start: each checks its copy again, none downloads it
    (they would all fetch the same shards at once)."""
    if training.distribution.processes > 1 and not store.is_local:
        CachedFeatures(store, manifest, family)  # the encoders' names: which caches


def with_work(record: dict[str, Any], store: Store, trained: int = 0) -> dict[str, Any]:
    """The stage's record with its work: the store failures this process retried, plus `trained`,
    those of the training processes (their sum, which rank 0 wrote)."""
    return {**record, "work": {"io_retries": len(store.retried) + trained}}


def train_process(job: Job, local: int, node: int, address: str, progress: Progress | None = None,
                  lease: Lease | None = None) -> None:
    """Training process `local` of node `node` (the group meets at `address`): its Trainer, fitted."""
    Trainer(job, local, node, address, progress, lease).fit()
