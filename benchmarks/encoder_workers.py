"""Encoding stages against their number of workers: stage seconds and model loads.

One workload: `--count` generated images in `--shard-size` shards through `precast stage
encode-text` and `encode-latents` (the flow, against a Prefect server of its own), each on a fresh
store, with `execution.workers` 1 (shards in this process) and 2 (a Dask worker process each). The
tiny models load in a fraction of a second and a shard encodes in about as long, so here the
figures show the mechanics (loads stay at one per worker however many shards; a worker's start-up
is paid once per stage); docs/benchmarks.md carries them to T5-XXL, 4,000 shards and 8-GPU nodes.
Usage: python -m benchmarks.encoder_workers [--count 256] [--shard-size 8]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.end_to_end import prefect_server
from configs.schema import QUICKSTART, load_config
from tasks.demo.data import write_demo_data
from tasks.demo.models import write_tiny_models

STAGES = ("encode-text", "encode-latents")


def run(count: int = 256, shard_size: int = 8, workers: tuple[int, ...] = (1, 2)) -> dict[str, Any]:
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from flows.pipeline import stage

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        models = write_tiny_models(folder / "models", random_vae=True)  # timings do not depend on what the VAE learned
        data = write_demo_data(folder / "data", count=count)
        with prefect_server(folder / "prefect") as env, \
                temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"], PREFECT_HOME: env["PREFECT_HOME"]}):
            results: dict[str, Any] = {"images": count, "shards": -(-count // shard_size)}
            for n in workers:
                config = load_config(QUICKSTART, [
                    f"storage.root={folder / f'store-{n}'}", f"model.path={models}", f"dataset.shard_size={shard_size}",
                    f"dataset.sources=[{{path: {data}}}]", f"execution.workers={n}", "text_encoding.dtype=fp32"])
                stage(name="ingest", config=config)
                for name in STAGES:
                    started = time.perf_counter()
                    record = stage(name=name, config=config)
                    results[f"{name}_{n}"] = {"s": round(time.perf_counter() - started, 2), **record["work"]}
            APILogWorker.drain_all(timeout=30)  # the flows' logs reach the server before it stops
    return results


def rows(result: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(figure, measured, compared with, target) for the summary table."""
    out = []
    for name in STAGES:
        one, two = result[f"{name}_1"], result[f"{name}_2"]
        out.append((f"{name} on 2 workers", f"{two['s']:.1f} s, {two['model_loads']} model loads",
                    f"1 worker: {one['s']:.1f} s, {one['model_loads']} load ({result['shards']} shards, "
                    f"{result['images']} images)", "loads = workers"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=256, help="generated images")
    parser.add_argument("--shard-size", type=int, default=8, help="images per shard")
    args = parser.parse_args()
    print(json.dumps(run(args.count, args.shard_size)))


if __name__ == "__main__":
    main()
