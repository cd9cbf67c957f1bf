"""encode-latents: cached posteriors equal a direct AutoencoderKL.encode of the same pixels."""

from __future__ import annotations

import io

import pytest
import torch
from diffusers import AutoencoderKL
from PIL import Image

from storage.shards import LatentShard, read_image_shard
from storage.store import Store
from tasks.encode_latents import bucket_table, encode_latents_shard, latent_cache_key, nearest_bucket, preprocess
from tasks.ingest import ingest
from tasks.models import vae_fingerprint


def test_cached_latents_equal_a_direct_vae_encode(make_config, tiny_models):
    config = make_config()
    dataset = ingest(config.storage, config.dataset)
    store = Store(config.storage)
    fingerprint = vae_fingerprint(config.model, config.latent_encoding)
    shard = dataset["shards"][0]["id"]
    record = encode_latents_shard(config.storage, config.model, config.latent_encoding, fingerprint,
                                  store.url(f"shards/images/{shard}.parquet"))
    assert len(record["buckets"]) > 1  # varied aspect ratios land in several buckets
    cache = LatentShard(store.local_path(latent_cache_key(fingerprint, shard)))
    assert cache.meta["scaling_factor"] == pytest.approx(0.13025)
    vae = AutoencoderKL.from_pretrained(tiny_models, subfolder="vae").eval()
    for row in read_image_shard(store.read_bytes(f"shards/images/{shard}.parquet")).to_pylist():
        pixels = preprocess(row["image"], 256)
        height, width = nearest_bucket(row["width"], row["height"], 256)
        assert pixels.shape == (3, height, width)
        with torch.no_grad():
            posterior = vae.encode(pixels[None]).latent_dist
        mean, std = cache[row["sample_id"]]
        assert mean.shape == (4, height // 8, width // 8)
        torch.testing.assert_close(mean, posterior.mean[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(std, posterior.std[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("ratio", sorted(bucket_table(256), key=float))
def test_every_256_bucket_round_trips(ratio):
    height, width = (int(v) for v in bucket_table(256)[ratio])
    image = Image.new("RGB", (width * 2, height * 2), (10, 20, 30))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    assert nearest_bucket(width * 2, height * 2, 256) == (height, width)
    assert preprocess(buffer.getvalue(), 256).shape == (3, height, width)
