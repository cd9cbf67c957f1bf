"""Faults injected into real pipeline runs: SIGKILL anywhere, flaky storage, two runs at once.

"The same outputs" means the same sha256 for every committed artifact (image shards, both
caches, the dataset, the manifest, checkpoints, the finished run), key for key.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from configs.schema import PipelineConfig
from flows.pipeline import pipeline
from storage.store import Store
from storage.verify import verify_store
from tests.killer import POINTS

ROOT = Path(__file__).parents[1]


def committed_checksums(store: Store) -> dict[str, str]:
    return {key.removesuffix(".done"): store.read_json(key)["sha256"]
            for key in store.find() if key.endswith(".done")}


def _config(make_config, root: str, **storage) -> PipelineConfig:
    config = make_config(root=root, training={"steps": 6, "checkpoint_every": 2, "keep_checkpoints": 2},
                         execution={"retries": 2, "retry_delay_seconds": 0})
    return config.model_copy(update={"storage": config.storage.model_copy(update=storage)})


# --- flaky storage ------------------------------------------------------------------------------
def _flaky(make_config, s3_endpoint, prefix: str, **faults) -> PipelineConfig:
    s3 = {"endpoint_url": s3_endpoint}
    options = {"target_protocol": "s3", "target_options": s3, "seed": 0, **faults}
    return _config(make_config, f"flaky://precast-faults/{prefix}", options=options, io_backoff_seconds=0.01,
                   io_attempts=4)


@pytest.fixture(scope="module")
def bucket(s3_endpoint):
    import s3fs

    s3fs.S3FileSystem(endpoint_url=s3_endpoint).mkdir("precast-faults")


def test_flaky_storage_retries_to_identical_outputs(prefect_server, make_config, s3_endpoint, bucket):
    clean = _config(make_config, "s3://precast-faults/clean", options={"endpoint_url": s3_endpoint})
    flaky = _flaky(make_config, s3_endpoint, "flaky", fail_rate=0.2)
    done = pipeline(config=flaky)
    assert pipeline(config=clean)["final_loss"] == done["final_loss"]

    faults = Store(flaky.storage).fs  # the one filesystem of those options in this process: the runs' own
    # about 13 faults a run (mostly writes: reads of remote shards are one download each)
    assert sum(faults.injected.values()) >= 5, faults.injected
    # each stage's work counts its own store's retries (not the flow's own reads between stages)
    retried = sum(work.get("io_retries", 0) for work in done["stages"].values())
    assert 0 < retried <= sum(faults.injected.values()), (done["stages"], faults.injected)
    assert committed_checksums(Store(flaky.storage)) == committed_checksums(Store(clean.storage))
    report = verify_store(Store(flaky.storage))
    assert report["ok"] and report["io_retries"] > 0  # verify's own reads of a flaky store, counted too


def test_an_object_store_that_throttles_resets_and_cuts_bodies_short_gives_the_same_bytes(make_config, s3_endpoint,
                                                                                           bucket):
    """Every stage, training included, on S3 behind an endpoint that answers every 5th request
    with a fault in turn: 503 SlowDown, 400 RequestTimeout, a connection reset (a PUT stored, its
    answer lost) and a GET body cut at half. The client's retries and the store's ride them out:
    every committed artifact has the sha256 of a clean run, and `verify` finds nothing wrong."""
    from storage.slow_endpoint import FAULTS, SlowEndpoint
    from tasks.runner import run_direct

    clean = _config(make_config, "s3://precast-faults/http-clean", options={"endpoint_url": s3_endpoint})
    run_direct(clean)
    with SlowEndpoint(s3_endpoint, delay=0, fault_every=5) as proxy:
        faulty = _config(make_config, "s3://precast-faults/http-faults", options={"endpoint_url": proxy.url})
        run_direct(faulty)
    assert set(proxy.injected) == set(FAULTS) and min(proxy.injected.values()) >= 5, proxy.injected
    store = Store(faulty.storage.model_copy(update={"options": {"endpoint_url": s3_endpoint}}))  # not through it
    assert committed_checksums(store) == committed_checksums(Store(clean.storage))
    assert verify_store(store)["ok"]


def test_every_stage_counts_the_store_failures_it_retried(make_config, tmp_path):
    """A store failing 30% of its calls (reads, and writes before or after they land): every stage,
    training's two spawned processes included, rides it out and counts its own retries in its
    work. Also the text encoder's ranged reads of a shard's footer and caption columns, whose
    failure fsspec hands back in place of the bytes (it was a TypeError, not retried)."""
    from tasks.runner import run_direct

    config = _config(make_config, f"flaky://{tmp_path}/store", io_backoff_seconds=0, io_attempts=12,
                     options={"fail_rate": 0.6, "seed": 1, "target_options": {"auto_mkdir": True}})
    config = config.model_copy(update={"training": config.training.updated({"distribution.processes": 2, "steps": 2})})
    records = run_direct(config)
    retried = {name: records[name]["work"]["io_retries"] for name in records["seconds"]}
    assert min(retried.values()) > 0, retried


def test_a_permanently_failing_object_fails_the_run_naming_it(prefect_server, make_config, s3_endpoint, bucket):
    config = _flaky(make_config, s3_endpoint, "permanent", permanent=["*/cache/latents/*"])
    with pytest.raises(OSError, match=r"flaky://precast-faults/permanent/cache/latents/\S+ failed 4 times"):
        pipeline(config=config)


# --- separate processes: SIGKILL anywhere, two runs at once ------------------------------------
def _precast(args: list[str], kill_at: str | None = None) -> subprocess.Popen:
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_LOGGING_LEVEL": "WARNING"}
    command = [sys.executable, "-m", "tests.killer", kill_at, "--"] if kill_at else [sys.executable, "-m", "flows.cli"]
    return subprocess.Popen(command + args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _finish(process: subprocess.Popen) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=600)
    return process.returncode, out, err


def _config_file(config: PipelineConfig, path: Path) -> str:
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return str(path)


@pytest.fixture(scope="module")
def reference(prefect_server, tiny_models, demo_data, tmp_path_factory):
    """An uninterrupted run's committed checksums, and a config factory for other roots."""
    base = tmp_path_factory.mktemp("faults")

    def config_at(root: Path) -> PipelineConfig:
        return PipelineConfig.model_validate({
            "storage": {"root": str(root)},
            "dataset": {"sources": [{"path": demo_data}], "shard_size": 10},
            "model": {"path": tiny_models},
            "text_encoding": {"dtype": "fp32", "batch_tokens": 128},
            "latent_encoding": {"resolution": 256, "storage_dtype": "fp32", "batch_size": 2},
            "training": {"rank": 4, "alpha": 4, "steps": 6, "batch_size": 2, "learning_rate": 1e-3,
                         "checkpoint_every": 2, "keep_checkpoints": 2,
                         "sample_prompts": ["a red circle on a blue background"], "sample_steps": 2},
            "execution": {"retries": 0, "max_parallel_shards": 1},
        })

    config = config_at(base / "reference")
    pipeline(config=config)
    return committed_checksums(Store(config.storage)), config_at, base


def _verify(config: PipelineConfig) -> dict:
    """`precast verify`'s report (tests/test_reliability.py runs the command itself)."""
    return verify_store(Store(config.storage))


@pytest.mark.slow
@pytest.mark.parametrize("point", list(POINTS))
def test_killed_anywhere_a_plain_rerun_converges(reference, point):
    expected, config_at, base = reference
    config = config_at(base / point.replace(" ", "-").replace(",", ""))
    path = _config_file(config, base / f"{point.replace(' ', '-')}.yaml")

    code, _, log = _finish(_precast(["run", path], kill_at=point))
    assert code == -signal.SIGKILL, f"never reached {point!r}:\n{log[-3000:]}"
    assert _verify(config)["damaged"] == []
    store = Store(config.storage)
    if POINTS[point].hold:  # killed while ingest's dataset record was held back: the stages overlapped
        assert not [key for key in store.find("datasets") if key.endswith(".done")], "ingest had finished"
    killed = _commit_records(store)  # what the killed run had committed, as the re-run must leave it

    pipeline(config=config)  # the plain re-run (in this process: `precast run` is the same flow)
    assert committed_checksums(store) == expected
    report = _verify(config)
    assert report["ok"] and report["damaged"] == []
    again = _commit_records(store)
    assert {key: again.get(key) for key in killed} == killed  # no shard written or encoded twice


def _commit_records(store: Store) -> dict[str, dict]:
    """The commit records (with their times) of the image shards and both caches."""
    return {key: store.read_json(key) for key in store.find() if key.endswith(".done")
            and key.startswith(("shards/", "cache/"))}


@pytest.mark.slow
def test_two_pipelines_started_at_once_agree(reference):
    expected, config_at, base = reference
    config = config_at(base / "concurrent")
    path = _config_file(config, base / "concurrent.yaml")
    first, second = _precast(["run", path, "--json"]), _precast(["run", path, "--json"])
    results = [_finish(first), _finish(second)]
    for code, _, log in results:
        assert code == 0, log[-3000:]
    first_result, second_result = (json.loads(out) for _, out, _ in results)
    # the same outputs; what each run cost (its "stages": seconds, model loads) and its flow run are its own
    own = {"stages": None, "flow_run": None, "flow_run_url": None}
    assert first_result["flow_run"] != second_result["flow_run"]
    assert first_result | own == second_result | own
    assert sum(": steps 1-6 in " in log for _, _, log in results) == 1  # trained once: the other waited for it
    assert committed_checksums(Store(config.storage)) == expected
    assert _verify(config)["ok"]
