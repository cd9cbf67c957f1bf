"""The store: atomic writes, commit records, checksums, and the same behaviour on S3."""

from __future__ import annotations

import os

import pytest

from configs.schema import StorageConfig
from storage.store import ArtifactMissing, Damaged, Store, json_bytes


def test_commit_writes_data_then_record(tmp_path):
    store = Store(StorageConfig(root=str(tmp_path)))
    record = store.commit("a/b.bin", b"payload", rows=3)
    assert store.read_bytes("a/b.bin") == b"payload"
    assert store.committed("a/b.bin") == record
    assert record["rows"] == 3 and record["size"] == 7 and record["url"] == store.url("a/b.bin")
    assert store.verify("a/b.bin")["sha256"] == record["sha256"]


def test_crash_mid_write_leaves_nothing_visible(tmp_path, monkeypatch):
    store = Store(StorageConfig(root=str(tmp_path)))

    def crash(*_):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        store.commit("cache/shard.safetensors", b"x" * 1000)
    monkeypatch.undo()
    assert not store.exists("cache/shard.safetensors")
    assert store.committed("cache/shard.safetensors") is None
    with pytest.raises(ArtifactMissing, match="not committed"):
        store.require("cache/shard.safetensors")


def test_artifact_without_commit_record_is_not_done(tmp_path):
    store = Store(StorageConfig(root=str(tmp_path)))
    store.write_bytes("cache/half.safetensors", b"data written, record not yet")
    assert store.committed("cache/half.safetensors") is None


def test_damaged_artifact_is_named(tmp_path):
    store = Store(StorageConfig(root=str(tmp_path)))
    store.commit("shards/x.parquet", b"original bytes")
    (tmp_path / "shards" / "x.parquet").write_bytes(b"original bytez")
    with pytest.raises(Damaged, match=r"shards/x\.parquet is damaged"):
        store.verify("shards/x.parquet")


def test_s3_store_round_trip(s3_endpoint, tmp_path):
    import s3fs

    s3fs.S3FileSystem(endpoint_url=s3_endpoint).mkdir("precast-test")
    store = Store(StorageConfig(root="s3://precast-test/root", options={"endpoint_url": s3_endpoint}))
    record = store.commit("cache/text/fp/shard.safetensors", b"\x00" * 4096, rows=1)
    assert record["url"] == "s3://precast-test/root/cache/text/fp/shard.safetensors"
    assert store.verify("cache/text/fp/shard.safetensors")["size"] == 4096
    local = store.local_path("cache/text/fp/shard.safetensors", cache_dir=tmp_path)
    assert open(local, "rb").read() == b"\x00" * 4096
    with open(local, "wb") as handle:  # an earlier local copy that differs from the committed object
        handle.write(b"\x01" * 4096)
    assert open(store.local_path("cache/text/fp/shard.safetensors", cache_dir=tmp_path), "rb").read() == b"\x00" * 4096
    store.fs.pipe_file(store.path("cache/text/fp/shard.safetensors"), b"\x02" * 4096)  # damaged after its commit
    with pytest.raises(Damaged, match=r"shard\.safetensors is damaged"):
        store.local_path("cache/text/fp/shard.safetensors", cache_dir=tmp_path / "fresh")
    assert list((tmp_path / "fresh").rglob("*")) == [next((tmp_path / "fresh").iterdir())]  # no bad copy kept
    assert store.list("cache/text/fp", ".safetensors") == ["cache/text/fp/shard.safetensors"]


@pytest.mark.parametrize("scheme", ["s3", "flaky"])
def test_an_s3_store_sees_what_another_process_wrote_or_removed_after_it_listed(s3_endpoint, scheme):
    """A long-lived process (a Dask worker, a training run, a watcher) lists a folder; another
    process then writes into it and removes from it. The first process's next list, check and read
    see the bucket as it is now, not a listing it kept (fsspec keeps one per filesystem instance),
    also through `flaky://` wrapping S3."""
    import s3fs

    other = s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True)  # another process's client
    bucket = f"precast-listing-{scheme}"
    other.mkdir(bucket)
    s3 = {"endpoint_url": s3_endpoint}
    options = s3 if scheme == "s3" else {"target_protocol": "s3", "target_options": s3}
    store = Store(StorageConfig(root=f"{scheme}://{bucket}/root", options=options))
    store.commit("runs/r/metrics.jsonl", b"{}\n")
    assert store.list("runs/r") == ["runs/r/metrics.jsonl", "runs/r/metrics.jsonl.done"]
    assert store.find("runs") == ["runs/r/metrics.jsonl", "runs/r/metrics.jsonl.done"]
    other.pipe_file(f"{bucket}/root/runs/r/lineage.json", b'{"steps": 5}')
    other.pipe_file(f"{bucket}/root/runs/r/lineage.json.done", json_bytes({"sha256": "x"}))
    other.rm_file(f"{bucket}/root/runs/r/metrics.jsonl.done")
    assert store.list("runs/r") == ["runs/r/lineage.json", "runs/r/lineage.json.done", "runs/r/metrics.jsonl"]
    assert store.exists("runs/r/lineage.json") and store.read_json("runs/r/lineage.json") == {"steps": 5}
    assert store.committed("runs/r/lineage.json") == {"sha256": "x"}
    assert store.committed("runs/r/metrics.jsonl") is None and not store.exists("runs/r/metrics.jsonl.done")


def test_credentials_from_a_prefect_secret_block_never_reach_the_store(prefect_server, s3_endpoint, monkeypatch):
    import multiprocessing

    import s3fs
    from prefect.blocks.system import Secret

    import flows  # noqa: F401  the Prefect layer registers Secret blocks as the store's credentials

    s3fs.S3FileSystem(endpoint_url=s3_endpoint).mkdir("precast-block")
    Secret(value={"key": "AKIABLOCKKEY", "secret": "block-secret-value"}).save("precast-s3", overwrite=True)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    config = StorageConfig(root="s3://precast-block/root", options={"endpoint_url": s3_endpoint},
                           credentials_block="precast-s3")
    store = Store(config)
    assert store.fs.key == "AKIABLOCKKEY"  # the session signs with the block's credentials
    store.commit_json("a.json", {"ok": True})
    for key in store.fs.find("precast-block"):
        assert b"block-secret-value" not in store.fs.cat_file(key)
    assert "block-secret-value" not in config.model_dump_json()
    # a process given the config pickled (a training process, a Dask worker) signs with the same
    # credentials, without Prefect or a resolver of its own
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_signing_key, (config,)) == ("AKIABLOCKKEY", False)
    with pytest.raises(ValueError, match="no such Prefect Secret block"):
        Store(StorageConfig(root="s3://precast-block/root", credentials_block="missing-block"))


def _signing_key(config: StorageConfig) -> tuple[str, bool]:
    import sys

    return Store(config).fs.key, "prefect" in sys.modules


def test_credentials_are_resolved_once_by_the_registered_resolver_and_never_in_json(tmp_path, monkeypatch):
    import pickle

    from storage import store as module

    monkeypatch.setattr(module, "_credentials_resolver", None)
    config = StorageConfig(root=str(tmp_path), credentials_block="local-secret")
    with pytest.raises(ValueError, match="no credentials resolver"):
        Store(config)
    asked = []
    module.register_credentials(lambda name: asked.append(name) or {"auto_mkdir": True})
    Store(config)
    Store(config)
    assert asked == ["local-secret"] and config.credentials == {"auto_mkdir": True}
    assert "auto_mkdir" not in config.model_dump_json() and "auto_mkdir" not in repr(config)
    assert pickle.loads(pickle.dumps(config)).credentials == {"auto_mkdir": True}
    # a config sent as JSON (a child flow run's parameters) resolves them again in its process
    assert StorageConfig.model_validate_json(config.model_dump_json()).credentials is None
    module.register_credentials(lambda name: ["not", "options"])
    with pytest.raises(ValueError, match="must hold a JSON object"):
        Store(StorageConfig(root=str(tmp_path), credentials_block="local-secret"))


def test_cache_shards_are_byte_identical_for_the_same_content(tmp_path):
    # content-addressed caches must not depend on the writer: re-encoding gives the same checksum
    import torch

    from storage.shards import LatentShard, pack_latents, pack_ragged

    sequences = [torch.randn(3, 4), torch.randn(5, 4)]
    rows = {"a/0": 0, "b/0": 1}
    assert len({pack_ragged(rows, sequences, {"format": 1, "shard": "s"}) for _ in range(10)}) == 1
    # metadata built in another order (computed here, read back from JSON there) is the same content
    assert pack_ragged(rows, sequences, {"shard": "s", "format": 1}) == pack_ragged(rows, sequences, {"format": 1, "shard": "s"})
    buckets = {"256x256": {"mean": torch.randn(2, 4, 2, 2), "std": torch.rand(2, 4, 2, 2)}}
    latent_rows = {"a": ["256x256", 0], "b": ["256x256", 1]}
    packed = {pack_latents(buckets, latent_rows, {"posterior": "mean_std"}) for _ in range(10)}
    assert len(packed) == 1
    path = tmp_path / "latents.safetensors"
    path.write_bytes(packed.pop())  # still a valid safetensors file
    mean, std = LatentShard(str(path)).get("b")
    assert torch.equal(mean, buckets["256x256"]["mean"][1]) and torch.equal(std, buckets["256x256"]["std"][1])


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_lease_has_one_holder_until_released_dead_or_stale_whatever_the_clocks(where, tmp_path, s3_endpoint,
                                                                                   monkeypatch):
    import socket
    import subprocess
    import time

    from storage import lease as leases

    if where == "s3":
        import s3fs

        s3fs.S3FileSystem(endpoint_url=s3_endpoint).mkdir("precast-lease")
        store = Store(StorageConfig(root="s3://precast-lease/store", options={"endpoint_url": s3_endpoint}))
    else:
        store = Store(StorageConfig(root=str(tmp_path / "store")))
    monkeypatch.setattr(leases, "HEARTBEAT_SECONDS", 0.05)

    first, second = leases.Lease(store, "runs/r/lease"), leases.Lease(store, "runs/r/lease")
    assert first.acquire() and not second.acquire()
    assert second.holder()["token"] == first.me["token"]
    first.release()
    assert second.acquire()  # released: free at once
    second.release()

    def held_by(generation: int, **holder) -> None:  # another process's lease, written directly
        assert store.create(f"runs/r/lease/{generation:08d}.json", json_bytes(
            {"token": "other", "host": socket.gethostname(), "pid": os.getpid(), "heartbeat": time.time(), **holder}))

    # a holder of this host whose process is gone (a SIGKILLed worker) is taken over at once
    finished = subprocess.Popen(["true"])
    finished.wait()
    held_by(3, pid=finished.pid)
    third = leases.Lease(store, "runs/r/lease")
    assert third.acquire() and store.list("runs/r/lease") == ["runs/r/lease/00000004.json"]
    third.release()

    # a holder on another node is taken over once its beats have stood still for STALE_AFTER_SECONDS
    # on the contender's clock, whatever the holder's clock said: this dead one's ran 10 minutes ahead
    monkeypatch.setattr(leases, "STALE_AFTER_SECONDS", 2.0)
    held_by(5, host="lost-node", beats=7, heartbeat=time.time() + 600)
    fourth = leases.Lease(store, "runs/r/lease")
    assert not fourth.acquire()  # first seen: watched from now on
    time.sleep(2.5)
    assert fourth.acquire()

    # a live holder whose clock is 10 minutes behind keeps its lease: its beats advance
    class Behind(leases.Lease):
        def _record(self):
            return {**super()._record(), "heartbeat": time.time() - 600}

    behind, contender = Behind(store, "runs/s/lease"), leases.Lease(store, "runs/s/lease")
    assert behind.acquire()
    watched_until = time.monotonic() + 4.0
    while time.monotonic() < watched_until:
        assert not contender.acquire()
        time.sleep(0.2)
    behind.release()

    # ... and a holder that was taken over notices at its next heartbeat and stops writing
    held_by(7, host="other-node")
    deadline = time.time() + 10
    while not fourth.lost and time.time() < deadline:
        time.sleep(0.05)
    with pytest.raises(leases.LeaseLost, match="taken over by other-node"):
        fourth.check()
    fourth.release()
    assert store.read_json("runs/r/lease/00000007.json")["token"] == "other"  # the new holder's stays


def test_only_the_layout_spells_store_keys():
    """storage/layout.py is the one home of the store's keys: no other module spells one."""
    import re
    from pathlib import Path

    root = Path(__file__).parent.parent
    spelled = re.compile(r"""["'](runs|cache|shards|manifests|datasets|refs|prefect)/"""
                         r"|\}/(lineage\.json|checkpoints\b|samples\b|adapter[\"/]|transformer[\"/]|metrics\.jsonl"
                         r"|progress\.json|lease\b|config\.yaml|loss_curve\.png)")
    offenders = [f"{path.relative_to(root)}:{number}: {line.strip()}"
                 for folder in ("flows", "tasks", "storage", "benchmarks", "configs")
                 for path in sorted((root / folder).rglob("*.py")) if path.name != "layout.py"
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if spelled.search(line) and not line.lstrip().startswith("#")]
    assert offenders == []


def test_an_image_shard_compresses_every_column_but_the_compressed_images():
    """Image bytes (JPEG, PNG, WebP) are stored as they are; ids, sizes, captions and sources are
    zstd, nested captions included (pyarrow names a list column's codec by its leaf path)."""
    import io

    import pyarrow.parquet as pq

    from storage.shards import IMAGE_SHARD_SCHEMA, pack_image_shard

    row = {"sample_id": "a" * 64, "image": b"\xff\xd8" * 50, "width": 64, "height": 64,
           "captions": ["a red circle"] * 3, "source": "data/0.png"}
    group = pq.ParquetFile(io.BytesIO(pack_image_shard([row]))).metadata.row_group(0)
    codecs = {group.column(n).path_in_schema.split(".")[0]: group.column(n).compression
              for n in range(group.num_columns)}
    assert codecs == {name: "UNCOMPRESSED" if name == "image" else "ZSTD" for name in IMAGE_SHARD_SCHEMA.names}


def test_an_image_shard_written_before_a_column_existed_reads_without_it(tmp_path):
    """Shards of older stores lack the columns added since (`resolution`): asked for it, they are
    read without it, from their bytes or by ranged reads of the columns."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from storage.shards import read_image_shard

    buffer = io.BytesIO()
    pq.write_table(pa.table({"sample_id": ["a"], "captions": [["x"]]}), buffer)
    store = Store(StorageConfig(root=str(tmp_path / "store")))
    store.commit("shards/images/old.parquet", buffer.getvalue())
    wanted = ["sample_id", "captions", "resolution"]
    for table in (read_image_shard(buffer.getvalue(), wanted), store.read_columns("shards/images/old.parquet", wanted)):
        assert table.to_pylist() == [{"sample_id": "a", "captions": ["x"]}]
