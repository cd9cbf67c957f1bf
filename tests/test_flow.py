"""The whole pipeline under a real Prefect server, through the flow and through the CLI."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from diffusers import PixArtTransformer2DModel

from flows.cli import main
from flows.pipeline import pipeline, stage
from storage.store import Store
from tasks.runner import run_direct


FINAL = {"Completed", "Cached", "Failed", "Crashed", "Cancelled"}


def _task_states(flow_run_id, count: int, deadline: float = 30.0) -> dict[str, list[str]]:
    """State names of a finished flow run's `count` task runs, by task name. Prefect 3 reports
    task runs to the server asynchronously, so this polls until all `count` are there in a final
    state (or the deadline passes, leaving what it saw for the caller's assertion to show)."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    async def read():
        async with get_client() as client:
            runs = await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                sort=TaskRunSort.EXPECTED_START_TIME_ASC, limit=200,
            )
            states: dict[str, list[str]] = {}
            for run in runs:
                # a run the server has not yet given a state (its events still on their way) is not final
                states.setdefault(run.name.rsplit("-", 1)[0], []).append(run.state.name if run.state else "Pending")
            return states

    give_up = time.monotonic() + deadline
    while True:
        states = asyncio.run(read())
        names = [name for names in states.values() for name in names]
        if (len(names) == count and set(names) <= FINAL) or time.monotonic() > give_up:
            return states
        time.sleep(0.25)


def _without_costs(outputs: dict) -> dict:
    """A pipeline's outputs without what this run cost (seconds, workers, model loads)."""
    return {key: value for key, value in outputs.items() if key != "stages"}


def _latest_artifact(key: str) -> str:
    from prefect.artifacts import Artifact

    return Artifact.get(key).data


def _files(store: Store) -> set[str]:
    return {path for path in store.fs.find(store.root_path) if "/prefect/" not in path}


def test_pipeline_end_to_end_then_all_cache_hits(prefect_server, make_config, tiny_models, caplog, capsys):
    caplog.set_level(logging.INFO, logger="flows.pipeline")
    config = make_config()
    state = pipeline(config=config, return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    store = Store(config.storage)
    assert set(result) >= {"dataset", "text_cache", "latent_cache", "manifest", "run", "weights", "samples", "loss_curve"}
    states = _task_states(state.state_details.flow_run_id, count=11)
    assert set(states) == {"ingest", "encode-prompts", "text-numerics", "encode-text", "encode-latents", "manifest",
                           "train"}
    assert len(states["encode-text"]) == len(states["encode-latents"]) == 3

    assert "## Quarantined by reason" in _latest_artifact("ingest-report")
    assert "| captions | tokens | truncated |" in _latest_artifact("text-encoding")
    page = _latest_artifact("training-run")  # the run page: pictures inline, how to load, lineage, stage costs
    assert page.startswith(f"# Training run `{result['run'].rsplit('/', 1)[1]}`")
    assert "![sample grid](data:image/" in page and "![training curves: loss, validation loss, learning rate](data:" in page
    assert f"`runs/{result['weights'].split('/runs/', 1)[1]}`" in page  # relative to the store root, given above
    loading = {}  # the page's own Python loads the trained adapter into the pipeline
    code = page.split("```python\n", 1)[1].split("```", 1)[0]
    assert max(map(len, code.splitlines())) <= 80, code  # a long path split over lines, which Python joins
    exec(code, loading)
    trained = PeftModel.from_pretrained(PixArtTransformer2DModel.from_pretrained(tiny_models, subfolder="transformer"),
                                        store.path(store.key(result["weights"]))).merge_and_unload().state_dict()
    assert all(torch.equal(value, trained[key]) for key, value in loading["pipeline"].transformer.state_dict().items())
    assert "\n- manifest: " in page and "| ingest | ran | 24 samples in 3 shards |" in page
    assert float(_latest_artifact("training-progress")) == 100.0

    summary = _latest_artifact("pipeline-summary")
    assert "| ingest | ran | 24 samples in 3 shards |" in summary and "| train | ran | 6 steps" in summary
    # the tables fit a page in both UIs (V1 does not wrap a cell): short columns, no URL; each stage's
    # output (relative to the store root) and work are listed under the table, as the run page's are
    table = [line for line in (summary + page).splitlines() if line.startswith("| ")]
    assert len(table) == 14 and max(map(len, table)) <= 100 and not any("://" in line for line in table), table
    assert f"Outputs, under `{store.root_url}/`, and the work each took:" in summary
    assert f"- manifest: `{store.key(result['manifest'])}`" in summary
    assert summary in caplog.text  # the run's log shows it too (precast run prints it)

    work = {name: {k: v for k, v in stage.items() if k != "seconds"} for name, stage in result["stages"].items()}
    assert work["encode-text"]["shards_encoded"] == work["encode-latents"]["shards_encoded"] == 3
    # on a CPU the VAE's share of waiting is the decoding itself, done between its batches
    assert 0 < work["encode-latents"]["feed_wait"] < 1 and "waiting for pixels" in summary
    assert work["manifest"] == work["train"] == {"io_retries": 0} and "`; 1 worker, " in summary
    assert work["ingest"]["units_read"] == 24 and work["ingest"]["units_reused"] == 0

    from flows.cli import main  # the same page in the terminal

    capsys.readouterr()
    assert main(["inspect", result["run"]]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"training run {result['run']}") and "loss by step:" in text
    assert f"weights: runs/{result['weights'].split('/runs/', 1)[1]}" in text and "  encode-latents  ran" in text
    assert main(["inspect", result["weights"], "--json"]) == 0  # the weights' URL finds their run
    shown = json.loads(capsys.readouterr().out)
    assert shown["run"] == result["run"] and [s["stage"] for s in shown["stages"]][-1] == "train"
    assert len(shown["metrics"]) == 6

    written = _files(store)
    again = pipeline(config=config, return_state=True)
    assert _without_costs(again.result()) == _without_costs(result)
    assert again.result()["stages"]["encode-latents"] | {"seconds": 0} == {
        "seconds": 0, "workers": 1, "model_loads": 0, "shards_encoded": 0, "shards_cached": 3, "samples_encoded": 0,
        "samples_copied": 0, "io_retries": 0}
    # ingest is its own cache: it lists the sources and reads nothing; so are the manifest and the
    # finished run (one commit record each); every encoding task is a cache hit
    assert again.result()["stages"]["ingest"] | {"seconds": 0} == {
        "seconds": 0, "workers": 1, "bytes_read": 0, "units_read": 0, "units_reused": 24, "io_retries": 0}
    cached = _task_states(again.state_details.flow_run_id, count=11)
    assert [cached.pop(name) for name in ("ingest", "manifest", "train")] == [["Completed"]] * 3
    assert {name for runs in cached.values() for name in runs} == {"Cached"}
    assert _files(store) == written  # nothing re-encoded, nothing re-written
    summary = _latest_artifact("pipeline-summary")
    assert summary.count("| cached |") == 5, summary


def test_store_is_the_ground_truth_without_prefect_cache(prefect_server, make_config):
    """With Prefect's cache records gone (another server, a wiped results folder) nothing re-encodes."""
    config = make_config()
    first = pipeline(config=config)
    store = Store(config.storage)
    store.fs.rm(store.path("prefect"), recursive=True)
    mtimes = {p: store.fs.info(p)["mtime"] for p in _files(store)}
    again = pipeline(config=config)
    assert _without_costs(again) == _without_costs(first)
    assert {stage.get("shards_encoded") for stage in again["stages"].values()} == {None, 0}
    assert {p: store.fs.info(p)["mtime"] for p in _files(store) if p in mtimes} == mtimes


def test_cli_run_json_and_single_stages(prefect_server, make_config, tmp_path, capsys, caplog):
    import logging

    import yaml

    config = make_config()
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config.model_dump()))

    records = {}
    for name in ["ingest", "encode-text", "encode-latents", "manifest", "train"]:
        assert main(["stage", name, str(path), "--set", "training.steps=3", "--json"]) == 0
        records[name] = record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        # the record every stage returns: where its output is, how much, when it was committed
        assert {"url", "amount", "committed_at"} <= set(record), name
    # the runner without Prefect returns the same records, all cached now
    direct = run_direct(config.model_copy(update={"training": config.training.updated({"steps": 3})}))
    for name, record in records.items():
        assert set(direct[name]) == set(record) and direct[name]["url"] == record["url"], name
        assert direct[name]["committed_at"] == record["committed_at"], name
    with caplog.at_level(logging.INFO, logger="flows.pipeline"):
        assert main(["run", str(path), "--set", "training.steps=3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"dataset", "text_cache", "latent_cache", "manifest", "run", "weights"} <= set(out)
    # the terminal's link to the UI: the flow run and its page on the server
    from prefect.settings import PREFECT_UI_URL

    assert out["flow_run_url"] == f"{PREFECT_UI_URL.value()}/runs/flow-run/{out['flow_run']}"
    assert f": {out['flow_run_url']}" in caplog.text  # the link the run logs as it starts is the same page
    assert out["run"] == record["run"]  # the stages alone built the same run the pipeline finds


def test_cli_reports_a_bad_config_by_field(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("training:\n  rank: 0\n")
    assert main(["run", str(path)]) == 1
    error = capsys.readouterr().err
    assert "training.lora.rank" in error and "greater than or equal to 1" in error


def test_a_second_precast_on_the_node_is_told_to_share_the_cores(tmp_path, capsys, monkeypatch):
    """Each precast process takes every core unless told: beside another one it says so and how to
    share (`--threads`), which sets the thread count of it and of what it starts."""
    import subprocess
    import sys

    other = tmp_path / "precast"  # what `ps` shows of a running precast command
    other.write_text("import time\ntime.sleep(60)\n")
    running = subprocess.Popen([sys.executable, str(other)])
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert main(["inspect", str(tmp_path / "nothing")]) == 1
        # at least this one (the suite's other process may be running precast commands too)
        assert re.search(r"precast: [1-9]\d* other precast process(es)? on this node, each using every core unless "
                         r"told otherwise; give each --threads N", capsys.readouterr().err)
        assert main(["--threads", "1", "inspect", str(tmp_path / "nothing")]) == 1
        assert "other precast process" not in capsys.readouterr().err
        assert os.environ["OMP_NUM_THREADS"] == "1"
    finally:
        running.kill()
        running.wait()


def test_pipeline_on_s3(prefect_server, make_config, s3_endpoint):
    """Every artifact, Prefect's results included, on an S3 API; credentials only in the environment."""
    import s3fs

    s3fs.S3FileSystem(endpoint_url=s3_endpoint).mkdir("precast-flow")
    config = make_config(root="s3://precast-flow/store")
    config = config.model_copy(update={"storage": config.storage.model_copy(
        update={"options": {"endpoint_url": s3_endpoint}})})
    result = pipeline(config=config)
    assert result["weights"].startswith("s3://precast-flow/store/runs/")
    store = Store(config.storage)
    assert store.committed(store.key(result["manifest"])) is not None
    assert store.exists(store.key(result["weights"]) + "/adapter_model.safetensors")
    assert store.fs.find(store.path("prefect/results"))  # Prefect results live beside the artifacts
    assert _without_costs(pipeline(config=config)) == _without_costs(result)


def test_every_stage_run_reads_the_result_storage_block_and_writes_it_only_when_it_changes(prefect_server, make_config,
                                                                                          s3_endpoint):
    """Each stage's flow run (a shard's, on a worker) asks for the remote root's result storage:
    written once, the block is read after that, so runs starting at once do not queue their writes
    at the server's database; new storage options rewrite it."""
    from prefect import get_client
    from prefect.filesystems import RemoteFileSystem

    from flows.stages import Plan

    config = make_config(root="s3://precast-flow/blocks")
    config = config.model_copy(update={"storage": config.storage.model_copy(update={"options": {"endpoint_url": s3_endpoint}})})

    def saved(name: str):
        with get_client(sync_client=True) as client:
            return client.read_block_document_by_name(name, "remote-file-system")

    name = Plan(config).results.removeprefix("remote-file-system/")
    first = saved(name)
    assert Plan(config).results == f"remote-file-system/{name}" and saved(name).updated == first.updated
    moved = config.model_copy(update={"storage": config.storage.model_copy(
        update={"options": {"endpoint_url": s3_endpoint, "use_ssl": False}})})
    assert Plan(moved).results == f"remote-file-system/{name}"  # the block of the root: its settings follow
    assert saved(name).updated > first.updated
    assert RemoteFileSystem.load(name).settings == {"endpoint_url": s3_endpoint, "use_ssl": False}


def test_prefect_server_accepts_its_own_clients_default_queries(prefect_server):
    """The pinned fastapi keeps Prefect 3.8.8's server answering queries with null fields (the UI's)."""
    from prefect import get_client

    async def query():
        async with get_client() as client:
            typed = [await client.read_artifacts(limit=5), await client.read_task_runs(limit=5),
                     await client.read_flow_runs(limit=5)]
            # the UI's own bodies: every filter field null
            raw = [await client._client.post(f"/{kind}/filter", json={kind: None, "limit": 5, "offset": None,
                                                                        "sort": None})
                   for kind in ("artifacts", "task_runs", "flow_runs")]
        return typed, raw

    typed, raw = asyncio.run(query())
    assert all(isinstance(answer, list) for answer in typed)
    assert [(response.status_code, type(response.json())) for response in raw] == [(200, list)] * 3


def test_gpu_stages_hold_the_nodes_gpu_slot(prefect_server, monkeypatch):
    import torch
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect import get_client

    from flows import stage_tasks as tasks

    async def create_and_read(create: bool):
        async with get_client() as client:
            if create:
                await client.create_global_concurrency_limit(
                    GlobalConcurrencyLimitCreate(name=tasks.gpu_slot_name(), limit=1))
            return (await client.read_global_concurrency_limit_by_name(tasks.gpu_slot_name())).active_slots

    asyncio.run(create_and_read(True))
    with tasks.device_slot("cpu"):
        assert asyncio.run(create_and_read(False)) == 0  # CPU work takes no GPU slot
    monkeypatch.setattr(tasks, "resolve_device", lambda name: torch.device("cuda"))
    with tasks.device_slot("cuda"):
        assert asyncio.run(create_and_read(False)) == 1
    assert asyncio.run(create_and_read(False)) == 0


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_parallel_shards_of_a_fingerprint_carry_one_precision_record(prefect_server, make_config, tmp_path, dtype):
    """The configuration users run: shards in parallel, a non-fp32 dtype, on fresh stores (each with
    no model loaded yet): every shard embeds the fingerprint's one committed precision record."""
    from storage.shards import RaggedShard
    from tasks.encode.models import TEXT_LOADERS

    for attempt in range(3):
        config = make_config(root=str(tmp_path / f"store-{attempt}"), text_encoding={"dtype": dtype},
                             execution={"max_parallel_shards": 2})
        TEXT_LOADERS.clear()  # as a fresh worker: no model loaded yet
        stage(name="ingest", config=config)
        result = stage(name="encode-text", config=config)
        store = Store(config.storage)
        (numerics,) = [key for key in store.find("cache/text") if key.endswith("numerics.json")]
        committed = json.loads(store.read_verified(numerics))
        assert committed["dtype"] == dtype and 0 < committed["samples"] <= config.text_encoding.numerics_samples
        assert committed["cosine_min"] > 0.99
        assert len(result["shards"]) == 3
        for record in result["shards"]:
            assert record["numerics"] == committed
            assert RaggedShard(store.local_path(store.key(record["url"]))).meta["numerics"] == committed


def test_direct_run_without_prefect_builds_what_the_pipeline_builds(prefect_server, make_config, capsys):
    """`precast run --direct`: the same stages in order, no Prefect: the same outputs, so the flow
    afterwards finds everything committed and re-encodes nothing."""
    import yaml

    config = make_config(training={"steps": 3})
    path = Path(config.storage.root).parent / "direct.yaml"
    path.write_text(yaml.safe_dump(config.model_dump()))
    assert main(["run", str(path), "--direct", "--json"]) == 0
    direct = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    store = Store(config.storage)
    written = {p: store.fs.info(p)["mtime"] for p in _files(store)}
    assert direct["stages"]["encode-latents"]["shards_encoded"] == 3
    flowed = pipeline(config=config)
    assert _without_costs(flowed) == _without_costs(direct)
    assert flowed["stages"]["encode-latents"]["shards_encoded"] == 0
    assert {p: store.fs.info(p)["mtime"] for p in _files(store) if p in written} == written


def test_stage_modules_are_prefect_free_and_each_task_is_its_stage_function():
    """The Prefect layer wraps the stage functions themselves: `.fn` runs a stage without Prefect,
    and nothing below flows/ imports Prefect."""
    import ast
    import subprocess
    import sys

    from flows.stage_tasks import TASKS
    from tasks import manifest, train
    from tasks.encode import latents as encode_latents, text as encode_text
    from tasks.ingest import stage as ingest, staging

    stages = {encode_latents.encode_latents_shard, encode_text.encode_prompts, encode_text.measure_numerics,
              encode_text.encode_text_shard, ingest.ingest, staging.examine_partition, manifest.build_manifest, train.train}
    assert {task.fn for task in TASKS} == stages
    probe = ("import sys, storage.store, tasks.identity, tasks.runner, tasks.runs.sampling, storage.verify, "
             "tasks.demo.models, tasks.demo.data; "
             "print(sorted(m for m in sys.modules if m == 'prefect' or m.startswith('prefect.')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    # and the Prefect layer never imports the benchmarks (`python -m benchmarks` runs them)
    imported = set()
    for path in (Path(__file__).parent.parent / "flows").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.split(".")[0])
    assert "benchmarks" not in imported and {"tasks", "storage", "configs", "prefect"} <= imported


def test_submit_names_a_deployment_that_does_not_exist(prefect_server, capsys):
    assert main(["submit", "precast-pipeline/no-such-deployment"]) == 1
    error = capsys.readouterr().err
    assert "deployment 'precast-pipeline/no-such-deployment' does not exist" in error and "precast deploy" in error


def test_the_run_pages_code_splits_a_long_path_that_python_joins_back():
    """A hub snapshot's path (about 110 characters) does not fit a code line of Prefect's V1 UI:
    the run page's code splits it after slashes into strings on lines of at most 80, which Python
    joins back to the path; a short path stays one string, a part longer than a line stays whole."""
    from tasks.runs.page import _assign

    snapshot = "/mnt/hf-cache/models--PixArt-alpha--PixArt-Sigma-XL-2-1024-MS/snapshots/" + "5c3a2b1f0e" * 4
    unbreakable = "s3://bucket/" + "x" * 90
    for path in (snapshot, "s3://team-bucket/precast/" + "nightly/" * 12 + "store", unbreakable, "/data/store"):
        code, scope = _assign("model", path), {}
        exec(code, scope)
        assert scope["model"] == path
        assert path == unbreakable or max(map(len, code.splitlines())) <= 80, code
    assert _assign("model", "/data/store") == "model = '/data/store'"
    assert len(_assign("model", snapshot).splitlines()) == 2 and len(_assign("model", unbreakable).splitlines()) == 2


def test_the_ingest_report_artifact_shows_how_this_run_mixes_its_sources(prefect_server, make_config, tmp_path):
    """The stored report serves every mix of the dataset's sources (their samples alone); the run's
    `ingest-report` artifact adds this config's mix: each source's settings and share of the draws."""
    from tasks.demo.data import write_demo_data

    sources = [{"path": str(write_demo_data(tmp_path / name, count=4, seed=seed)), **mix}
               for name, seed, mix in (("subject", 1, {"repeats": 3}), ("styles", 2, {"weight": 0.25}))]
    config = make_config(dataset={"sources": sources})
    record = stage(name="ingest", config=config)
    report = Store(config.storage).read_json(Store(config.storage).key(record["report"]))
    assert [s["samples"] for s in report["sources"]] == [4, 4] and "share" not in report["sources"][0]
    artifact = _latest_artifact("ingest-report")
    assert "## By source, as this run's training draws from them" in artifact
    assert "| 75.0% |" in artifact and "| 25.0% |" in artifact and "| 3 |" in artifact
