"""Ingest: content-addressed shards, quarantine with reasons, append-only re-runs."""

from __future__ import annotations

import io
import shutil

from PIL import Image

from storage.shards import read_image_shard
from storage.store import Store
from tasks.ingest import ingest


def _png(size=(128, 96), color=(200, 30, 30), mode="RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def _corpus(folder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "good.png").write_bytes(_png())
    (folder / "good.txt").write_text("a red square\n\nthe same, said differently\n")
    (folder / "nested").mkdir()
    (folder / "nested" / "alpha.png").write_bytes(_png(mode="RGBA", color=(0, 0, 255, 128)))
    (folder / "nested" / "alpha.txt").write_text("\ufeffa  blue   square ")
    (folder / "copy.png").write_bytes(_png())  # same bytes as good.png: kept once
    (folder / "copy.txt").write_text("a crimson square")
    (folder / "nocaption.png").write_bytes(_png(color=(1, 2, 3)))
    (folder / "empty.png").write_bytes(_png(color=(4, 5, 6)))
    (folder / "empty.txt").write_text("   \n")
    (folder / "broken.png").write_bytes(_png(color=(7, 8, 9))[:60])
    (folder / "broken.txt").write_text("truncated file")
    (folder / "tiny.png").write_bytes(_png(size=(20, 20)))
    (folder / "tiny.txt").write_text("too small")
    (folder / "zero.png").write_bytes(b"")
    (folder / "zero.txt").write_text("zero bytes")
    (folder / "thin.png").write_bytes(_png(size=(600, 100)))
    (folder / "thin.txt").write_text("beyond 1:4")
    (folder / "latin1.png").write_bytes(_png(color=(9, 9, 9)))
    (folder / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    return folder


def test_ingest_validates_and_quarantines(tmp_path, make_config):
    config = make_config(source=str(_corpus(tmp_path / "src")))
    result = ingest(config.storage, config.dataset)
    store = Store(config.storage)
    assert result["samples"] == 2
    reasons = sorted(q["reason"] for q in store.read_json(f"quarantine/{result['id']}.json"))
    assert reasons == ["aspect_ratio", "caption_encoding", "empty_caption", "empty_file", "missing_caption",
                       "too_small", "unreadable"]
    rows = read_image_shard(store.read_bytes(f"shards/images/{result['shards'][0]['id']}.parquet")).to_pylist()
    captions = sorted(tuple(r["captions"]) for r in rows)
    # duplicates merge their captions in path order (copy.png before good.png)
    assert captions == [("a blue square",), ("a crimson square", "a red square", "the same, said differently")]
    alpha = next(r for r in rows if r["captions"] == ["a blue square"])
    decoded = Image.open(io.BytesIO(alpha["image"]))
    assert decoded.mode == "RGB" and decoded.getpixel((0, 0)) == (127, 127, 255)  # alpha over white


def test_reingest_is_a_no_op_and_new_data_goes_to_new_shards(tmp_path, make_config, demo_data):
    source = tmp_path / "src"
    shutil.copytree(demo_data, source)
    config = make_config(source=str(source))
    first = ingest(config.storage, config.dataset)
    store = Store(config.storage)
    shard_files = set(store.list("shards/images", ".parquet"))
    assert first["samples"] == 24 and first["new_shards"] == 3

    again = ingest(config.storage, config.dataset)
    assert again["id"] == first["id"] and again["new_shards"] == 0
    assert set(store.list("shards/images", ".parquet")) == shard_files

    (source / "extra.png").write_bytes(_png(color=(10, 200, 10)))
    (source / "extra.txt").write_text("a green square")
    grown = ingest(config.storage, config.dataset)
    assert grown["id"] != first["id"] and grown["new_shards"] == 1 and grown["samples"] == 25
    new_shards = set(store.list("shards/images", ".parquet")) - shard_files
    assert len(new_shards) == 1
    rows = read_image_shard(store.read_bytes(new_shards.pop())).to_pylist()
    assert [r["captions"] for r in rows] == [["a green square"]]

    # an edited caption supersedes the old record without rewriting its shard
    (source / "00000.txt").write_text("a new caption for the first image\n")
    edited = ingest(config.storage, config.dataset)
    assert edited["samples"] == 25 and edited["new_shards"] == 1
    partial = [s for s in edited["shards"] if s["samples"] is not None]
    assert len(partial) == 1 and len(partial[0]["samples"]) == 9


def test_unreachable_source_names_it(tmp_path, make_config):
    import pytest

    config = make_config(source=str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match="missing"):
        ingest(config.storage, config.dataset)
