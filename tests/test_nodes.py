"""Training across nodes: each "node" is its own process group of processes on loopback (gloo),
started as a node's train flow run starts it (`tests/node.py` calls `train(node=…, attempt=…)`);
the nodes meet and watch each other through the store alone."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load

from configs.schema import TrainingConfig, flat
from storage import layout
from storage.store import Store
from tasks.train import train

ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.slow(minutes=2)


def _config(cached_manifest, root: Path, **training):
    base, _ = cached_manifest
    if not root.exists():
        shutil.copytree(base.storage.root, root)
    values = {"rank": 4, "alpha": 4, "batch_size": 2, "learning_rate": 1e-3, "sample_prompts": [],
              "validation_samples": 4, "validation_every": 2, **training}
    raw = base.model_dump()
    return type(base).model_validate({**raw, "storage": {**raw["storage"], "root": str(root)},
                                      "training": {**flat(TrainingConfig, raw["training"]), **values}})


def _manifest(cached_manifest, config) -> str:
    return Store(config.storage).url(cached_manifest[1])


def _start(config, manifest: str, node: int, attempt: str) -> subprocess.Popen:
    """A node in its own process session (its processes die together, as a node does)."""
    path = Path(config.storage.root).parent / f"node-{node}.json"
    path.write_text(config.model_dump_json())
    env = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    return subprocess.Popen([sys.executable, "-m", "tests.node", str(path), manifest, str(node), attempt], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _finish(node: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str, float]:
    started = time.monotonic()
    out, err = node.communicate(timeout=timeout)
    return node.returncode, out, err, time.monotonic() - started


def _outputs(store: Store, run: str) -> tuple[list[float], dict[str, torch.Tensor], list[str]]:
    metrics = [json.loads(line) for line in store.read_bytes(f"{run}/metrics.jsonl").splitlines() if line]
    adapter = load(store.read_bytes(f"{run}/adapter/adapter_model.safetensors"))
    return [m["loss"] for m in metrics], adapter, [m["validation_loss"] for m in metrics if "validation_loss" in m]


# FLUX.1-dev with its flow-matching objective, its packed tokens and guidance input, and an EMA
# of its adapter carried through the checkpoint the nodes resume from
FAMILY_SETTINGS = {"pixart": {}, "flux": {"ema_decay": 0.9}}


@pytest.mark.parametrize("family", FAMILY_SETTINGS)
def test_two_nodes_of_two_processes_train_what_one_process_trains_with_the_same_global_batch(
        cached_manifest, family_manifests, family, tmp_path):
    """2 nodes × 2 processes (world 4, no accumulation) against 1 process accumulating 4
    micro-batches: the same global batch of 8, so the same run id, the same losses and validation
    losses and the same adapter within float tolerance. The two nodes resume a run one process
    started and stopped after its step-3 checkpoint; rank 0 alone writes the run (one lineage, one
    adapter)."""
    from tests.test_manifest_and_train import kill_training_at

    if family != "pixart":
        cached_manifest = family_manifests(family)
    settings = dict(steps=6, global_batch=8, checkpoint_every=3, **FAMILY_SETTINGS[family])
    one = _config(cached_manifest, tmp_path / "one", **settings)
    nodes = _config(cached_manifest, tmp_path / "nodes", nodes=2, processes=2, **settings)
    assert (one.training.accumulation, nodes.training.accumulation) == (4, 1)
    reference = train(one.storage, one.model, one.training, _manifest(cached_manifest, one))
    stopped = _config(cached_manifest, tmp_path / "nodes", **settings)
    kill_training_at(stopped, _manifest(cached_manifest, stopped), 20)  # in step 5, after the step-3 checkpoint

    started = [_start(nodes, _manifest(cached_manifest, nodes), node, "attempt-1") for node in (0, 1)]
    results = [_finish(node) for node in started]
    for code, out, err, _ in results:
        assert code == 0, err[-8000:]  # with a crashed process's threads
    records = [json.loads(out.splitlines()[-1]) for _, out, _, _ in results]
    assert records[0]["resumed_from"] == 3
    runs = [record["run"] for record in records]
    assert runs[0] == runs[1] and runs[0].rsplit("/", 1)[1] == reference["run"].rsplit("/", 1)[1]  # one run id

    stores = Store(one.storage), Store(nodes.storage)
    run = layout.run(reference["run"].rsplit("/", 1)[1])
    (losses, adapter, validation), (node_losses, node_adapter, node_validation) = (_outputs(s, run) for s in stores)
    assert len(losses) == 6 and torch.allclose(torch.tensor(losses), torch.tensor(node_losses), rtol=1e-4)
    assert len(validation) == 3 and validation == pytest.approx(node_validation, rel=1e-4)
    for name, tensor in adapter.items():
        assert torch.allclose(tensor, node_adapter[name], rtol=1e-3, atol=1e-5), name
    written = stores[1].find(run)
    assert sum(key.endswith("lineage.json") for key in written) == 1
    assert sum(key.endswith("adapter_model.safetensors") for key in written) == 1


def test_a_killed_node_fails_the_run_naming_it_within_the_timeout_and_a_rerun_resumes(cached_manifest, tmp_path):
    config = _config(cached_manifest, tmp_path / "store", steps=16, checkpoint_every=3, nodes=2, node_timeout=8,
                     validation_samples=0)
    manifest, store = _manifest(cached_manifest, config), Store(config.storage)
    first = [_start(config, manifest, node, "attempt-1") for node in (0, 1)]
    deadline = time.monotonic() + 240
    while not [key for key in store.find("runs") if key.endswith(".safetensors.done")]:  # a checkpoint committed
        assert time.monotonic() < deadline and first[0].poll() is None, "training never reached a checkpoint"
        time.sleep(0.2)
    os.killpg(first[1].pid, signal.SIGKILL)  # node 1 and its processes, as a lost machine
    code, _, err, seconds = _finish(first[0])
    assert code != 0 and seconds < config.training.distribution.node_timeout + 5, (seconds, err[-3000:])
    assert "failed on node 0: node 1" in err, err[-3000:]
    run = next(key for key in store.find("runs") if key.endswith(".safetensors.done")).split("/checkpoints/")[0]
    assert store.committed(layout.run_part(run, "lineage")) is None

    again = [_start(config, manifest, node, "attempt-2") for node in (0, 1)]
    results = [_finish(node) for node in again]
    for code, out, err, _ in results:
        assert code == 0, err[-8000:]  # with a crashed process's threads
    assert json.loads(results[0][1].splitlines()[-1])["resumed_from"] >= 3
    losses, _, _ = _outputs(store, run)
    assert len(losses) == 16


def test_a_node_that_never_joins_fails_the_run_within_the_timeout(cached_manifest, tmp_path):
    config = _config(cached_manifest, tmp_path / "store", steps=3, nodes=2, node_timeout=6)
    code, _, err, seconds = _finish(_start(config, _manifest(cached_manifest, config), 0, "attempt-1"))
    assert code != 0 and "node 1 never joined" in err, err[-3000:]
    assert seconds < 60


def test_several_nodes_without_the_train_deployment_are_refused_before_any_stage(make_config, prefect_server):
    from flows.pipeline import pipeline

    config = make_config(training={"nodes": 2})
    with pytest.raises(ValueError, match="training.distribution.nodes is 2: set execution.placement.train"):
        pipeline(config=config)
    assert [key for key in Store(config.storage).find() if not key.startswith("prefect/")] == []
