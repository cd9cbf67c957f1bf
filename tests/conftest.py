"""Shared fixtures: tiny real models, generated data, and configs on a temporary store."""

from __future__ import annotations

import os
import socket
import tempfile

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
# local copies of remote shards go to a throwaway folder, not the user's cache
os.environ.setdefault("PRECAST_CACHE", tempfile.mkdtemp(prefix="precast-test-cache-"))

from configs.schema import PipelineConfig  # noqa: E402
from tasks.demo.data import write_demo_data  # noqa: E402
from tasks.demo.models import write_tiny_models  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> str:
    # a random VAE: these tests check the path, not the pictures (test_learning trains one)
    return str(write_tiny_models(tmp_path_factory.mktemp("models") / "tiny-pixart-sigma", vae_steps=0))


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> str:
    return str(write_demo_data(tmp_path_factory.mktemp("data") / "demo", count=24))


SAMPLE_PROMPT = "a red circle on a blue background"


@pytest.fixture(scope="session")
def cached_manifest(tmp_path_factory, tiny_models, demo_data):
    """A store whose manifest is built (every feature cached, SAMPLE_PROMPT encoded): (its config,
    the manifest's key). Tests copy the store to a root of their own before training on it."""
    from storage.store import Store
    from tasks.manifest import build_manifest
    from tasks.runner import run_direct

    root = tmp_path_factory.mktemp("cached") / "store"
    config = PipelineConfig.model_validate({
        "storage": {"root": str(root)}, "dataset": {"sources": [{"path": demo_data}], "shard_size": 10},
        "model": {"path": tiny_models}, "text_encoding": {"dtype": "fp32"},
        "latent_encoding": {"resolution": 256, "storage_dtype": "fp32"},
        "training": {"sample_prompts": [SAMPLE_PROMPT]}})
    done = run_direct(config, until="encode-latents")
    manifest = build_manifest(config.storage, done["ingest"]["id"], done["text_fingerprints"],
                              done["vae_fingerprint"], [SAMPLE_PROMPT])
    return config, Store(config.storage).key(manifest["url"])


@pytest.fixture
def make_config(tmp_path, tiny_models, demo_data):
    """A small config on a fresh store under tmp_path; keyword sections override defaults."""

    def make(root: str | None = None, source: str | None = None, **sections) -> PipelineConfig:
        raw = {
            "storage": {"root": root or str(tmp_path / "store")},
            "dataset": {"sources": [{"path": source or demo_data}], "shard_size": 10},
            "model": {"path": tiny_models},
            "text_encoding": {"dtype": "fp32", "batch_tokens": 256},
            "latent_encoding": {"resolution": 256, "storage_dtype": "fp32", "batch_size": 4},
            "training": {"rank": 4, "alpha": 4, "steps": 6, "batch_size": 2, "learning_rate": 1e-3,
                         "sample_prompts": ["a red circle on a blue background"], "sample_steps": 2},
            "execution": {"retries": 0, "retry_delay_seconds": 0},
        }
        for name, values in sections.items():
            raw.setdefault(name, {}).update(values)
        return PipelineConfig.model_validate(raw)

    return make


@pytest.fixture(scope="session")
def prefect_server():
    """A real Prefect API server (SQLite, temporary) for the session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 API on loopback (moto server); credentials come from the environment."""
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    yield f"http://127.0.0.1:{port}"
    server.stop()
