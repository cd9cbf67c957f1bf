"""The stages overlap: the latent encoder takes each image shard as ingest commits it, the text
encoders run beside it once the dataset is known; the outputs are byte for byte those of the
stages run one after another, and a failure anywhere loses nothing and encodes nothing twice."""

from __future__ import annotations

import time

import pytest

from storage.store import Store
from tasks.ingest import shards as ingest_shards
from tasks.runner import Direct, Shards, one_after_another, run_direct, run_stages


def _store_bytes(store: Store) -> dict[str, bytes]:
    """Every committed artifact of the data stages (commit records carry times: left out)."""
    return {key: store.read_bytes(key) for key in store.find()
            if key.startswith(("shards/", "datasets/", "cache/", "manifests/")) and not key.endswith(".done")}


def _one_after_another(config) -> Store:
    """The reference: each stage whole before the next begins (as the benchmark runs it)."""
    executor = Direct(config)
    one_after_another(executor)
    return executor.store


@pytest.fixture
def slow_writes(monkeypatch):
    """Ingest's shards take a while to write, as large shards to an object store do."""
    write = ingest_shards.write_shard

    def slowly(*args):
        time.sleep(0.3)
        return write(*args)

    monkeypatch.setattr(ingest_shards, "write_shard", slowly)


def test_encoders_start_on_shards_ingest_has_committed_and_write_what_one_stage_after_another_writes(
        make_config, tmp_path, monkeypatch):
    """Ingest writes its third shard only once a latent shard is committed (a minute at most: on a
    machine where the encoder waited for the dataset, the assertions below fail rather than hang),
    so on any machine's timing the encoder has started before ingest ends."""
    import threading

    from tasks import runner

    config = make_config(root=str(tmp_path / "overlapped"), dataset={"shard_size": 3})
    encode, write, encoded, writes = runner.encode_latents_shard, ingest_shards.write_shard, threading.Event(), []

    def slowly(*args):  # a shard takes the VAE a while, so the text encoder starts before it ends
        time.sleep(0.5)
        record = encode(*args)
        encoded.set()
        return record

    def after_a_latent_shard(*args):
        writes.append(1)
        if len(writes) > 2:
            encoded.wait(60)
        return write(*args)

    monkeypatch.setattr(runner, "encode_latents_shard", slowly)
    monkeypatch.setattr(ingest_shards, "write_shard", after_a_latent_shard)
    done = run_direct(config, until="manifest")
    store = Store(config.storage)
    dataset_committed = done["ingest"]["committed_at"]
    latents = done["encode-latents"]["shards"]
    assert len(latents) == len(done["ingest"]["shards"]) == 8
    # the latent encoder had encoded shards before ingest had written them all
    assert min(shard["committed_at"] for shard in latents) < dataset_committed
    assert [shard["shard"] for shard in latents] == [shard["id"] for shard in done["ingest"]["shards"]]
    text = min(shard["committed_at"] for shard in done["encode-text"]["shards"])
    assert text > dataset_committed  # its precision check is measured on the dataset's first shard
    # both encoders on this one CPU, at once: the text encoder began before the latent encoder was done
    assert text < max(shard["committed_at"] for shard in latents)
    reference = _one_after_another(make_config(root=str(tmp_path / "reference"), dataset={"shard_size": 3}))
    assert _store_bytes(store) == _store_bytes(reference)


def test_a_failure_while_the_stages_overlap_loses_nothing_and_encodes_nothing_twice(
        make_config, tmp_path, monkeypatch, slow_writes):
    """Ingest failing while the latent encoder works fails the run with ingest's error; the latent
    encoder failing on a shard fails it with its own, after ingest has finished. Either way only
    whole artifacts are left, and the re-run encodes only what was not committed, to the same
    bytes as a run that never failed."""
    from tasks.encode import latents as latent_stage

    config = make_config(root=str(tmp_path / "failing"), dataset={"shard_size": 3})
    store = Store(config.storage)
    writes, write = [], ingest_shards.write_shard

    def dying(*args):  # the sixth shard's write fails (slowly, as the others)
        writes.append(1)
        if len(writes) == 6:
            raise OSError(5, "Input/output error on the sixth shard")
        return write(*args)

    monkeypatch.setattr(ingest_shards, "write_shard", dying)
    with pytest.raises(OSError, match="sixth shard"):
        run_stages(Direct(config), until="manifest")
    assert not store.find("datasets") and not store.find("cache/text")
    encoded = {key: store.committed(key) for key in store.find("cache/latents") if key.endswith(".safetensors")}
    assert encoded and all(record is not None for record in encoded.values())  # whole, and committed

    monkeypatch.setattr(ingest_shards, "write_shard", write)
    encode, calls = latent_stage.encode_latents_shard, []

    def failing_encoder(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the VAE's node went away")
        return encode(*args)

    monkeypatch.setattr("tasks.runner.encode_latents_shard", failing_encoder)
    with pytest.raises(RuntimeError, match="node went away"):
        run_stages(Direct(config), until="manifest")
    assert store.find("datasets")  # ingest finished meanwhile

    monkeypatch.setattr("tasks.runner.encode_latents_shard", encode)
    done = run_direct(config, until="manifest")
    again = {shard["url"]: shard["committed_at"] for shard in done["encode-latents"]["shards"]}
    assert all(again[store.url(key)] == record["committed_at"] for key, record in encoded.items())  # not redone
    assert done["encode-latents"]["work"]["shards_cached"] >= len(encoded)
    reference = _one_after_another(make_config(root=str(tmp_path / "reference"), dataset={"shard_size": 3}))
    assert _store_bytes(store) == _store_bytes(reference)


def test_an_encoder_waiting_on_a_failed_ingest_takes_what_was_committed_then_stops(make_config):
    from tasks.runner import NoDataset

    shards = Shards(Store(make_config().storage))
    shards.committed("file:///store/shards/images/a.parquet")
    shards.fail(OSError(28, "No space left on device"))
    given = iter(shards)
    assert next(given) == "file:///store/shards/images/a.parquet"
    with pytest.raises(NoDataset, match="ingest failed .*No space left"):
        next(given)
