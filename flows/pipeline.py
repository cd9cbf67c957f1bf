"""The whole pipeline on one screen: ingest → encode text, latents → manifest → train.

Each stage is a retryable, content-cached Prefect task (or, with `execution.placement`, a child
flow run on another work pool) that exchanges URLs with the others, so a re-run over unchanged data
is all cache hits and any stage can run on another node.
"""

from __future__ import annotations

import logging
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from configs.schema import PipelineConfig, Stage
from flows.stages import (
    Plan, check_nodes_placed, publish_run_page, run_encode_latents, run_encode_text, run_ingest, run_manifest,
    run_train, stored_dataset, stored_manifest,
)
from flows.summary import Summary
from tasks.runner import outputs

log = logging.getLogger(__name__)


@flow(name="precast-pipeline", log_prints=True)
def pipeline(config: PipelineConfig) -> dict[str, Any]:
    plan = Plan(config)  # the store, fingerprints and result storage, each derived once
    plan.store.check_reachable()
    check_nodes_placed(config)
    summary = Summary()
    dataset = summary.stage("ingest", lambda: run_ingest(plan))
    summary.stage("encode-text", lambda: run_encode_text(plan, dataset))
    summary.stage("encode-latents", lambda: run_encode_latents(plan, dataset))
    manifest = summary.stage("manifest", lambda: run_manifest(plan, dataset))
    run = summary.stage("train", lambda: run_train(plan, manifest))
    report = summary.markdown()  # what ran, what was cached, and how long each stage took
    create_markdown_artifact(key="pipeline-summary", markdown=report)
    log.info("%s", report)
    publish_run_page(plan, run, summary.rows if summary.ran("train") else None)
    return outputs(summary.records)


@flow(name="precast-stage", log_prints=True)
def stage(name: Stage, config: PipelineConfig, shards: list[str] | None = None,
          node: int | None = None, attempt: str | None = None) -> dict[str, Any]:
    """One stage alone, its inputs taken from the store (the latest dataset of these sources);
    `shards` limits an encoding stage to those image shard URLs; `node` and `attempt` make a train
    stage one node of a multi-node run (training.nodes)."""
    plan = Plan(config)
    plan.store.check_reachable()
    if name == "ingest":
        return run_ingest(plan)
    if name == "encode-text":
        return run_encode_text(plan, stored_dataset(plan), shards)
    if name == "encode-latents":
        return run_encode_latents(plan, stored_dataset(plan), shards)
    if name == "manifest":
        return run_manifest(plan, stored_dataset(plan))
    run = run_train(plan, stored_manifest(plan), node, attempt)
    publish_run_page(plan, run)
    return run
