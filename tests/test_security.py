"""The doors of a precast cluster, tried on loopback as an outsider would: each refuses a client
without the credentials it was set up with (docs/security.md)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from configs.schema import ExecutionConfig
from flows.credentials import cluster_security, write_cluster_certificates
from tasks.train.rendezvous import free_port

DASK = str(Path(sys.executable).with_name("dask"))


def _tls(folder: Path) -> list[str]:
    return ["--tls-ca-file", str(folder / "ca.pem"), "--tls-cert", str(folder / "cert.pem"),
            "--tls-key", str(folder / "key.pem")]


def _connect(address: str, security=None) -> None:
    """Connect a client as an outsider would. Asynchronous, in one event loop of this thread:
    each refused synchronous Client leaves an IO-loop thread behind, and on a loaded machine the
    next one's thread then missed distributed's 10 s start-up wait."""
    from distributed import Client

    async def attempt() -> None:
        client = Client(address, security=security, asynchronous=True, timeout=5)
        try:
            await client
        finally:
            await client.close()

    asyncio.run(attempt())


def _workers(client) -> int:
    return len(client.scheduler_info(n_workers=-1)["workers"])


def test_a_tls_dask_cluster_refuses_clients_and_workers_without_its_certificate(tmp_path):
    """A scheduler and worker started as the README's multi-node steps start them (`precast
    certificates`, `dask scheduler|worker --tls-…`) run a precast client's task; a client without
    a certificate, one speaking plain TCP, one holding another CA's certificate, and a worker with
    another CA's certificate are all refused, and the stranger worker never joins."""
    from distributed import Client

    ours, theirs = write_cluster_certificates(tmp_path / "ours"), write_cluster_certificates(tmp_path / "theirs")
    assert (ours / "key.pem").stat().st_mode & 0o777 == 0o600 and (ours / "ca-key.pem").stat().st_mode & 0o777 == 0o600
    port = free_port()
    address = f"tls://127.0.0.1:{port}"
    started = [subprocess.Popen([DASK, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--protocol", "tls",
                                 *_tls(ours), "--no-dashboard"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        started.append(subprocess.Popen([DASK, "worker", address, *_tls(ours), "--nthreads", "1", "--no-dashboard"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        config = ExecutionConfig(cluster=address, cluster_tls=str(ours))
        with Client(address, security=cluster_security(config.cluster_tls), timeout=60) as client:
            client.wait_for_workers(1, timeout=60)
            assert client.submit(sum, [1, 2]).result(timeout=60) == 3

            with pytest.raises(TypeError, match="TLS expects a `ssl_context`"):
                _connect(address)  # no certificate: it cannot even offer one
            with pytest.raises(OSError):
                _connect(f"tcp://127.0.0.1:{port}")
            with pytest.raises(OSError):
                _connect(address, cluster_security(str(theirs)))

            stranger = subprocess.Popen([DASK, "worker", address, *_tls(theirs), "--nthreads", "1", "--no-dashboard",
                                         "--death-timeout", "8"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            started.append(stranger)
            assert stranger.wait(timeout=60) != 0  # it gives up: the scheduler never answered it
            assert _workers(client) == 1
    finally:
        for process in reversed(started):
            process.terminate()
        for process in started:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def test_a_cluster_beyond_loopback_needs_tls_and_its_credentials(tmp_path):
    """Plain tcp:// is accepted on loopback only; tls:// needs cluster_tls, whose folder must hold
    the three PEM files; each refusal says what to do."""
    assert ExecutionConfig(cluster="tcp://127.0.0.1:8786").cluster_tls is None
    with pytest.raises(ValidationError, match="listens beyond this machine without TLS"):
        ExecutionConfig(cluster="tcp://10.0.0.5:8786")
    with pytest.raises(ValidationError, match="set cluster_tls"):
        ExecutionConfig(cluster="tls://10.0.0.5:8786")
    with pytest.raises(ValidationError, match="plain tcp:// but cluster_tls is set"):
        ExecutionConfig(cluster="tcp://127.0.0.1:8786", cluster_tls=str(tmp_path))
    with pytest.raises(ValueError, match=r"no ca\.pem, cert\.pem, key\.pem there \(`precast certificates DIR`"):
        cluster_security(str(tmp_path))
    folder = write_cluster_certificates(tmp_path / "tls")
    (folder / "cert.pem").write_text("not a certificate")
    with pytest.raises(ValueError, match="cert is not PEM text"):
        cluster_security(str(folder))


def test_cluster_credentials_from_a_prefect_secret_block(prefect_server, tmp_path):
    """`cluster_tls: secret:<name>` reads the three PEM texts from a Secret block: the same
    Security as the files give; a block without them is refused by name."""
    from prefect.blocks.system import Secret

    folder = write_cluster_certificates(tmp_path / "tls")
    pems = {part: (folder / f"{part}.pem").read_text() for part in ("ca", "cert", "key")}
    Secret(value=pems).save("precast-cluster-tls", overwrite=True)
    from_block, from_files = cluster_security("secret:precast-cluster-tls"), cluster_security(str(folder))
    assert (from_block.tls_ca_file, from_block.tls_client_cert, from_block.tls_client_key) == \
        (from_files.tls_ca_file, from_files.tls_client_cert, from_files.tls_client_key)
    assert from_block.require_encryption
    Secret(value={"ca": pems["ca"]}).save("precast-cluster-half", overwrite=True)
    with pytest.raises(ValueError, match="'precast-cluster-half' must hold a JSON object with"):
        cluster_security("secret:precast-cluster-half")
    with pytest.raises(ValueError, match="execution.cluster_tls 'nope': no such Prefect Secret block"):
        cluster_security("secret:nope")


TRAINING_GROUP = '''
import json, os, socket, sys
import torch.multiprocessing as mp
from tasks.train.distributed import Distributed

def rank(local, address, out):
    group = Distributed.start(local, 2, local, address, "cpu", 60)
    if local == 0:
        port = int(address.rsplit(":", 1)[1])
        reached = {}
        for host in ("127.0.0.1", "127.0.0.2"):  # both this host; only the first is the advertised address
            with socket.socket() as probe:
                probe.settimeout(5)
                reached[host] = probe.connect_ex((host, port)) == 0
        json.dump({"reached": reached, "gloo": os.environ.get("GLOO_SOCKET_IFNAME")}, open(out, "w"))
    group.close()

if __name__ == "__main__":
    mp.spawn(rank, args=(sys.argv[1], sys.argv[2]), nprocs=2)
'''


def test_the_training_store_listens_on_the_advertised_interface_only(tmp_path):
    """Rank 0's c10d store (no authentication in its protocol) answers on the address the group
    meets at and not on this host's other addresses, as torch's own would; gloo is pinned to that
    address's interface."""
    script = tmp_path / "group.py"
    script.write_text(TRAINING_GROUP)
    out = tmp_path / "reached.json"
    address = f"127.0.0.1:{free_port()}"
    root = Path(__file__).parents[1]
    subprocess.run([sys.executable, str(script), address, str(out)], check=True, timeout=300, cwd=root,
                   env={**os.environ, "PYTHONPATH": str(root)})
    assert json.loads(out.read_text()) == {"reached": {"127.0.0.1": True, "127.0.0.2": False}, "gloo": "lo"}


def test_credentials_in_storage_options_are_refused_naming_them():
    """storage.options travels with the config (deployment parameters, run pages, lineage): a
    credential there is refused by name, at any depth; options that only say where credentials
    come from are kept."""
    from configs.schema import StorageConfig

    with pytest.raises(ValidationError, match=r"options holds credentials \(key, secret\)"):
        StorageConfig(options={"key": "AKIA", "secret": "s3cr3t"})
    with pytest.raises(ValidationError, match=r"\(client_kwargs\.aws_secret_access_key\).*storage\.credentials_block"):
        StorageConfig(options={"client_kwargs": {"aws_secret_access_key": "s3cr3t"}})
    with pytest.raises(ValidationError, match=r"\(target_options\.token\)"):
        StorageConfig(options={"target_options": {"token": "ya29.secret"}})
    kept = {"endpoint_url": "http://127.0.0.1:5555", "anon": False, "token": "google_default"}
    assert StorageConfig(options=kept).options == kept
