"""Shared fixtures: tiny real models, generated data, and configs on a temporary store."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
# local copies of remote shards go to a throwaway folder, not the user's cache
os.environ.setdefault("PRECAST_CACHE", tempfile.mkdtemp(prefix="precast-test-cache-"))

from configs.schema import PipelineConfig  # noqa: E402
from tasks.demo.data import write_demo_data  # noqa: E402
from tasks.demo.models import write_tiny_models  # noqa: E402
from tasks.train.rendezvous import free_port  # noqa: E402


def pytest_collection_modifyitems(items):
    """Tests marked slow first, the longest first (`slow(minutes=…)` on 2 cores; a stable sort: the
    rest keep their order). infra/test.sh's processes take whole files in this order
    (`--no-loadscope-reorder`), so the long files start at once and the short ones fill in around
    them; sorted by their count of tests, as xdist does by default, the few-test trainings met at the
    end, one process each, minutes late."""
    def minutes(item) -> float:
        marker = item.get_closest_marker("slow")
        return marker.kwargs.get("minutes", 1) if marker else 0

    items.sort(key=lambda item: -minutes(item))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> str:
    # a random VAE: these tests check the path, not the pictures (the demo sets one by hand)
    return str(write_tiny_models(tmp_path_factory.mktemp("models") / "tiny-pixart-sigma", random_vae=True))


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory, request):
    """The tiny model folder of a family by its demo name (`tasks.demo.flow_models.FAMILIES`,
    `pixart-sigma`: `tiny_models`, or `pixart-alpha`: the same models under PixArtAlphaPipeline),
    each written once a session, its VAE random."""
    import json
    import shutil

    from tasks.demo.flow_models import write_tiny_family

    root = tmp_path_factory.mktemp("families")

    def folder(name: str) -> Path:
        if name == "pixart-sigma":
            return Path(request.getfixturevalue("tiny_models"))
        if name == "pixart-alpha":
            if not (root / name).exists():
                shutil.copytree(folder("pixart-sigma"), root / name)
                index = root / name / "model_index.json"
                index.write_text(json.dumps({**json.loads(index.read_text()), "_class_name": "PixArtAlphaPipeline"}))
            return root / name
        return write_tiny_family(root / name, name, random_vae=True)

    return folder


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> str:
    return str(write_demo_data(tmp_path_factory.mktemp("data") / "demo", count=24))


SAMPLE_PROMPT = "a red circle on a blue background"


def _cached(root, models: str, data: str) -> tuple[PipelineConfig, str]:
    """A store under `root` whose manifest for `models` is built (every feature cached,
    SAMPLE_PROMPT encoded): (its config, the manifest's key)."""
    from storage.store import Store
    from tasks.manifest import build_manifest
    from tasks.runner import run_direct

    config = PipelineConfig.model_validate({
        "storage": {"root": str(root)}, "dataset": {"sources": [{"path": data}], "shard_size": 10},
        "model": {"path": models}, "text_encoding": {"dtype": "fp32"},
        "latent_encoding": {"resolution": 256, "storage_dtype": "fp32"},
        "training": {"sample_prompts": [SAMPLE_PROMPT]}})
    done = run_direct(config, until="encode-latents")
    manifest = build_manifest(config.storage, done["ingest"]["id"], done["text_fingerprints"],
                              done["vae_fingerprint"], [SAMPLE_PROMPT])
    return config, Store(config.storage).key(manifest["url"])


@pytest.fixture(scope="session")
def cached_manifest(tmp_path_factory, tiny_models, demo_data):
    """PixArt's cached store (`_cached`). Tests copy the store to a root of their own before
    training on it."""
    return _cached(tmp_path_factory.mktemp("cached") / "store", tiny_models, demo_data)


@pytest.fixture(scope="session")
def family_manifests(tmp_path_factory, demo_data, tiny_family):
    """A flow-matching family's cached store (`_cached`) by its demo name, built when first asked
    for (its tiny models' VAE untrained: these check the math, not the pictures)."""
    built = {}

    def cached(family: str) -> tuple[PipelineConfig, str]:
        if family not in built:
            folder = tmp_path_factory.mktemp(f"cached-{family}")
            built[family] = _cached(folder / "store", str(tiny_family(family)), demo_data)
        return built[family]

    return cached


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


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 API on loopback (moto server); credentials come from the environment."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    yield f"http://127.0.0.1:{port}"
    server.stop()
