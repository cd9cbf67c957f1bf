"""Experiment trackers of a training run: TensorBoard (by default), MLflow, Weights & Biases.

Rank 0 hands each record — losses, learning rate, gradient norm, samples/s and peak memory every
`log_every` steps, the sample grids, and once the run's config and lineage as hyperparameters —
to `Trackers`, which passes it on in one background thread: a slow tracker never slows a step,
and one that fails is reported once, as a warning, and dropped; training goes on and loses
nothing. TensorBoard writes its event files to a local folder and copies them into
`runs/<id>/tensorboard/` at every checkpoint and at the end, so they work on any root (s3://,
gs://) and a resumed run adds its own file beside the earlier ones. MLflow logs to
`training.tracking.mlflow_tracking_uri` (MLflow's own default when unset), W&B as its environment says
(`WANDB_MODE=offline` writes the run's files locally); both continue the same run on resume.
"""

from __future__ import annotations

import io
import logging
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from configs.schema import TrainingConfig
from storage import layout
from storage.store import Store

log = logging.getLogger(__name__)
WAIT_ON_CLOSE_SECONDS = 60.0  # what the end of a run gives trackers to finish what they were handed


def hyperparameters(run_id: str, lineage: dict[str, Any]) -> dict[str, str | float | int | bool]:
    """The run's identity and lineage as flat, scalar hyperparameters."""
    flat: dict[str, Any] = {"run_id": run_id}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else key, inner)
        elif isinstance(value, (list, tuple)):
            flat[prefix] = ", ".join(map(str, value))
        elif value is None:
            flat[prefix] = "none"
        else:
            flat[prefix] = value
    walk("", lineage)
    return flat


class TensorBoard:
    def __init__(self, store: Store, run: str, training: TrainingConfig, params: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.store, self.folder = store, layout.run_part(run, "tensorboard")
        self.local = Path(tempfile.mkdtemp(prefix="precast-tensorboard-"))
        self.writer = SummaryWriter(str(self.local))
        for summary in hparams(params, {"loss/validation": 0.0}):  # the hparams plugin's view of the run
            self.writer.file_writer.add_summary(summary)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def image(self, step: int, name: str, png: bytes) -> None:
        import numpy as np
        from PIL import Image

        self.writer.add_image(name, np.asarray(Image.open(io.BytesIO(png)).convert("RGB")), step, dataformats="HWC")

    def sync(self) -> None:
        self.writer.flush()
        for file in sorted(self.local.iterdir()):
            self.store.put_file(file, f"{self.folder}/{file.name}")

    def close(self) -> None:
        self.writer.close()
        self.sync()
        shutil.rmtree(self.local, ignore_errors=True)


class MLflow:
    def __init__(self, store: Store, run: str, training: TrainingConfig, params: dict[str, Any]):
        import mlflow
        from mlflow.entities import Param

        self.client = mlflow.MlflowClient(tracking_uri=training.tracking.mlflow_tracking_uri)
        experiment = self.client.get_experiment_by_name(training.tracking.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
            training.tracking.project)
        found = self.client.search_runs([experiment_id], f"tags.`precast.run_id` = '{params['run_id']}'")
        if found:  # a resumed run continues the tracker's run
            self.run_id = found[0].info.run_id
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=params["run_id"][:12], tags={
                "precast.run_id": params["run_id"], "precast.run": store.url(run)}).info.run_id
            params = {key: str(value)[:6000] for key, value in params.items()}
            items = [Param(key, value) for key, value in params.items()]
            for start in range(0, len(items), 100):
                self.client.log_batch(self.run_id, params=items[start : start + 100])

    def scalars(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(name, value, now, step) for name, value in values.items()])

    def image(self, step: int, name: str, png: bytes) -> None:
        from PIL import Image

        self.client.log_image(self.run_id, Image.open(io.BytesIO(png)), key=name.replace("/", "-"), step=step)

    def sync(self) -> None:
        pass

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandB:
    def __init__(self, store: Store, run: str, training: TrainingConfig, params: dict[str, Any]):
        import wandb

        self.run = wandb.init(project=training.tracking.project, id=params["run_id"][:32], name=params["run_id"][:12],
                              resume="allow", config=params, reinit="create_new")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def image(self, step: int, name: str, png: bytes) -> None:
        import wandb
        from PIL import Image

        self.run.log({name: wandb.Image(Image.open(io.BytesIO(png)))}, step=step)

    def sync(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


KINDS = {"tensorboard": TensorBoard, "mlflow": MLflow, "wandb": WandB}


class Trackers:
    """The run's trackers, fed from one background thread; each call returns at once."""

    def __init__(self, store: Store, run: str, training: TrainingConfig, lineage: dict[str, Any]):
        self.calls: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.live: dict[str, Any] = {}  # touched by the thread alone
        params = hyperparameters(run.rsplit("/", 1)[-1], lineage)

        def start() -> None:  # wandb.init and MLflow's first requests take seconds: not on the training thread
            for name in training.tracking.trackers:
                self._guarded(name, lambda name=name: self.live.__setitem__(
                    name, KINDS[name](store, run, training, params)))
        self.calls.put(start)
        self.thread = threading.Thread(target=self._serve, name="precast-trackers", daemon=True)
        self.thread.start()

    def _guarded(self, name: str, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as error:  # a tracker never stops training: warn once, drop it
            log.warning("tracker %s failed (%s: %s); training goes on without it", name, type(error).__name__, error)
            self.live.pop(name, None)

    def _serve(self) -> None:
        while (call := self.calls.get()) is not None:
            call()

    def _each(self, method: str, *args: Any) -> None:
        def call() -> None:
            for name, tracker in list(self.live.items()):
                self._guarded(name, lambda tracker=tracker: getattr(tracker, method)(*args))
        self.calls.put(call)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._each("scalars", step, values)

    def image(self, step: int, name: str, png: bytes) -> None:
        self._each("image", step, name, png)

    def sync(self) -> None:
        """Bring what the trackers keep locally to the store (at checkpoints)."""
        self._each("sync")

    def close(self) -> None:
        """Finish every tracker: waits (up to a minute) for what they were handed."""
        self._each("close")
        self.calls.put(None)
        self.thread.join(WAIT_ON_CLOSE_SECONDS)
        if self.thread.is_alive():
            log.warning("trackers still busy after %.0f s; the run finishes without waiting for them",
                        WAIT_ON_CLOSE_SECONDS)
