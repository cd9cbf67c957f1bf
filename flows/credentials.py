"""Credentials: the store's and the Dask cluster's.

Storage credentials from Prefect Secret blocks: `storage.credentials_block` names one whose JSON
value holds fsspec options (for s3: {"key": …, "secret": …}). Registered with the store when flows/
is imported (flows/__init__.py), so storage/ never imports Prefect; a process given the config
pickled gets the resolved options with it (storage.store.fsspec_options).

The cluster's: mutual TLS for `execution.cluster` (`cluster_security`), from files that
`write_cluster_certificates` makes or from a Secret block."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any


@functools.lru_cache(maxsize=8)
def secret_block_credentials(name: str, field: str = "storage.credentials_block") -> dict[str, Any]:
    # Prefect loads only when a block is named: `precast` sets its settings first (flows/cli.py)
    from prefect.blocks.system import Secret

    try:
        return Secret.load(name).get()  # its caller checks that it is a JSON object
    except ValueError as error:
        raise ValueError(f"{field} {name!r}: no such Prefect Secret block") from error


CLUSTER_FILES = {"ca": "ca.pem", "cert": "cert.pem", "key": "key.pem"}


def cluster_security(cluster_tls: str):
    """The Dask `Security` of a client of a tls:// cluster, from `execution.cluster_tls`: a folder
    of CLUSTER_FILES or 'secret:<name>' (a Secret block holding the three PEM texts). Mutual TLS:
    distributed verifies the peer's certificate against the CA both ways."""
    from distributed import Security

    if cluster_tls.startswith("secret:"):
        name = cluster_tls.removeprefix("secret:")
        pems = secret_block_credentials(name, "execution.cluster_tls")
        where = f"execution.cluster_tls: Secret block {name!r}"
        if not isinstance(pems, dict) or (missing := set(CLUSTER_FILES) - set(pems)):
            raise ValueError(f"{where} must hold a JSON object with {sorted(CLUSTER_FILES)} (PEM texts)")
    else:
        folder = Path(cluster_tls).expanduser()
        missing = [name for name in CLUSTER_FILES.values() if not (folder / name).is_file()]
        if missing:
            raise ValueError(f"execution.cluster_tls {cluster_tls}: no {', '.join(missing)} there "
                             "(`precast certificates DIR` writes them)")
        pems = {part: (folder / name).read_text() for part, name in CLUSTER_FILES.items()}
        where = f"execution.cluster_tls {cluster_tls}"
    for part, text in pems.items():
        if part in CLUSTER_FILES and "-----BEGIN" not in str(text):
            raise ValueError(f"{where}: {part} is not PEM text")
    return Security(require_encryption=True, tls_ca_file=pems["ca"], tls_client_cert=pems["cert"],
                    tls_client_key=pems["key"])


def write_cluster_certificates(folder: Path, days: int = 365) -> Path:
    """A cluster's CA (ca.pem; its key ca-key.pem, which stays with the operator) and a member
    certificate signed by it (cert.pem, key.pem) for the scheduler, every worker and every client:
    `dask scheduler|worker --tls-ca-file ca.pem --tls-cert cert.pem --tls-key key.pem`, and
    `execution.cluster_tls` naming the folder. An existing CA is kept, so a second call issues
    another member certificate of the same cluster. Keys are written owner-only."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def pem_key(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    def write_private(path: Path, data: bytes) -> None:
        path.touch(mode=0o600, exist_ok=True)
        path.chmod(0o600)
        path.write_bytes(data)

    def certificate(subject: str, key, issuer: x509.Name, signer, ca: bool) -> x509.Certificate:
        return (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                .issuer_name(issuer).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
                .sign(signer, hashes.SHA256()))

    if (folder / "ca.pem").exists() and (folder / "ca-key.pem").exists():
        ca_key = serialization.load_pem_private_key((folder / "ca-key.pem").read_bytes(), None)
        ca_cert = x509.load_pem_x509_certificate((folder / "ca.pem").read_bytes())
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "precast cluster CA")])
        ca_cert = certificate("precast cluster CA", ca_key, name, ca_key, ca=True)
        write_private(folder / "ca-key.pem", pem_key(ca_key))
        (folder / "ca.pem").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    key = ec.generate_private_key(ec.SECP256R1())
    member = certificate("precast cluster member", key, ca_cert.subject, ca_key, ca=False)
    write_private(folder / "key.pem", pem_key(key))
    (folder / "cert.pem").write_bytes(member.public_bytes(serialization.Encoding.PEM))
    return folder
