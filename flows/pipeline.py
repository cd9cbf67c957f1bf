"""The whole pipeline on one screen: ingest → encode text, latents → manifest → train.

Each stage is a retryable, content-cached Prefect task (or, with `execution.placement`, a child
flow run on another work pool) that exchanges URLs with the others, so a re-run over unchanged data
is all cache hits and any stage can run on another node.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from configs.schema import PipelineConfig
from flows.stages import (
    run_encode_latents, run_encode_text, run_ingest, run_manifest, run_train, stored_dataset, stored_manifest,
)
from flows.summary import Summary
from storage.store import Store

log = logging.getLogger(__name__)


@flow(name="precast-pipeline", log_prints=True)
def pipeline(config: PipelineConfig = PipelineConfig()) -> dict[str, Any]:
    Store(config.storage).check_reachable()
    summary = Summary(config)
    dataset = summary.stage("ingest", lambda: run_ingest(config))
    text = summary.stage("encode-text", lambda: run_encode_text(config, dataset))
    latents = summary.stage("encode-latents", lambda: run_encode_latents(config, dataset))
    manifest = summary.stage("manifest", lambda: run_manifest(config, dataset))
    run = summary.stage("train", lambda: run_train(config, manifest))
    report = summary.markdown()  # what ran, what was cached, and how long each stage took
    create_markdown_artifact(key="pipeline-summary", markdown=report)
    log.info("%s", report)
    return {
        "dataset": dataset["url"],
        "text_cache": text["url"],
        "latent_cache": latents["url"],
        "manifest": manifest["url"],
        "run": run["run"],
        "adapter": run["adapter"] or run["transformer"],
        "samples": run["samples"],
        "final_loss": run["final_loss"],
        "first_loss": run["first_loss"],
    }


Stage = Literal["ingest", "encode-text", "encode-latents", "manifest", "train"]


@flow(name="precast-stage", log_prints=True)
def stage(name: Stage, config: PipelineConfig = PipelineConfig(), shards: list[str] | None = None) -> dict[str, Any]:
    """One stage alone, its inputs taken from the store (the latest dataset of these sources);
    `shards` limits an encoding stage to those image shard URLs."""
    Store(config.storage).check_reachable()
    if name == "ingest":
        return run_ingest(config)
    if name == "encode-text":
        return run_encode_text(config, stored_dataset(config), shards)
    if name == "encode-latents":
        return run_encode_latents(config, stored_dataset(config), shards)
    if name == "manifest":
        return run_manifest(config, stored_dataset(config))
    return run_train(config, stored_manifest(config))
