"""Damage is found before use and named; partial writes are found and repaired; bad configs fail
before any work."""

from __future__ import annotations

import json
import re

import pyarrow.parquet as pq
import pytest
from huggingface_hub.constants import HF_HUB_CACHE

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


def _flip(store: Store, key: str, at: int | None = None) -> None:
    data = bytearray(store.read_bytes(key))
    data[len(data) // 2 if at is None else at] ^= 0x10
    open(store.path(key), "wb").write(bytes(data))


def _column_values(store: Store, key: str, column: str) -> int:
    """An offset in the middle of `column`'s values in a parquet artifact: its dictionary page (a
    page's header statistics, which no reader checks, are left alone)."""
    group = pq.ParquetFile(store.path(key)).metadata.row_group(0)
    chunk = next(group.column(index) for index in range(group.num_columns)
                 if group.column(index).path_in_schema.split(".")[0] == column)
    return (chunk.dictionary_page_offset + chunk.data_page_offset) // 2


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


@pytest.mark.parametrize("column, encoder", [("image", encode_latents_shard), ("captions", encode_text_shard),
                                             ("sample_id", encode_text_shard)])
def test_a_damaged_image_shard_is_found_by_the_encoder_that_reads_the_damaged_bytes(make_config, column, encoder):
    """The latent encoder reads a whole image shard and checks its sha256; the text encoder reads
    only its sample id and caption columns (not the images) and checks them against the shard's
    id, their hash. Either way, nothing is encoded from damaged bytes."""
    config = make_config()
    store = Store(config.storage)
    dataset = ingest(config.storage, config.dataset)
    key = layout.image_shard(dataset["shards"][0]["id"])
    _flip(store, key, _column_values(store, key, column))
    settings, fingerprint = ((config.text_encoding, text_fingerprints(config.model, config.text_encoding))
                             if encoder is encode_text_shard else
                             (config.latent_encoding, vae_fingerprint(config.model, config.latent_encoding)))
    dataset_id = (dataset["id"],) if encoder is encode_text_shard else ()
    with pytest.raises(Damaged, match=f"{key} is damaged"):
        encoder(config.storage, config.model, settings, fingerprint, *dataset_id, store.url(key))
    assert not store.find("cache")


@pytest.mark.parametrize("artifact", ["text shard", "latent shard", "manifest", "checkpoint"])
def test_damage_is_detected_before_use_naming_the_artifact(make_config, artifact):
    config = make_config(training={"steps": 3, "sample_prompts": [], "checkpoint_every": 1})
    store = Store(config.storage)
    dataset = ingest(config.storage, config.dataset)
    shard = dataset["shards"][0]["id"]
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
    ("training.lora.rank=0", "training.lora.rank"),
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


# --- a full disk ----------------------------------------------------------------------------------
def _full_ledger(monkeypatch):
    """The ingest ledger's SQLite file may not grow past its schema: SQLite's own "database or disk
    is full", as on a full TMPDIR."""
    from tasks.ingest.ledger import Ledger

    made = Ledger.__init__

    def capped(self, folder):
        made(self, folder)
        pages = self.db.execute("PRAGMA page_count").fetchone()[0]
        self.db.execute(f"PRAGMA max_page_count = {pages}")

    monkeypatch.setattr(Ledger, "__init__", capped)


def _full_where(monkeypatch, pattern: str):
    """Writes of files whose path holds `pattern` find no space left (ENOSPC)."""
    import errno
    from pathlib import Path

    write = Path.write_bytes

    def full(self, data):
        if pattern in str(self):
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return write(self, data)

    monkeypatch.setattr(Path, "write_bytes", full)


def _full_hub_cache(monkeypatch):
    """Every model load finds the disk full, as a download into a full hub cache does."""
    import errno

    from diffusers import ModelMixin
    from transformers import PreTrainedModel

    def full(cls, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    for base in (ModelMixin, PreTrainedModel):
        monkeypatch.setattr(base, "from_pretrained", classmethod(full))


@pytest.mark.parametrize("site, fill, named", [
    ("ingest's spill folder", lambda patch: _full_where(patch, "precast-ingest-"),
     r"precast-ingest-\w+/\w+: it needs [\d,.]+ MB \([\d,]+ B\)"),
    ("ingest's ledger", _full_ledger, r"ledger\.sqlite: it needs about 1 GB a million listed objects \(TMPDIR .*\)"),
    ("a checkpoint", lambda patch: _full_where(patch, "/checkpoints/"),
     r"checkpoints/step-00000002\.safetensors: it needs [\d,.]+ MB \([\d,]+ B\)"),
    ("a sample grid", lambda patch: _full_where(patch, "/samples/"),
     r"samples/step-000002\.png: it needs [\d,.]+ MB \([\d,]+ B\)"),
    ("the hub cache", _full_hub_cache, re.escape(f"{HF_HUB_CACHE}: it needs room for the model's files (HF_HOME / "
                                                 "HF_HUB_CACHE move the hub cache)")),
])
def test_a_full_disk_fails_naming_the_file_and_the_space_needed_and_the_rerun_completes_the_same(
        make_config, tmp_path, monkeypatch, site, fill, named):
    """A full disk at each place precast writes locally is the machine's fault, not an input's: the
    run fails with DiskFull naming the file, what it needed and what is free (an image is not
    quarantined for it), leaves no partial file, and once space is free the plain re-run gives
    every artifact a clean run's sha256."""
    from storage.store import DiskFull
    from storage.verify import verify_store
    from tasks.runner import run_direct
    from tests.test_faults import committed_checksums

    settings = {"training": {"steps": 4, "checkpoint_every": 2, "sample_every": 2, "sample_steps": 2}}
    clean = make_config(root=str(tmp_path / "clean"), **settings)
    run_direct(clean)
    config = make_config(root=str(tmp_path / "full"), **settings)
    with monkeypatch.context() as patch:
        fill(patch)
        with pytest.raises(DiskFull, match=named + r", [\d,.]+ MB \([\d,]+ B\) free there"):
            run_direct(config)
    store = Store(config.storage)
    report = verify_store(store)
    assert report["damaged"] == [] and report["partial"] == [], report
    run_direct(config)
    assert committed_checksums(store) == committed_checksums(Store(clean.storage))
