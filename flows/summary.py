"""The pipeline's closing report: per stage, whether it ran or was a cache hit, how much, how
long, and where its outputs are (the `pipeline-summary` Prefect artifact)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prefect import get_run_logger

from configs.schema import Stage
from tasks.records import EncodingWork, IngestWork, Record, Records, StoreWork, Work
from tasks.runs.page import stage_table


class Summary:
    def __init__(self):
        self.started = time.time()
        self.rows: list[dict[str, str]] = []  # stage, status, amount, seconds, work, output

    def watch(self, name: Stage, run: Callable[[], Record]) -> Record:
        """Run one stage (the runner's `watch`): a failing stage is named in the run's log (the flow
        run's state names only the exception), and `precast submit` reports it from there."""
        try:
            return run()
        except Exception as error:
            get_run_logger().error("stage %s failed: %s: %s", name, type(error).__name__, error)
            raise

    def add(self, records: Records) -> None:
        """A row for each stage of `records`: "ran" when any of its outputs was committed during
        this pipeline run, else "cached" (everything was)."""
        for name, seconds in records["seconds"].items():
            record: Any = records[name]
            self.rows.append({"stage": name, "status": "ran" if record["committed_at"] >= self.started else "cached",
                              "amount": record["amount"], "seconds": f"{seconds:.1f} s",
                              "work": work_text(name, record.get("work")), "output": record["url"]})

    def ran(self, name: Stage) -> bool:
        return any(row["stage"] == name and row["status"] == "ran" for row in self.rows)

    def markdown(self) -> str:
        return "\n".join(["# precast pipeline", "", *stage_table(self.rows)])

    def description(self) -> str:
        """One line for the UI's artifact list: each stage ran or cached, and what training made."""
        train = next((row["amount"] for row in self.rows if row["stage"] == "train"), None)
        return ", ".join(f"{row['stage']} {row['status']}" for row in self.rows) + (f"; {train}" if train else "")


def ingest_work_text(work: IngestWork) -> str:
    """"1.2 MB read: 1 unit read, 399 taken from the last ingest" ("… read on 4 workers: …" on workers;
    under 100 kB in bytes: a nightly run that read one new caption says how little)."""
    where = f" on {work['workers']} workers" if work.get("workers", 1) > 1 else ""
    count = work["bytes_read"]
    read = f"{count / 1e6:,.1f} MB" if count >= 100_000 else f"{count:,} B"
    return (f"{read} read{where}: {work['units_read']} "
            f"unit{'s' * (work['units_read'] != 1)} read, {work['units_reused']} taken from the last ingest"
            f"{retries_text(work)}")


def encoding_work_text(work: EncodingWork) -> str:
    """"2 workers, 2 model loads, 16 shards encoded, 0 cached" (the latent encoder's: "…; waiting
    for pixels 4% of the time"; after a throttled store: "…; 3 storage retries")."""
    feed = f"; waiting for pixels {work['feed_wait']:.0%} of the time" if "feed_wait" in work else ""
    copied = work.get("samples_copied", 0)
    copied = f"; latents of {copied} re-captioned samples copied, not encoded" if copied else ""
    return (f"{work['workers']} worker{'s' * (work['workers'] != 1)}, {work['model_loads']} model "
            f"load{'s' * (work['model_loads'] != 1)}, {work['shards_encoded']} shards encoded, "
            f"{work['shards_cached']} cached{copied}{feed}{retries_text(work)}")


def retries_text(work: Work) -> str:
    retries = work.get("io_retries", 0)
    return f"; {retries} storage retr{'ies' if retries != 1 else 'y'}" if retries else ""


def store_work_text(work: StoreWork) -> str:
    """"3 storage retries" (the manifest's and training's: "" when the store never failed)."""
    return retries_text(work).removeprefix("; ")


# each stage's work, told
WORK_TEXT: dict[Stage, Callable[[Any], str]] = {
    "ingest": ingest_work_text, "encode-text": encoding_work_text, "encode-latents": encoding_work_text,
    "manifest": store_work_text, "train": store_work_text,
}


def work_text(stage: Stage, work: Work | None) -> str:
    """A stage's cost in words ("" for a stage without any)."""
    return WORK_TEXT[stage](work) if work else ""
