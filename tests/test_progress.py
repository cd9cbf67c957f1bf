"""Progress of every long stage: Prefect progress artifacts that change while the stage runs (read
through the real server's API during a run), a bar on a terminal (a tmux pane captures it) and
plain lines anywhere else."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parent.parent


def test_progress_artifacts_change_while_the_stages_run(prefect_server, make_config, monkeypatch):
    """While a pipeline runs, the encoder's progress artifact moves forward (one artifact, updated
    in place); off a terminal each stage also logs a plain line at every tenth of the way."""
    from prefect.artifacts import Artifact

    from flows import progress, stage_tasks
    from flows.pipeline import pipeline

    monkeypatch.setattr(progress, "ARTIFACT_SECONDS", 0.0)  # every change reaches the API
    lines: list[str] = []  # what a worker's log gets: pytest's stderr is no terminal
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger(progress.__name__).addHandler(handler)
    real = stage_tasks.encode_latents_task.fn

    def slowed(*args):  # long enough a stage to watch from outside
        time.sleep(0.4)
        return real(*args)

    monkeypatch.setattr(stage_tasks.encode_latents_task, "fn", slowed)
    config = make_config(dataset={"shard_size": 3}, training={"steps": 2, "sample_prompts": []})
    seen: dict[str, list[tuple[str, float, str]]] = {"ingest": [], "encode-latents": [], "training": []}
    finished = threading.Event()
    outcome = {}

    def run():
        outcome["state"] = pipeline(config=config, return_state=True)
        finished.set()

    started = time.time()
    threading.Thread(target=run).start()
    while not finished.wait(0.05):
        for stage, values in seen.items():
            artifact = Artifact.get(f"{stage}-progress")
            if artifact is not None and artifact.created.timestamp() >= started - 1:
                values.append((str(artifact.id), float(artifact.data), artifact.description))
    assert outcome["state"].is_completed(), outcome["state"].message
    latents = [(value, description) for _, value, description in dict.fromkeys(seen["encode-latents"])]
    values = [value for value, _ in latents]
    assert len(set(values)) >= 3 and values == sorted(values), latents  # moving forward while it ran
    assert values[0] < 100 and len({id_ for id_, _, _ in seen["encode-latents"]}) == 1  # one artifact, updated
    final = Artifact.get("encode-latents-progress")
    assert float(final.data) == 100.0
    assert final.description.startswith("encode-latents: 8/8 shards, 24/24 samples (")
    assert "done in" in final.description
    middle = next(d for v, d in latents if 0 < v < 100)
    assert "/8 shards" in middle and "ETA" in middle
    assert float(Artifact.get("ingest-progress").data) == 100.0
    assert Artifact.get("ingest-progress").description.startswith("ingest: ")
    assert Artifact.get("training-progress").description.startswith("training: 2/2 steps")
    logging.getLogger(progress.__name__).removeHandler(handler)
    assert "|" not in "".join(lines)  # no bar drawn into a log
    latents = [line for line in lines if line.startswith("encode-latents: ")]
    assert len(latents) == 8 and latents[-1].startswith("encode-latents: 8/8 shards, 24/24 samples"), lines
    assert "ETA" in latents[3] and "done in" in latents[-1] and any(l.startswith("ingest: 24/24 files") for l in lines)


def _config_file(make_config, folder: Path) -> Path:
    folder.mkdir(parents=True)
    config = make_config(root=str(folder / "store"))
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return path


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux to give the command a terminal")
def test_a_terminal_shows_a_bar(prefect_server, make_config, tmp_path):
    """`precast stage ingest` on a terminal (a tmux pane) draws a bar, not log lines."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "flows.cli", "stage", "ingest"]
    config = _config_file(make_config, tmp_path / "terminal")
    session = f"precast-{os.getpid()}"
    script = " ".join(command + [str(config)]) + "; echo exit=$?; sleep 60"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "40", "-e",
                    f"PREFECT_API_URL={env['PREFECT_API_URL']}", "-e", f"PYTHONPATH={ROOT}", "-c", str(ROOT), script],
                   check=True)
    try:
        deadline, screen = time.monotonic() + 240, ""
        while time.monotonic() < deadline and "exit=" not in screen:
            time.sleep(0.5)
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                                    text=True).stdout
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    assert "exit=0" in screen, screen
    assert "ingest: 100%|" in screen and "24/24" in screen, screen  # tqdm's bar, filled
    assert "ingest: 24/24 files" not in screen  # and no plain line beside it
