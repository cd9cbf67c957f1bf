"""A run's figures: each step's loss, gradient norm, learning rate, bucket and samples, kept on the
device until `flush` reads them all at once (the loop's only wait for the device), averaged over
every process into the rows metrics.jsonl keeps; rank 0 reports them (`report`) to `progress` (or
the log), the experiment trackers (with samples/s and peak memory) and, when several processes
train, the progress file the process that started them relays."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from configs.schema import TrainingConfig
from tasks.train.distributed import Distributed
from tasks.train.publisher import RunPublisher

log = logging.getLogger(__name__)

# progress(step, steps, loss, validation_loss or None)
Progress = Callable[[int, int, float, float | None], None]


class Metrics:
    def __init__(self, training: TrainingConfig, dist: Distributed, publisher: RunPublisher | None,
                 progress: Progress | None = None):
        """`publisher` and `progress` are rank 0's (None elsewhere). Reads `steps` and `log_every`."""
        self.dist, self.publisher, self.progress = dist, publisher, progress
        self.steps, self.every = training.steps, training.log_every
        self.log_interval = max(1, training.steps // 20)  # without `progress`, the log says it 20 times
        self.rows: list[dict[str, Any]] = []  # every step so far, as metrics.jsonl keeps them
        self.unread: list[dict[str, Any]] = []  # steps whose figures are still on the device
        self.fresh: list[dict[str, Any]] = []  # the rows of the last flush, not reported yet
        self.flushed = time.perf_counter()  # when the last figures left the device

    def resume(self, rows: list[dict[str, Any]]) -> None:
        """Continue after `rows`, the metrics saved with the checkpoint training resumes from."""
        self.rows = list(rows)
        self.flushed = time.perf_counter()

    def record(self, figures: dict[str, Any]) -> None:
        """A step's figures: `step`, `lr`, `bucket`, `samples`, and `loss` and `grad_norm` as tensors
        on the device, not read yet."""
        self.unread.append(figures)

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.steps

    def flush(self) -> None:
        """The unread steps' losses, gradient norms and sample counts off the device in one read,
        summed over every process (all of them call this) and averaged, into `rows`."""
        steps, world, device = self.unread, self.dist.world, self.dist.device
        table = torch.stack([torch.stack([s.pop("loss"), s.pop("grad_norm").float(),
                                          torch.tensor(float(s.pop("samples")), device=device)])
                             for s in steps])
        self.unread, self.fresh = [], []
        for row, (loss, norm, samples) in zip(steps, self.dist.sum(table).tolist()):
            loss, norm = loss / world, norm / world
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {row['step']}")
            self.fresh.append({"step": row["step"], "loss": loss, "lr": row["lr"], "bucket": row["bucket"],
                               "batch": int(samples), "grad_norm": norm if math.isfinite(norm) else None})
        self.rows += self.fresh

    def report(self, validation_loss: float | None) -> None:
        """Rank 0: the last flush's rows, the last with `validation_loss` (when scored), to
        `progress` or the log, the trackers and the progress file."""
        for row in self.fresh:
            scored = validation_loss if row is self.fresh[-1] else None
            if scored is not None:
                row["validation_loss"] = scored
            if self.progress is not None:
                self.progress(row["step"], self.steps, row["loss"], scored)
            elif row["step"] % self.log_interval == 0 or row["step"] == self.steps:
                log.info("step %d/%d loss %.4f%s", row["step"], self.steps, row["loss"],
                         "" if scored is None else f" validation {scored:.4f}")
            self.publisher.record(row["step"], {"loss/train": row["loss"], "learning_rate": row["lr"], **(
                {"grad_norm": row["grad_norm"]} if row["grad_norm"] is not None else {}), **(
                {"loss/validation": scored} if scored is not None else {})})
        last, now = self.fresh[-1], time.perf_counter()
        samples = sum(row["batch"] for row in self.fresh)
        self.publisher.record(last["step"], {"samples_per_s": samples / max(now - self.flushed, 1e-9),
                                             "peak_memory_gib": peak_memory_gib(self.dist.device)})
        self.flushed = now
        if self.dist.world > 1:
            self.publisher.relay(last["step"], last["loss"], validation_loss)


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
