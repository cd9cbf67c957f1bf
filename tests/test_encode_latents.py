"""encode-latents: PixArt buckets, faithful preprocessing, posterior layouts, safe precision."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKL
from PIL import Image

from storage import layout
from storage.shards import LatentShard, read_image_shard, read_latent_rows
from storage.store import Store
from tasks.encode import latents as encode_latents
from tasks.encode.latents import crop_box, encode_latents_shard, preprocess
from tasks.families.pixart import ALPHA, SIGMA
from tasks.ingest.stage import ingest
from tasks.identity import vae_fingerprint

ROOT = Path(__file__).parent.parent


def _encode(config, dataset=None, **settings):
    dataset = dataset or ingest(config.storage, config.dataset)
    store = Store(config.storage)
    latents = config.latent_encoding.model_copy(update=settings)
    fingerprint = vae_fingerprint(config.model, latents)
    shard = dataset["shards"][0]["id"]
    record = encode_latents_shard(config.storage, config.model, latents, fingerprint,
                                  store.url(f"shards/images/{shard}.parquet"))
    cache = LatentShard(store.local_path(layout.cache_shard("latents", fingerprint, shard)))
    rows = read_image_shard(store.read_bytes(f"shards/images/{shard}.parquet")).to_pylist()
    return record, cache, rows, latents


def _direct(vae, row, latents):
    box = crop_box(bucket_table(latents.resolution), row["width"], row["height"], latents.crop, latents.crop_seed,
                   row["sample_id"])
    pixels, _ = preprocess(row["image"], box)
    with torch.no_grad():
        return vae.encode(pixels[None]).latent_dist, pixels


@pytest.mark.parametrize("posterior", ["mean_std", "mean_logvar", "mean"])
def test_cached_posterior_equals_a_direct_vae_encode(make_config, tiny_models, posterior):
    config = make_config()
    record, cache, rows, latents = _encode(config, posterior=posterior, flip=True)
    assert len(record["buckets"]) > 1  # varied aspect ratios land in several buckets
    vae = AutoencoderKL.from_pretrained(tiny_models, subfolder="vae").eval()
    assert cache.meta["scaling_factor"] == vae.config.scaling_factor
    for row in rows:
        direct, pixels = _direct(vae, row, latents)
        height, width = pixels.shape[1:]
        mean, std = cache.get(row["sample_id"])
        assert mean.shape == (4, height // 8, width // 8)
        torch.testing.assert_close(mean, direct.mean[0], rtol=1e-4, atol=1e-5)
        if posterior == "mean":
            assert std is None
        else:
            torch.testing.assert_close(std, direct.std[0], rtol=1e-4, atol=1e-5)
        with torch.no_grad():  # the flipped twin is the posterior of the mirrored pixels
            flipped = vae.encode(pixels.flip(-1)[None]).latent_dist
        torch.testing.assert_close(cache.get(row["sample_id"], flipped=True)[0], flipped.mean[0], rtol=1e-4, atol=1e-5)


bucket_table = SIGMA.codec.bucket_table  # the demo model's family


def test_the_bucket_tables_are_diffusers_own():
    """Read from diffusers' source without importing its pipelines: the same tables as the modules
    PixArt's pipelines use, imported (in a fresh interpreter, which also shows that reading them
    imports neither diffusers' pipelines nor transformers)."""
    from diffusers.pipelines.pixart_alpha import pipeline_pixart_alpha, pipeline_pixart_sigma

    for resolution in (256, 512, 1024):
        assert bucket_table(resolution) == getattr(pipeline_pixart_alpha, f"ASPECT_RATIO_{resolution}_BIN")
    assert bucket_table(2048) == pipeline_pixart_sigma.ASPECT_RATIO_2048_BIN
    assert ALPHA.codec.bucket_table(1024) == bucket_table(1024)
    with pytest.raises(ValueError, match="latent_encoding.resolution 2048: PixArt-α has aspect-ratio buckets for 256, 512, 1024 only"):
        ALPHA.codec.bucket_table(2048)
    probe = ("import sys; from tasks.families.pixart import SIGMA; SIGMA.codec.bucket_table(1024); "
             "print(sorted(m for m in sys.modules if m.startswith(('diffusers.pipelines', 'transformers.models'))))")
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]", loaded.stdout


def test_every_256_bucket_round_trips(make_config, tmp_path):
    table = bucket_table(256)
    source = tmp_path / "buckets"
    source.mkdir()
    for i, ratio in enumerate(table):
        height, width = (int(v) for v in table[ratio])
        Image.new("RGB", (width * 2, height * 2), (i * 7 % 255, 90, 160)).save(source / f"{i:02d}.png")
        (source / f"{i:02d}.txt").write_text(f"bucket {ratio}")
    config = make_config(source=str(source), dataset={"shard_size": 64, "min_side": 16})
    record, cache, rows, _ = _encode(config)
    assert len(rows) == len(table) and len(record["buckets"]) == len(table)
    for row in rows:
        ratio = row["captions"][0].removeprefix("bucket ")
        height, width = (int(v) for v in table[ratio])
        assert cache.get(row["sample_id"])[0].shape == (4, height // 8, width // 8)
        assert cache.rows[row["sample_id"]][0] == f"{height // 8}x{width // 8}"


def test_random_crops_are_seeded_and_recorded(make_config):
    config = make_config()
    _, center, rows, _ = _encode(config)
    _, random_a, _, _ = _encode(config, crop="random", crop_seed=1)
    _, random_b, _, _ = _encode(config, crop="random", crop_seed=1)
    boxes = random_a.meta["crop_boxes"]
    assert boxes == random_b.meta["crop_boxes"]
    assert any(boxes[r["sample_id"]] != center.meta["crop_boxes"][r["sample_id"]] for r in rows)


def test_fingerprint_covers_what_changes_latents_only(make_config):
    config = make_config()
    settings = config.latent_encoding
    base = vae_fingerprint(config.model, settings)
    for change in [{"resolution": 512}, {"crop": "random"}, {"posterior": "mean"}, {"flip": True},
                   {"storage_dtype": "bf16"}, {"dtype": "bf16"}, {"tiling": True}]:
        assert vae_fingerprint(config.model, settings.model_copy(update=change)) != base, change
    for same in [{"batch_size": 1}, {"slicing": True}, {"device": "cpu"}, {"crop_seed": 5}]:
        assert vae_fingerprint(config.model, settings.model_copy(update=same)) == base, same


def test_fp16_overflow_falls_back_to_fp32(make_config, tiny_models, tmp_path):
    hot = tmp_path / "hot-vae"
    shutil.copytree(tiny_models, hot)
    vae = AutoencoderKL.from_pretrained(hot, subfolder="vae")
    with torch.no_grad():
        vae.encoder.conv_in.weight.mul_(1e6)  # activations far beyond fp16's 65504
    vae.save_pretrained(hot / "vae")
    config = make_config()
    config = config.model_copy(update={"model": config.model.model_copy(update={"path": str(hot)})})
    half = AutoencoderKL.from_pretrained(hot, subfolder="vae", torch_dtype=torch.float16)
    record, cache, rows, latents = _encode(config, dtype="fp16")
    with torch.no_grad():
        assert not half.encode(preprocess(rows[0]["image"], cache.meta["crop_boxes"][rows[0]["sample_id"]])[0][None]
                               .half()).latent_dist.mean.isfinite().all()  # the trap is real
    assert record["samples"] == len(rows) and record["quarantined"] == []
    for row in rows:
        direct, _ = _direct(vae, row, latents)
        mean, std = cache.get(row["sample_id"])
        assert mean.isfinite().all() and std.isfinite().all()
        torch.testing.assert_close(mean.float(), direct.mean[0], rtol=1e-2, atol=1e-2)


def test_a_non_finite_sample_is_quarantined_alone(make_config, monkeypatch):
    config = make_config()
    dataset = ingest(config.storage, config.dataset)
    store = Store(config.storage)
    rows = read_image_shard(store.read_bytes(f"shards/images/{dataset['shards'][0]['id']}.parquet")).to_pylist()
    real = encode_latents.encode_pixels
    poisoned = {}

    def poison_first_row(vae, pixels):
        mean, logvar = real(vae, pixels)
        if not poisoned:
            poisoned["pixels"] = pixels[0].clone()
        for i in range(len(pixels)):
            if torch.equal(pixels[i], poisoned["pixels"]):
                mean[i] = float("nan")
        return mean, logvar

    monkeypatch.setattr(encode_latents, "encode_pixels", poison_first_row)
    record, cache, _, _ = _encode(config, dataset)
    assert len(record["quarantined"]) == 1 and record["quarantined"][0]["reason"] == "non_finite_latent"
    assert record["samples"] == len(rows) - 1
    bad = record["quarantined"][0]["sample_id"]
    assert bad not in cache and all(cache.get(r["sample_id"])[0].isfinite().all() for r in rows if r["sample_id"] != bad)


def test_prefetch_overlaps_loading_and_keeps_order():
    import threading

    from tasks.prefetch import prefetched

    loaded_in = []

    def load(item):
        loaded_in.append(threading.current_thread().name)
        return torch.tensor(item)

    assert [int(t) for t in prefetched(load, [3, 1, 2], ahead=1)] == [3, 1, 2]
    assert all(name != threading.current_thread().name for name in loaded_in)  # loaded in the background
    loaded_in.clear()
    assert [int(t) for t in prefetched(load, [3, 1], ahead=0)] == [3, 1]
    assert set(loaded_in) == {threading.current_thread().name}
    for ahead in (1, 3):  # an endless source is fine: `ahead` items read ahead at most
        loaded_in.clear()
        endless = prefetched(load, iter(int, 1), ahead=ahead)
        assert [int(next(endless)) for _ in range(3)] == [0, 0, 0]
        assert len(loaded_in) <= 3 + ahead
        endless.close()
    loaded_in.clear()
    reader = prefetched(load, range(10), ahead=3)
    assert int(next(reader)) == 0
    time.sleep(0.2)
    assert len(loaded_in) == 4  # the item asked for and three ahead of it
    reader.close()

    # a GPU's feed: several threads decode at once (each batch here takes 0.2 s), still in order
    def slow(item):
        time.sleep(0.2 if item % 2 else 0.1)
        return load(item)

    loaded_in.clear()
    began = time.perf_counter()
    assert [int(t) for t in prefetched(slow, range(8), ahead=4, threads=4)] == list(range(8))
    assert time.perf_counter() - began < 0.8 and len(set(loaded_in)) == 4  # 1.2 s one after another


@pytest.mark.parametrize("root", ["local", "s3"])
def test_recaptioning_encodes_the_captions_again_and_copies_every_latent(make_config, demo_data, tmp_path, root,
                                                                         request):
    """The commonest dataset change after adding images: every caption given a trigger word. The
    re-captioned samples go to new image shards (a shard is its records), whose captions are encoded
    again; their latents are copied from the shards that hold the same images, bit for bit, and only
    an image new to the store is encoded. A new resolution then encodes latents again and no text."""
    from tasks.runner import run_direct

    data = tmp_path / "data"
    shutil.copytree(demo_data, data)
    where = {}
    if root == "s3":  # the holders' rows are ranged reads of an object store
        import s3fs

        endpoint = request.getfixturevalue("s3_endpoint")
        s3fs.S3FileSystem(endpoint_url=endpoint).mkdir("precast-recaption")
        where = {"root": "s3://precast-recaption/store", "storage": {"options": {"endpoint_url": endpoint}}}
    config = make_config(source=str(data), **where)
    first = run_direct(config, until="encode-latents")
    for caption in data.glob("*.txt"):
        caption.write_text("sks " + caption.read_text())
    Image.new("RGB", (320, 192), (12, 200, 40)).save(data / "new.png")
    (data / "new.png").with_suffix(".txt").write_text("sks a green picture")

    again = run_direct(config, until="encode-latents")
    samples = again["ingest"]["samples"]
    assert again["ingest"]["new_samples"] == samples == first["ingest"]["samples"] + 1
    assert again["encode-text"]["work"]["samples_encoded"] == samples
    work = again["encode-latents"]["work"]
    assert (work["samples_encoded"], work["samples_copied"]) == (1, samples - 1), work
    assert work["shards_encoded"] == len(again["ingest"]["shards"])  # each new shard written, by copying

    store = Store(config.storage)
    fingerprint = again["vae_fingerprint"]

    def latents_of(dataset) -> dict[str, tuple]:  # {sample_id: ((bucket, parts), crop box)}, as stored
        stored = {}
        for shard in dataset["shards"]:
            key = layout.cache_shard("latents", fingerprint, shard["id"])
            cache = LatentShard(store.local_path(key))
            rows, _ = read_latent_rows(store, key, store.committed(key)["size"], cache.meta["crop_boxes"])
            stored |= {sample_id: (row, cache.meta["crop_boxes"][sample_id]) for sample_id, row in rows.items()}
            for sample_id, (bucket, parts) in rows.items():  # the ranged reads are the tensors the reader gives
                mean, _ = cache.get(sample_id)
                assert torch.equal(parts["mean"][0], mean)
        return stored

    before, after = latents_of(first["ingest"]), latents_of(again["ingest"])
    assert set(before) < set(after) and len(after) == len(before) + 1  # and the new image
    for sample_id, ((bucket, parts), box) in before.items():
        (bucket_after, parts_after), box_after = after[sample_id]
        assert (bucket_after, box_after, parts_after.keys()) == (bucket, box, parts.keys())
        assert all(torch.equal(parts[part], parts_after[part]) for part in parts)

    # a text stage's records: one a shard for each encoder (FLUX.1's CLIP and T5), its samples counted once
    from tasks.encode.models import encoding_work

    records = [{"shard": shard, "samples": 10, "committed_at": 1.0} for shard in ("a", "b") for _ in range(2)]
    assert encoding_work(records, 0.0, 1, 2)["samples_encoded"] == 20

    bigger = make_config(source=str(data), latent_encoding={"resolution": 512}, **where)
    resized = run_direct(bigger, until="encode-latents")
    assert resized["encode-text"]["work"]["shards_encoded"] == 0
    assert resized["encode-latents"]["work"]["samples_encoded"] == samples
