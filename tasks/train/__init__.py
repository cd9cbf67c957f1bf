"""Stage 5 — train: a LoRA adapter on PixArtTransformer2DModel (or the whole transformer) from
cached features only.

T5 and the VAE encoder are never loaded: text embeddings and latent posteriors come from the
manifest's shards. Read top to bottom: data, model, optimiser, loop, outputs. The run folder
`runs/<run_id>/` holds config.yaml, metrics.jsonl, adapter/ (PEFT format), samples/ and
lineage.json, written last as the run's commit record. The run id hashes the manifest, the
training config and the transformer weights, so the same run is never trained twice.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import fsspec
import torch
from safetensors.torch import load as load_safetensors

from configs.schema import ModelConfig, StorageConfig, TrainingConfig
from storage import layout
from storage.fingerprint import hash_json
from storage.lease import Lease, LeaseLost
from storage.store import Store, fsspec_options
from tasks.train.checkpointer import Checkpointer, TrainingState
from tasks.train.distributed import Distributed, NodeFailed, Rendezvous, free_port
from tasks.train.ema import Ema
from tasks.train.publisher import RunPublisher, read_metrics
from tasks.train.data import CachedFeatures, batch_sizes, bucket_batches, draws, seed_of
from tasks.train.loss import Objective, diffusion_loss
from tasks.encode.models import (
    DTYPES, load_noise_scheduler, load_transformer, transformer_fingerprint,
)
from tasks.prefetch import prefetched
from tasks.train.validation import Validation

log = logging.getLogger(__name__)


# settings that cannot change the trained weights or samples stay out of the run id; how the
# global batch is split over nodes, processes and accumulation is one of them (the run id holds the
# micro-batches per step), so a run is the same run on any number of nodes; so are the memory and
# speed settings whose math is the same (checkpointing recomputes exactly; compiled blocks compute
# the same within float tolerance, as another device does)
NOT_IN_RUN_ID = {"device", "checkpoint_every", "keep_checkpoints", "nodes", "processes", "node_timeout",
                 "gradient_accumulation", "global_batch", "gradient_checkpointing", "compile", "prefetch",
                 "log_every", "trackers", "tracker_project", "mlflow_tracking_uri"}
# in the run id: bump it with any change to training's code that changes what a run produces (the
# loss, sampling, data order, outputs), so a re-run trains anew instead of returning the old run
TRAIN_FORMAT = "precast.train/5"
LEASE_POLL_SECONDS = 2.0
JOIN_POLL_SECONDS = 1.0
# progress(step, steps, loss, validation_loss or None)
Progress = Callable[[int, int, float, float | None], None]


def run_id_for(manifest_id: str, model: ModelConfig, training: TrainingConfig, init: dict | None = None) -> str:
    # an explicit init_from URL counts by the adapter's bytes; "latest" by the word, so a re-run
    # over an unchanged manifest is the same run, and new data continues from the newest run
    init_id = init["sha256"] if init and training.init_from not in ("none", "latest") else None
    return hash_json({"manifest": manifest_id, "transformer": transformer_fingerprint(model),
                      "training": {**training.model_dump(exclude=NOT_IN_RUN_ID), "micro_batches": training.micro_batches},
                      "init": init_id, "format": TRAIN_FORMAT})


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
    progress: Progress | None = None, node: int = 0, attempt: str | None = None,
) -> dict[str, Any]:
    """Train (or resume, or return the finished run); `progress(step, steps, loss, validation_loss)`
    after each step (the validation loss is None at steps without one). With `training.nodes` > 1,
    every node calls this with its `node` index and the `attempt` id they share (a new one for each
    attempt: a re-run resumes from the last checkpoint)."""
    store = Store(storage)
    manifest = json.loads(store.read_verified(store.key(manifest_url)))
    run, init = run_for(store, model, training, manifest["id"])
    if (record := finished_run(store, run)) is not None:
        return record
    if training.nodes > 1 and attempt is None:
        raise ValueError(f"training.nodes is {training.nodes}: train on several nodes through the pipeline flow with "
                         f"execution.placement.train, which gives each node its index and the attempt id they share")
    if not 0 <= node < training.nodes:
        raise ValueError(f"node {node} is not one of training.nodes ({training.nodes})")
    if node > 0:  # node 0 holds the run's lease and publishes where to join; the others join it (and
        # take its weights, "latest" adapter included: DDP broadcasts rank 0's when it wraps the network)
        return train_on_node(store, run, Trainer(storage, model, training, manifest, run, init), node, attempt)
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
        if training.world == 1:
            trainer(0, 0, "", progress, lease)
            return finished_run(store, run)
        return train_on_node(store, run, trainer, 0, attempt, progress, lease)
    finally:
        lease.release()


def train_on_node(store: Store, run: str, trainer: Trainer, node: int, attempt: str | None,
                  progress: Progress | None = None, lease: Lease | None = None) -> dict[str, Any]:
    """This node's `training.processes` data-parallel processes (gloo on CPUs, NCCL on GPUs),
    watched until the run is committed. Rank 0 (node 0) writes the run and its progress, which this
    process relays; across nodes each node beats a heartbeat and watches the others', and a node
    that failed, died or stopped answering ends every node's processes with an error naming it."""
    training = trainer.training
    rendezvous = None
    if training.nodes > 1:
        rendezvous = Rendezvous(store, layout.rendezvous(run, attempt), node, training.nodes, training.node_timeout)
        if node == 0:
            address = rendezvous.publish()
        elif (address := rendezvous.address(lambda: finished_run(store, run) is not None)) is None:
            return finished_run(store, run)
    else:
        address = f"127.0.0.1:{free_port()}"
    processes = torch.multiprocessing.spawn(trainer, nprocs=training.processes, join=False, args=(node, address))
    looked = 0.0
    try:
        while not processes.join(timeout=JOIN_POLL_SECONDS):
            if lease is not None:
                lease.check()
            if rendezvous is not None and time.monotonic() - looked > rendezvous.interval:
                rendezvous.beat()
                rendezvous.check()
                looked = time.monotonic()
            if progress is not None:
                with contextlib.suppress(FileNotFoundError):  # rank 0 has not reported yet
                    progress(*store.read_json(layout.run_part(run, "progress")))
    except Exception as error:
        for process in processes.processes:
            if process.is_alive():
                process.terminate()
        if rendezvous is None:
            raise
        local = isinstance(error, (NodeFailed, LeaseLost))  # known here: no other node to wait for
        cause = str(error) if local else rendezvous.culprits() or _last_line(error)
        rendezvous.beat(error=cause)  # the other nodes stop at once instead of at their timeout
        raise NodeFailed(f"training {store.url(run)} on {training.nodes} nodes failed on node {node}: "
                         f"{cause}") from error
    if progress is not None:
        progress(training.steps, training.steps, float("nan"), None)
    # rank 0 commits the run just after every process left the group: the other nodes wait for it
    while (record := finished_run(store, run)) is None and rendezvous is not None and node > 0:
        rendezvous.beat()
        rendezvous.check()
        time.sleep(rendezvous.interval)
    if record is None:
        raise RuntimeError(f"training processes of {store.url(run)} ended without committing the run")
    return record


def _last_line(error: BaseException) -> str:
    """The final line of an error from a training process (its traceback comes before it)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


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

    def __call__(self, local: int, node: int, address: str, progress: Progress | None = None,
                 lease: Lease | None = None) -> None:
        """The loop of process `local` of node `node` (rank node × processes + local), joining
        the group at `address`; `progress` (as `train`'s) on rank 0. Writes stop with LeaseLost
        once `lease` (held by the process that started training) was taken over."""
        training, run = self.training, self.run
        store = Store(self.storage)
        world, rank = training.world, node * training.processes + local
        processes = Distributed.start(rank, world, local, address, training.device, training.node_timeout)
        device, leader = processes.device, processes.leader

        # --- model: LoRA layers on the frozen transformer, or the whole transformer -----------
        network = trainable_network(self.model, training, self.init).to(device)
        replicas = processes.wrap(network)
        noise_scheduler = load_noise_scheduler(self.model)
        objective = Objective.of(training)

        # --- data: cached features only; each process takes every world-th micro-batch of the
        # global stream, and each micro-batch's draws are seeded by its index in that stream
        features = CachedFeatures(store, self.manifest)
        validation = Validation(features, training.validation_samples, training.validation_every,
                                training.batch_size, training.seed)
        buckets = validation.training_buckets()
        sizes = batch_sizes(buckets, training.batch_size, training.batch_tokens, network.config.patch_size)
        stream = enumerate(bucket_batches(buckets, sizes, training.seed))
        batches = islice(stream, rank, None, world)

        # --- optimiser: AdamW (fused on accelerators) with linear warm-up ---------------------
        trainable = [p for p in network.parameters() if p.requires_grad]
        if training.optimizer == "adamw8bit":
            import bitsandbytes

            adamw, options = bitsandbytes.optim.AdamW8bit, {}
        else:
            adamw, options = torch.optim.AdamW, {"fused": device.type == "cuda" or None}
        optimizer = adamw(trainable, lr=training.learning_rate, weight_decay=training.weight_decay, **options)
        warmup = max(1, training.warmup_steps)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        half = DTYPES.get(training.mixed_precision)  # None for "no"
        scaler = torch.amp.GradScaler(device.type, enabled=training.mixed_precision == "fp16")

        # the moving average of the trainable weights is what is saved when it is on
        ema = Ema(network, training.ema_decay) if training.ema_decay else None

        # --- resume: weights, optimiser and schedule of the latest checkpoint; its step fixes the
        # data position (micro-batches are a pure function of seed and index)
        state = TrainingState(network, optimizer, schedule, ema and ema.averages)
        checkpointer = Checkpointer(store, run, training.checkpoint_every, training.keep_checkpoints, lease)
        start = checkpointer.restore(state)
        metrics = read_metrics(store, run)[:start]
        accumulation = training.accumulation
        for _ in range(start * accumulation):
            next(batches)
        if start:
            log.info("resuming %s at step %d", run, start)

        def load(item: tuple[int, list[str]]):
            index, sample_ids = item
            batch = features.batch(sample_ids, draws(training.seed, index, "data"), training.caption_dropout)
            if device.type == "cuda":  # pinned, so the copy to the device does not hold the host
                batch = tuple(tensor.pin_memory() for tensor in batch)
            return index, batch

        # with an accelerator the next batches are read while the model works; on a CPU that gains
        # nothing (both share the same cores)
        loader = prefetched(load, batches, 0 if device.type == "cpu" else training.prefetch)
        publisher = RunPublisher(store, run, self.model, training, self.manifest, self.init, features.prompts) \
            if leader else None
        flushed = time.perf_counter()  # when the last figures left the device

        def flush(steps: list[dict[str, Any]], validation_loss: float | None) -> None:
            """The steps' losses, gradient norms and sample counts off the device in one read (the
            loop's only wait for it), averaged over every process, into `metrics`, `progress` and the
            trackers; the last step's validation loss (rank 0) with them."""
            nonlocal flushed
            table = torch.stack([torch.stack([s.pop("loss"), s.pop("grad_norm").float(),
                                              torch.tensor(float(s.pop("samples")), device=device)])
                                 for s in steps])
            for row, (loss, norm, samples) in zip(steps, processes.sum(table).tolist()):
                loss, norm = loss / world, norm / world
                if not math.isfinite(loss):
                    raise FloatingPointError(f"loss is {loss} at step {row['step']}")
                metrics.append({"step": row["step"], "loss": loss, "lr": row["lr"], "bucket": row["bucket"],
                                "batch": int(samples), "grad_norm": norm if math.isfinite(norm) else None})
                scored = validation_loss if row is steps[-1] else None
                if scored is not None:
                    metrics[-1]["validation_loss"] = scored
                if leader and progress is None and (row["step"] % max(1, training.steps // 20) == 0
                                                    or row["step"] == training.steps):  # else progress says it
                    log.info("step %d/%d loss %.4f%s", row["step"], training.steps, loss,
                             "" if scored is None else f" validation {scored:.4f}")
                if leader and progress is not None:
                    progress(row["step"], training.steps, loss, scored)
                if leader:
                    publisher.record(row["step"], {"loss/train": loss, "learning_rate": row["lr"], **(
                        {"grad_norm": norm} if math.isfinite(norm) else {}), **(
                        {"loss/validation": scored} if scored is not None else {})})
            if leader:
                now, samples = time.perf_counter(), sum(m["batch"] for m in metrics[-len(steps):])
                publisher.record(metrics[-1]["step"], {"samples_per_s": samples / max(now - flushed, 1e-9),
                                                       "peak_memory_gib": peak_memory_gib(device)})
                flushed = now
            if leader and world > 1:
                store.write_json(layout.run_part(run, "progress"), [metrics[-1]["step"], training.steps,
                                                                    metrics[-1]["loss"], validation_loss])

        # --- loop: nothing waits for the device but `flush`, every log_every steps -------------
        network.train()
        started = time.perf_counter()
        unread: list[dict[str, Any]] = []
        for step in range(start + 1, training.steps + 1):
            optimizer.zero_grad(set_to_none=True)
            step_loss, samples = torch.zeros((), device=device), 0
            for micro in range(accumulation):
                index, batch = next(loader)
                latents, text, mask = (tensor.to(device, non_blocking=True) for tensor in batch)
                if micro == 0:
                    bucket = f"{latents.shape[2]}x{latents.shape[3]}"
                torch.manual_seed(seed_of(training.seed, index, "dropout"))  # LoRA dropout
                with kept_activations(training.gradient_checkpointing, device):
                    loss = diffusion_loss(replicas, noise_scheduler, latents, text, mask,
                                          draws(training.seed, index, "noise", device), half, objective)
                scaler.scale(loss / accumulation).backward()
                step_loss += loss.detach() / accumulation
                samples += len(latents)
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, training.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            schedule.step()
            if ema is not None:
                ema.update(network)
            unread.append({"step": step, "loss": step_loss, "grad_norm": grad_norm, "samples": samples,
                           "lr": optimizer.param_groups[0]["lr"], "bucket": bucket})
            validating, checkpointing = validation.due(step, training.steps), checkpointer.due(step, training.steps)
            if step % training.log_every == 0 or validating or checkpointing or step == training.steps:
                flush(unread, validation.loss(network, noise_scheduler, device, half) if leader and validating
                      else None)
                unread = []
            if leader:
                publisher.maybe_sample(network, step)
            if leader and checkpointing:
                checkpointer.save(step, state, metrics)
                publisher.checkpointed()
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
        log.info("trained %s: steps %d-%d in %.1f s", run, start + 1, training.steps, elapsed)


def peak_memory_gib(device: torch.device) -> float:
    """The most memory training has held: the accelerator's allocations, or this process's peak
    resident memory on a CPU (VmHWM: getrusage's ru_maxrss keeps, across exec, the high-water mark
    of the parent memory a child was forked with)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    status = Path("/proc/self/status")
    if status.exists():
        line = next(line for line in status.read_text().splitlines() if line.startswith("VmHWM:"))
        return int(line.split()[1]) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def kept_activations(checkpointing: str, device: torch.device):
    """Where the tensors backward needs wait during forward: on the device, or with `offload` in
    host memory (pinned beside an accelerator, copied there and back without holding the host:
    torch's saved-tensor hooks). With checkpointing these are the blocks' inputs only."""
    if checkpointing == "offload":
        return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")
    return contextlib.nullcontext()


def trainable_network(model: ModelConfig, training: TrainingConfig, init: dict | None = None):
    """The transformer with LoRA layers (only they train, in fp32; from `init`'s weights when
    given) on the frozen base held in `base_precision`, or the whole transformer for `method:
    full`; gradient checkpointing and compiled blocks as configured. Seeded: every process builds
    the same one."""
    torch.manual_seed(training.seed)
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(training.base_precision)
    transformer = load_transformer(model, half)
    if training.gradient_checkpointing != "none":
        transformer.enable_gradient_checkpointing()
    if training.method == "full":
        network = transformer.requires_grad_(True)
    else:
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

        transformer.requires_grad_(False)
        if training.base_precision == "int8":
            from torchao.quantization import Int8WeightOnlyConfig, quantize_

            quantize_(transformer, Int8WeightOnlyConfig())
        lora = LoraConfig(r=training.rank, lora_alpha=training.alpha, lora_dropout=training.lora_dropout,
                          target_modules=training.target_modules, bias="none")
        with warnings.catch_warnings():  # int8: PEFT warns that merging needs the quantisation recipe; never merged here
            warnings.filterwarnings("ignore", "TorchaoLoraLinear was instantiated without")
            network = get_peft_model(transformer, lora)  # the adapter in fp32 on any base (autocast_adapter_dtype)
        if init is not None:
            try:
                set_peft_model_state_dict(network, init["tensors"])
            except RuntimeError as error:
                raise ValueError(f"init_from {init['url']} does not fit this LoRA config: {error}") from error
            log.info("continuing from %s", init["url"])
    if training.compile:  # each block once per input shape; the rest of the model stays eager
        for block in transformer.transformer_blocks:
            block.compile()
    return network

