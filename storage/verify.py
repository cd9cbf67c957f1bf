"""`precast verify`: check every committed artifact of a store, find partial and orphaned objects.

- damaged: a commit record whose artifact is missing, or whose bytes no longer match its sha256;
- partial: a temporary file left by a write that was killed (`*.partial-*`);
- orphaned: an object of a committed kind (shards, caches, manifests, datasets, checkpoints,
  lineage) without a commit record: its writer died between the data and the record. No
  committed artifact refers to it, and a re-run writes it again.
Everything else (reports, refs, metrics, samples, adapters of unfinished runs, Prefect results)
is auxiliary and left alone. `repair` removes partial and orphaned objects only.
"""

from __future__ import annotations

import re
from typing import Any

from storage.layout import COMMITTED, PREFECT_RESULTS
from storage.store import COMMIT_SUFFIX, Store

PARTIAL = re.compile(r"\.partial-[0-9a-f]{32}$")


def verify_store(store: Store, repair: bool = False) -> dict[str, Any]:
    """The integrity report of the store (and, with `repair`, what was removed)."""
    keys = store.find()
    present = set(keys)
    report: dict[str, Any] = {"root": store.root_url, "checked": 0, "damaged": [], "partial": [], "orphaned": [],
                              "removed": []}
    for key in keys:
        if key.startswith(PREFECT_RESULTS.split("/")[0] + "/"):
            continue
        if PARTIAL.search(key):
            report["partial"].append(key)
        elif key.endswith(COMMIT_SUFFIX):
            artifact = key.removesuffix(COMMIT_SUFFIX)
            report["checked"] += 1
            if artifact not in present:
                report["damaged"].append({"key": artifact, "reason": "missing: the commit record has no data"})
                continue
            expected = store.read_json(key)["sha256"]
            if store.sha256(artifact) != expected:
                report["damaged"].append({"key": artifact, "reason": "checksum mismatch"})
        elif COMMITTED.match(key) and key + COMMIT_SUFFIX not in present:
            report["orphaned"].append(key)
    if repair:
        for key in report["partial"] + report["orphaned"]:
            store.remove(key)
            report["removed"].append(key)
    report["ok"] = not report["damaged"]
    report["io_retries"] = len(store.retried)  # transient failures ridden out: a flaky store shows here
    return report


def report_text(report: dict[str, Any]) -> str:
    lines = [f"{report['root']}: {report['checked']} committed artifacts checked, {len(report['damaged'])} damaged, "
             f"{len(report['partial'])} partial, {len(report['orphaned'])} orphaned"
             + (f"; {report['io_retries']} storage retries" if report.get("io_retries") else "")]
    lines += [f"  damaged   {d['key']} ({d['reason']})" for d in report["damaged"]]
    lines += [f"  partial   {key}" for key in report["partial"]]
    lines += [f"  orphaned  {key}" for key in report["orphaned"]]
    lines += [f"  removed   {key}" for key in report["removed"]]
    return "\n".join(lines)
