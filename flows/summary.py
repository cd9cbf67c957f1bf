"""The pipeline's closing report: per stage, whether it ran or was a cache hit, how much, how
long, and where its outputs are (the `pipeline-summary` Prefect artifact)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prefect import get_run_logger

from storage import layout
from storage.store import Store


class Summary:
    def __init__(self, store: Store):
        self.store = store
        self.started = time.time()
        self.rows: list[tuple[str, str, str, str, str]] = []
        self.records: dict[str, dict[str, Any]] = {}  # each stage's record, by name

    def stage(self, name: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run one stage and record its row (a failing stage records nothing: the flow fails)."""
        began = time.perf_counter()
        try:
            result = run()
        except Exception as error:
            # the run's log names the stage (the flow run's state names only the exception), and
            # `precast submit` reports it from there
            get_run_logger().error("stage %s failed: %s: %s", name, type(error).__name__, error)
            raise
        seconds = time.perf_counter() - began
        records, amount, where = self._outputs(name, result)
        # "ran" when any output was committed during this pipeline run, else everything was cached
        ran = any(r.get("committed_at", 0) >= self.started for r in records)
        self.rows.append((name, "ran" if ran else "cached", amount, f"{seconds:.1f} s", where))
        self.records[name] = result
        return result

    def _outputs(self, name: str, result: dict[str, Any]) -> tuple[list[dict], str, str]:
        if name == "ingest":
            shards = [self.store.committed(layout.image_shard(s["id"])) or {} for s in result["shards"]]
            return shards, f"{result['samples']} samples in {len(shards)} shards", result["url"]
        if name == "encode-text":
            records = result["shards"] + [result["prompts"]]
            return records, f"{sum(r['captions'] for r in records)} captions", result["url"]
        if name == "encode-latents":
            return result["shards"], f"{sum(r['samples'] for r in result['shards'])} images", result["url"]
        if name == "manifest":
            return [result], f"{result['samples']} samples", result["url"]
        return [result], f"{result['steps']} steps, loss {result['first_loss']:.3f} → {result['final_loss']:.3f}", \
            result["adapter"] or result["transformer"]

    def markdown(self) -> str:
        lines = ["# precast pipeline", "", "| stage | status | amount | time | output |",
                 "| --- | --- | --- | --- | --- |"]
        lines += [f"| {name} | {status} | {amount} | {seconds} | `{where}` |"
                  for name, status, amount, seconds, where in self.rows]
        return "\n".join(lines)
