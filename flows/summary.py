"""The pipeline's closing report: per stage, whether it ran or was a cache hit, how much, how
long, and where its outputs are (the `pipeline-summary` Prefect artifact)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prefect import get_run_logger



class Summary:
    def __init__(self):
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
        # "ran" when any output was committed during this pipeline run, else everything was cached
        ran = result["committed_at"] >= self.started
        self.rows.append((name, "ran" if ran else "cached", result["amount"], f"{seconds:.1f} s", result["url"]))
        self.records[name] = result
        return result

    def markdown(self) -> str:
        lines = ["# precast pipeline", "", "| stage | status | amount | time | output |",
                 "| --- | --- | --- | --- | --- |"]
        lines += [f"| {name} | {status} | {amount} | {seconds} | `{where}` |"
                  for name, status, amount, seconds, where in self.rows]
        return "\n".join(lines)
