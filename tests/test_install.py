"""Reproducible installs: the environment is the locked set, the locks honour pyproject.toml, and
the worker image's own steps (infra/Dockerfile → infra/install.sh) install a working precast."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).parent.parent


def _locked(*names: str) -> dict[str, Version]:
    pins = {}
    for name in names:
        for line in (ROOT / "infra" / name).read_text().splitlines():
            if line and not line.startswith("#"):
                package, _, version = line.partition("==")
                pins[canonicalize_name(package)] = Version(version)
    return pins


def _required(name: str, extras: frozenset[str] = frozenset(), seen: set[str] | None = None) -> set[str]:
    """`name` and every distribution it needs on this machine, transitively (markers evaluated)."""
    seen = set() if seen is None else seen
    key = canonicalize_name(name)
    if key in seen:
        return seen
    seen.add(key)
    for text in metadata.requires(name) or []:
        requirement = Requirement(text)
        markers = [{"extra": extra} for extra in extras or {""}]
        if requirement.marker is None or any(requirement.marker.evaluate(m) for m in markers):
            _required(requirement.name, frozenset(requirement.extras), seen)
    return seen


def test_the_environment_is_the_locked_set():
    """Every distribution precast (with its optional trackers and test tools) needs is locked, at
    the version installed."""
    locked = _locked("requirements.lock", "requirements-test.lock")
    needed = _required("precast", frozenset({"test", "mlflow", "wandb"})) - {"precast"}
    assert needed - set(locked) == set(), "needed but not locked: run infra/lock.sh"
    wrong = {name: (str(Version(metadata.version(name)).public), str(locked[name])) for name in needed
             if Version(Version(metadata.version(name)).public) != locked[name]}
    assert wrong == {}, "installed != locked (installed, locked): rerun infra/setup-venv.sh"


def test_the_locks_satisfy_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime, test = _locked("requirements.lock"), _locked("requirements-test.lock")
    assert set(runtime) & set(test) == set()  # the test tools never move a runtime pin
    extras = project["optional-dependencies"]
    for text, pins in [(t, runtime) for t in project["dependencies"] + extras["mlflow"] + extras["wandb"]] + \
                      [(t, test | runtime) for t in extras["test"]]:
        requirement = Requirement(text)
        version = pins.get(canonicalize_name(requirement.name))
        assert version is not None and requirement.specifier.contains(version, prereleases=True), (text, version)
    assert runtime["sqlalchemy"] < Version("2.1")  # Prefect 3.8.8's scheduler fails on 2.1


def _dockerfile_steps() -> list[tuple[str, str]]:
    text = (ROOT / "infra" / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0], line.split(None, 1)[1]) for line in lines]


def test_the_worker_image_steps_install_a_working_precast(tmp_path):
    """Replays infra/Dockerfile's WORKDIR, COPY and install RUN steps from this checkout (the build
    context) into a folder, with its /opt/venv a venv that sees this environment's packages, so the
    dependency phase finds everything locked already installed: a file the image forgets to copy,
    or an install step that fails, fails here as it fails `docker build`."""
    image, venv = tmp_path / "image", tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = (venv / "lib").glob("python3*/site-packages")
    (site / "environment.pth").write_text("\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n")
    workdir, ran = image, []
    for instruction, rest in _dockerfile_steps():
        if instruction == "WORKDIR":
            workdir = image / rest.lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
        elif instruction == "COPY":
            *sources, target = rest.split()
            for source in sources:
                into = workdir / target / Path(source).name if target.endswith("/") or len(sources) > 1 \
                    else workdir / target
                into.parent.mkdir(parents=True, exist_ok=True)
                copy = shutil.copytree if (ROOT / source).is_dir() else shutil.copy2
                copy(ROOT / source, into, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                             if (ROOT / source).is_dir() else {}))
        elif instruction == "RUN" and "infra/install.sh" in rest:
            done = subprocess.run(["bash", "-c", rest.replace("/opt/venv", str(venv))], cwd=workdir,
                                  capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, f"{rest}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            ran.append(rest.split()[2])
    assert ran == ["deps", "project"]
    env = {**os.environ, "PYTHONPATH": ""}
    check = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import benchmarks, flows.cli, tasks.demo.models, tasks.train; print(flows.cli.__file__)"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr[-3000:]
    assert Path(check.stdout.strip()).is_relative_to(image)  # the image's own copy, installed
