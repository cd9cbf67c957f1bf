"""Ingest on workers: what the ingest that lists and merges (the coordinator) costs per image,
against reading and decoding everything in one process.

`--count` photo-sized JPEGs (1024x768, ~250 KB) with captions in a local folder, ingested twice on
fresh stores: in this process (threads, one per core), and with partitions of `--partition-size`
units examined by two Dask worker processes (`tasks.ingest.staging.examine_partition`, submitted on a
plain Dask client: the Prefect task around it adds a task run per partition, nothing per image).
Both give the same dataset id. On this 2-core machine the workers share the cores with the
coordinator, so wall time is not the figure; the coordinator's own CPU per image is: it bounds how
many workers one coordinator keeps busy (docs/benchmarks.md carries it to a cluster).
Usage: python -m benchmarks.ingest_workers [--count 400] [--partition-size 50]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks.ingest_throughput import photo_jpegs
from configs.schema import DatasetConfig, SourceConfig, StorageConfig
from storage.store import Store
from tasks.ingest.stage import ingest
from tasks.ingest.staging import Partitions, examine_partition


def worker_cpu() -> float:
    times = psutil.Process().cpu_times()
    return times.user + times.system


def run(count: int = 400, partition_size: int = 50, workers: int = 2) -> dict:
    from distributed import Client, LocalCluster

    result: dict = {"images": count, "workers": workers, "partition_size": partition_size}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        data.mkdir()
        for index, photo in enumerate(photo_jpegs(count)):
            (data / f"{index:06d}.jpg").write_bytes(photo)
            (data / f"{index:06d}.txt").write_text(f"photo number {index}, smooth colour noise")
        result["source_bytes_per_image"] = round(sum(p.stat().st_size for p in data.iterdir()) / count)
        dataset = DatasetConfig(sources=[SourceConfig(path=str(data))], partition_size=partition_size)

        here = StorageConfig(root=str(Path(tmp) / "here"))
        cpu, began = time.process_time(), time.perf_counter()
        expected = ingest(here, dataset)["id"]
        result["in_process_images_per_s"] = round(count / (time.perf_counter() - began), 1)
        result["in_process_cpu_ms_per_image"] = round((time.process_time() - cpu) * 1000 / count, 2)

        remote = StorageConfig(root=str(Path(tmp) / "workers"))
        staged: list[int] = []
        with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
                Client(cluster) as client:
            def examine(index: int, fmt: str, units: list[list]) -> str:
                key = client.submit(examine_partition, remote, dataset, index, fmt, units, pure=False).result()
                staged.append(Store(remote).require(key)["size"])
                return key

            partitions = Partitions(examine, slots=workers, size=partition_size)
            before = sum(client.run(worker_cpu).values())
            cpu, began = time.process_time(), time.perf_counter()
            done = ingest(remote, dataset, partitions=partitions)["id"]
            result["on_workers_images_per_s"] = round(count / (time.perf_counter() - began), 1)
            result["coordinator_cpu_ms_per_image"] = round((time.process_time() - cpu) * 1000 / count, 2)
            result["workers_cpu_ms_per_image"] = round((sum(client.run(worker_cpu).values()) - before) * 1000 / count, 2)
    assert done == expected, (done, expected)
    result["partitions"] = len(staged)
    result["staged_bytes_per_image"] = round(sum(staged) / count)
    result["coordinator_share_of_in_process_cpu"] = round(
        result["coordinator_cpu_ms_per_image"] / result["in_process_cpu_ms_per_image"], 3)
    return result


def rows(result: dict) -> list[tuple[str, str, str, str]]:
    return [
        ("ingest on workers, coordinator CPU", f"{result['coordinator_cpu_ms_per_image']} ms an image",
         f"in one process {result['in_process_cpu_ms_per_image']} ms "
         f"({result['coordinator_share_of_in_process_cpu']:.0%}); workers {result['workers_cpu_ms_per_image']} ms",
         ""),
        ("ingest on workers, images/s", f"{result['on_workers_images_per_s']:,.0f} img/s on {result['workers']} workers",
         f"in one process {result['in_process_images_per_s']:,.0f} img/s ({result['images']} images, "
         f"{result['partitions']} partitions; 2 cores shared)", ""),
        ("ingest on workers, staged bytes", f"{result['staged_bytes_per_image']:,} B an image",
         f"source {result['source_bytes_per_image']:,} B an image (JPEGs kept byte for byte)", ""),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=400)
    parser.add_argument("--partition-size", type=int, default=50)
    args = parser.parse_args()
    print(json.dumps(run(count=args.count, partition_size=args.partition_size)))


if __name__ == "__main__":
    main()
