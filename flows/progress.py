"""A long stage's progress where its user looks: a Prefect progress artifact of the flow run
(`<stage>-progress`, updated every few seconds while the stage runs, whichever workers do the work),
a bar on a terminal, and on anything else (a worker's log, CI) a plain line at every tenth of the
way. Each says what is done of what, how fast, and when it should end."""

from __future__ import annotations

import contextvars
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from prefect.artifacts import create_progress_artifact, update_progress_artifact

log = logging.getLogger(__name__)
if log.level == logging.NOTSET:  # a worker's flow run logs libraries from WARNING on: progress still shows
    log.setLevel(logging.INFO)
ARTIFACT_SECONDS = 2.0  # each artifact update is an API call: a few a minute, whatever the pace


class StageProgress:
    """Progress of `stage` over `total` units of work (shards, files, steps) and, when given, the
    items they hold (`items` of them in all: samples, captioned samples). `advance` may be called
    from any thread; the ETA follows the pace of the units."""

    def __init__(self, stage: str, total: int | None, unit: str, items: int | None = None, item_unit: str = "samples",
                 started: float | None = None):
        """`total` None: the work comes as the stage runs (`grow`), and is all known at `settle`.
        `started` (time.monotonic) when the stage began, if before this: rates, ETAs and "done in"
        count from then, as the pipeline summary's time does."""
        self.stage, self.total, self.unit, self.settled = stage, max(total or 0, 0), unit, total is not None
        self.items, self.item_unit = items, item_unit
        self.done = self.items_done = 0
        self.started = time.monotonic() if started is None else started
        self.lock = threading.Lock()
        self.artifact = None
        self.tenths = 0  # plain lines printed so far
        self.extra = ""
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc=stage, unit=f" {unit}", file=sys.stderr, dynamic_ncols=True)
        try:
            self.artifact = create_progress_artifact(progress=0.0 if self.total or not self.settled else 100.0,
                                                     key=f"{stage}-progress",
                                                     description=self.line())
        except Exception as error:  # no flow run (the direct runner), or the API is away: terminal only
            log.debug("no progress artifact for %s: %s", stage, error)
        self.updated = time.monotonic()

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        text = f"{self.stage}: {self.done:,}/{self.total:,} {self.unit}"
        if self.items is not None or self.items_done:
            text += f", {self.items_done:,}" + (f"/{self.items:,}" if self.items is not None else "") + \
                f" {self.item_unit} ({self.items_done / max(elapsed, 1e-9):,.1f}/s)"
        else:
            text += f" ({self.done / max(elapsed, 1e-9):,.1f}/s)"
        if 0 < self.done < self.total:
            text += f", ETA {_duration(elapsed * (self.total - self.done) / self.done)}"
        elif self.settled and self.total and self.done >= self.total:
            text += f", done in {_duration(elapsed)}"
        return text + (f", {self.extra}" if self.extra else "")

    def grow(self, count: int) -> None:
        """`count` more units to do (a stage given its work as it comes)."""
        with self.lock:
            self.total += count
            if self.bar is not None:
                self.bar.total = self.total
                self.bar.refresh()

    def settle(self, items: int | None = None) -> None:
        """No more work will come (of `items` items in all, when known): the stage is done when
        what it has is."""
        self.settled, self.items = True, items if items is not None else self.items
        self.advance(0)

    def advance(self, count: int = 1, items: int = 0, extra: str | None = None) -> None:
        """`count` more units done (holding `items` items); `extra` replaces the line's tail."""
        with self.lock:
            self.done = min(self.total, self.done + count)
            self.items_done += items
            if extra is not None:
                self.extra = extra
            finished = self.settled and self.done >= self.total
            if self.bar is not None:
                self.bar.n = self.done
                self.bar.set_postfix_str(self.line().split(", ", 1)[-1] if self.items or self.extra else "",
                                         refresh=False)
                self.bar.refresh()
            elif self.total and (finished or 10 * self.done // self.total > self.tenths):
                self.tenths = 10 * self.done // self.total
                log.info("%s", self.line())
            if self.artifact is not None and (finished or time.monotonic() - self.updated >= ARTIFACT_SECONDS):
                percent, line = 100.0 * self.done / max(self.total, 1), self.line()
                viewed(lambda: update_progress_artifact(self.artifact, progress=percent, description=line))
                self.updated = time.monotonic()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def reporter(stage: str, unit: str) -> Callable[..., None]:
    """A `progress(done, total, extra=None)` callback for a stage function (the stage modules never
    import Prefect): its StageProgress is made at the first call, when the total is known."""
    made: list[StageProgress] = []
    began = time.monotonic()  # the first call comes some units in: its rate counts from here

    def report(done: int, total: int, extra: str | None = None) -> None:
        if not made:
            made.append(StageProgress(stage, total, unit, started=began))
        progress = made[0]
        progress.advance(done - progress.done, extra=extra)
        if done >= total:
            progress.close()

    return report


@contextmanager
def followed(stage: str, shards: int | None = None, label: str | None = None, done: int = 0) -> Iterator[None]:
    """The progress of `stage` run in child flow runs of this one (placed on other pools), in this
    flow run's own `<label>-progress` artifact (`label`: the stage's by default) every few seconds,
    so the pipeline run shows every stage moving: an encoder's `shards` summed over its children
    (each reports a fraction of the shards it was given) after the `done` found cached; any other
    stage as its furthest child reports it (ingest's one child, training's node 0)."""
    from prefect.context import FlowRunContext

    parent, label = FlowRunContext.get().flow_run.id, label or stage
    summed = StageProgress(label, shards, "shards") if shards is not None else None
    if summed is not None and done:
        summed.advance(done)
    mirror = None  # the artifact, made when a child first reports

    def poll() -> None:
        nonlocal mirror
        children = children_progress(parent, stage, label)
        if summed is not None:
            summed.advance(done + sum(round(percent * given / 100) for given, percent, _ in children) - summed.done)
        elif children:
            _, percent, description = max(children, key=lambda child: child[1])
            if mirror is None:
                mirror = create_progress_artifact(progress=percent, key=f"{label}-progress", description=description)
            else:
                update_progress_artifact(mirror, progress=percent, description=description)

    def follow() -> None:
        while not stop.wait(ARTIFACT_SECONDS):
            viewed(poll)

    stop = threading.Event()
    # in this flow run's context: its artifact and plain lines belong to this run
    watcher = threading.Thread(target=contextvars.copy_context().run, args=(follow,), daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
    if summed is not None:
        summed.advance(shards - summed.done)
        summed.close()
    else:
        viewed(poll)  # the children's last word: 100 when they finished


def viewed(update: Callable[[], Any]) -> None:
    """`update()` of a progress view: the stage goes on without it when the API fails."""
    try:
        update()
    except Exception as error:
        log.debug("progress not updated: %s", error)


def children_progress(parent, stage: str, label: str | None = None) -> list[tuple[int, float, str]]:
    """For each child flow run of flow run `parent` that runs `stage` and has reported: the shards
    it was given, its progress (percent) and its description, from its `<label>-progress` artifact."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey, FlowRunFilter, FlowRunFilterParentFlowRunId,
    )

    with get_client(sync_client=True) as client:
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent])))
        given = {run.id: len(run.parameters.get("shards") or []) for run in children
                 if run.parameters.get("name") == stage}
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[f"{label or stage}-progress"]),
            flow_run_id=ArtifactFilterFlowRunId(any_=list(given))))
    return [(given[artifact.flow_run_id], float(artifact.data), artifact.description or "") for artifact in found]


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
