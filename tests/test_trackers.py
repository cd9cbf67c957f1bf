"""Experiment trackers, read back with each tool's own reader: TensorBoard's event accumulator on
the event files the run left on an S3 root, MLflow's client on a local (SQLite) tracking store,
and the W&B offline run's records parsed with W&B's own protobuf messages. A tracker that fails or
hangs costs the run nothing."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import pytest

from storage.store import Store
from tasks.train import train
from tests.conftest import SAMPLE_PROMPT


def _training(cached_manifest, root: str, options: dict, **training):
    base, manifest_key = cached_manifest
    raw = base.model_dump()
    values = {"rank": 4, "alpha": 4, "steps": 6, "batch_size": 2, "learning_rate": 1e-3, "sample_prompts": [],
              "validation_samples": 4, "validation_every": 3, "log_every": 2, "checkpoint_every": 0, **training}
    config = type(base).model_validate({**raw, "storage": {"root": root, "options": options}, "training": values})
    return config, manifest_key


def _approx(series: list[tuple[int, float]]) -> list:
    """The same steps, values within float32 rounding (what the trackers store)."""
    return [(step, pytest.approx(value, rel=1e-6)) for step, value in series]


def _wandb_records(path: Path) -> list:
    """The records of a W&B offline run file (`run-<id>.wandb`): W&B's `Record` messages in the
    LevelDB log framing W&B writes them in (32 KiB blocks; 7-byte headers: crc, length, kind)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    position, records, pending = 7, [], b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0:
            break
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_each_tracker_reads_back_the_run_with_its_own_reader(cached_manifest, s3_endpoint, tmp_path, monkeypatch):
    import mlflow
    import s3fs
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    secret = "precast-tracker-secret-7f3a91"  # the store's key, in the environment (moto takes any)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    s3 = s3fs.S3FileSystem(endpoint_url=s3_endpoint)
    s3.put(cached_manifest[0].storage.root, "precast-trackers/store", recursive=True)
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # a SQLite store keeps artifacts under ./mlruns unless its experiment says where
    mlflow.MlflowClient(tracking).create_experiment("trackers-test", artifact_location=(tmp_path / "artifacts").as_uri())
    config, manifest_key = _training(
        cached_manifest, "s3://precast-trackers/store", {"endpoint_url": s3_endpoint},
        trackers=["tensorboard", "mlflow", "wandb"], mlflow_tracking_uri=tracking, tracker_project="trackers-test",
        sample_prompts=[SAMPLE_PROMPT], sample_steps=2)
    store = Store(config.storage)
    record = train(config.storage, config.model, config.training, store.url(manifest_key))
    run_id = record["run"].rsplit("/", 1)[1]
    metrics = [json.loads(line) for line in store.read_bytes(store.key(record["run"]) + "/metrics.jsonl").splitlines()]
    losses = [(m["step"], m["loss"]) for m in metrics]
    validation = [(m["step"], m["validation_loss"]) for m in metrics if "validation_loss" in m]
    assert [step for step, _ in validation] == [3, 6]

    # TensorBoard: the event files are in the run folder on the S3 root
    s3.get(f"precast-trackers/store/runs/{run_id}/tensorboard", str(tmp_path / "tensorboard"), recursive=True)
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss/train")] == _approx(losses)
    assert [(e.step, e.value) for e in events.Scalars("loss/validation")] == _approx(validation)
    assert {"learning_rate", "grad_norm", "samples_per_s", "peak_memory_gib"} <= set(events.Tags()["scalars"])
    assert [image.step for image in events.Images("samples")] == [6]
    start = plugin_data_pb2.HParamsPluginData.FromString(
        events.PluginTagToContent("hparams")["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["run_id"].string_value == run_id
    assert start.hparams["training.lora.rank"].number_value == 4
    assert start.hparams["fingerprints.text_fingerprint"].string_value

    # MLflow: its client on the local tracking store
    client = mlflow.MlflowClient(tracking)
    (found,) = client.search_runs([client.get_experiment_by_name("trackers-test").experiment_id])
    assert found.info.status == "FINISHED" and found.data.tags["precast.run_id"] == run_id
    assert found.data.params["training.lora.rank"] == "4" and found.data.params["manifest"]
    history = client.get_metric_history(found.info.run_id, "loss/train")
    assert [(m.step, m.value) for m in history] == _approx(losses)
    validated = client.get_metric_history(found.info.run_id, "loss/validation")
    assert [(m.step, m.value) for m in validated] == _approx(validation)
    assert [a.path for a in client.list_artifacts(found.info.run_id)] == ["images"]

    # W&B: the offline run's own records
    (path,) = tmp_path.glob(f"wandb/offline-run-*/run-{run_id}.wandb")
    records = _wandb_records(path)
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], h["loss/train"]) for h in history] == _approx(losses)
    assert [(h["_step"], h["loss/validation"]) for h in history if "loss/validation" in h] == _approx(validation)
    assert history[-1]["samples/_type"] == "image-file"  # the sample grid, as a W&B image
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config_items = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert run.project == "trackers-test" and config_items["run_id"] == run_id
    assert config_items["training.lora.rank"] == 4 and config_items["fingerprints.vae_fingerprint"]

    # no tracker is given a credential: the params and config each one holds, and every file they wrote
    tracked = [json.dumps(found.data.params), json.dumps(config_items), str(start.hparams), path.read_bytes().decode(
        "latin-1"), *(p.read_bytes().decode("latin-1") for p in (tmp_path / "tensorboard").rglob("*") if p.is_file())]
    assert all(secret not in text for text in tracked)


def test_a_failing_or_hanging_tracker_costs_the_run_nothing(cached_manifest, tmp_path, monkeypatch, caplog):
    """A tracker that raises is dropped with one warning; one that never returns is left behind
    when the run ends (after `WAIT_ON_CLOSE_SECONDS`); the run's weights and metrics are the bits
    of a run without trackers."""
    import shutil
    import threading

    from tasks.train import trackers

    def run(name: str, kinds: list[str]):
        root = tmp_path / name
        shutil.copytree(cached_manifest[0].storage.root, root)
        config, key = _training(cached_manifest, str(root), {}, trackers=kinds)
        store = Store(config.storage)
        record = train(config.storage, config.model, config.training, store.url(key))
        run_key = store.key(record["run"])
        return (store.read_bytes(run_key + "/metrics.jsonl"),
                store.read_bytes(run_key + "/adapter/adapter_model.safetensors"))

    plain = run("plain", [])
    released = threading.Event()

    def broken(self, step, values):
        raise OSError("disk full")

    class Hanging:  # a tracker whose server stopped answering
        def __init__(self, *args):
            pass

        def scalars(self, step, values):
            released.wait()

    monkeypatch.setattr(trackers.TensorBoard, "scalars", broken)
    monkeypatch.setitem(trackers.KINDS, "wandb", Hanging)
    monkeypatch.setattr(trackers, "WAIT_ON_CLOSE_SECONDS", 1.0)
    caplog.set_level(logging.WARNING, logger="tasks.train.trackers")
    tracked = run("tracked", ["tensorboard", "wandb"])
    released.set()
    assert tracked == plain  # metrics.jsonl and adapter bytes
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("tracker tensorboard failed (OSError: disk full)" in w for w in warnings) == 1
    assert any("trackers still busy after 1 s" in w for w in warnings)
