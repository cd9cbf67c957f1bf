"""The way teams run it: a real Prefect server, an S3 API, two process workers on two pools whose
working directories share nothing but the S3 root, deployments from prefect.yaml, runs started
with `prefect deployment run --watch`. Started by infra/local-stack.sh, as a developer would."""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import subprocess
import time
from pathlib import Path

import pytest

from configs.schema import PipelineConfig
from tasks.demo.data import write_demo_data
from storage import layout
from storage.store import Store
from tasks.train.rendezvous import free_port

ROOT = Path(__file__).parent.parent
# distinctive credentials: the test searches every object and log line for them
SECRETS = {"AWS_ACCESS_KEY_ID": "AKIAPRECASTTESTKEY7", "AWS_SECRET_ACCESS_KEY": "precast-secret-4f1c9e2b7a"}

pytestmark = pytest.mark.slow(minutes=7)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_models):
    directory = tmp_path_factory.mktemp("stack")
    prefect_port, s3_port, dask_port = free_port(), free_port(), free_port()
    env = {**os.environ, **SECRETS, "STACK_DIR": str(directory), "PREFECT_PORT": str(prefect_port),
           "S3_PORT": str(s3_port), "S3_BUCKET": "precast", "PRECAST_HOME": str(ROOT),
           "DASK_WORKERS": "2", "DASK_PORT": str(dask_port),  # two encoder "nodes" for execution.cluster
           "PREFECT_API_AUTH_STRING": f"precast:{secrets.token_urlsafe(12)}",  # the server refuses all else
           "PREFECT_API_URL": f"http://127.0.0.1:{prefect_port}/api", "PREFECT_HOME": str(directory / "prefect-home")}
    env.pop("PRECAST_CACHE", None)
    subprocess.run(["bash", "infra/local-stack.sh", "up"], cwd=ROOT, env=env, check=True, capture_output=True,
                   timeout=300)
    try:
        endpoint = f"http://127.0.0.1:{s3_port}"
        import s3fs

        data = write_demo_data(directory / "upload", count=12)
        s3fs.S3FileSystem(endpoint_url=endpoint, key=SECRETS["AWS_ACCESS_KEY_ID"],
                          secret=SECRETS["AWS_SECRET_ACCESS_KEY"]).put(str(data), "precast/data", recursive=True)
        stack = {"env": env, "endpoint": endpoint, "dir": directory, "models": tiny_models,
                 "cluster": {"cluster": f"tls://127.0.0.1:{dask_port}", "cluster_tls": str(directory / "tls")}}
        deployed = _precast(stack, "deploy", _config_file(stack, _config(stack)))
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        yield stack
    finally:
        subprocess.run(["bash", "infra/local-stack.sh", "down"], cwd=ROOT, env=env, timeout=120)


def _config(stack, **training) -> dict:
    placement = {"encode-text": "precast-stage/encode-text", "encode-latents": "precast-stage/encode-latents",
                 "train": "precast-stage/train"}
    config = PipelineConfig.model_validate({
        "storage": {"root": "s3://precast/store", "options": {"endpoint_url": stack["endpoint"]}},
        "dataset": {"sources": [{"path": "s3://precast/data"}], "shard_size": 6},
        "model": {"path": stack["models"]},
        "text_encoding": {"dtype": "fp32"},
        "latent_encoding": {"resolution": 256, "batch_size": 1},
        "training": {"steps": 4, "batch_size": 2, "rank": 4, "alpha": 4, "sample_steps": 2, **training},
        "execution": {"retries": 0, "placement": placement},
    })
    return config.model_dump(mode="json")


def _train_placed(stack, **training) -> dict:
    """`_config` with only training on another pool: the encoders run in the pipeline's own flow run
    (cache hits after the first run, without a child process each)."""
    config = _config(stack, **training)
    config["execution"]["placement"] = {"train": "precast-stage/train"}
    return config


def _nightly(stack, **training) -> dict:
    """`_train_placed` with the encoders' shards sent to the stack's Dask workers (execution.cluster)."""
    config = _train_placed(stack, **training)
    config["execution"].update(stack["cluster"])
    return config


def _config_file(stack, config: dict, name: str = "my-run.yaml") -> str:
    import yaml

    path = stack["dir"] / name
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _precast(stack, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / ".venv/bin/precast"), *args], cwd=stack["dir"], env=stack["env"],
                          capture_output=True, text=True, timeout=timeout)


def _run(stack, deployment: str, config: dict) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / ".venv/bin/prefect"), "deployment", "run", deployment, "--watch",
                           "--params", json.dumps({"config": config})],
                          cwd=ROOT, env=stack["env"], capture_output=True, text=True, timeout=600)


def _summary_rows(stack, flow_run_id) -> dict[str, str]:
    """The `pipeline-summary` artifact of one pipeline flow run, by stage: its table row and the
    line under the table with its output and work."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    (summary,) = _api(stack, lambda client: client.read_artifacts(artifact_filter=ArtifactFilter(
        key=ArtifactFilterKey(any_=["pipeline-summary"]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))))
    rows = {line.split("|")[1].strip(): line for line in summary.data.splitlines() if line.startswith("| ")}
    for line in summary.data.splitlines():
        if line.startswith("- ") and (stage := line[2:].split(":", 1)[0]) in rows:
            rows[stage] += line
    return rows


def _encoder_work(row: str) -> tuple[int, ...]:
    """(workers, model loads, shards encoded, shards cached) of an encoding stage's summary row."""
    return tuple(map(int, re.search(r"(\d+) workers?, (\d+) model loads?, (\d+) shards encoded, (\d+) cached",
                                    row).groups()))


def _children(stack, parent: str) -> list:
    """The child flow runs of a flow run (its placed stages')."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    return _api(stack, lambda client: client.read_flow_runs(
        flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent]))))


def _api(stack, query):
    from prefect.client.orchestration import PrefectClient

    async def call():
        async with PrefectClient(stack["env"]["PREFECT_API_URL"], auth_string=stack["env"]["PREFECT_API_AUTH_STRING"]) \
                as client:
            return await query(client)

    return asyncio.run(call())


def _scheduled_runs(stack, deployment_id) -> list:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    runs = _api(stack, lambda client: client.read_flow_runs(
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))))
    return [run for run in runs if run.auto_scheduled]


def _wait(probe, seconds: float):
    """probe() until it returns something truthy, for at most `seconds`."""
    deadline = time.monotonic() + seconds
    while not (found := probe()) and time.monotonic() < deadline:
        time.sleep(2)
    return found


def _store(stack) -> Store:
    os.environ.update(SECRETS)
    return Store(PipelineConfig.model_validate(_config(stack)).storage)


def _encoded(store: Store) -> dict[str, float]:
    """Commit time of every encoded shard and prompt set."""
    return {key: store.read_json(store.key(store.fs.unstrip_protocol(key)))["committed_at"]
            for key in store.fs.find(store.path("cache")) if key.endswith(".done")}


@pytest.fixture(scope="module")
def first_run(stack) -> dict[str, float]:
    """The pipeline deployment run once on the stack; what it encoded."""
    done = _run(stack, "precast-pipeline/pipeline", _config(stack))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return _encoded(_store(stack))


def test_pipeline_deployment_spreads_stages_over_pools(stack, first_run):

    runs = _api(stack, lambda client: client.read_flow_runs(limit=100))
    pools = {run.name: run.work_pool_name for run in runs if run.state and run.state.is_completed()}
    encoders = {name: pool for name, pool in pools.items() if name.startswith(("encode-text", "encode-latents"))}
    # 2 shards x 2 encoders, and the text encoder's prompts and precision check before its shards
    assert len(encoders) == 5 and "encode-text-prepare" in encoders and set(encoders.values()) == {"precast-encode"}
    assert pools["train-all"] == "precast-train"
    # each stage's progress is in the run's logs in the UI: the encoders' summed over their children
    lines = [record.message for record in _api(stack, lambda client: client.read_logs(limit=200))]
    for line in ("encode-text: 2/2 shards", "encode-latents: 2/2 shards", "training: "):
        assert any(message.startswith(line) and "done in" in message for message in lines), lines
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    from flows.progress import children_progress

    child = next(run for run in runs if run.name.startswith("encode-latents-"))
    parent = _api(stack, lambda client: client.read_task_run(child.parent_task_run_id)).flow_run_id
    with temporary_settings({PREFECT_API_URL: stack["env"]["PREFECT_API_URL"],  # what the pipeline reads
                             PREFECT_API_AUTH_STRING: stack["env"]["PREFECT_API_AUTH_STRING"]}):
        for stage, shards in (("encode-text", [0, 1, 1]), ("encode-latents", [1, 1])):  # each child's, all at 100%
            children = children_progress(parent, stage)  # (encode-text's first child: the prompts, no shard)
            assert sorted(given for given, _, _ in children) == shards and {p for _, p, _ in children} == {100}
        assert children_progress(child.id, "encode-latents") == []
    progress = _api(stack, lambda client: client.read_artifacts(artifact_filter=ArtifactFilter(
        key=ArtifactFilterKey(any_=["training-progress"]), flow_run_id=ArtifactFilterFlowRunId(any_=[parent]))))
    # the placed train stage's progress, followed into the pipeline run's own artifact
    assert len(progress) == 1 and float(progress[0].data) == 100 and progress[0].description.startswith("training: 4/4")

    store = _store(stack)
    lineage = [key for key in store.fs.find(store.path("runs")) if key.endswith("lineage.json")]
    assert len(lineage) == 1 and store.committed(store.key(store.fs.unstrip_protocol(lineage[0])))
    assert store.fs.find(store.path("cache/text")) and store.fs.find(store.path("cache/latents"))
    assert store.fs.find(store.path("manifests")) and store.fs.find(store.path("prefect/results"))
    workers = [stack["dir"] / f"worker-{pool}" for pool in ("precast-encode", "precast-train")]
    for worker in workers:  # nothing but caches of remote shards may land in a worker's own folder
        leftovers = [p for p in worker.rglob("*") if p.is_file() and "cache" not in p.parts]
        assert leftovers == [], leftovers


def test_placed_stages_spread_over_two_nodes_encoders_loading_their_model_once(stack):
    """Placed encoders whose shards go to a Dask cluster of two worker processes ("nodes"): bf16 T5
    and a new VAE precision (new fingerprints, so everything is encoded), on the S3 root. The
    pipeline summary reports both workers, at most one model load each, every shard encoded. The
    same run trains on two nodes (training.distribution.nodes): one train flow run per node on the train pool,
    meeting through the store, training one run written once. It runs before the night is
    scheduled: workers' model loads are counted per pipeline run as a difference, so a pipeline
    loading models on the same Dask workers while the night encodes would be counted as the night's."""
    config = _config(stack, nodes=2, global_batch=4)
    config["text_encoding"]["dtype"] = "bf16"
    config["latent_encoding"]["dtype"] = "bf16"
    config["execution"].update(stack["cluster"])
    done = _run(stack, "precast-pipeline/pipeline", config)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    parent = re.search(r"UUID: ([0-9a-f-]{36})", done.stdout).group(1)
    rows = _summary_rows(stack, parent)
    for stage in ("encode-text", "encode-latents"):
        workers, loads, encoded, cached = _encoder_work(rows[stage])
        assert (workers, encoded, cached) == (2, 2, 0) and 1 <= loads <= 2, rows[stage]

    runs = _api(stack, lambda client: client.read_flow_runs(limit=200))
    nodes = {run.name: run for run in runs if run.parameters.get("attempt") == parent}
    assert sorted(nodes) == ["train-node-0", "train-node-1"]
    assert {child.name for child in _children(stack, parent)} >= {*nodes, "encode-text-prepare"}
    assert all(run.state.is_completed() and run.work_pool_name == "precast-train" for run in nodes.values())
    store = _store(stack)
    (folder,) = {key.split("/rendezvous/")[0] for key in store.find("runs") if f"/rendezvous/{parent}/" in key}
    assert sorted(key.rsplit("/", 1)[1] for key in store.find(f"{folder}/rendezvous/{parent}")) == \
        ["address.json", "node-0.json", "node-1.json"]
    assert store.committed(layout.run_part(folder, "lineage"))
    assert store.read_json(layout.run_part(folder, "lineage"))["training"]["distribution"]["nodes"] == 2


def test_the_nightly_deployment_runs_at_two_utc(stack):
    deployment = _api(stack, lambda client: client.read_deployment_by_name("precast-pipeline/nightly"))
    (schedule,) = deployment.schedules
    assert schedule.schedule.cron == "0 2 * * *" and schedule.schedule.timezone == "UTC" and schedule.active


@pytest.fixture(scope="module")
def scheduled_night(stack, first_run) -> dict:
    """A user's config deployed with a nightly schedule 2-3 minutes ahead, then deployed again with
    another step count; the server's scheduler creates the night's run, which a worker executes while
    the tests in between run. Returns the run the scheduler created, its time and its cron."""
    import datetime

    now = datetime.datetime.now(datetime.timezone.utc)
    # 120-180 s from now: both deploys and the scheduler's runs fit before it on a loaded machine
    # (at 60-120 s the night had started before the second deploy); the tests in between take longer
    when = (now + datetime.timedelta(seconds=180)).replace(second=0, microsecond=0)
    cron = f"{when.minute} {when.hour} * * *"
    path = _config_file(stack, _nightly(stack), "nightly.yaml")
    found = {}

    def deploy_then_wait_for_the_scheduler(steps: int):
        done = _precast(stack, "deploy", path, "--nightly", cron, "--set", f"training.steps={steps}")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert done.stdout.count("deployed: ") == 7 and "deployed: precast-pipeline/nightly" in done.stdout
        found["nightly"] = _api(stack, lambda client: client.read_deployment_by_name("precast-pipeline/nightly"))
        runs = _wait(lambda: [r for r in _scheduled_runs(stack, found["nightly"].id) if r.expected_start_time == when],
                     60)
        assert runs, "the scheduler created no nightly run"
        time.sleep(8)  # past the scheduler's window for recently updated deployments (5 s)
        return runs

    found["first"] = deploy_then_wait_for_the_scheduler(3)
    (found["run"],) = deploy_then_wait_for_the_scheduler(5)  # deploying again updates the deployments and the runs
    return {**found, "when": when, "cron": cron}


def test_deploying_a_users_config_again_updates_every_deployment_and_the_scheduled_run(stack, scheduled_night):
    """`precast deploy` puts the user's config in every deployment (the UI form's values); deploying
    again updates them and the runs already scheduled."""
    first, run, nightly = scheduled_night["first"], scheduled_night["run"], scheduled_night["nightly"]
    assert first[0].parameters["config"]["training"]["steps"] == 3
    assert run.id != first[0].id and run.parameters["config"]["training"]["steps"] == 5
    expected = PipelineConfig.model_validate(_nightly(stack, steps=5))
    pipeline = _api(stack, lambda client: client.read_deployment_by_name("precast-pipeline/pipeline"))
    assert pipeline.parameters["config"] == expected.model_dump(mode="json")  # the UI form's values
    assert nightly.parameters["config"]["training"] == {**expected.model_dump(mode="json")["training"],
                                                        "init_from": "latest"}
    (schedule,) = nightly.schedules
    assert schedule.schedule.cron == scheduled_night["cron"] and schedule.active


def test_a_failing_stage_fails_the_run_with_its_error(stack):
    done = _run(stack, "precast-pipeline/pipeline", _train_placed(stack, init_from="s3://precast/no-such-run"))
    assert done.returncode != 0
    runs = _api(stack, lambda client: client.read_flow_runs(limit=100))
    failed = [run for run in runs if run.state and run.state.is_failed() and run.parent_task_run_id is None]
    assert failed and "init_from: no adapter_model.safetensors at s3://precast/no-such-run" in failed[0].state.message


def test_submit_from_ci_names_the_failed_stage_and_its_error(stack):
    """The README's CI command: exit 1, with the failing stage and a clear reason for a mistyped model path."""
    bad = _config(stack)
    bad["model"]["path"] = "/models/PixArt-Sigma-XL-2-1024-MS"  # no such folder on the worker
    done = _precast(stack, "submit", "precast-pipeline/pipeline", "--config", _config_file(stack, bad, "bad.yaml"))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "encode-text: Failed: FileNotFoundError: model.path '/models/PixArt-Sigma-XL-2-1024-MS' is neither an " \
           "existing folder" in done.stderr, done.stderr
    assert "HFValidationError" not in done.stderr

    readme = (ROOT / "README.md").read_text()
    example = readme.split("## Calling from CI", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    command = next(line for line in example.splitlines() if line.startswith("precast submit"))
    done = subprocess.run(["bash", "-c", command.replace("precast ", f"{ROOT / '.venv/bin/precast'} ", 1)],
                          cwd=ROOT, env=stack["env"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.rstrip().endswith("precast-pipeline/pipeline: Completed")


def test_a_run_with_nothing_new_wakes_no_pool(stack, first_run):
    """The first run's config again, every stage placed: its encoders' every shard, prompt and
    precision check is cached and its run is finished, so the pipeline starts no child flow run;
    its summary counts the shards found cached."""
    done = _precast(stack, "submit", "precast-pipeline/pipeline", "--config",
                    _config_file(stack, _config(stack), "again.yaml"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = re.search(r"([0-9a-f]{8}-[0-9a-f-]{27})\)", done.stdout).group(1)
    assert [child.name for child in _children(stack, run)] == []
    rows = _summary_rows(stack, run)
    for stage in ("encode-text", "encode-latents"):
        assert _encoder_work(rows[stage]) == (0, 0, 0, 2), rows[stage]


def test_the_server_and_precast_refuse_a_client_without_the_auth_string(stack):
    """The stack's server answers 401 to a request without its auth string, and to one with
    another; `precast submit` then exits 1 naming the server, the 401 and the setting to give."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(stack["env"]["PREFECT_API_URL"] + "/deployments/filter", data=b"{}",
                                     headers={"Content-Type": "application/json"}, method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 401
    for given in (None, "precast:not-the-one"):
        env = {key: value for key, value in stack["env"].items() if key != "PREFECT_API_AUTH_STRING"}
        env.update({"PREFECT_API_AUTH_STRING": given} if given else {})
        done = subprocess.run([str(ROOT / ".venv/bin/precast"), "submit", "precast-pipeline/pipeline"],
                              cwd=stack["dir"], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
        assert f"the Prefect server at {stack['env']['PREFECT_API_URL'].rsplit('/api', 1)[0]} refused the request " \
               f"(401 Unauthorized): this client sent {'an auth string it does not accept' if given else 'no auth string'}" \
               ". Set PREFECT_API_AUTH_STRING" in done.stderr, done.stderr[-2000:]
        assert "Traceback" not in done.stderr


def test_credentials_never_reach_objects_or_logs(stack):
    store = _store(stack)
    blobs = []
    for key in store.fs.find("precast"):
        try:
            blobs.append(store.fs.cat_file(key))
        except FileNotFoundError:  # a Prefect lock released while listing
            continue
    logs = [path.read_bytes() for path in stack["dir"].glob("*.log")]
    records = _api(stack, lambda client: client.read_logs(limit=200))
    logs.append("\n".join(record.message for record in records).encode())
    # what the UI shows: the deployments' parameters (the config), the artifacts (run pages, summaries)
    deployments = _api(stack, lambda client: client.read_deployments())
    artifacts = _api(stack, lambda client: client.read_artifacts(limit=200))
    assert deployments and artifacts
    blobs += [json.dumps(d.parameters).encode() for d in deployments] + [str(a.data).encode() for a in artifacts]
    assert blobs and logs
    # the store's keys, the server's auth string and the Dask cluster's private key
    key = (stack["dir"] / "tls" / "key.pem").read_text().split("-----")[2].strip().splitlines()[1]
    for secret in [*SECRETS.values(), stack["env"]["PREFECT_API_AUTH_STRING"], key]:
        for blob in blobs + logs:
            assert secret.encode() not in blob


def test_the_schedulers_nightly_run_completes_and_an_unchanged_night_encodes_nothing(stack, first_run,
                                                                                     scheduled_night):
    """The run the server's scheduler created (last test: it ran meanwhile) completes with the
    deployed values, on the S3 root, training anew from the latest adapter; its encoders send their
    shards to the Dask cluster's two workers, which find every shard the first run encoded cached
    and encode none again."""
    import datetime

    when, run = scheduled_night["when"], scheduled_night["run"]
    seconds = (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds() + 300
    finished = _wait(lambda: [r for r in _scheduled_runs(stack, scheduled_night["nightly"].id)
                              if r.id == run.id and r.state.is_final()], seconds)
    assert finished, f"the scheduled nightly run at {when} did not finish"
    assert finished[0].state.is_completed(), finished[0].state.message
    assert finished[0].parameters["config"]["storage"]["root"] == "s3://precast/store"
    store = _store(stack)
    lineage = [key for key in store.find("runs") if key.endswith("lineage.json")]
    assert any(store.read_json(key)["training"]["steps"] == 5 for key in lineage)

    rows = _summary_rows(stack, run.id)
    for stage in ("encode-text", "encode-latents"):
        workers, loads, encoded, cached = _encoder_work(rows[stage])
        assert (workers, loads, encoded, cached) == (2, 0, 0, 2), rows[stage]
    encoded = _encoded(store)
    assert {key: encoded[key] for key in first_run} == first_run  # nothing the first run encoded was encoded again
