"""A machine that has never run precast: an empty home (no ~/.prefect), no Prefect server, or no
usable home at all (a container's user, a systemd unit). Each command either works the first time
or says at once what to set."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from storage.store import Store, UnusableFolder, home_problem

ROOT = Path(__file__).resolve().parent.parent
SLOW_DATABASE = Path(__file__).parent / "slow_database"  # its sitecustomize makes creating Prefect's tables slow


def _fresh_machine(home: Path, **settings: str) -> dict[str, str]:
    """This process's environment as a machine that has never run precast has it: HOME=`home`, no
    Prefect setting (so no server), no folder moved out of the home, and `settings`."""
    moved = ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "MPLCONFIGDIR", "HF_HOME", "HF_HUB_CACHE", "TORCH_HOME")
    env = {name: value for name, value in os.environ.items() if not name.startswith("PREFECT_") and name not in moved}
    return {**env, "HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONPATH": str(ROOT), **settings}


def _precast(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def _config_file(make_config, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = make_config(root=str(folder / "store"), training={"steps": 2, "validation_samples": 0})
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return path


def test_the_first_run_on_an_empty_home_waits_for_prefects_database_however_slow_it_is(make_config, tmp_path):
    """`precast run` with no server and an empty home: Prefect's temporary server must create its
    database first. Here creating it takes longer than the whole wait Prefect's client gives the
    server to start (as on 2 loaded cores); the database is made before the server is waited for,
    with a line saying so, and the run succeeds. Before, the server made it inside that wait and
    the run failed: "Timed out while attempting to connect to ephemeral Prefect API server"."""
    from prefect.settings.models.server.ephemeral import ServerEphemeralSettings

    wait = ServerEphemeralSettings.model_fields["startup_timeout_seconds"].default
    home = tmp_path / "home"
    home.mkdir()
    config = _config_file(make_config, tmp_path / "run")
    env = _fresh_machine(home, PRECAST_TEST_TABLES_DELAY=str(wait + 1),
                         PYTHONPATH=os.pathsep.join([str(SLOW_DATABASE), str(ROOT)]))
    done = _precast(["run", str(config), "--json"], env, tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stderr.count("creates Prefect's tables") == 1, done.stderr[-4000:]  # the delay was really there
    assert f"preparing Prefect's database at {home}/.prefect/prefect.db" in done.stderr
    assert "Prefect's database is ready" in done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["flow_run"] and Path(result["weights"].removeprefix("file://"), "adapter_model.safetensors").exists()


def test_without_a_usable_home_a_run_names_what_to_set_and_with_a_server_it_works(prefect_server, make_config,
                                                                                 tmp_path):
    """A home no one can write in (here a path through a file, which even root cannot create):
    without a server, Prefect's database has nowhere to go, and the command says at once which
    settings fix it (not a wait for a server that cannot start); with a server, nothing of the
    home is needed and the same command works, leaving no ./~ behind."""
    from prefect.settings import PREFECT_API_URL

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    config = _config_file(make_config, tmp_path / "run")
    env = _fresh_machine(blocked / "home")
    done = _precast(["stage", "ingest", str(config)], env, tmp_path)
    assert done.returncode == 1, done.stderr[-4000:]
    assert (f"precast: the home directory {blocked / 'home'} is not a folder this user can write in, so there is no "
            "~/.prefect for Prefect's database: set PREFECT_HOME to a writable folder (or HOME to a writable home), "
            "or PREFECT_API_URL to a running Prefect server") in done.stderr, done.stderr[-4000:]
    assert "Timed out" not in done.stderr and "Traceback" not in done.stderr

    done = _precast(["stage", "ingest", str(config)], {**env, "PREFECT_API_URL": PREFECT_API_URL.value()}, tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Failed to create the Prefect home directory" not in done.stderr, done.stderr[-4000:]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a-file", "run"]


def test_deploy_and_submit_without_a_server_say_to_set_one(make_config, tmp_path):
    """Deployments live on a server that workers poll: with none set, `precast deploy` and
    `precast submit` say so at once, rather than register on a temporary server that ends with
    the command."""
    home = tmp_path / "home"
    home.mkdir()
    config = _config_file(make_config, tmp_path / "run")
    for args, what in ((["deploy", str(config)], "deploy registers deployments"),
                       (["submit", "precast-pipeline/pipeline"], "submit runs a deployment")):
        done = _precast(args, _fresh_machine(home), tmp_path)
        assert (done.returncode, done.stderr) == (1, (
            f"precast: {what} on a Prefect server that workers poll, and none is set: set PREFECT_API_URL (and "
            "PREFECT_API_AUTH_STRING) to it; infra/local-stack.sh up starts one on this machine\n"))
    assert not (home / ".prefect" / "prefect.db").exists()


@pytest.fixture
def no_home(monkeypatch):
    """HOME unset for a user the system does not know, as a container's numeric user is."""
    def unknown(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", unknown)


def test_with_no_home_at_all_the_pipeline_and_the_remote_cache_name_what_to_set(no_home, monkeypatch, tmp_path,
                                                                               make_config, capsys):
    """No home directory at all: Prefect cannot even load (it reads the home as it is imported,
    whatever PREFECT_HOME says), so a pipeline command says at once to set HOME; a remote store's
    local copies are refused by PRECAST_CACHE and kept where it points."""
    from configs.schema import StorageConfig
    from flows.cli import main

    assert home_problem().startswith(f"HOME is unset and user {os.getuid()} has no entry")
    assert main(["stage", "ingest", str(_config_file(make_config, tmp_path / "run"))]) == 1
    assert capsys.readouterr().err == (
        f"precast: HOME is unset and user {os.getuid()} has no entry in the system's user database: set HOME to a "
        "folder this user can write in (Prefect, which the pipeline loads, needs one)\n")

    monkeypatch.delenv("PRECAST_CACHE", raising=False)
    store = Store(StorageConfig(root=f"memory://first-run-{os.getpid()}"))
    store.commit("shards/a.bin", b"the bytes")
    with pytest.raises(UnusableFolder, match=r"no ~/\.cache/precast for local copies of remote artifacts: set "
                                             r"PRECAST_CACHE to a writable folder"):
        store.local_path("shards/a.bin")
    monkeypatch.setenv("PRECAST_CACHE", str(tmp_path / "cache"))
    assert Path(store.local_path("shards/a.bin")).read_bytes() == b"the bytes"
