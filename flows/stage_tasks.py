"""The Prefect layer of the stages, on one screen: one task per stage function, its cache policy,
the GPU slot and the progress artifact. The stage modules in tasks/ never import Prefect: each
task here is `task(...)` applied to the stage function itself (`encode_text_task.fn is
encode_text_shard`), so calling `.fn` skips Prefect entirely. Retries and result storage come
from the run's config (`flows.stages.Plan.configured`); the other artifacts are created by the
stage runners in flows/stages.py. Not named flows/tasks.py: Prefect loads a flow file as a script
with its folder first on sys.path, where that name would hide the `tasks` package.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prefect import task
from prefect.cache_policies import INPUTS, NO_CACHE, TASK_SOURCE

from flows.progress import reporter
from tasks.encode.latents import encode_latents_shard
from tasks.encode.text import encode_prompts, encode_text_shard, measure_numerics
from tasks.ingest.stage import ingest
from tasks.ingest.staging import examine_partition
from tasks.manifest import build_manifest
from tasks.loading import resolve_device
from tasks.train import train

# Arguments are content-addressed ids, URLs and config sections, so INPUTS is the store's own key.
# INPUTS alone ignores which task it is: text-numerics and encode-text of the first shard take the
# same arguments, and TASK_SOURCE keeps their keys apart.
STAGE_CACHE = INPUTS + TASK_SOURCE
JSON = {"persist_result": True, "result_serializer": "json"}

# ingest is its own cache: it lists the sources and reads only what its last record does not hold
ingest_task = task(name="ingest", cache_policy=NO_CACHE, **JSON)(ingest)
# the store is its cache: a staged partition is deleted once merged, so a cached key could name nothing
ingest_partition_task = task(name="ingest-partition", cache_policy=NO_CACHE, **JSON)(examine_partition)
encode_prompts_task = task(name="encode-prompts", cache_policy=STAGE_CACHE, **JSON)(encode_prompts)
measure_numerics_task = task(name="text-numerics", cache_policy=STAGE_CACHE, **JSON)(measure_numerics)
encode_text_task = task(name="encode-text", cache_policy=STAGE_CACHE, **JSON)(encode_text_shard)
encode_latents_task = task(name="encode-latents", cache_policy=STAGE_CACHE, **JSON)(encode_latents_shard)
# the manifest and a finished run are their own caches (one read of a commit record), and what
# each returns counts this run's store retries: a cached result would repeat an earlier run's
manifest_task = task(name="manifest", cache_policy=NO_CACHE, **JSON)(build_manifest)
train_task = task(name="train", cache_policy=NO_CACHE, **JSON)(train)
TASKS = [ingest_task, ingest_partition_task, encode_prompts_task, measure_numerics_task, encode_text_task,
         encode_latents_task, manifest_task, train_task]

def gpu_slot_name() -> str:
    return f"gpu-{socket.gethostname()}"


@contextmanager
def device_slot(device: str) -> Iterator[None]:
    """While a stage uses a GPU, hold this node's slot of the Prefect global concurrency limit
    `gpu-<hostname>` (limit 1: infra/local-stack.sh creates it; on a cluster, `prefect
    global-concurrency-limit create gpu-<hostname> --limit 1`), so a node never runs two GPU stages
    at once. Without the limit Prefect warns and lets the stage run."""
    if resolve_device(device).type != "cuda":
        yield
        return
    from prefect.concurrency.sync import concurrency

    with concurrency(gpu_slot_name(), occupy=1):
        yield


def training_progress() -> Callable[[int, int, float, float | None], None]:
    """A `progress(step, steps, loss, validation_loss)` callback for `train`: the `training`
    stage's progress (the `training-progress` artifact, a bar or plain lines), with the latest
    training and validation loss."""
    report, validation = reporter("training", "steps"), None

    def progress(step: int, steps: int, loss: float, validation_loss: float | None = None) -> None:
        nonlocal validation
        validation = validation_loss if validation_loss is not None else validation
        losses = [f"loss {loss:.4f}"] if math.isfinite(loss) else []
        losses += [f"validation loss {validation:.4f}"] if validation is not None else []
        report(step, steps, ", ".join(losses) or None)

    return progress
