"""Where an encoding stage runs its tasks: in this process, or on long-lived workers (a Dask
cluster per stage, or a running one, through Prefect's `DaskTaskRunner`).

Each worker is a process pinned to one device (its own `CUDA_VISIBLE_DEVICES`, as dask-cuda's
cluster does) that loads the stage's model once (tasks/encode/models.py caches loaders per process) and
encodes shard after shard. The shard stays the unit of commit, retry and idempotence: each is a
Prefect task run of this flow run, with the task's retries and cache, and its output is committed
last, so a shard redone on another worker changes nothing. The stage's other tasks (the text
encoder's prompts and precision check) run on a worker too: the flow's process loads no model.
Engine behaviour this relies on, measured here (tests/test_workers.py tests the first three):
- Dask keeps a result on the worker that made it, and a killed worker's finished tasks are rerun
  for their lost results: each future is released as soon as it is done.
- A task whose worker died `allowed-failures` times raises `KilledWorker`, and its Prefect task run
  stays RUNNING: it is set Crashed here and the shard is submitted again as a new task run.
- A worker reports its task runs' states to the server as events, sent from a queue after the
  task returned: a worker killed just after a shard finished took its COMPLETED with it, and the
  run stayed RUNNING. After a worker left, the final states the flow got back are set where the
  server lacks them.
- Without `PREFECT_API_URL` a worker would start a temporary Prefect server of its own: workers
  get this flow run's API URL.
- Dask sets `OMP_NUM_THREADS=1` in its workers: on CPUs each worker gets its share of the cores.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from prefect import Task

from configs.schema import ExecutionConfig
from flows.credentials import cluster_security
from flows.stage_tasks import device_slot
from tasks.encode.models import encoding_work, model_loads
from tasks.loading import resolve_device
from tasks.records import EncodingWork

log = logging.getLogger(__name__)


def worker_count(execution: ExecutionConfig, device: str) -> int:
    """`execution.workers`, else one per visible GPU of `device`'s kind, else 1."""
    if execution.workers:
        return execution.workers
    import torch

    return torch.cuda.device_count() if resolve_device(device).type == "cuda" else 1


@contextmanager
def stage_executor(execution: ExecutionConfig, device: str, configure: Callable[[Task], Task],
                   stage: str) -> Iterator[Any]:
    """Where `stage` runs its tasks (each `configure`d with the run's retries and result storage):
    on `execution.cluster`, on a cluster of `worker_count` processes of its own (closed with the
    stage) when that is more than one, else in this process. Its work counts the loads of its own
    models only: the other encoder may be loading its own beside it."""
    if execution.cluster is None and worker_count(execution, device) == 1:
        yield InProcess(configure, execution.max_parallel_shards, device, stage)
        return
    from prefect_dask import DaskTaskRunner

    if execution.cluster:
        security = cluster_security(execution.cluster_tls) if execution.cluster_tls else None
        with DaskTaskRunner(address=execution.cluster, client_kwargs={"security": security}) as runner:
            yield OnWorkers(runner, configure, execution.retries, stage)
        return
    with local_cluster(worker_count(execution, device), device) as cluster, \
            DaskTaskRunner(cluster=cluster) as runner:  # a runner given a cluster does not close it
        yield OnWorkers(runner, configure, execution.retries, stage)


def local_cluster(count: int, device: str):
    """The stage's own workers: on loopback only, over TLS with a certificate made for this
    cluster alone (`Security.temporary`), so neither the network nor another user of the node
    can hand them code."""
    from distributed import Nanny, Scheduler, Security, SpecCluster
    from prefect.client.orchestration import get_client

    from prefect.settings import get_current_settings

    with get_client(sync_client=True) as client:
        api = client.api_url
    gpus = resolve_device(device).type == "cuda"
    threads = max(1, (os.cpu_count() or 1) // count)
    auth = get_current_settings().api.auth_string  # a server with an auth string refuses task runs without it
    env = {"PREFECT_API_URL": str(api).rstrip("/"), "OMP_NUM_THREADS": str(threads),
           **({"PREFECT_API_AUTH_STRING": auth.get_secret_value()} if auth else {})}
    security = Security.temporary()
    private = {"host": "127.0.0.1", "security": security, "protocol": "tls"}
    workers = {index: {"cls": Nanny, "options": {
        "nthreads": 1, **private, "env": {**env, **({"CUDA_VISIBLE_DEVICES": str(index)} if gpus else {})}}}
        for index in range(count)}
    return SpecCluster(workers=workers, scheduler={"cls": Scheduler, "options": {"dashboard": False, **private}},
                       security=security, silence_logs=logging.WARNING)


class InProcess:
    """A stage's tasks in this process: shards in threads, `limit` at once, each holding the
    node's GPU slot when `device` is a GPU."""

    def __init__(self, configure: Callable[[Task], Task], limit: int, device: str, stage: str):
        self.configure, self.limit, self.device, self.stage = configure, limit, device, stage
        self.started, self.loads = time.time(), model_loads().get(stage, 0)

    def one(self, task: Task, *args: Any) -> Any:
        with device_slot(self.device):
            return self.configure(task)(*args)

    def map(self, task: Task, items: Iterable[Any], *args: Any,
            completed: Callable[[Any], None] | None = None) -> list[Any]:
        """Results in `items`' order (each started as it comes); `completed(result)` as each completes."""
        def run(item: Any) -> Any:
            result = self.one(task, *args, item)
            if completed is not None:
                completed(result)
            return result
        return in_threads(run, items, self.limit)

    def work(self, records: list[dict[str, Any]]) -> EncodingWork:
        return encoding_work(records, self.started, 1, model_loads().get(self.stage, 0) - self.loads)


def in_threads(work: Callable[[Any], Any], items: Iterable[Any], limit: int) -> list[Any]:
    """`work(item)` for each item as it comes, at most `limit` at once (one: in this thread), in
    threads that end with the call; raises the first failure. Each thread gets a copy of this
    flow's context, so its task runs and child flow runs belong to this flow run.

    Parallel threads live only as long as this call: a thread that ran torch keeps an OpenMP team,
    and while libgomp manages more threads than there are cores it puts idle workers to sleep after
    every parallel region, which made every later stage (training) run twice as slow beside
    long-lived threads."""
    if limit == 1:
        return [work(item) for item in items]
    with ThreadPoolExecutor(max_workers=limit) as pool:
        futures = [pool.submit(contextvars.copy_context().run, work, item) for item in items]
        return [future.result() for future in futures]


class OnWorkers:
    """A stage's tasks on a Dask cluster's workers, as task runs of this flow run."""

    def __init__(self, runner: Any, configure: Callable[[Task], Task], retries: int, stage: str):
        self.runner, self.configure, self.retries, self.stage = runner, configure, retries, stage
        self.started, self.loads = time.time(), runner.client.run(model_loads)

    def submit(self, task: Task, *args: Any):
        names = list(inspect.signature(task.fn).parameters)
        return self.runner.submit(self.configure(task), parameters=dict(zip(names, args)))

    def one(self, task: Task, *args: Any) -> Any:
        return self.map(task, [args[-1]], *args[:-1])[0]

    def map(self, task: Task, items: Iterable[Any], *args: Any,
            completed: Callable[[Any], None] | None = None) -> list[Any]:
        """Results in `items`' order, each submitted as it comes, `completed(result)` as each
        completes; raises the first failure (after the task's own retries). An item whose workers
        kept dying is submitted again as a new task run, up to `retries` times."""
        from distributed import KilledWorker, as_completed

        given: list[Any] = []
        futures: dict[str, tuple[int, Any]] = {}
        results: list[Any] = []
        deaths: list[int] = []
        finals: dict[Any, Any] = {}  # task run id -> the final state its worker returned
        began = time.time()
        pending = as_completed([], loop=self.runner.client.loop)

        def submit(index: int) -> None:
            future = self.submit(task, *args, given[index])
            futures[future.wrapped_future.key] = (index, future)
            pending.add(future.wrapped_future)

        def finished(done: Any) -> None:
            index, future = futures.pop(done.key)
            try:
                state = done.result()
            except KilledWorker as error:  # its task run would stay RUNNING: end it, beside the other work
                from prefect.states import Crashed

                settle({future.task_run_id: Crashed(message=f"its Dask worker died: {error}")})
                deaths[index] += 1
                if deaths[index] > self.retries:  # an item that kills every worker it meets (out of memory?)
                    raise RuntimeError(f"{given[index]}: the workers running {task.name} on it died "
                                       f"{deaths[index]} time(s) after Dask's own reruns: {error}") from error
                log.warning("%s: its worker died running %s; submitted again", given[index], task.name)
                submit(index)
                return
            finally:
                done.release()  # a result left on a worker that dies later would make Dask rerun the task
            finals[future.task_run_id] = state
            results[index] = state.result()  # raises the task's error
            if completed is not None:
                completed(results[index])

        for item in items:  # may wait for the next item: what completed meanwhile is taken first
            given.append(item)
            results.append(None)
            deaths.append(0)
            submit(len(given) - 1)
            for done in pending.next_batch(block=False):
                finished(done)
        for done in pending:
            finished(done)
        if self.workers_left(since=began):
            unreported(finals)
        return results

    def workers(self) -> dict[str, Any]:
        """The cluster's workers now, by address (each with its `nthreads`)."""
        return self.runner.client.scheduler_info()["workers"]

    def workers_left(self, since: float) -> bool:
        """Whether a worker left the cluster (died, or was retired) after `since` (epoch seconds)."""
        return any(event.get("action") == "remove-worker" and when >= since
                   for when, event in self.runner.client.get_events("all"))

    def work(self, records: list[dict[str, Any]]) -> EncodingWork:
        after = self.runner.client.run(model_loads)
        loads = sum(counts.get(self.stage, 0) - self.loads.get(worker, {}).get(self.stage, 0)
                    for worker, counts in after.items())
        return encoding_work(records, self.started, len(self.workers()), loads)


def unreported(finals: dict[Any, Any]) -> None:
    """Of the task runs whose final state (`finals`, by id) a worker returned, those the server
    holds as unfinished or not at all: settled (beside the stage's other work) to that state."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterId
    from prefect.states import State

    ids, known = list(finals), {}
    with get_client(sync_client=True) as client:
        for start in range(0, len(ids), 200):  # the server's page size
            chunk = ids[start:start + 200]
            for run in client.read_task_runs(task_run_filter=TaskRunFilter(id=TaskRunFilterId(any_=chunk)),
                                             limit=len(chunk)):
                known[run.id] = run.state
    missing = {run: State(type=state.type, name=state.name, message="finished on a Dask worker that died "
                          "before it reported this state")
               for run, state in finals.items() if known.get(run) is None or not known[run].is_final()}
    if missing:
        log.warning("%d task run(s) finished on a worker that died before reporting them: set on the server",
                    len(missing))
        settle(missing)


def settle(states: dict[Any, Any], wait: float = 60.0) -> None:
    """Set each task run's state (`states`, by id) on the server, in a thread of its own beside the
    stage's other work. A worker reports its task runs to the server as events, which a loaded
    machine delivers seconds late (a run still unknown after 10 s arrived later), so a run not
    there yet is waited for, and one that never arrives was never started. The server gone
    meanwhile (the flow ended), it gives up. A state set here is newer than any event still on its
    way: the server keeps it."""
    threading.Thread(target=_settle, args=(dict(states), wait), name="precast-settle").start()


def _settle(states: dict[Any, Any], wait: float) -> None:
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError

    deadline = time.monotonic() + wait
    with get_client(sync_client=True) as client:
        while True:
            for task_run_id, state in list(states.items()):
                try:
                    client.set_task_run_state(task_run_id, state, force=True)
                    del states[task_run_id]
                except PrefectHTTPStatusError as error:
                    if error.response.status_code != 404:
                        raise
                except httpx.TransportError as error:
                    log.info("task runs %s left as they are: the server went away (%s)", list(states), error)
                    return
            if not states:
                return
            if time.monotonic() > deadline:
                log.info("task runs %s never reached the server: nothing to set", list(states))
                return
            time.sleep(0.5)
