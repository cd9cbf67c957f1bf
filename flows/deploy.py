"""Deployments with the user's config, and runs of them that report like a CI job should.

`precast deploy CONFIG` registers every deployment of prefect.yaml (through Prefect's own
`prefect deploy`) with CONFIG as its parameters: the UI's run form shows those values, the
nightly schedule runs them, and deploying again replaces them (Prefect then drops the runs it had
already scheduled with the old values). `precast submit DEPLOYMENT` starts a run, follows it, and
on failure prints which stage failed and its error, exiting non-zero.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from configs.schema import PipelineConfig

HOME = Path(__file__).resolve().parent.parent  # the checkout whose prefect.yaml and flows are deployed
NIGHTLY = "nightly"


def deployment_file(config: PipelineConfig, nightly_cron: str | None = None, timezone: str | None = None) -> dict:
    """prefect.yaml with `config` as every deployment's parameters (the nightly one continuing from
    the latest run) and, if given, the nightly schedule's cron and timezone."""
    spec = yaml.safe_load((HOME / "prefect.yaml").read_text())
    values = config.model_dump(mode="json")
    for deployment in spec["deployments"]:
        parameters = dict(deployment.get("parameters") or {})
        parameters["config"] = values
        if deployment["name"] == NIGHTLY:
            parameters["config"] = {**values, "training": {**values["training"], "init_from": "latest"}}
            for schedule in deployment.get("schedules", []):
                schedule["cron"] = nightly_cron or schedule["cron"]
                schedule["timezone"] = timezone or schedule["timezone"]
        deployment["parameters"] = parameters
    return spec


def deploy(config: PipelineConfig, nightly_cron: str | None = None, timezone: str | None = None,
           home: str | None = None) -> list[str]:
    """Register (or update) every deployment with `config`; returns their names. `home`: where
    workers find this checkout (default $PRECAST_HOME, else this checkout)."""
    spec = deployment_file(config, nightly_cron, timezone)
    env = {**os.environ, "PRECAST_HOME": home or os.environ.get("PRECAST_HOME") or str(HOME)}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", dir=HOME, prefix=".deploy-") as file:
        yaml.safe_dump(spec, file, sort_keys=False)
        file.flush()
        done = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all",
                               "--prefect-file", file.name], cwd=HOME, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"prefect deploy failed:\n{done.stdout[-4000:]}{done.stderr[-4000:]}")
    flows = {"flows/pipeline.py:pipeline": "precast-pipeline", "flows/pipeline.py:stage": "precast-stage"}
    return [f"{flows[d['entrypoint']]}/{d['name']}" for d in spec["deployments"]]


def submit(deployment: str, config: PipelineConfig | None = None, poll_seconds: float = 2.0,
           echo=print) -> dict[str, Any]:
    """Run `deployment` (with `config`, else the parameters it was deployed with), follow it to
    its end and return {"state", "url", "failures"}: each failed stage (task or child flow run)
    with its error. Never raises on a failed run."""
    return asyncio.run(_submit(deployment, config, poll_seconds, echo))


async def _submit(deployment: str, config: PipelineConfig | None, poll_seconds: float, echo) -> dict[str, Any]:
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter, FlowRunFilterParentFlowRunId, LogFilter, LogFilterFlowRunId, LogFilterLevel, TaskRunFilter,
        TaskRunFilterFlowRunId,
    )
    from prefect.settings import PREFECT_UI_URL

    from prefect.exceptions import ObjectNotFound

    async with get_client() as client:
        try:
            target = await client.read_deployment_by_name(deployment)
        except ObjectNotFound:
            raise ValueError(f"deployment {deployment!r} does not exist on {client.api_url}: "
                             "register it with `precast deploy CONFIG`") from None
        parameters = {"config": config.model_dump(mode="json")} if config is not None else {}
        run = await client.create_flow_run_from_deployment(target.id, parameters=parameters)
        url = f"{PREFECT_UI_URL.value()}/runs/flow-run/{run.id}" if PREFECT_UI_URL.value() else str(run.id)
        echo(f"{deployment}: flow run {run.name} ({url})")
        seen = None
        while True:
            run = await client.read_flow_run(run.id)
            if run.state and run.state.name != seen:
                seen = run.state.name
                echo(f"{time.strftime('%H:%M:%S')} {run.name}: {seen}")
            if run.state and run.state.is_final():
                break
            await asyncio.sleep(poll_seconds)
        failures = []
        if not run.state.is_completed():
            # the stages that failed: task runs of this run and of its child flow runs (placement)
            children = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id])))
            ids = [run.id] + [child.id for child in children]
            # the pipeline logs "stage NAME failed: ERROR" (flows/summary.py); logs reach the server
            # a moment after the state, so they are polled for a few seconds
            for _ in range(20):
                logs = await client.read_logs(log_filter=LogFilter(
                    flow_run_id=LogFilterFlowRunId(any_=ids), level=LogFilterLevel(ge_=40)))
                lines = [r.message for r in logs if r.message.startswith("stage ") and " failed: " in r.message]
                if lines:
                    break
                await asyncio.sleep(0.5)
            for line in lines:
                stage, _, error = line.removeprefix("stage ").partition(" failed: ")
                failures.append({"stage": stage, "state": "Failed", "error": error})
            tasks = await client.read_task_runs(
                task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=ids)))
            runs = [(t.name.rsplit("-", 1)[0], t) for t in tasks] + [(c.name, c) for c in children]
            runs.append(("flow run", run))
            failures += [{"stage": name, "state": r.state.name, "error": r.state.message} for name, r in runs
                         if r.state and r.state.is_final() and not r.state.is_completed()]
        return {"state": run.state.name, "url": url, "failures": failures}
