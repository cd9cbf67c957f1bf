"""Ingest throughput (images/s): precast's ingest stage vs a plain PIL open+verify loop.

Both read the same generated folder in one invocation. The plain loop only opens and verifies
each file (no pixel decode, no caption, no output); a second plain loop decodes the pixels
(`load`), the floor for any ingest that really checks images; precast also hashes, fully decodes, applies
EXIF orientation, checks geometry, reads captions and writes parquet shards and the report. A
second precast pass over unchanged sources shows the incremental path (known images are not
decoded again). Decoding alone, on photo-sized JPEGs (1024x768, ~250 KB), is measured serially,
in one thread per core (what ingest does) and in one process per core: Pillow releases the GIL
while it decodes, so threads scale without start-up or copying bytes between processes.
Usage: python -m benchmarks.ingest_throughput [--count 600]
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

from configs.schema import DatasetConfig, SourceConfig, StorageConfig
from storage.fingerprint import sha256_bytes
from tasks.demo.data import write_demo_data
from tasks.ingest.formats import IMAGE_EXTENSIONS
from tasks.ingest.stage import ingest
from tasks.ingest.untrusted import normalise_image


def plain_loop(folder: Path, decode: bool = False) -> int:
    count = 0
    for path in sorted(folder.rglob("*")):
        if path.suffix.lstrip(".").lower() in IMAGE_EXTENSIONS:
            with Image.open(path) as image:
                image.load() if decode else image.verify()
            count += 1
    return count


def check(data: bytes, dataset: DatasetConfig) -> tuple[int, int]:
    """What ingest does to a new image's bytes: hash, decode, orient, check."""
    sha256_bytes(data)
    return normalise_image(data, dataset)[1:]


def photo_jpegs(count: int) -> list[bytes]:
    """Photo-sized JPEGs (1024x768, about 250 KB): smooth noise, so they compress like photos."""
    rng = np.random.default_rng(0)
    photos = []
    for _ in range(count):
        pixels = Image.fromarray(rng.integers(0, 255, (96, 128, 3), dtype=np.uint8)).resize((1024, 768), Image.BICUBIC)
        buffer = io.BytesIO()
        pixels.save(buffer, "JPEG", quality=90)
        photos.append(buffer.getvalue())
    return photos


def decode_scaling(count: int = 96) -> dict:
    """Images/s of `check` on photo-sized JPEGs: serially, in threads and in processes (one per core)."""
    photos = photo_jpegs(count)
    dataset = DatasetConfig(sources=[SourceConfig(path=".")])
    cores = os.cpu_count() or 1
    rates = {}
    pools = {"threads": lambda: ThreadPoolExecutor(cores),
             "processes": lambda: ProcessPoolExecutor(cores, mp_context=multiprocessing.get_context("spawn"))}
    for name, make in pools.items():
        with make() as pool:
            list(pool.map(check, photos[:cores], [dataset] * cores))  # started and warm
            started = time.perf_counter()
            list(pool.map(check, photos, [dataset] * count))
            rates[name] = count / (time.perf_counter() - started)
    started = time.perf_counter()
    for photo in photos:
        check(photo, dataset)
    rates["serial"] = count / (time.perf_counter() - started)
    return {f"decode_{name}_images_per_s": round(rate, 1) for name, rate in rates.items()} | {
        "decode_cores": cores, "decode_jpeg_kb": round(sum(map(len, photos)) / count / 1024)}


def run(count: int = 600) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        data = write_demo_data(Path(tmp) / "data", count=count)
        storage = StorageConfig(root=str(Path(tmp) / "store"))
        dataset = DatasetConfig(sources=[SourceConfig(path=str(data))], shard_size=256)
        plain_loop(data)  # warm the page cache for both sides
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
        **decode_scaling(),
    }


def rows(result: dict) -> list[tuple[str, str, str, str]]:
    return [
        ("ingest", f"{result['precast_ingest_images_per_s']:,.0f} img/s",
         f"PIL open+load loop {result['plain_open_load_images_per_s']:,.0f} img/s; open+verify "
         f"{result['plain_open_verify_images_per_s']:,.0f} img/s ({result['images']} images)", ""),
        ("ingest, unchanged re-run", f"{result['precast_unchanged_rerun_images_per_s']:,.0f} img/s",
         "known images recognised by sha256, not decoded", ""),
        (f"ingest decode, {result['decode_jpeg_kb']} KB JPEGs", f"{result['decode_threads_images_per_s']:,.0f} img/s",
         f"{result['decode_cores']} threads (ingest); {result['decode_cores']} processes "
         f"{result['decode_processes_images_per_s']:,.0f} img/s; serial {result['decode_serial_images_per_s']:,.0f} img/s", ""),
    ]

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=600)
    args = parser.parse_args()
    print(json.dumps(run(**vars(args))))


if __name__ == "__main__":
    main()
