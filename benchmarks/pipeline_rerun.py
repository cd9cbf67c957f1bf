"""End-to-end wall time of the quickstart pipeline, first run vs an unchanged re-run.

Runs `precast run configs/quickstart.yaml` twice in a fresh working directory (tiny models and
demo data made first, outside the timing) and reports both times and their ratio, measured in the
same invocation. Usage: python -m benchmarks.pipeline_rerun [--count 200] [--steps 2000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from configs.schema import QUICKSTART
from flows.demo_data import write_demo_data
from flows.tiny_models import write_tiny_models


def timed_run(workdir: Path, overrides: list[str]) -> tuple[float, dict]:
    command = [sys.executable, "-m", "flows.cli", "run", str(QUICKSTART), "--json"]
    for item in overrides:
        command += ["--set", item]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=workdir, capture_output=True, text=True, check=True)
    return time.perf_counter() - started, json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=200, help="generated images")
    parser.add_argument("--steps", type=int, default=2000, help="training steps")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        write_tiny_models(workdir / "precast-demo/models/tiny-pixart-sigma")
        write_demo_data(workdir / "precast-demo/data", count=args.count)
        overrides = [f"training.steps={args.steps}"]
        first, result = timed_run(workdir, overrides)
        second, again = timed_run(workdir, overrides)
    assert again == result, "a re-run must return the same artifacts"
    print(json.dumps({"images": args.count, "steps": args.steps, "first_run_s": round(first, 1),
                      "rerun_s": round(second, 1), "rerun_ratio": round(second / first, 3)}))


if __name__ == "__main__":
    main()
