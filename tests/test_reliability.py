"""Damage is found before use and named; partial writes are found and repaired; bad configs fail
before any work."""

from __future__ import annotations

import json

import pytest

from flows.cli import main
from storage import layout
from storage.store import Damaged, Store
from tasks.encode.latents import encode_latents_shard
from tasks.encode.text import encode_text_shard
from tasks.ingest.stage import ingest
from tasks.manifest import build_manifest
from tasks.identity import text_fingerprints, vae_fingerprint
from tasks.train import train
from tests.test_manifest_and_train import _cache_everything, kill_training_at


def _flip(store: Store, key: str) -> None:
    data = bytearray(store.read_bytes(key))
    data[len(data) // 2] ^= 0x10
    open(store.path(key), "wb").write(bytes(data))


def test_verify_finds_damage_partials_and_orphans_and_repairs_only_those(make_config, capsys):
    config = make_config(training={"steps": 2, "sample_prompts": [], "checkpoint_every": 1})
    dataset, text_fps, vae_fp = _cache_everything(config)
    manifest = build_manifest(config.storage, dataset["id"], text_fps, vae_fp, [])
    train(config.storage, config.model, config.training, manifest["url"])
    store = Store(config.storage)
    root = store.root_url

    assert main(["verify", root, "--json"]) == 0
    clean = json.loads(capsys.readouterr().out)
    assert clean["ok"] and clean["checked"] >= 12 and not (clean["partial"] or clean["orphaned"])

    damaged = layout.cache_shard("text", text_fps["t5"], dataset["shards"][0]["id"])
    _flip(store, damaged)
    store.write_bytes("shards/images/deadbeef.parquet", b"written, never committed")  # killed before its record
    (store_path := store.path("cache/latents/x.safetensors.partial-" + "0" * 32))
    open(store_path, "wb").write(b"half")
    assert main(["verify", root, "--json"]) == 3
    report = json.loads(capsys.readouterr().out)
    assert report["damaged"] == [{"key": damaged, "reason": "checksum mismatch"}]
    assert report["orphaned"] == ["shards/images/deadbeef.parquet"]
    assert report["partial"] == ["cache/latents/x.safetensors.partial-" + "0" * 32]

    before = set(store.fs.find(store.root_path))
    assert main(["verify", root, "--repair"]) == 3  # still damaged: repair never deletes committed data
    removed = before - set(store.fs.find(store.root_path))
    assert {store.key(store.fs.unstrip_protocol(p)) for p in removed} == {
        "shards/images/deadbeef.parquet", "cache/latents/x.safetensors.partial-" + "0" * 32}
    assert "damaged" in capsys.readouterr().out


@pytest.mark.parametrize("artifact", ["image shard", "text shard", "latent shard", "manifest", "checkpoint"])
def test_damage_is_detected_before_use_naming_the_artifact(make_config, artifact):
    config = make_config(training={"steps": 3, "sample_prompts": [], "checkpoint_every": 1})
    store = Store(config.storage)
    dataset = ingest(config.storage, config.dataset)
    shard = dataset["shards"][0]["id"]
    shard_url = store.url(f"shards/images/{shard}.parquet")
    text_fps = text_fingerprints(config.model, config.text_encoding)
    vae_fp = vae_fingerprint(config.model, config.latent_encoding)
    if artifact == "image shard":
        _flip(store, f"shards/images/{shard}.parquet")
        for encode, settings, fp in [(encode_text_shard, config.text_encoding, text_fps),
                                     (encode_latents_shard, config.latent_encoding, vae_fp)]:
            with pytest.raises(Damaged, match=f"shards/images/{shard}.parquet is damaged"):
                encode(config.storage, config.model, settings, fp, shard_url)
        return
    dataset, text_fps, vae_fp = _cache_everything(config)
    manifest = build_manifest(config.storage, dataset["id"], text_fps, vae_fp, [])
    if artifact in ("text shard", "latent shard"):
        kind = "text" if artifact == "text shard" else "latents"
        key = f"cache/{kind}/{text_fps['t5'] if kind == 'text' else vae_fp}/{shard}.safetensors"
    elif artifact == "manifest":
        key = store.key(manifest["url"])
    else:
        kill_training_at(config, manifest["url"], 3)
        key = next(store.key(store.fs.unstrip_protocol(p)) for p in store.fs.find(store.path("runs"))
                   if p.endswith("step-00000002.safetensors"))
    _flip(store, key)
    with pytest.raises(Damaged, match=key.replace(".", r"\.") + " is damaged"):
        train(config.storage, config.model, config.training, manifest["url"])
    assert not any(p.endswith("lineage.json") for p in store.fs.find(store.root_path))  # nothing trained on it


@pytest.mark.parametrize("override, field", [
    ("training.rank=0", "training.rank"),
    ("latent_encoding.resolution=300", "latent_encoding.resolution"),
    ("trainig.steps=3", "trainig"),
    ("training.steps=many", "training.steps"),
    ("execution.placement={train: nowhere}", "execution.placement"),
])
def test_bad_configuration_fails_before_any_work_naming_the_field(make_config, tmp_path, capsys, override, field):
    import yaml

    config = make_config()
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config.model_dump()))
    assert main(["run", str(path), "--set", override]) == 1
    assert field in capsys.readouterr().err
    assert not (tmp_path / "store").exists()  # not a single artifact written


def test_unreachable_storage_fails_before_any_work(prefect_server, make_config, tmp_path):
    from flows.pipeline import pipeline

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    config = make_config(root=str(blocker / "store"))
    with pytest.raises(ValueError, match="storage.root .* cannot be reached"):
        pipeline(config=config)
