"""Every stage in order, in this process, without Prefect: `precast run --direct`, and the
reference that benchmarks and test fixtures run. The Prefect flow (flows/pipeline.py) calls the
same stage functions as tasks, with retries, caching, placement and artifacts around them; both
return the same records and the same outputs.

    precast run configs/quickstart.yaml --direct
"""

from __future__ import annotations

import time
from typing import Any

from configs.schema import PipelineConfig, Stage
from storage import layout
from storage.store import Store
from tasks.encode.latents import encode_latents_shard, latent_cache_record
from tasks.encode.text import encode_prompts, encode_text_shard, measure_numerics, text_cache_record
from tasks.ingest.stage import ingest
from tasks.manifest import build_manifest
from tasks.encode.models import encoding_work, model_loads, text_encoder_fingerprint, vae_fingerprint
from tasks.train import train


def run_direct(config: PipelineConfig, until: Stage = "train") -> dict[str, Any]:
    """Run the stages up to `until`; returns each stage's record by name (every one has `url`,
    `amount` and `committed_at`, as in the flow), the encoders' fingerprints and `seconds`, each
    stage's wall time."""
    store = Store(config.storage)
    store.check_reachable()
    text_fp = text_encoder_fingerprint(config.model, config.text_encoding)
    vae_fp = vae_fingerprint(config.model, config.latent_encoding)
    done: dict[str, Any] = {"text_fingerprint": text_fp, "vae_fingerprint": vae_fp, "seconds": {}}

    def stage(name: Stage, work) -> bool:
        """Run one stage, record it; True when it is the last one asked for."""
        started = time.perf_counter()
        done[name] = work()
        done["seconds"][name] = time.perf_counter() - started
        return name == until

    if stage("ingest", lambda: ingest(config.storage, config.dataset)):
        return done
    urls = [store.url(layout.image_shard(shard["id"])) for shard in done["ingest"]["shards"]]
    text = (config.storage, config.model, config.text_encoding, text_fp)

    def shards(encode, prepare=lambda: None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """`prepare()`, then `encode(url)` for every shard, here; the records and the stage's
        encoding_work, counted from before `prepare` as the flow counts it."""
        started, before = time.time(), sum(model_loads().values())
        prepare()
        records = [encode(url) for url in urls]
        return records, encoding_work(records, started, 1, sum(model_loads().values()) - before)

    def encode_text() -> dict[str, Any]:
        prompts = {}

        def prepare() -> None:  # the prompts, then the precision check before any shard, as in the flow
            prompts.update(encode_prompts(*text, config.training.sample_prompts))
            measure_numerics(*text, urls[0] if urls else None)

        records, work = shards(lambda url: encode_text_shard(*text, url), prepare)
        return {**text_cache_record(store, text_fp, prompts, records), "work": work}

    def encode_latents() -> dict[str, Any]:
        records, work = shards(lambda url: encode_latents_shard(config.storage, config.model, config.latent_encoding,
                                                                vae_fp, url))
        return {**latent_cache_record(store, vae_fp, records), "work": work}

    if stage("encode-text", encode_text):
        return done
    if stage("encode-latents", encode_latents):
        return done
    if stage("manifest", lambda: build_manifest(config.storage, done["ingest"]["id"], text_fp, vae_fp,
                                                config.training.sample_prompts)):
        return done
    stage("train", lambda: train(config.storage, config.model, config.training, done["manifest"]["url"]))
    return done


def outputs(records: dict[str, Any]) -> dict[str, Any]:
    """What a whole pipeline run reports, from its stages' records (the flow's return value)."""
    run = records["train"]
    return {
        "dataset": records["ingest"]["url"],
        "text_cache": records["encode-text"]["url"],
        "latent_cache": records["encode-latents"]["url"],
        "manifest": records["manifest"]["url"],
        "run": run["run"],
        "weights": run["url"],  # the adapter, or the transformer of a full fine-tune
        "samples": run["samples"],
        "loss_curve": layout.run_part(run["run"], "loss_curve"),
        "final_loss": run["final_loss"],
        "first_loss": run["first_loss"],
        # what each stage cost: its seconds, and an encoder's workers, model loads and shards
        "stages": {name: {"seconds": round(seconds, 2), **(records[name].get("work") or {})}
                   for name, seconds in records["seconds"].items()},
    }
