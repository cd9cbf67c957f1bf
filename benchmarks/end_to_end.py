"""End to end on a generated dataset: orchestration overhead, unchanged re-run, 10% new data.

One invocation, one workload: the quickstart config (tiny PixArt-Sigma-shaped models, 256 px
buckets, local store) with 256-sample shards on `--count` generated images. Every run is a fresh process talking to one
Prefect server, as on a cluster (the server's start-up is not counted):
- stages: the five stages called directly, in order, in one process without Prefect; the sum of
  their times is the stages' own compute (imports and start-up excluded);
- pipeline: `precast run` on a fresh store, wall time from process start to exit; overhead =
  (pipeline - stages) / pipeline: start-up, imports, Prefect flow and task orchestration;
- re-run: `precast run` again with nothing changed;
- 10% new data: `--count / 10` more images in the source folder, then `precast run` continuing
  the newest adapter (`training.init_from=latest`) for a tenth of the steps, as a nightly
  retraining does; its data stages encode only the new shard(s).
Usage: python -m benchmarks.end_to_end [--count 3000] [--steps 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import yaml

from benchmarks.stages import run_stages
from configs.schema import QUICKSTART, PipelineConfig, load_config
from flows.demo_data import write_demo_data
from flows.tiny_models import write_tiny_models

ROOT = Path(__file__).parents[1]
SHARD_SIZE = 256  # the quickstart's 32 shows sharding on a demo; real datasets use far larger shards


def workload(workdir: Path, name: str, store: str, steps: int, *overrides: str) -> Path:
    """Config file `<name>.yaml`: the quickstart with this workload's paths and steps."""
    config = load_config(QUICKSTART, [f"storage.root={workdir / store}", f"model.path={workdir / 'models'}",
                                      f"training.steps={steps}", f"dataset.shard_size={SHARD_SIZE}", *overrides])
    raw = config.model_dump(mode="json")
    raw["dataset"]["sources"] = [{**raw["dataset"]["sources"][0], "path": str(workdir / "data")}]
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@contextmanager
def prefect_server(home: Path) -> Iterator[dict[str, str]]:
    """A Prefect API server of its own (SQLite under `home`); yields the environment to reach it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                               "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2)
                break
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    raise RuntimeError("the Prefect server did not start")
                time.sleep(0.5)
        yield env
    finally:
        server.terminate()
        server.wait(timeout=60)


def timed_process(command: list[str], env: dict[str, str]) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - started, done.stdout


def run(count: int = 3000, steps: int = 1000) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        write_tiny_models(workdir / "models")
        write_demo_data(workdir / "data", count=count)
        with prefect_server(workdir / "prefect") as env:
            precast = [sys.executable, "-m", "flows.cli", "run"]
            stages = json.loads(timed_process(
                [sys.executable, "-m", "benchmarks.end_to_end", "--worker", str(workload(workdir, "direct", "direct", steps))],
                env)[1].strip().splitlines()[-1])
            config = workload(workdir, "pipeline", "store", steps)
            pipeline_s, _ = timed_process(precast + [str(config)], env)
            rerun_s, _ = timed_process(precast + [str(config)], env)
            write_demo_data(workdir / "data", count=count + count // 10)  # the first `count` are unchanged
            nightly = workload(workdir, "nightly", "store", max(1, steps // 10), "training.init_from=latest")
            added_s, _ = timed_process(precast + [str(nightly)], env)
    compute = sum(stages.values())
    return {
        "images": count, "steps": steps, "stage_seconds": {k: round(v, 2) for k, v in stages.items()},
        "stages_s": round(compute, 2), "pipeline_s": round(pipeline_s, 2),
        "overhead": round((pipeline_s - compute) / pipeline_s, 4),
        "rerun_s": round(rerun_s, 2), "rerun_vs_pipeline": round(rerun_s / pipeline_s, 4),
        "added_10pct_s": round(added_s, 2), "added_10pct_vs_pipeline": round(added_s / pipeline_s, 4),
    }


def rows(result: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(figure, measured, compared with, target) for the summary table."""
    return [
        ("orchestration overhead", f"{result['overhead']:.1%}", f"pipeline {result['pipeline_s']:.1f} s vs stages "
         f"{result['stages_s']:.1f} s ({result['images']} images, {result['steps']} steps)", "< 15%"),
        ("unchanged re-run", f"{result['rerun_vs_pipeline']:.1%}", f"{result['rerun_s']:.1f} s vs the full run", "< 5%"),
        ("+10% images", f"{result['added_10pct_vs_pipeline']:.1%}",
         f"{result['added_10pct_s']:.1f} s vs the full run", "< 20%"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=3000, help="generated images")
    parser.add_argument("--steps", type=int, default=1000, help="training steps of the first run")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # run the stages directly on this config file
    args = parser.parse_args()
    if args.worker:
        _, seconds = run_stages(PipelineConfig.model_validate(yaml.safe_load(Path(args.worker).read_text())))
        print(json.dumps(seconds))
        return
    print(json.dumps(run(args.count, args.steps)))


if __name__ == "__main__":
    main()
