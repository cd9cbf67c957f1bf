"""Every benchmark in one run: `python -m benchmarks [--quick] [--only NAME,...]`.

Runs the benchmarks below one after another in this process (each measures its own baselines in
the same run, so a noisy machine hurts both sides of every ratio alike), then writes
`benchmarks/results/<date>-<host>[-quick].json` (every figure, the machine, the code's commit) and
a markdown table beside it, and prints the table. `--quick` uses smaller workloads: under 10
minutes on 2 CPU cores. The GPU benchmark is skipped, with a message, where there is no GPU.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
# name: (module, full workload, quick workload; None: not run with --quick); each module is imported when it
# runs, so `--only gpu` needs only what that one imports (a GPU machine has no Prefect or Dask)
SUITE = {
    "ingest": ("ingest_throughput", {"count": 600}, {"count": 600}),
    "s3_ingest": ("s3_ingest", {"count": 400}, {"count": 200}),
    "ingest_memory": ("ingest_memory", {"sizes": (20_000, 80_000)}, {"sizes": (5_000, 20_000)}),
    "ingest_workers": ("ingest_workers", {"count": 400}, {"count": 200, "partition_size": 25}),
    "text_encoding": ("text_encoding", {}, {"captions": 256, "reference_captions": 64}),
    "latent_encoding": ("latent_encoding", {}, {"count": 48, "repeat": 2}),
    "training": ("training", {}, {"steps": 20, "count": 32}),
    "training_modes": ("training_modes", {}, {"steps": 8, "count": 32, "repeat": 1}),  # 7 processes, not 14
    "encoder_workers": ("encoder_workers", {"count": 512}, {"count": 128}),
    "pipeline_shape": ("pipeline_shape", {"count": 600, "sizes": (1000, 20000)}, {"count": 300, "sizes": (1000, 5000)}),
    "end_to_end": ("end_to_end", {"count": 4000, "steps": 2000, "repeat": 3}, {"count": 2000, "steps": 600, "repeat": 1}),  # one run a side, not best of 2
    "gpu": ("gpu", {}, {"captions": 128, "repeat": 2, "max_batch": 32}),
    "demo_world": ("demo_world", {}, None),  # seven demo trainings per family, about 75 minutes for the six
    "family_costs": ("family_costs", {}, {}),  # published shapes on the meta device: about 15 s either way
    # the plan of every family at its published shapes and against the H100's steps: about 15 minutes on 2 cores
    "memory_plan": ("memory_plan", {}, {"families": ("PixArt-Σ XL/2",), "check": False}),
    "activation_growth": ("activation_growth", {}, {"frames": (21, 41)}),  # 81 frames: about 3 minutes on 2 cores
    "video": ("video", {}, None),  # writing the 720p and 4K sources takes most of its 2 to 3 minutes
    "video_direction": ("video_direction", {}, None),  # two trainings on made-up latents: about 7 minutes on 2 cores
}


def module(name: str):
    return importlib.import_module(f"benchmarks.{SUITE[name][0]}")


def machine() -> dict[str, Any]:
    import torch

    memory = next((int(line.split()[1]) // 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal")), None) if Path("/proc/meminfo").exists() else None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        commit = ""
    return {"host": socket.gethostname(), "cpus": os.cpu_count(), "memory_mib": memory,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__, "python": platform.python_version(), "commit": commit}


def table(results: dict[str, Any]) -> str:
    lines = ["| benchmark | figure | measured | compared with | target |", "| --- | --- | --- | --- | --- |"]
    for name, result in results.items():
        for figure, measured, compared, target in module(name).rows(result):
            lines.append(f"| {name} | {figure} | {measured} | {compared} | {target} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller workloads: under 10 minutes on 2 CPU cores")
    parser.add_argument("--only", help=f"comma-separated subset of: {', '.join(SUITE)}")
    parser.add_argument("--out", default=str(RESULTS), help="folder for the JSON and markdown results")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else list(SUITE)
    if unknown := set(names) - set(SUITE):
        parser.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
    started = datetime.datetime.now(datetime.timezone.utc)
    results, seconds = {}, {}
    for name in names:
        _, full, quick = SUITE[name]
        if args.quick and quick is None:
            print(f"[{name}] skipped with --quick: run it with --only {name}", flush=True)
            continue
        print(f"[{name}] running", flush=True)
        began = time.perf_counter()
        results[name] = module(name).run(**(quick if args.quick else full))
        seconds[name] = round(time.perf_counter() - began, 1)
        print(f"[{name}] {seconds[name]} s: {json.dumps(results[name])}", flush=True)
    info = machine()
    stem = f"{started:%Y-%m-%d}-{info['host']}" + ("-quick" if args.quick else "")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"started": started.isoformat(timespec="seconds"), "quick": args.quick, "machine": info,
              "seconds": seconds, "results": results}
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    markdown = (f"Benchmarks {started:%Y-%m-%d} on {info['host']} ({info['cpus']} CPU cores, "
                f"{info['gpu'] or 'no GPU'}; commit {info['commit']}; {'quick' if args.quick else 'full'} workloads, "
                f"{sum(seconds.values()):.0f} s)\n\n{table(results)}\n")
    (out / f"{stem}.md").write_text(markdown)
    print(markdown)
    print(f"results: {out / stem}.json, .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
