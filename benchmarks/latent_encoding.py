"""Latent encoding: precast's stage vs a plain loop, and bytes per sample vs a `.npy` per sample.

One run, one VAE, the same images:
- plain loop: PIL open, resize and centre-crop to the bucket, one image per `vae.encode` call;
- precast: `encode_latents_shard` over the ingested shards (bucket-grouped batches, next batch
  decoded while the VAE runs, posterior mean+std stored in fp16).
Bytes per sample: precast's shard size / samples vs one `.npy` per sample holding mean and std
(8 channels, float32), as the reference training scripts' feature extraction stores them. The VAE is randomly initialised (SD-style, 8x downsampling)
and loaded through `from_pretrained`. Usage: python -m benchmarks.latent_encoding [--count 96]
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from configs.schema import DatasetConfig, LatentEncodingConfig, ModelConfig, SourceConfig, StorageConfig
from tasks.demo.data import write_demo_data
from storage import layout
from storage.store import Store
from tasks.encode.latents import crop_box, encode_latents_shard, preprocess
from tasks.ingest.stage import ingest
from tasks.encode.models import load_vae
from tasks.demo.models import write_model_index
from tasks.families import family_of
from tasks.identity import vae_fingerprint


def make_vae(folder: Path, width: int) -> Path:
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1, norm_num_groups=32,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(width, width * 2, width * 4, width * 4), scaling_factor=0.13025,
    ).save_pretrained(folder / "vae")
    write_model_index(folder)
    return folder


@torch.inference_mode()
def plain_loop(files: list[Path], vae, table: dict[str, list[float]]) -> list[bytes]:
    """One image per call, as a simple feature-extraction script does; returns the .npy bytes."""
    stored = []
    for path in files:
        data = path.read_bytes()
        from PIL import Image

        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
        pixels, _ = preprocess(data, crop_box(table, width, height, "center", 0, ""))
        posterior = vae.encode(pixels[None]).latent_dist
        moments = torch.cat([posterior.mean, posterior.std], dim=1)[0].numpy()
        buffer = io.BytesIO()
        np.save(buffer, moments)
        stored.append(buffer.getvalue())
    return stored


def run(count: int = 96, width: int = 32, resolution: int = 256, batch: int = 1, repeat: int = 3) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = ModelConfig(path=str(make_vae(tmp / "model", width)))
        data = write_demo_data(tmp / "data", count=count)
        storage = StorageConfig(root=str(tmp / "store"))
        dataset = ingest(storage, DatasetConfig(sources=[SourceConfig(path=str(data))], shard_size=32))
        settings = LatentEncodingConfig(resolution=resolution, batch_size=batch, device="cpu")
        vae = load_vae(model, family_of(model), settings.dtype, settings.device)
        files = sorted(p for p in data.iterdir() if p.suffix in (".png", ".jpg"))
        table = family_of(model).codec.bucket_table(resolution)
        plain_loop(files[:4], vae, table)  # warm-up

        store = Store(storage)
        plain_s = precast_s = float("inf")
        fingerprint = vae_fingerprint(model, settings)
        for _ in range(repeat):  # alternate the two, keep each one's best: a noisy machine hurts both
            started = time.perf_counter()
            npy = plain_loop(files, vae, table)
            plain_s = min(plain_s, time.perf_counter() - started)

            if store.exists("cache"):  # encode for real every round
                store.fs.rm(store.path("cache"), recursive=True)
            started = time.perf_counter()
            records = [encode_latents_shard(storage, model, settings, fingerprint,
                                            store.url(layout.image_shard(shard["id"])))
                       for shard in dataset["shards"]]
            precast_s = min(precast_s, time.perf_counter() - started)
    samples = sum(r["samples"] for r in records)
    assert samples == len(files) == count
    return {
        "images": count, "resolution": resolution, "vae_width": width, "batch": batch,
        "images_per_s": {"plain_loop": round(count / plain_s, 2), "precast": round(count / precast_s, 2)},
        "precast_vs_plain": round(plain_s / precast_s, 2),
        "bytes_per_sample": {"npy_fp32_mean_std": round(sum(map(len, npy)) / len(npy)),
                             "precast_fp16_mean_std": round(sum(r["size"] for r in records) / samples)},
        "precast_bytes_vs_npy": round(sum(r["size"] for r in records) / samples / (sum(map(len, npy)) / len(npy)), 3),
    }


def rows(result: dict) -> list[tuple[str, str, str, str]]:
    speed, size = result["images_per_s"], result["bytes_per_sample"]
    return [
        ("latent encoding", f"{speed['precast']:,.1f} img/s",
         f"{result['precast_vs_plain']}x a one-image-per-call loop ({speed['plain_loop']:,.1f} img/s, VAE batch "
         f"{result['batch']})", ""),
        ("latent cache size", f"{size['precast_fp16_mean_std']:,} B/sample",
         f"{result['precast_bytes_vs_npy']:.1%} of a float32 .npy per sample ({size['npy_fp32_mean_std']:,} B)", ""),
    ]

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=96)
    parser.add_argument("--width", type=int, default=32, help="channels of the VAE's first block")
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1, help="VAE batch (on a CPU, 1 is fastest)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(run(**vars(args))))


if __name__ == "__main__":
    main()
