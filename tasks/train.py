"""Stage 5 — train: a LoRA adapter on PixArtTransformer2DModel (or the whole transformer) from
cached features only.

T5 and the VAE encoder are never loaded: text embeddings and latent posteriors come from the
manifest's shards. Read top to bottom: data, model, optimiser, loop, outputs. The run folder
`runs/<run_id>/` holds config.yaml, metrics.jsonl, adapter/ (PEFT format), samples/ and
lineage.json, written last as the run's commit record. The run id hashes the manifest, the
training config and the transformer weights, so the same run is never trained twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from typing import Any

import fsspec
import torch
from safetensors.torch import load as load_safetensors

from configs.schema import ModelConfig, StorageConfig, TrainingConfig
from storage import layout
from storage.fingerprint import hash_json
from storage.lease import Lease
from storage.store import Store, fsspec_options
from tasks.checkpoints import Checkpointer, TrainingState
from tasks.distributed import Distributed, free_port
from tasks.ema import Ema
from tasks.publisher import RunPublisher, read_metrics
from tasks.features import CachedFeatures, bucket_batches
from tasks.loss import diffusion_loss
from tasks.models import (
    load_noise_scheduler, load_transformer, transformer_fingerprint,
)
from tasks.prefetch import prefetched
from tasks.validation import Validation

log = logging.getLogger(__name__)


# settings that cannot change the trained weights or samples stay out of the run id
NOT_IN_RUN_ID = {"device", "checkpoint_every", "keep_checkpoints"}
# in the run id: bump it with any change to training's code that changes what a run produces (the
# loss, sampling, data order, outputs), so a re-run trains anew instead of returning the old run
TRAIN_FORMAT = "precast.train/3"
LEASE_POLL_SECONDS = 2.0
# progress(step, steps, loss, validation_loss or None)
Progress = Callable[[int, int, float, float | None], None]


def run_id_for(manifest_id: str, model: ModelConfig, training: TrainingConfig, init: dict | None = None) -> str:
    # an explicit init_from URL counts by the adapter's bytes; "latest" by the word, so a re-run
    # over an unchanged manifest is the same run, and new data continues from the newest run
    init_id = init["sha256"] if init and training.init_from not in ("none", "latest") else None
    return hash_json({"manifest": manifest_id, "transformer": transformer_fingerprint(model),
                      "training": training.model_dump(exclude=NOT_IN_RUN_ID), "init": init_id,
                      "format": TRAIN_FORMAT})


def initial_adapter(store: Store, model: ModelConfig, training: TrainingConfig) -> dict | None:
    """The adapter `init_from` names: None, the newest finished LoRA run of this model in the
    store ("latest"; None if there is none yet), or a run/adapter URL. Returns its URL, sha256
    and tensors."""
    if training.init_from == "none":
        return None
    if training.init_from == "latest":
        finished = []
        for key in store.list(layout.RUNS):
            record = store.committed(layout.run_part(key, "lineage"))
            if record and record.get("adapter") and record.get("model") == model.model_dump():
                finished.append((record["finished"], record["adapter"]))
        if not finished:
            log.info("init_from latest: no finished run of this model yet, starting from scratch")
            return None
        url = max(finished)[1]
    else:
        url = training.init_from.rstrip("/")
        url = layout.run_part(layout.run_of(url), "adapter")
    fs, path = fsspec.core.url_to_fs(f"{url}/adapter_model.safetensors", **fsspec_options(store.config))
    try:
        data = fs.cat_file(path)
    except FileNotFoundError as error:
        raise FileNotFoundError(f"init_from: no adapter_model.safetensors at {url}") from error
    return {"url": url, "sha256": hashlib.sha256(data).hexdigest(), "tensors": load_safetensors(data)}


def run_for(store: Store, model: ModelConfig, training: TrainingConfig, manifest_id: str) -> tuple[str, dict | None]:
    """The run folder these inputs train, and the adapter an explicit `init_from` names (for
    "latest" the newest run is looked up only when training starts: it is not part of the id)."""
    explicit = training.init_from not in ("none", "latest")
    init = initial_adapter(store, model, training) if explicit else None
    return layout.run(run_id_for(manifest_id, model, training, init)), init


def finished_run(store: Store, run: str) -> dict[str, Any] | None:
    """What train returns for a finished run, also when it ran elsewhere (None: not finished): the
    lineage's commit record with the fields every stage's record has — `url` (the weights),
    `amount` and `committed_at`."""
    if (record := store.committed(layout.run_part(run, "lineage"))) is None:
        return None
    return {**record, "url": record["adapter"] or record["transformer"],
            "amount": f"{record['steps']} steps, loss {record['first_loss']:.3f} → {record['final_loss']:.3f}"}


def train(
    storage: StorageConfig, model: ModelConfig, training: TrainingConfig, manifest_url: str,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Train (or resume, or return the finished run); `progress(step, steps, loss, validation_loss)`
    after each step (the validation loss is None at steps without one)."""
    store = Store(storage)
    manifest = json.loads(store.read_verified(store.key(manifest_url)))
    run, init = run_for(store, model, training, manifest["id"])
    if (record := finished_run(store, run)) is not None:
        return record
    if training.init_from == "latest":  # resolved only now that this run is known to be unfinished
        init = initial_adapter(store, model, training)
    # one trainer per run: another pipeline training it already is waited for, not raced
    lease = Lease(store, layout.run_part(run, "lease"))
    while not lease.acquire():
        if (record := finished_run(store, run)) is not None:
            return record
        log.info("run %s is being trained by %s; waiting for it", store.url(run), lease.holder())
        time.sleep(LEASE_POLL_SECONDS)
    try:
        if (record := finished_run(store, run)) is not None:  # finished while we waited
            return record
        trainer = Trainer(storage, model, training, manifest, run, init)
        if training.processes == 1:
            trainer(0, 1, 0, progress, lease)
            return finished_run(store, run)
        # data parallel: one process per device (gloo on CPUs, NCCL on GPUs); rank 0 writes the
        # run and its progress, which this process relays while it waits
        processes = torch.multiprocessing.spawn(trainer, nprocs=training.processes, join=False,
                                                args=(training.processes, free_port()))
        while not processes.join(timeout=2):
            if lease.lost:
                for process in processes.processes:
                    process.terminate()
                lease.check()
            if progress is not None and store.exists(layout.run_part(run, "progress")):
                progress(*store.read_json(layout.run_part(run, "progress")))
        if progress is not None:
            progress(training.steps, training.steps, float("nan"), None)
        if (record := finished_run(store, run)) is None:
            raise RuntimeError(f"training processes of {store.url(run)} ended without committing the run")
        return record
    finally:
        lease.release()


@dataclass
class Trainer:
    """One run's training, built from its parts: the process group (`Distributed`), cached
    features and the held-out `Validation`, the network, optimiser and moving average, the
    `Checkpointer` and the `RunPublisher`. Called once per process; rank 0 publishes the run."""

    storage: StorageConfig
    model: ModelConfig
    training: TrainingConfig
    manifest: dict[str, Any]
    run: str
    init: dict | None

    def __call__(self, rank: int, world: int, port: int, progress: Progress | None = None,
                 lease: Lease | None = None) -> None:
        """The loop of process `rank` of `world`; `progress` (as `train`'s) on rank 0. Writes
        stop with LeaseLost once `lease` (held by the process that started training) was taken over."""
        training, run = self.training, self.run
        store = Store(self.storage)
        processes = Distributed.start(rank, world, port, training.device)
        device, leader = processes.device, processes.leader

        # --- data: cached features only; each process takes every world-th batch --------------
        features = CachedFeatures(store, self.manifest)
        validation = Validation(features, training.validation_samples, training.validation_every,
                                training.batch_size, training.seed)
        batches = islice(bucket_batches(validation.training_buckets(), training.batch_size, training.seed),
                         rank, None, world)
        # two generators: data choices (caption variant, dropout, flip, posterior draw) are made in the
        # loader thread, noise and timesteps in this one, so each stream is reproducible on its own
        data_rng = torch.Generator().manual_seed(training.seed + 1_000_003 * rank)
        noise_rng = torch.Generator().manual_seed(training.seed + 1_000_003 * rank + 1)

        # --- model: LoRA layers on the frozen transformer, or the whole transformer -----------
        network = trainable_network(self.model, training, self.init).to(device)
        replicas = processes.wrap(network)
        noise_scheduler = load_noise_scheduler(self.model)

        # --- optimiser: AdamW with linear warm-up ---------------------------------------------
        trainable = [p for p in network.parameters() if p.requires_grad]
        if training.optimizer == "adamw8bit":
            import bitsandbytes

            adamw = bitsandbytes.optim.AdamW8bit
        else:
            adamw = torch.optim.AdamW
        optimizer = adamw(trainable, lr=training.learning_rate, weight_decay=training.weight_decay)
        warmup = max(1, training.warmup_steps)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(training.mixed_precision)
        scaler = torch.amp.GradScaler(device.type, enabled=training.mixed_precision == "fp16")

        # the moving average of the trainable weights is what is saved when it is on
        ema = Ema(network, training.ema_decay) if training.ema_decay else None

        # --- resume: weights, optimiser, schedule, RNG and data position of the latest checkpoint
        state = TrainingState(network, optimizer, schedule, {"data": data_rng, "noise": noise_rng},
                              ema and ema.averages)
        checkpointer = Checkpointer(store, run, training.checkpoint_every, training.keep_checkpoints, lease)
        start = checkpointer.restore(state, rank)
        metrics = read_metrics(store, run)[:start]
        for _ in range(start * training.gradient_accumulation):
            next(batches)  # batches are a pure function of seed and position: skip the ones consumed
        if start:
            log.info("resuming %s at step %d", run, start)

        def load(sample_ids: list[str]):
            """A batch and the data generator's state after it (what a checkpoint must restore)."""
            return features.batch(sample_ids, data_rng, training.caption_dropout), data_rng.get_state()

        # with an accelerator the next batch is read while the model works on this one; on a CPU
        # that gains nothing (both share the same cores)
        loader = prefetched(load, batches, overlap=device.type != "cpu")
        data_state = data_rng.get_state()
        publisher = RunPublisher(store, run, self.model, training, self.manifest, self.init, features.prompts)

        # --- loop -----------------------------------------------------------------------------
        network.train()
        started = time.perf_counter()
        for step in range(start + 1, training.steps + 1):
            optimizer.zero_grad(set_to_none=True)
            step_loss = 0.0
            for _ in range(training.gradient_accumulation):
                (latents, text, mask), data_state = next(loader)
                loss = diffusion_loss(replicas, noise_scheduler, latents.to(device), text.to(device),
                                      mask.to(device), noise_rng, half)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"loss is {loss.item()} at step {step}")
                scaler.scale(loss / training.gradient_accumulation).backward()
                step_loss += loss.item() / training.gradient_accumulation
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(trainable, training.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            schedule.step()
            if ema is not None:
                ema.update(network)
            step_loss = processes.mean(step_loss)  # the logged loss is the mean over every process's batches
            metrics.append({"step": step, "loss": step_loss, "lr": optimizer.param_groups[0]["lr"],
                            "bucket": f"{latents.shape[2]}x{latents.shape[3]}", "batch": len(latents) * world})
            if leader and validation.due(step, training.steps):
                metrics[-1]["validation_loss"] = validation.loss(network, noise_scheduler, device, half)
            if leader and (step % max(1, training.steps // 20) == 0 or step == training.steps):
                log.info("step %d/%d loss %.4f%s", step, training.steps, step_loss,
                         f" validation {metrics[-1]['validation_loss']:.4f}" if "validation_loss" in metrics[-1] else "")
            if leader and progress is not None:
                progress(step, training.steps, step_loss, metrics[-1].get("validation_loss"))
            if leader and world > 1 and step % max(1, training.steps // 100) == 0:
                store.write_json(layout.run_part(run, "progress"),
                                 [step, training.steps, step_loss, metrics[-1].get("validation_loss")])
            if leader:
                publisher.maybe_sample(network, step)
            if checkpointer.due(step, training.steps):
                states = {"data": processes.gather(data_state), "noise": processes.gather(noise_rng.get_state())}
                if leader:  # every process took part in the gathering above
                    checkpointer.save(step, state, states, metrics)
        elapsed = time.perf_counter() - started
        loader.close()
        processes.close()
        if not leader:
            return

        # --- outputs: weights, samples, metrics, lineage (last) --------------------------------
        if lease is not None:
            lease.check()
        if ema is not None:  # the averaged weights are the run's result (and render its final samples)
            ema.copy_to(network)
        publisher.publish(network, metrics, start, elapsed)


def trainable_network(model: ModelConfig, training: TrainingConfig, init: dict | None = None):
    """The transformer with LoRA layers (only they train; from `init`'s weights when given), or
    the whole transformer for `method: full`. Seeded: every process builds the same one."""
    torch.manual_seed(training.seed)
    transformer = load_transformer(model)
    if training.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    if training.method == "full":
        return transformer.requires_grad_(True)
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    lora = LoraConfig(r=training.rank, lora_alpha=training.alpha, lora_dropout=training.lora_dropout,
                      target_modules=training.target_modules, bias="none")
    network = get_peft_model(transformer.requires_grad_(False), lora)
    if init is not None:
        try:
            set_peft_model_state_dict(network, init["tensors"])
        except RuntimeError as error:
            raise ValueError(f"init_from {init['url']} does not fit this LoRA config: {error}") from error
        log.info("continuing from %s", init["url"])
    return network


def run_markdown(record: dict[str, Any]) -> str:
    resumed = f" (resumed at step {record['resumed_from']})" if record["resumed_from"] else ""
    lines = [f"# Training run{resumed}", "", f"- steps: {record['steps']}",
             f"- loss: {record['first_loss']:.4f} at the start, {record['final_loss']:.4f} at the end",
             f"- weights: `{record['url']}`",
             f"- validation loss: {record['validation_loss']:.4f}" if record["validation_loss"] is not None
             else "- validation loss: none (training.validation_samples is 0)",
             f"- loss curve: `{layout.run_part(record['run'], 'loss_curve')}`",
             f"- metrics: `{layout.run_part(record['run'], 'metrics')}`"]
    lines += [f"- samples: `{url}`" for url in record["samples"]]
    return "\n".join(lines)
