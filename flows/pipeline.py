"""The whole pipeline on one screen: ingest → encode text, latents → manifest → train.

Each stage is a retryable, content-cached Prefect task (or, with `execution.placement`, a child
flow run on another work pool) that exchanges URLs with the others, so a re-run over unchanged data
is all cache hits and any stage can run on another node. The order of the stages and what each is
given are tasks/runner.py's; this flow gives the runner its executor (flows/stages.py).

    precast run configs/quickstart.yaml
    precast stage encode-text configs/quickstart.yaml
"""

from __future__ import annotations

import logging
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from prefect.utilities.urls import url_for

from configs.schema import PipelineConfig, Stage
from flows.stages import STORED, FlowExecutor, Plan, check_nodes_placed, publish_run_page
from flows.summary import Summary
from tasks.records import Record
from tasks.runner import ENCODERS, INPUTS, Shards, outputs, run_stages, stage_method

log = logging.getLogger(__name__)


@flow(name="precast-pipeline", log_prints=True)
def pipeline(config: PipelineConfig) -> dict[str, Any]:
    if url := url_for("flow-run", obj_id=flow_run.id):  # with a server: the terminal's link to the UI
        log.info("precast-pipeline run %s: %s", flow_run.name, url)
    plan = Plan(config)  # the store, fingerprints and result storage, each derived once
    check_nodes_placed(config)
    summary = Summary()
    records = run_stages(FlowExecutor(plan), watch=summary.watch)
    summary.add(records)  # what ran, what was cached, and how long each stage took
    report = summary.markdown()
    create_markdown_artifact(key="pipeline-summary", markdown=report, description=summary.description())
    log.info("%s", report)
    publish_run_page(plan, records["train"], summary.rows if summary.ran("train") else None)
    return outputs(records)


@flow(name="precast-stage", log_prints=True)
def stage(name: Stage, config: PipelineConfig, shards: list[str] | None = None,
          node: int | None = None, attempt: str | None = None) -> Record:
    """One stage alone, its inputs taken from the store (the latest dataset of these sources);
    `shards` limits an encoding stage to those image shard URLs; `node` and `attempt` make a train
    stage one node of a multi-node run (training.distribution.nodes)."""
    plan = Plan(config)
    plan.store.check_reachable()
    inputs = [STORED[earlier](plan) for earlier in INPUTS[name]]
    if name in ENCODERS:  # the dataset ingested already, whole
        inputs = [Shards.of(plan.store, *inputs)]
    record = stage_method(FlowExecutor(plan, shards, node, attempt), name)(*inputs)
    if name == "train":
        publish_run_page(plan, record)
    return record
