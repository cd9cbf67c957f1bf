"""The pipeline's closing report: per stage, whether it ran or was a cache hit, how much, how
long, and where its outputs are (the `pipeline-summary` Prefect artifact)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prefect import get_run_logger

from tasks.runs.page import stage_table


class Summary:
    def __init__(self):
        self.started = time.time()
        self.rows: list[dict[str, str]] = []  # stage, status, amount, seconds, work, output
        # each stage's record by name, and "seconds": each stage's wall time (as tasks.runner's)
        self.records: dict[str, Any] = {"seconds": {}}

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
        self.rows.append({"stage": name, "status": "ran" if ran else "cached", "amount": result["amount"],
                          "seconds": f"{seconds:.1f} s", "work": work_text(result.get("work")), "output": result["url"]})
        self.records[name] = result
        self.records["seconds"][name] = seconds
        return result

    def ran(self, name: str) -> bool:
        return any(row["stage"] == name and row["status"] == "ran" for row in self.rows)

    def markdown(self) -> str:
        return "\n".join(["# precast pipeline", "", *stage_table(self.rows)])


def work_text(work: dict[str, Any] | None) -> str:
    """A stage's cost in words: "2 workers, 2 model loads, 16 shards encoded, 0 cached" (an encoder),
    "1.2 MB read: 1 unit read, 399 taken from the last ingest" (ingest; "… read on 4 workers: …" on workers)."""
    if not work:
        return ""
    if "bytes_read" in work:
        where = f" on {work['workers']} workers" if work.get("workers", 1) > 1 else ""
        return (f"{work['bytes_read'] / 1e6:,.1f} MB read{where}: {work['units_read']} "
                f"unit{'s' * (work['units_read'] != 1)} read, {work['units_reused']} taken from the last ingest")
    return (f"{work['workers']} worker{'s' * (work['workers'] != 1)}, {work['model_loads']} model "
            f"load{'s' * (work['model_loads'] != 1)}, {work['shards_encoded']} shards encoded, "
            f"{work['shards_cached']} cached")
