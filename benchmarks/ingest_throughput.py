"""Ingest throughput (images/s): precast's ingest stage vs a plain PIL open+verify loop.

Both read the same generated folder in one invocation. The plain loop only opens and verifies
each file (no pixel decode, no caption, no output); a second plain loop decodes the pixels
(`load`), the floor for any ingest that really checks images; precast also hashes, fully decodes, applies
EXIF orientation, checks geometry, reads captions and writes parquet shards and the report. A
second precast pass over unchanged sources shows the incremental path (known images are not
decoded again). Usage: python -m benchmarks.ingest_throughput [--count 600]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from PIL import Image

from configs.schema import DatasetConfig, SourceConfig, StorageConfig
from tasks.demo_data import write_demo_data
from tasks.encode_latents import nearest_ratio
from tasks.ingest import ingest
from tasks.sources import IMAGE_EXTENSIONS


def plain_loop(folder: Path, decode: bool = False) -> int:
    count = 0
    for path in sorted(folder.rglob("*")):
        if path.suffix.lstrip(".").lower() in IMAGE_EXTENSIONS:
            with Image.open(path) as image:
                image.load() if decode else image.verify()
            count += 1
    return count


def run(count: int = 600) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        data = write_demo_data(Path(tmp) / "data", count=count)
        storage = StorageConfig(root=str(Path(tmp) / "store"))
        dataset = DatasetConfig(sources=[SourceConfig(path=str(data))], shard_size=256)
        plain_loop(data)  # warm the page cache for both sides
        nearest_ratio(1, 1, 1024)  # the bucket tables are read once per process, not per ingest

        started = time.perf_counter()
        verified = plain_loop(data)
        plain_s = time.perf_counter() - started

        started = time.perf_counter()
        plain_loop(data, decode=True)
        decode_s = time.perf_counter() - started

        started = time.perf_counter()
        result = ingest(storage, dataset)
        precast_s = time.perf_counter() - started

        started = time.perf_counter()
        ingest(storage, dataset)
        rerun_s = time.perf_counter() - started
    assert verified == result["samples"] == count
    return {
        "images": count,
        "plain_open_verify_images_per_s": round(count / plain_s, 1),
        "plain_open_load_images_per_s": round(count / decode_s, 1),
        "precast_ingest_images_per_s": round(count / precast_s, 1),
        "precast_unchanged_rerun_images_per_s": round(count / rerun_s, 1),
        "precast_vs_plain": round(plain_s / precast_s, 3),
    }


def rows(result: dict) -> list[tuple[str, str, str, str]]:
    return [
        ("ingest", f"{result['precast_ingest_images_per_s']:,.0f} img/s",
         f"PIL open+load loop {result['plain_open_load_images_per_s']:,.0f} img/s; open+verify "
         f"{result['plain_open_verify_images_per_s']:,.0f} img/s ({result['images']} images)", ""),
        ("ingest, unchanged re-run", f"{result['precast_unchanged_rerun_images_per_s']:,.0f} img/s",
         "known images recognised by sha256, not decoded", ""),
    ]

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=600)
    args = parser.parse_args()
    print(json.dumps(run(**vars(args))))


if __name__ == "__main__":
    main()
