"""Ingest's memory against the number of listed objects: flat, not one entry per object.

Generated folders of small distinct PNGs with a caption each (two listed objects per image) are
ingested by a fresh process, then ingested again unchanged (the nightly run: every unit taken from
the record); each process reports how far its resident memory rose above where it stood when the
ingest began (peak RSS, VmHWM, reset at that point). Two sizes give the slope: the memory per
million listed objects. Images are 64x64 so that the listing, the record and the bookkeeping are
what grows, not pixel work.
Usage: python -m benchmarks.ingest_memory [--sizes 20000,80000]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from configs.schema import DatasetConfig, SourceConfig, StorageConfig


def make_source(folder: Path, count: int) -> None:
    """`count` distinct 64x64 PNGs, each with a .txt caption, 1,000 to a subfolder."""
    pixels = np.zeros((64, 64, 3), dtype=np.uint8)
    for index in range(count):
        part = folder / f"{index // 1000:05d}"
        if index % 1000 == 0:
            part.mkdir(parents=True)
        pixels[0, :4] = np.frombuffer(index.to_bytes(12, "little"), dtype=np.uint8).reshape(4, 3)
        Image.fromarray(pixels).save(part / f"{index:08d}.png", compress_level=1)
        (part / f"{index:08d}.txt").write_text(f"a grey square, number {index}")


def vm(field: str) -> int:
    """A VmXXX line of /proc/self/status, in KiB."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1])


def measured_ingest(root: str, source: str, queue: multiprocessing.Queue) -> None:
    """In a fresh process: one ingest, and how far its peak resident memory rose above the start."""
    from tasks.ingest.stage import ingest  # imported before the baseline: libraries are not what is measured

    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    start, began = vm("VmRSS"), time.perf_counter()
    result = ingest(StorageConfig(root=root), DatasetConfig(sources=[SourceConfig(path=source)]))
    queue.put({"peak_rise_mib": round((vm("VmHWM") - start) / 1024, 1), "seconds": round(time.perf_counter() - began, 1),
               "samples": result["samples"], "units_read": result["work"]["units_read"]})


def in_fresh_process(target: Callable[..., None], *args: str) -> dict:
    """What `target(*args, queue)` puts on its queue, run in a fresh process (its own peak memory)."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=target, args=(*args, queue))
    process.start()
    result = queue.get()
    process.join()
    return result


def run(sizes: tuple[int, ...] = (20_000, 80_000)) -> dict:
    result: dict = {"sizes": list(sizes)}
    with tempfile.TemporaryDirectory(prefix="precast-ingest-memory-") as tmp:
        for count in sizes:
            source, root = Path(tmp) / f"source-{count}", f"file://{tmp}/store-{count}"
            make_source(source, count)
            first, nightly = (in_fresh_process(measured_ingest, root, str(source)) for _ in range(2))
            assert first["samples"] == nightly["samples"] == count and nightly["units_read"] == 0
            result[f"first_{count}"], result[f"nightly_{count}"] = first, nightly
    small, large = sizes[0], sizes[-1]
    objects = 2 * (large - small) / 1e6  # an image and its caption
    for run_ in ("first", "nightly"):
        rise = result[f"{run_}_{large}"]["peak_rise_mib"] - result[f"{run_}_{small}"]["peak_rise_mib"]
        result[f"{run_}_mib_per_million_objects"] = round(rise / objects, 1)
    return result


def rows(result: dict) -> list[tuple[str, str, str, str]]:
    small, large = result["sizes"][0], result["sizes"][-1]
    out = []
    for run_, what in (("first", "first ingest"), ("nightly", "nightly ingest, unchanged")):
        out.append((f"{what}: memory per million listed objects", f"{result[f'{run_}_mib_per_million_objects']:,} MiB",
                    f"peak rise {result[f'{run_}_{small}']['peak_rise_mib']:,} MiB at {2 * small:,} objects, "
                    f"{result[f'{run_}_{large}']['peak_rise_mib']:,} MiB at {2 * large:,}", "bounded"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="20000,80000")
    print(json.dumps(run(tuple(int(size) for size in parser.parse_args().sizes.split(",")))))


if __name__ == "__main__":
    main()
