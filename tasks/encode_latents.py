"""Stage 3 — encode-latents: VAE per image shard → posterior mean and std per aspect-ratio bucket.

Each image goes to the nearest ratio of diffusers' PixArt table for the configured resolution,
is resized to cover it and centre-cropped (PixArt's recipe), and encoded in batches that never mix
shapes. The posterior (mean, std) is stored unscaled so training samples a fresh latent each
epoch; the VAE's scaling factor is recorded in the shard and applied by the reader.
Output: `cache/latents/<vae_fp>/<shard_id>.safetensors`.
"""

from __future__ import annotations

import io
import logging
from collections import defaultdict
from typing import Any

import numpy as np
import torch
from PIL import Image
from prefect import task
from prefect.cache_policies import INPUTS

from configs.schema import LatentEncodingConfig, ModelConfig, StorageConfig
from storage.shards import bucket_name, pack_latents, read_image_shard, shard_id_of
from storage.store import Store
from tasks.models import DTYPES, LATENT_FORMAT, load_vae

log = logging.getLogger(__name__)


def bucket_table(resolution: int) -> dict[str, list[float]]:
    """diffusers' PixArt aspect-ratio table: height/width ratio → [height, width] in pixels."""
    from diffusers.pipelines.pixart_alpha.pipeline_pixart_alpha import (
        ASPECT_RATIO_256_BIN, ASPECT_RATIO_512_BIN, ASPECT_RATIO_1024_BIN,
    )
    from diffusers.pipelines.pixart_alpha.pipeline_pixart_sigma import ASPECT_RATIO_2048_BIN

    return {256: ASPECT_RATIO_256_BIN, 512: ASPECT_RATIO_512_BIN, 1024: ASPECT_RATIO_1024_BIN,
            2048: ASPECT_RATIO_2048_BIN}[resolution]


def nearest_ratio(width: int, height: int, resolution: int) -> str:
    """The table's height/width ratio key nearest the image's."""
    return min(bucket_table(resolution), key=lambda r: abs(float(r) - height / width))


def nearest_bucket(width: int, height: int, resolution: int) -> tuple[int, int]:
    """(height, width) of the table entry whose ratio is nearest the image's."""
    height_px, width_px = bucket_table(resolution)[nearest_ratio(width, height, resolution)]
    return int(height_px), int(width_px)


def preprocess(image_bytes: bytes, resolution: int) -> torch.Tensor:
    """Pixels the VAE sees: resized to cover the bucket, centre-cropped, scaled to [-1, 1], [3, H, W]."""
    with Image.open(io.BytesIO(image_bytes)) as opened:
        image = opened.convert("RGB")
    target_h, target_w = nearest_bucket(image.width, image.height, resolution)
    scale = max(target_h / image.height, target_w / image.width)
    resized_w, resized_h = max(target_w, round(image.width * scale)), max(target_h, round(image.height * scale))
    image = image.resize((resized_w, resized_h), Image.Resampling.BICUBIC)
    left, top = (resized_w - target_w) // 2, (resized_h - target_h) // 2
    image = image.crop((left, top, left + target_w, top + target_h))
    pixels = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1)
    return pixels.float().div(127.5).sub(1.0)


def latent_cache_key(fingerprint: str, shard_id: str) -> str:
    return f"cache/latents/{fingerprint}/{shard_id}.safetensors"


@torch.inference_mode()
def encode_latents_shard(
    storage: StorageConfig, model: ModelConfig, latents: LatentEncodingConfig, fingerprint: str, shard_url: str
) -> dict[str, Any]:
    """Encode every image of one shard; returns the latent cache shard's commit record."""
    store = Store(storage)
    shard_id = shard_id_of(shard_url)
    key = latent_cache_key(fingerprint, shard_id)
    if (record := store.committed(key)) is not None:
        return record
    table = read_image_shard(store.read_bytes(store.key(shard_url)), columns=["sample_id", "image"])
    by_shape: dict[tuple[int, int], list[tuple[str, torch.Tensor]]] = defaultdict(list)
    for sample in table.to_pylist():
        pixels = preprocess(sample["image"], latents.resolution)
        by_shape[tuple(pixels.shape[1:])].append((sample["sample_id"], pixels))

    vae = load_vae(model, latents.dtype, latents.device)
    store_dtype = DTYPES[latents.storage_dtype]
    buckets: dict[str, dict[str, torch.Tensor]] = {}
    rows: dict[str, tuple[str, int]] = {}
    for shape, items in sorted(by_shape.items()):
        means, stds = [], []
        for start in range(0, len(items), latents.batch_size):
            batch = torch.stack([p for _, p in items[start : start + latents.batch_size]])
            posterior = vae.encode(batch.to(vae.device, vae.dtype)).latent_dist
            mean, std = posterior.mean.float().cpu(), posterior.std.float().cpu()
            if not (torch.isfinite(mean).all() and torch.isfinite(std).all()):
                raise FloatingPointError(f"VAE produced non-finite latents in shard {shard_id} ({latents.dtype})")
            means.append(mean.to(store_dtype))
            stds.append(std.to(store_dtype))
        name = bucket_name(*means[0].shape[2:])
        buckets[name] = {"mean": torch.cat(means), "std": torch.cat(stds)}
        rows.update({sample_id: (name, index) for index, (sample_id, _) in enumerate(items)})
    meta = {
        "format": LATENT_FORMAT, "fingerprint": fingerprint, "shard": shard_id, "resolution": latents.resolution,
        "scaling_factor": vae.config.scaling_factor, "shift_factor": vae.config.get("shift_factor") or 0.0,
    }
    record = store.commit(
        key, pack_latents(buckets, rows, meta), shard=shard_id, samples=len(rows),
        buckets={name: len(parts["mean"]) for name, parts in buckets.items()},
    )
    log.info("encoded %d images of shard %s into %d buckets", len(rows), shard_id, len(buckets))
    return record


@task(name="encode-latents", cache_policy=INPUTS, persist_result=True, result_serializer="json")
def encode_latents_task(
    storage: StorageConfig, model: ModelConfig, latents: LatentEncodingConfig, fingerprint: str, shard_url: str
) -> dict[str, Any]:
    return encode_latents_shard(storage, model, latents, fingerprint, shard_url)
