"""The pipeline's stages called directly, in order, without Prefect: the reference for what the
stages themselves cost (shared by the training and end-to-end benchmarks)."""

from __future__ import annotations

import time
from typing import Any

from configs.schema import PipelineConfig


def run_stages(config: PipelineConfig, train: bool = True) -> tuple[dict[str, Any], dict[str, float]]:
    """Ingest, encode every shard (text, then latents), build the manifest and (with `train`)
    train. Returns the manifest's record and each stage's seconds."""
    from storage import layout
    from storage.store import Store
    from tasks.encode_latents import encode_latents_shard
    from tasks.encode_text import encode_prompts, encode_text_shard, measure_numerics
    from tasks.ingest import ingest
    from tasks.manifest import build_manifest
    from tasks.models import text_encoder_fingerprint, vae_fingerprint
    from tasks.train import train as train_run

    seconds: dict[str, float] = {}

    def timed(stage: str, work):
        started = time.perf_counter()
        result = work()
        seconds[stage] = time.perf_counter() - started
        return result

    store = Store(config.storage)
    dataset = timed("ingest", lambda: ingest(config.storage, config.dataset))
    urls = [store.url(layout.image_shard(shard["id"])) for shard in dataset["shards"]]
    text_fp = text_encoder_fingerprint(config.model, config.text_encoding)
    vae_fp = vae_fingerprint(config.model, config.latent_encoding)
    args = (config.storage, config.model, config.text_encoding, text_fp)
    timed("encode-text", lambda: [encode_prompts(*args, config.training.sample_prompts),
                                  measure_numerics(*args, urls[0] if urls else None)]
          + [encode_text_shard(*args, url) for url in urls])
    timed("encode-latents", lambda: [encode_latents_shard(config.storage, config.model, config.latent_encoding,
                                                          vae_fp, url) for url in urls])
    manifest = timed("manifest", lambda: build_manifest(config.storage, dataset["id"], text_fp, vae_fp,
                                                        config.training.sample_prompts))
    if train:
        timed("train", lambda: train_run(config.storage, config.model, config.training, manifest["url"]))
    return manifest, seconds
