"""The trainer: one run's training in one process, built from its parts and read top to bottom.

To train a run on one device (or on the processes of `training.distribution.processes`):
$ precast stage train configs/quickstart.yaml
as the last stage of the pipeline:
$ precast run configs/quickstart.yaml
on several nodes, each node of the train deployment's work pool one child flow run:
$ precast run configs/quickstart.yaml --set training.distribution.nodes=2 \
    --set execution.placement.train=precast-stage/train

`tasks.train.train` takes the run's lease and launches the processes; each builds a `Trainer`
(its parts once, in the order they depend on each other) and calls `fit()`: restore the newest
checkpoint, then per step `step()`, the figures to `Metrics`, rank 0's reports, samples and
checkpoint, and at the end rank 0 publishes the run. The text encoders and the VAE encoder are
never loaded: text features and latent posteriors come from the manifest's shards.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from configs.schema import ModelConfig, StorageConfig, TrainingConfig
from storage import layout
from storage.lease import Lease
from storage.shards import bucket_name
from storage.store import Store
from tasks.loading import DTYPES
from tasks.train.checkpointer import Checkpointer, TrainingState
from tasks.train.data import Batches, CachedFeatures, draws, seed_of
from tasks.train.distributed import Distributed
from tasks.train.ema import Ema
from tasks.train.loss import Objective, diffusion_loss
from tasks.train.metrics import Metrics, Progress
from tasks.train.network import attention_kernels, kept_activations, sampling_module, trainable_network
from tasks.train.streaming import BlockStreamer
from tasks.train.optimizer import build_optimizer, build_scaler, build_schedule
from tasks.train.plan import auto_settings, device_memory, reader_shapes
from tasks.train.publisher import RunPublisher
from tasks.train.validation import Validation

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """What a run trains: its config sections, its manifest, its folder (`runs/<run_id>`) and the
    adapter it starts from. Sent to every training process."""

    storage: StorageConfig
    model: ModelConfig
    training: TrainingConfig
    manifest: dict[str, Any]
    run: str
    init: dict | None


class Trainer:
    """One process's share of a run. Rank 0 reports, samples, checkpoints and publishes the run."""

    # --- the parts, in the order __init__ builds them; each gets the ones before it ---------------
    store: Store  # the run's storage, which every part below reads and writes through
    dist: Distributed  # this process's rank and device in the process group
    network: torch.nn.Module  # LoRA layers on the frozen transformer, or the whole transformer
    streamer: BlockStreamer | None  # the blocks whose frozen weights wait in host memory (blocks_to_swap)
    replicas: torch.nn.Module  # the network as forward and backward run it: DDP averages gradients
    objective: Objective  # the family's loss, with the run's timesteps and weighting
    validation: Validation  # the held-out samples and their loss
    data: Batches  # this process's micro-batches of the other samples
    optimizer: torch.optim.Optimizer  # AdamW over the trainable weights
    schedule: torch.optim.lr_scheduler.LambdaLR  # linear warm-up
    scaler: torch.amp.GradScaler  # loss scaling under fp16
    ema: Ema | None  # the moving average of the trainable weights, when `ema_decay` > 0
    checkpointer: Checkpointer  # when to save the parts above, and restoring them
    publisher: RunPublisher | None  # rank 0: trackers, samples and the run's outputs
    metrics: Metrics  # the figures of each step, read off the device in batches

    def __init__(self, job: Job, local: int, node: int, address: str, progress: Progress | None = None,
                 lease: Lease | None = None):
        """Process `local` of node `node`, joining the group at `address`; `progress` (as
        `train`'s) on rank 0. Writes stop with LeaseLost once `lease` (held by the process that
        started training) was taken over."""
        self.job, self.training, self.lease = job, job.training, lease
        training, store = job.training, Store(job.storage)
        self.store = store
        self.dist = Distributed.from_config(training, node, local, address)
        device = self.dist.device

        # --- model: LoRA layers on the frozen transformer, or the whole transformer -----------
        self.objective = Objective.of(job.model, training)  # and the model's family, resolved here once
        family = self.objective.family
        features = CachedFeatures(store, job.manifest, family)
        if training.gradient_checkpointing == "auto":  # the memory plan's choice for this device
            training = self.training = auto_settings(job.model, training, family,
                                                     reader_shapes(job.model, family, features), device_memory(device))
            if self.dist.leader:
                log.info("gradient_checkpointing auto: %s, blocks_to_swap %d, for %.1f GiB", training.gradient_checkpointing,
                         training.blocks_to_swap, device_memory(device) / 2**30)
        network = trainable_network(job.model, family, training, job.init)
        # streamed blocks' frozen weights leave the network before it moves: they never reach the device at once
        self.streamer = BlockStreamer(family.denoiser.blocks(sampling_module(network, training)),
                                      training.blocks_to_swap, device) if training.blocks_to_swap else None
        self.network = network.to(device)
        self.replicas = self.dist.wrap(self.network)

        # --- data: cached features only, the held-out samples apart; batch sizes count image
        # tokens as the family's transformer does, so the batches come after the network
        self.validation = Validation.from_config(training, features)
        self.data = Batches(training, features, self.validation.training_buckets(), self.dist,
                            lambda *sides: family.denoiser.image_tokens(self.network.config, *sides))

        # --- optimiser: AdamW (fused on accelerators) with linear warm-up ---------------------
        self.trainable = [p for p in self.network.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(training, self.trainable, device)
        self.schedule = build_schedule(training, self.optimizer)
        self.scaler = build_scaler(training, device)
        # the moving average of the trainable weights is what is saved when it is on
        self.ema = Ema(self.network, training.optimizer.ema_decay) if training.optimizer.ema_decay else None

        # --- checkpoints, outputs and figures --------------------------------------------------
        state = TrainingState(self.network, self.optimizer, self.schedule, self.ema, self.scaler)
        self.checkpointer = Checkpointer.from_config(training, store, job.run, lease, state)
        self.publisher = RunPublisher(store, job.run, job.model, family, training, job.manifest, job.init,
                                      features.text, features.resolution, features.reference_resolution
                                      ) if self.dist.leader else None
        self.metrics = Metrics(training, self.dist, self.publisher, progress)

        # derived once: the autocast dtype (None: fp32) and the micro-batches of a step
        self.half = DTYPES.get(training.mixed_precision)
        self.accumulation = training.accumulation

    def fit(self) -> None:
        """Train from the newest checkpoint to `training.steps`; rank 0 then publishes the run."""
        training, leader = self.training, self.dist.leader
        # --- resume: the parts as the latest checkpoint saved them; its step fixes the data
        # position (micro-batches are a pure function of seed and index) and the metrics so far
        start = self.checkpointer.restore()
        self.metrics.resume(self.checkpointer.saved_metrics(start))
        self.data.resume(start)
        if start:
            log.info("resuming %s at step %d", self.job.run, start)

        # --- loop: nothing waits for the device but the metrics' flush, every log_every steps and
        # before a validation or checkpoint (whose step must be in the metrics they go with)
        self.network.train()
        started = time.perf_counter()
        for step in range(start + 1, training.steps + 1):
            self.metrics.record(self.step(step))
            validating = self.validation.due(step, training.steps)
            flushing = validating or self.checkpointer.due(step) or self.metrics.due(step)
            if flushing:  # every process: the figures are averaged over all of them
                self.metrics.flush()
            if leader:  # rank 0 alone scores, reports, samples and checkpoints; the others go on
                if flushing:
                    self.metrics.report(self.validation.loss(self.network, self.objective, self.dist.device,
                                                             self.half) if validating else None)
                self.publisher.maybe_sample(self.network, step)
                if self.checkpointer.maybe_save(step, self.metrics.rows):
                    self.publisher.checkpointed()
        elapsed = time.perf_counter() - started
        self.data.close()
        # the store failures every process retried, for the stage's work (not in the run's bytes)
        retried = self.dist.total(len(self.store.retried))
        before_publishing = len(self.store.retried)
        self.dist.close()
        if not leader:
            return

        # --- outputs: weights, samples, metrics, lineage (last) --------------------------------
        if self.lease is not None:
            self.lease.check()
        if self.ema is not None:  # the averaged weights are the run's result (and render its final samples)
            self.ema.copy_to(self.network)
        self.publisher.publish(self.network, self.metrics.rows, start, elapsed)
        self.store.write_json(layout.run_part(self.job.run, "work"),
                              {"io_retries": retried + len(self.store.retried) - before_publishing})
        log.info("trained %s: steps %d-%d in %.1f s", self.job.run, start + 1, training.steps, elapsed)

    def step(self, step: int) -> dict[str, Any]:
        """One optimiser step: `accumulation` micro-batches forward and backward (the loss scaled
        under fp16), the gradients unscaled and clipped, then the optimiser, the schedule and the
        moving average. Its figures stay on the device: reading them would wait for it."""
        training, device = self.training, self.dist.device
        self.optimizer.zero_grad(set_to_none=True)
        step_loss, samples = torch.zeros((), device=device), 0
        for micro in range(self.accumulation):
            index, (latents, text, weighing) = next(self.data)
            if micro == 0:
                bucket = bucket_name(*latents.shape[2:])  # a clip's frames too
            seeded(seed_of(training.seed, index, "dropout"), device)  # LoRA dropout, by the micro-batch
            with kept_activations(training.gradient_checkpointing, device), attention_kernels():
                loss = diffusion_loss(self.replicas, self.objective.at(step), latents, text,
                                      draws(training.seed, index, "noise", device), self.half, weighing, self.network)
            self.scaler.scale(loss / self.accumulation).backward()
            step_loss += loss.detach() / self.accumulation
            samples += len(latents)
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, training.optimizer.max_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.schedule.step()
        if self.ema is not None:
            self.ema.update(self.network)
        return {"step": step, "loss": step_loss, "grad_norm": grad_norm, "samples": samples,
                "lr": self.optimizer.param_groups[0]["lr"], "bucket": bucket}


def seeded(seed: int, device: torch.device) -> None:
    """Seed the host's generator and `device`'s, which dropout draws from. `torch.manual_seed`
    seeds every accelerator too, and where none is initialised queues the call with its stack
    trace: a millisecond a micro-batch on a CPU."""
    torch.random.default_generator.manual_seed(seed)
    if device.type != "cpu":
        torch.get_device_module(device).manual_seed(seed)
