"""The ingest report: counts by reason, format, aspect ratio and caption length, and the markdown
the Prefect artifact and `precast inspect` show."""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

from storage import layout
from tasks.ingest.scan import Scan

CAPTION_WORD_BINS = (5, 10, 20, 50, 100, 200)
# the report's aspect-ratio bins (height/width), the model's buckets being unknown to ingest: 1:4 to
# 4:1 in steps of 2^(1/8), fine enough to see a dataset's shapes, coarse enough to read
ASPECT_BINS = tuple(round(2 ** (step / 8), 2) for step in range(-16, 17))


def ingest_report(scan: Scan) -> dict[str, Any]:
    """Counts by reason, by format, by aspect-ratio bucket, and a caption length histogram."""
    ledger = scan.ledger
    accepted = dict(ledger.rows("SELECT format, count(*) FROM samples WHERE role IS NULL GROUP BY format"))
    rejected = dict(ledger.rows("SELECT format, count(*) FROM quarantined GROUP BY format"))
    words, buckets, variants = Counter(), Counter(), 0
    for width, height, captions in ledger.rows("SELECT width, height, captions FROM samples WHERE role IS NULL"):
        buckets[str(min(ASPECT_BINS, key=lambda ratio: abs(ratio - height / width)))] += 1
        for caption in json.loads(captions):
            variants += 1
            count = len(caption.split())
            words[next((f"<={b}" for b in CAPTION_WORD_BINS if count <= b), f">{CAPTION_WORD_BINS[-1]}")] += 1
    samples, quarantined = scan.samples(), scan.count("quarantined")
    return {
        **paired(scan),
        "samples": samples,
        "quarantined": quarantined,
        "candidates": sum(scan.formats.values()),
        "duplicates": sum(scan.formats.values()) - samples - quarantined,
        # of which, in a source that prefixes or mixes otherwise than the first that gave the file
        "duplicates_apart": scan.kept_apart,
        "caption_variants": variants,
        "by_reason": dict(ledger.rows("SELECT reason, count(*) FROM quarantined GROUP BY reason ORDER BY reason")),
        "by_format": {f: {"accepted": accepted.get(f, 0), "quarantined": rejected.get(f, 0)} for f in sorted(scan.formats)},
        "by_bucket": dict(sorted(buckets.items(), key=lambda kv: float(kv[0]))),
        "caption_words": {b: words[b] for b in [f"<={b}" for b in CAPTION_WORD_BINS] + [f">{CAPTION_WORD_BINS[-1]}"]},
    }


def paired(scan: Scan) -> dict[str, int]:
    """Of a dataset with references: its pairs (samples with references), its references (each
    stored once) and those of them several targets share, and the references its pairs name."""
    ledger = scan.ledger
    pairs = ledger.one("SELECT count(*) FROM samples WHERE refs IS NOT NULL")[0]
    if not pairs:
        return {}
    return {"pairs": pairs, "references": scan.count("samples") - scan.samples(),
            "references_shared": ledger.one("SELECT count(*) FROM (SELECT value FROM samples, json_each(samples.refs) "
                                            "GROUP BY value HAVING count(*) > 1)")[0],
            "references_named": ledger.one("SELECT count(*) FROM samples, json_each(samples.refs)")[0]}


def report_markdown(report: dict[str, Any]) -> str:
    """The ingest report as markdown (the Prefect artifact and `precast inspect`)."""
    lines = [f"# Ingest report — dataset `{report['dataset']}`", "",
             f"**{report['samples']}** samples accepted, **{report['quarantined']}** quarantined, "
             f"{report['duplicates']} exact duplicates merged, {report['caption_variants']} caption variants.", ""]
    if report.get("pairs"):
        lines[-1:-1] = [f"**{report['pairs']}** of the samples are pairs made from references: they name "
                        f"{report['references_named']} references, **{report['references']}** stored (each once), "
                        f"{report['references_shared']} of them shared by several targets.", ""]
    if report.get("duplicates_apart"):
        lines[-1:-1] = [f"{report['duplicates_apart']} of the duplicates came from a source with another caption "
                        "prefix, resolution or mix than the first that gave them: they kept that source's captions, "
                        "resolution and role alone.", ""]

    def table(title: str, header: str, rows: list[tuple]) -> None:
        if not rows:  # a header row alone reads as a broken table
            lines.extend([f"## {title}", "", "none", ""])
            return
        lines.extend([f"## {title}", "", header, "|" + " --- |" * (header.count("|") - 1)])
        lines.extend("| " + " | ".join(str(c) for c in row) + " |" for row in rows)
        lines.append("")

    # the stored JSON's keys come back sorted as strings ("<=10" before "<=5"): bins in numeric order
    def numeric(label: str) -> tuple[bool, float]:
        return label.startswith(">"), float(label.lstrip("<=>"))

    if len(report.get("sources", [])) > 1:  # reports before sources mixed have none
        table("By source", "| source | samples |", [(markdown_literal(s["path"]), s["samples"]) for s in report["sources"]])
    table("By format", "| format | accepted | quarantined |",
          [(f, c["accepted"], c["quarantined"]) for f, c in report["by_format"].items()])
    table("Quarantined by reason", "| reason | count |", list(report["by_reason"].items()))
    table("By aspect-ratio bucket (height/width)", "| ratio | samples |",
          sorted(report["by_bucket"].items(), key=lambda row: numeric(row[0])))
    table("Caption length (words)", "| words | captions |",
          sorted(report["caption_words"].items(), key=lambda row: numeric(row[0])))
    if report["quarantine"]:  # a list: sources and messages are long, and V1's table cells do not wrap
        shown = report["quarantine"][:200]
        folder = layout.common_folder([q["source"] for q in shown])
        lines.extend([f"## Quarantined inputs, under `{folder}`", ""])
        lines.extend(f"- {markdown_literal(q['source'].removeprefix(folder))}: {markdown_literal(q['reason'])}: "
                     f"{markdown_literal(q['message'])}"
                     for q in shown)
    return "\n".join(lines)


def mix_markdown(drawn: list[dict[str, Any]]) -> str:
    """How training draws from the sources (`DatasetConfig.drawn`), as a markdown table."""
    rows = [(markdown_literal(s["path"]), s["samples"], s["repeats"],
             "by size" if s["weight"] is None else f"{s['weight']:g}", f"{s['loss_weight']:g}",
             "training's" if s["caption_dropout"] is None else f"{s['caption_dropout']:g}", s["regularisation"],
             f"{s['share']:.1%}") for s in drawn]
    return "\n".join(["## By source, as this run's training draws from them", "",
                      "| source | samples | repeats | weight | loss weight | caption dropout | regularisation | "
                      "share of draws |", "|" + " --- |" * 8, *("| " + " | ".join(map(str, row)) + " |" for row in rows),
                      ""])


def markdown_literal(text: str) -> str:
    """`text` (a message about a hostile input, which may name its bytes) shown as it is in
    markdown: each character that would format it (or open an HTML tag) escaped."""
    return re.sub(r"([\\`*_\[\]|#~<>&])", r"\\\1", text)
