"""Encoding stages on long-lived Dask workers: each worker loads its model once and encodes many
shards; a worker that dies loses nothing committed and leaves no task run RUNNING."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter

import psutil
import pytest
import torch
from prefect.artifacts import Artifact

from flows.pipeline import stage
from storage.shards import read_image_shard
from storage.store import Store
from storage.verify import PARTIAL, verify_store
from tasks.demo.data import write_demo_data

pytestmark = pytest.mark.slow(minutes=3)

SHARDS = 16


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory) -> str:
    return str(write_demo_data(tmp_path_factory.mktemp("data") / "demo", count=SHARDS * 2))


def _cache_bytes(store: Store, kind: str) -> dict[str, bytes]:
    return {key.rsplit("/", 1)[-1]: store.read_bytes(key) for key in store.find(f"cache/{kind}")
            if key.endswith(".safetensors")}


def _in_process(config):
    """`config` with no workers: a test of the encoders ingests without starting a cluster."""
    return config.model_copy(update={"execution": config.execution.model_copy(update={"workers": None})})


def _encode(config) -> dict[str, dict]:
    stage(name="ingest", config=config if config.execution.cluster else _in_process(config))
    return {name: stage(name=name, config=config) for name in ("encode-text", "encode-latents")}


def test_sixteen_shards_on_two_workers_load_each_model_at_most_twice(prefect_server, make_config, many_shards,
                                                                      tmp_path):
    one = make_config(root=str(tmp_path / "one"), source=many_shards, dataset={"shard_size": 2})
    two = make_config(root=str(tmp_path / "two"), source=many_shards, dataset={"shard_size": 2},
                      execution={"workers": 2})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker on 2 cores: a CPU convolution's sum order depends on its threads
    try:
        _encode(one)
    finally:
        torch.set_num_threads(threads)
    records = _encode(two)
    for name, kind in (("encode-text", "text"), ("encode-latents", "latents")):
        # progress counted at the flow as each worker's shard completed
        assert Artifact.get(f"{name}-progress").description.startswith(f"{name}: {SHARDS}/{SHARDS} shards, ")
        work = records[name]["work"]
        assert work["workers"] == 2 and 1 <= work["model_loads"] <= 2, (name, work)
        assert work["shards_encoded"] == SHARDS and work["shards_cached"] == 0, (name, work)
        assert len(records[name]["shards"]) == SHARDS
        assert _cache_bytes(Store(two.storage), kind) == _cache_bytes(Store(one.storage), kind)  # as one worker wrote


def test_a_running_dask_cluster_given_by_address_encodes_the_shards(prefect_server, make_config, many_shards, tmp_path,
                                                                     tiny_family):
    """`execution.cluster`: the workers a team started (here two processes on this machine),
    reporting to the same Prefect server. Then Qwen-Image-Edit's pairs on the same workers, a pair
    a shard (so a shared reference is stored beside another pair): each worker loads the encoder
    that reads the references, and caches what this process caches."""
    from distributed import LocalCluster
    from prefect.client.orchestration import get_client
    from safetensors.torch import load

    from configs.schema import PipelineConfig
    from tasks.demo.data import write_edit_data

    with get_client(sync_client=True) as client:
        api = str(client.api_url).rstrip("/")
    pairs = write_edit_data(tmp_path / "pairs", count=4)

    def edit(root: str, cluster: str | None) -> PipelineConfig:
        return PipelineConfig.model_validate({
            "storage": {"root": root}, "model": {"path": str(tiny_family("qwen-image-edit"))},
            "dataset": {"sources": [{"path": str(pairs / "targets"), "references": "files",
                                     "reference_path": str(pairs / "references")}], "shard_size": 1},
            "text_encoding": {"dtype": "fp32"}, "latent_encoding": {"resolution": 64, "storage_dtype": "fp32"},
            "training": {"samples": {"prompts": ["make the background red"],
                                     "references": [str(pairs / "references" / "00002.png")]}},
            "execution": {"cluster": cluster}})

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                      env={"PREFECT_API_URL": api}) as cluster:
        config = make_config(root=str(tmp_path / "store"), source=many_shards, dataset={"shard_size": 2},
                             execution={"cluster": cluster.scheduler_address})
        records = _encode(config)
        paired = _encode(edit(str(tmp_path / "edit-workers"), cluster.scheduler_address))
        # the pairs' references are encoded beside them, and counted in the total as they are
        assert re.search(r" (\d+)/\1 samples ", Artifact.get("encode-latents-progress").description)
    for name in ("encode-text", "encode-latents"):
        work = records[name]["work"]
        assert work["workers"] == 2 and 1 <= work["model_loads"] <= 2 and work["shards_encoded"] == SHARDS, work
    work = paired["encode-text"]["work"]
    assert work["workers"] == 2 and 1 <= work["model_loads"] <= 2 and work["samples_encoded"] == 4, work
    here = _encode(edit(str(tmp_path / "edit-here"), None))
    cached = {where: _cache_bytes(Store(config.storage), "text") for where, config in
              (("workers", edit(str(tmp_path / "edit-workers"), None)), ("here", edit(str(tmp_path / "edit-here"), None)))}
    assert here["encode-text"]["url"].rsplit("/", 1)[-1] == paired["encode-text"]["url"].rsplit("/", 1)[-1]
    assert cached["workers"].keys() == cached["here"].keys() and cached["here"]
    for name, data in cached["here"].items():
        for key, tensor in load(data).items():
            torch.testing.assert_close(load(cached["workers"][name])[key], tensor, rtol=1e-5, atol=1e-5)


def _task_run_states(flow_run_id, finished: int) -> list[str]:
    """The state names of a flow run's task runs, once `finished` of them are and none is pending
    or running (or after 30 s: workers report task runs to the server asynchronously)."""
    import asyncio

    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def read() -> list[str]:
        async with get_client() as client:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            return [run.state.name for run in runs]

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = asyncio.run(read())
        if states.count("Completed") + states.count("Cached") >= finished and not {"Pending", "Running"} & set(states):
            break
        time.sleep(0.5)
    return states


# Dask's default: it reruns the task itself; 0: KilledWorker at once, and precast submits the shard again
@pytest.mark.parametrize("allowed_failures", [3, 0])
def test_a_worker_killed_mid_stage_loses_no_shard(prefect_server, make_config, many_shards, tmp_path,
                                                  allowed_failures):
    import dask
    import distributed  # noqa: F401 - its config defaults, before dask.config.set below (which would drop them)

    config = make_config(root=str(tmp_path / "store"), source=many_shards, dataset={"shard_size": 2},
                         execution={"workers": 2, "retries": 1})
    stage(name="ingest", config=_in_process(config))
    store = Store(config.storage)
    killed = []

    def kill_a_worker_after_the_first_shard() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(k.endswith(".done") for k in store.find("cache/latents")):
            time.sleep(0.05)
        workers = [p for p in psutil.Process().children(recursive=True)
                   if any("spawn_main" in part or "forkserver" in part for part in p.cmdline())]
        if workers:
            workers[0].kill()
            killed.append(workers[0].pid)

    killer = threading.Thread(target=kill_a_worker_after_the_first_shard)
    killer.start()
    with dask.config.set({"distributed.scheduler.allowed-failures": allowed_failures}):
        state = stage(name="encode-latents", config=config, return_state=True)
    killer.join()
    assert killed, "no worker process was found to kill"
    record = state.result()
    assert record["work"]["shards_encoded"] == SHARDS and len(record["shards"]) == SHARDS
    states = _task_run_states(state.state_details.flow_run_id, SHARDS)
    # a shard whose worker died after committing it is found in Prefect's cache when it runs again
    finished = states.count("Completed") + states.count("Cached")
    assert finished >= SHARDS and set(states) <= {"Completed", "Cached", "Crashed"}, Counter(states)
    # a worker killed while it wrote leaves at most its temporary file (the kill comes as the first
    # shard commits, when the workers' shards finish together), never a half-written artifact:
    # every commit verifies, `precast verify` names each such file as partial, `--repair` removes it
    leftovers = [key for key in store.find("cache/latents") if not key.endswith((".safetensors", ".done"))]
    report = verify_store(store, repair=True)
    assert report["ok"] and report["checked"] >= 2 * SHARDS and not report["orphaned"], report
    assert sorted(report["partial"]) == sorted(report["removed"]) == leftovers and len(leftovers) <= 1, report
    assert not [key for key in store.find("cache/latents") if PARTIAL.search(key)]


def test_a_shard_whose_worker_died_before_reporting_it_ends_as_the_flow_got_it(prefect_server):
    """A worker sends its task runs' states as events after the task returned: one killed in
    between leaves the server a RUNNING run (or none yet) for a shard the flow got back. Each such
    run is set to the state the flow got, a late one when it arrives; a finished one is left."""
    import uuid

    from prefect import flow, get_client, task
    from prefect.context import get_run_context
    from prefect.states import Completed, Running

    from flows.workers import unreported

    @task
    def shard() -> None:
        pass

    @flow
    def runs() -> tuple:
        with get_client(sync_client=True) as client:
            run = get_run_context().flow_run.id
            return tuple(client.create_task_run(shard, run, key, state=state).id
                         for key, state in (("0", Running()), ("1", Completed())))

    running, done = runs()
    late = uuid.uuid4()
    with get_client(sync_client=True) as client:
        before = client.read_task_run(done).state
        unreported({running: Completed(), done: Completed(), late: Completed(name="Cached")})
        time.sleep(1.5)  # its worker's events arrive after the flow settled it
        client.create_task_run(shard, client.read_task_run(running).flow_run_id, "2", id=late, state=Running())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not client.read_task_run(late).state.is_final():
            time.sleep(0.2)
        states = {name: client.read_task_run(run).state for name, run in
                  (("running", running), ("done", done), ("late", late))}
    assert (states["running"].name, states["late"].name) == ("Completed", "Cached"), states
    assert "died before it reported" in states["running"].message
    assert states["done"].id == before.id, states


def test_ingest_on_two_workers_equals_ingest_in_this_process(prefect_server, make_config, demo_data, tmp_path):
    """Every source format at once (the same hostile corpus in each, so duplicates span sources and
    partitions), and videos decoded into clips, in partitions of four units on two worker
    processes: the same dataset, report and shards, byte for byte, as one process reading them
    all; a nightly run sends no partition."""
    from tests.corpus import MAX_PIXELS, WRITERS
    from tests.videos import write_video

    sources = [{"path": str(write(tmp_path / "corpora" / fmt))} for fmt, write in WRITERS.items()]
    sources.append({"path": str(demo_data)})
    videos = tmp_path / "corpora" / "videos"
    videos.mkdir()
    for index, codec in enumerate(["libx264", "libvpx-vp9", "mpeg4"]):  # 6 s at 16 fps: the default clip and more
        write_video(videos / f"{index}.mkv", frames=96 + index, fps=16, codec=codec, size=(96, 64 + 16 * index))
        (videos / f"{index}.txt").write_text(f"video {index}")
    (videos / "cut.mkv").write_bytes((videos / "0.mkv").read_bytes()[:3000])
    (videos / "cut.txt").write_text("a cut video")
    sources.append({"path": str(videos)})
    dataset = {"sources": sources, "max_pixels": MAX_PIXELS, "partition_size": 4}
    here = make_config(root=str(tmp_path / "here"), dataset=dataset)
    workers = make_config(root=str(tmp_path / "workers"), dataset=dataset, execution={"workers": 2})
    expected = stage(name="ingest", config=here)
    state = stage(name="ingest", config=workers, return_state=True)
    record = state.result()
    stores = Store(here.storage), Store(workers.storage)
    assert record["id"] == expected["id"] and record["work"]["workers"] == 2
    assert record["work"]["bytes_read"] == expected["work"]["bytes_read"] > 0
    report = [store.read_json(store.key(r["report"])) for store, r in zip(stores, (expected, record))]
    assert report[1] == report[0] and report[1]["quarantined"] > 0 and report[1]["duplicates"] > 0
    shards = [{key: store.read_bytes(key) for key in store.list("shards/images", ".parquet")} for store in stores]
    assert shards[1] == shards[0]
    clips = [row for data in shards[1].values() for row in read_image_shard(data).to_pylist() if "/videos/" in row["source"]]
    assert len(clips) == 3 and report[1]["by_reason"]["truncated"] == 1  # each video's one clip; the cut one
    assert stores[1].find("staging") == []  # every staged partition merged and deleted
    states = _task_run_states(state.state_details.flow_run_id, 2)
    partitions = states.count("Completed") - 1  # the ingest task itself
    assert partitions >= 2 and set(states) == {"Completed"}, Counter(states)

    again = stage(name="ingest", config=workers, return_state=True)
    metadata = sum(path.stat().st_size for path in (tmp_path / "corpora").rglob("metadata.*"))
    assert again.result()["id"] == record["id"] and again.result()["work"]["bytes_read"] == metadata
    assert _task_run_states(again.state_details.flow_run_id, 1) == ["Completed"]  # ingest alone: no partition
