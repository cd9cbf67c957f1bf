"""FLUX.1, SD3 and Chroma through the whole pipeline: the stages cache each family's encoders and
latents and train its default LoRA; the adapter loads with the pipeline's own `load_lora_weights`
as PEFT merges it, samples, and ComfyUI's key map (restated in tests/comfyui_flow.py) patches the
same weights."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from flows.cli import main
from storage.store import Store
from tasks.families import family_of
from tasks.runner import run_direct
from tasks.runs.folder import FinishedRun
from tasks.runs.sampling import sample_run
from tests.comfyui_flow import apply_lora, comfy_weights, maps_for

FAMILIES = ("flux-dev", "sd3", "chroma")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each family's tiny folder, their VAEs untrained (this checks paths and numbers, not pictures)."""
    from tasks.demo.flow_models import write_tiny_family

    root = tmp_path_factory.mktemp("flow-families")
    flux = write_tiny_family(root / "flux-dev", "flux-dev", vae_steps=0)
    return {"flux-dev": flux, "sd3": write_tiny_family(root / "sd3", "sd3", vae_steps=0),
            "chroma": write_tiny_family(root / "chroma", "chroma", vae_from=flux)}


@pytest.fixture(scope="module")
def runs(models, demo_data, tmp_path_factory):
    """Each family's LoRA run on the demo data, with its defaults (encoders, max lengths, targets)."""
    from configs.schema import PipelineConfig

    out = {}
    for family, folder in models.items():
        config = PipelineConfig.model_validate({
            "storage": {"root": str(tmp_path_factory.mktemp(family) / "store")},
            "dataset": {"sources": [{"path": demo_data}], "shard_size": 10},
            "model": {"path": str(folder)}, "text_encoding": {"dtype": "fp32"},
            "latent_encoding": {"resolution": 256, "storage_dtype": "fp32", "batch_size": 4},
            "training": {"rank": 4, "alpha": 2, "steps": 4, "batch_size": 2, "learning_rate": 1e-2,
                         "validation_samples": 4, "validation_every": 2,
                         "sample_prompts": ["a red circle on a blue background"], "sample_steps": 2},
            "execution": {"retries": 0, "retry_delay_seconds": 0}})
        out[family] = config, run_direct(config)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_its_default_lora_on_its_own_caches(runs, family):
    config, records = runs[family]
    spec = family_of(config.model)
    assert set(records["text_fingerprints"]) == {encoder.name for encoder in spec.text_encoders}
    lineage = FinishedRun.at(records["train"]["run"]).lineage
    assert lineage["training"]["target_modules"] == list(spec.lora_targets)
    assert records["train"]["final_loss"] == records["train"]["final_loss"]  # finite: not NaN
    assert records["train"]["samples"], "the run drew its sample grid"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_adapter_loads_with_load_lora_weights_as_peft_merges_it(runs, models, family, tmp_path):
    config, records = runs[family]
    spec = family_of(config.model)
    out = tmp_path / "lora.safetensors"
    assert main(["export", records["train"]["run"], "--format", "diffusers", "--out", str(out)]) == 0
    pipeline = spec.pipeline_class().from_pretrained(models[family])
    before = {k: v.clone() for k, v in pipeline.transformer.state_dict().items()}
    pipeline.load_lora_weights(str(out))
    pipeline.fuse_lora()
    pipeline.unload_lora_weights()
    loaded = pipeline.transformer.state_dict()
    store = Store(config.storage)
    merged = PeftModel.from_pretrained(spec.load_transformer(config.model),
                                       store.path(store.key(records["train"]["url"]))).merge_and_unload().state_dict()
    assert set(loaded) == set(merged)
    assert any(not torch.equal(loaded[k], before[k]) for k in before)  # the adapter changed the weights
    for key in merged:
        torch.testing.assert_close(loaded[key], merged[key], rtol=1e-5, atol=1e-6)
    grid = sample_run(records["train"]["run"], ["a red circle on a blue background"], steps=2, device="cpu")
    assert grid.size == (256, 256)


@pytest.mark.parametrize("family", FAMILIES)
def test_comfyui_export_patches_what_peft_merges(runs, family, tmp_path):
    config, records = runs[family]
    out = tmp_path / "lora.safetensors"
    assert main(["export", records["train"]["run"], "--format", "comfyui", "--out", str(out)]) == 0
    spec = family_of(config.model)
    base = spec.load_transformer(config.model)
    diffusers_map, key_map = maps_for(base)
    weights = comfy_weights(base.state_dict(), diffusers_map)
    assert apply_lora(weights, load_file(out), key_map) == []  # every key is read
    store = Store(config.storage)
    merged = PeftModel.from_pretrained(base, store.path(store.key(records["train"]["url"]))).merge_and_unload()
    expected = comfy_weights(merged.state_dict(), diffusers_map)
    assert set(weights) == set(expected)
    for key in weights:
        torch.testing.assert_close(weights[key], expected[key], rtol=1e-5, atol=1e-6)
