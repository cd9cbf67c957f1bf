"""The store: atomic writes, commit records, checksums, and the same behaviour on S3."""

from __future__ import annotations

import os

import pytest

from configs.schema import StorageConfig
from storage.store import ArtifactMissing, Store


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
    with pytest.raises(ValueError, match=r"shards/x\.parquet is damaged"):
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
    assert store.list("cache/text/fp", ".safetensors") == ["cache/text/fp/shard.safetensors"]


def test_credentials_from_a_prefect_secret_block_never_reach_the_store(prefect_server, s3_endpoint, monkeypatch):
    import s3fs
    from prefect.blocks.system import Secret

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
    with pytest.raises(ValueError, match="no such Prefect Secret block"):
        Store(StorageConfig(root="s3://precast-block/root", credentials_block="missing-block"))
