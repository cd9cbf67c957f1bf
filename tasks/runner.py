"""The stage order and what passes between the stages, Prefect-free: `run_stages` runs
`configs.schema.STAGES` in order through an executor, one method per stage, handing each the
records it needs (`INPUTS`). The executor decides where a stage runs: `Direct`, every stage in
this process (`precast run --direct`, and the reference that benchmarks and test fixtures run),
or the Prefect flow's (flows/stages.py), which calls the same stage functions as tasks, with
retries, caching, placement and artifacts around them; both return the same records and the same
outputs.

    precast run configs/quickstart.yaml --direct
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from configs.schema import STAGES, PipelineConfig, Stage
from storage import layout
from storage.store import Store
from tasks.encode.latents import encode_latents_shard, latent_cache_record
from tasks.encode.text import encode_prompts, encode_text_shard, measure_numerics, text_cache_record
from tasks.ingest.stage import ingest
from tasks.manifest import build_manifest
from tasks.encode.models import encoding_work, model_loads
from tasks.identity import text_fingerprints, vae_fingerprint
from tasks.records import (
    CacheRecord, DatasetRecord, EncodingWork, ManifestRecord, Record, Records, RunRecord,
)
from tasks.train import train


class Executor(Protocol):
    """Where the stages run: one method per stage (its name with `_` for `-`), given the records of
    the earlier stages it reads (`INPUTS`)."""

    def ingest(self) -> DatasetRecord: ...

    def encode_text(self, dataset: DatasetRecord) -> CacheRecord: ...

    def encode_latents(self, dataset: DatasetRecord) -> CacheRecord: ...

    def manifest(self, dataset: DatasetRecord) -> ManifestRecord: ...

    def train(self, manifest: ManifestRecord) -> RunRecord: ...


# the earlier records each stage is given; the order the stages run in is STAGES'
INPUTS: dict[Stage, tuple[Stage, ...]] = {
    "ingest": (), "encode-text": ("ingest",), "encode-latents": ("ingest",), "manifest": ("ingest",),
    "train": ("manifest",),
}
# wraps each stage's call: `watch(name, call)` returns `call()` (the flow's logs a failing stage's name)
Watch = Callable[[Stage, Callable[[], Record]], Record]


def stage_method(executor: Executor, name: Stage) -> Callable[..., Record]:
    return getattr(executor, name.replace("-", "_"))


def run_stages(executor: Executor, until: Stage = "train", watch: Watch = lambda name, call: call()) -> Records:
    """Run the stages up to `until` in order through `executor`; returns each stage's record by
    name (every one has `url`, `amount` and `committed_at`) and `seconds`, each stage's wall time."""
    records: Any = {"seconds": {}}
    for name in STAGES[: STAGES.index(until) + 1]:
        inputs = [records[earlier] for earlier in INPUTS[name]]
        started = time.perf_counter()
        records[name] = watch(name, partial(stage_method(executor, name), *inputs))
        records["seconds"][name] = time.perf_counter() - started
    return records


def image_shard_urls(store: Store, dataset: DatasetRecord) -> list[str]:
    """The URLs of a dataset's image shards, what the encoders take."""
    return [store.url(layout.image_shard(shard["id"])) for shard in dataset["shards"]]


class Direct:
    """Every stage in this process, shard after shard; the encoders' fingerprints computed once."""

    def __init__(self, config: PipelineConfig):
        self.config, self.store = config, Store(config.storage)
        self.store.check_reachable()
        self.text_fps = text_fingerprints(config.model, config.text_encoding)
        self.vae_fp = vae_fingerprint(config.model, config.latent_encoding)

    def ingest(self) -> DatasetRecord:
        return ingest(self.config.storage, self.config.dataset)

    def encode_text(self, dataset: DatasetRecord) -> CacheRecord:
        config, urls, prompts = self.config, image_shard_urls(self.store, dataset), {}
        text = (config.storage, config.model, config.text_encoding, self.text_fps)

        def prepare() -> None:  # the prompts, then the precision check before any shard, as in the flow
            prompts.update(encode_prompts(*text, config.training.sample_prompts))
            measure_numerics(*text, urls[0] if urls else None)

        records, work = self.encoded(lambda url: encode_text_shard(*text, url), urls, prepare)
        return {**text_cache_record(self.store, self.text_fps, prompts, records), "work": work}

    def encode_latents(self, dataset: DatasetRecord) -> CacheRecord:
        config = self.config
        records, work = self.encoded(
            lambda url: [encode_latents_shard(config.storage, config.model, config.latent_encoding, self.vae_fp, url)],
            image_shard_urls(self.store, dataset))
        return {**latent_cache_record(self.store, self.vae_fp, records), "work": work}

    @staticmethod
    def encoded(encode: Callable[[str], list[Any]], urls: list[str], prepare: Callable[[], None] = lambda: None,
                ) -> tuple[list[Any], EncodingWork]:
        """`prepare()`, then `encode(url)` for every shard, here (its records: one per encoder);
        all the records and the stage's encoding_work, counted from before `prepare` as the flow
        counts it."""
        started, before = time.time(), sum(model_loads().values())
        prepare()
        records = [record for url in urls for record in encode(url)]
        return records, encoding_work(records, started, 1, sum(model_loads().values()) - before)

    def manifest(self, dataset: DatasetRecord) -> ManifestRecord:
        config = self.config
        return build_manifest(config.storage, dataset["id"], self.text_fps, self.vae_fp, config.training.sample_prompts)

    def train(self, manifest: ManifestRecord) -> RunRecord:
        config = self.config
        return train(config.storage, config.model, config.training, manifest["url"])


def run_direct(config: PipelineConfig, until: Stage = "train") -> Records:
    """Run the stages up to `until` in this process (`Direct`); returns `run_stages`' records and
    the encoders' fingerprints."""
    executor = Direct(config)
    return {"text_fingerprints": executor.text_fps, "vae_fingerprint": executor.vae_fp,
            **run_stages(executor, until)}


def outputs(records: Records) -> dict[str, Any]:
    """What a whole pipeline run reports, from its stages' records (the flow's return value)."""
    run = records["train"]
    return {
        "dataset": records["ingest"]["url"],
        "quarantined": records["ingest"]["quarantined"],  # files or rows ingest refused; the report says why
        "ingest_report": records["ingest"]["report"],
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
