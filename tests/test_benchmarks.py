"""The benchmark suite's command: what it runs, what it writes."""

from __future__ import annotations

import datetime
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.__main__ import main


def test_bench_writes_dated_json_and_markdown_table(tmp_path, capsys):
    assert main(["--only", "ingest", "--quick", "--out", str(tmp_path)]) == 0
    stem = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}-{socket.gethostname()}-quick"
    report = json.loads((tmp_path / f"{stem}.json").read_text())
    assert report["quick"] and set(report["results"]) == {"ingest"}
    assert report["machine"]["cpus"] and report["machine"]["torch"]
    assert report["results"]["ingest"]["precast_ingest_images_per_s"] > 0
    table = (tmp_path / f"{stem}.md").read_text()
    assert "| ingest | ingest | " in table and "img/s" in table
    assert table in capsys.readouterr().out


def test_bench_refuses_an_unknown_benchmark(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--only", "ingest,nope", "--out", str(tmp_path)])
    assert exit_.value.code == 2 and "unknown benchmark(s): nope" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_one_benchmark_imports_only_what_it_needs(tmp_path):
    """A GPU machine has no Prefect or Dask: `--only gpu` imports neither (without CUDA it records
    that it skipped)."""
    probe = (f"import sys; from benchmarks.__main__ import main; main(['--only', 'gpu', '--out', {str(tmp_path)!r}]); "
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'prefect', 'distributed', 'dask', 's3fs', 'moto'}))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).parents[1])
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
    assert "skipped" in next(tmp_path.glob("*.md")).read_text()


def test_the_video_direction_benchmark_scores_its_own_clips_as_moving_the_named_way():
    """Its made-up clips move the blob the way their word names, and its score says so: a sample
    the same as its clip counts as the named way; the clip with its frames swapped, as another."""
    import torch

    from benchmarks.video_direction import DIRECTIONS, clips, moved

    colours = torch.randn(2, 3, generator=torch.Generator().manual_seed(7))
    directions = torch.arange(48) % len(DIRECTIONS)
    made = clips(directions, colours, torch.Generator().manual_seed(0))
    assert moved(made, colours, directions) == (48, 0)
    assert moved(made.flip(2), colours, directions) == (0, 48)
