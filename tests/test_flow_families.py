"""FLUX.1, SD3, Chroma, Z-Image, Qwen-Image, FLUX.2 [dev] and [klein] and Wan (pictures as one-frame
clips) through the whole pipeline: the stages cache each family's encoders and latents and train
its default LoRA; the adapter loads with the pipeline's own `load_lora_weights` as PEFT merges it,
samples, and ComfyUI's key map (restated in tests/comfyui_flow.py) patches the same weights."""

from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest
import torch
from peft import PeftModel
from PIL import Image
from safetensors.torch import load_file

from flows.cli import main
from storage.shards import RaggedShard
from storage.store import Store
from tasks.families import family_of
from tasks.runner import run_direct
from tasks.runs.folder import FinishedRun
from tasks.runs.sampling import sample_run
from tests.comfyui_flow import apply_lora, comfy_weights, maps_for

FAMILIES = ("flux", "sd3", "chroma", "zimage", "qwen-image", "flux2-dev", "flux2-klein", "wan", "wan2.2-ti2v",
            "wan2.2-a14b")


def _options(config) -> list[str]:
    """The CLI's storage options of `config`'s root (the S3 endpoint of an S3 root)."""
    return [f"--option={key}={value}" for key, value in config.storage.options.items()]


def _adapter_folder(config, records, tmp_path) -> str:
    """The run's PEFT adapter folder on this machine (a copy, from an S3 root)."""
    store = Store(config.storage)
    store.fs.get(store.path(store.key(records["train"]["url"])) + "/", str(tmp_path / "adapter") + "/", recursive=True)
    return str(tmp_path / "adapter")


@pytest.fixture(scope="module")
def models(tiny_family):
    """Each family's tiny folder, their VAEs random (this checks paths and numbers, not pictures)."""
    return {family: tiny_family(family) for family in FAMILIES}


# the configurations users run, one per family: Flux through the Prefect flow on an S3 root with
# bf16 encoders, parallel shards and a bf16 base; SD3 with fp16 encoders (T5's wo kept fp32) and an
# int8 base; Chroma in fp32 through the direct runner; Z-Image with a bf16 Qwen3, parallel shards,
# bf16 autocast and recomputed activations; Qwen-Image with an fp16 Qwen2.5-VL, a bf16 base and
# activations kept in host memory; FLUX.2 [dev] with its Mistral streamed to the device layer by
# layer (sequential offload, as a 24B encoder is on most cards) in bf16 and an int8 base under bf16
# autocast; FLUX.2 [klein] with a bf16 Qwen3, parallel shards and an fp8 base; Wan with bf16 umT5,
# parallel shards and a bf16 base; Wan 2.2 TI2V (its 48-channel VAE, a timestep a token) with fp16
# umT5 and bf16 autocast; Wan 2.2 A14B's low-noise expert (transformer_2/, below the boundary) with EMA
SETTINGS = {
    "flux": dict(flow=True, s3=True, text={"dtype": "bf16"}, shards=3,
                 training={"mixed_precision": "bf16", "base_precision": "bf16"}),
    "sd3": dict(flow=False, s3=False, text={"dtype": "fp16"}, shards=2, training={"base_precision": "int8"}),
    "chroma": dict(flow=False, s3=False, text={"dtype": "fp32"}, shards=1, training={}),
    "zimage": dict(flow=False, s3=False, text={"dtype": "bf16"}, shards=2,
                   training={"mixed_precision": "bf16", "gradient_checkpointing": "recompute"}),
    "flux2-dev": dict(flow=False, s3=False, text={"dtype": "bf16", "offload": "sequential"}, shards=1,
                      training={"mixed_precision": "bf16", "base_precision": "int8"}),
    "flux2-klein": dict(flow=False, s3=False, text={"dtype": "bf16"}, shards=2,
                        training={"mixed_precision": "bf16", "base_precision": "fp8"}),
    "qwen-image": dict(flow=False, s3=False, text={"dtype": "fp16"}, shards=1,
                       training={"mixed_precision": "bf16", "base_precision": "bf16",
                                 "gradient_checkpointing": "offload"}),
    "wan": dict(flow=False, s3=False, text={"dtype": "bf16"}, shards=2,
                training={"mixed_precision": "bf16", "base_precision": "bf16"}),
    "wan2.2-ti2v": dict(flow=False, s3=False, text={"dtype": "fp16"}, shards=1, training={"mixed_precision": "bf16"}),
    "wan2.2-a14b": dict(flow=False, s3=False, text={"dtype": "fp32"}, shards=1, training={"ema_decay": 0.9},
                        model={"expert": "low_noise"}),
}


@pytest.fixture(scope="module")
def runs(models, demo_data, tmp_path_factory, request):
    """Each family's LoRA run on the demo data, with its defaults (encoders, max lengths, targets)
    and its SETTINGS."""
    from configs.schema import PipelineConfig
    from flows.pipeline import pipeline

    out = {}
    for family, folder in models.items():
        settings = SETTINGS[family]
        storage = {"root": str(tmp_path_factory.mktemp(family) / "store")}
        if settings["s3"]:
            import s3fs

            endpoint = request.getfixturevalue("s3_endpoint")
            s3fs.S3FileSystem(endpoint_url=endpoint).mkdir(f"precast-{family}")
            storage = {"root": f"s3://precast-{family}/store", "options": {"endpoint_url": endpoint}}
        if settings["flow"]:
            request.getfixturevalue("prefect_server")
        config = PipelineConfig.model_validate({
            "storage": storage, "dataset": {"sources": [{"path": demo_data}], "shard_size": 10},
            "model": {"path": str(folder), **settings.get("model", {})}, "text_encoding": settings["text"],
            "latent_encoding": {"resolution": 256, "storage_dtype": "fp32", "batch_size": 4},
            "training": {"rank": 4, "alpha": 2, "steps": 4, "batch_size": 2, "learning_rate": 1e-2,
                         "validation_samples": 4, "validation_every": 2,
                         "sample_prompts": ["a red circle on a blue background"], "sample_steps": 2,
                         **settings["training"]},
            "execution": {"retries": 0, "retry_delay_seconds": 0, "max_parallel_shards": settings["shards"]}})
        flowed = pipeline(config=config) if settings["flow"] else None
        out[family] = config, run_direct(config)  # after the flow: its records, every stage found done
        assert flowed is None or flowed["run"] == out[family][1]["train"]["run"]
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_its_default_lora_on_its_own_caches(runs, family):
    config, records = runs[family]
    spec = family_of(config.model)
    assert set(records["text_fingerprints"]) == {encoder.name for encoder in spec.text.encoders}
    lineage = FinishedRun.at(records["train"]["run"], config.storage.options).lineage
    assert lineage["training"]["lora"]["target_modules"] == list(spec.denoiser.lora_targets)
    assert records["train"]["final_loss"] == records["train"]["final_loss"]  # finite: not NaN
    assert records["train"]["samples"], "the run drew its sample grid"
    assert lineage["training"]["base_precision"] == config.training.base_precision
    if config.text_encoding.dtype != "fp32":  # each encoder's parallel shards carry its one precision record
        store = Store(config.storage)
        for encoder, fingerprint in records["text_fingerprints"].items():
            numerics = json.loads(store.read_verified(f"cache/text/{fingerprint}/numerics.json"))
            shards = store.list(f"cache/text/{fingerprint}", ".safetensors")
            assert len(shards) == 3 and all(RaggedShard(store.local_path(key)).meta["numerics"] == numerics
                                            for key in shards), encoder
            assert numerics["dtype"] == config.text_encoding.dtype and numerics["cosine_min"] > 0.99, encoder


def _loads_as_peft_merges(config, records, folder, tmp_path) -> None:
    """The run's `precast export --format diffusers`, read by its pipeline's own `load_lora_weights`
    and fused, changes the weights to what PEFT's merge of its adapter gives."""
    spec = family_of(config.model)
    out = tmp_path / "lora.safetensors"
    assert main(["export", records["train"]["run"], "--format", "diffusers", "--out", str(out), *_options(config)]) == 0
    pipeline = spec.sampler.pipeline_class().from_pretrained(folder)
    slot = spec.denoiser.folder(config.model)  # an expert's: transformer_2 for the low-noise one
    before = {k: v.clone() for k, v in getattr(pipeline, slot).state_dict().items()}
    untouched = {k: v.clone() for k, v in pipeline.transformer.state_dict().items()} if slot != "transformer" else {}
    pipeline.load_lora_weights(str(out), **({"load_into_transformer_2": True} if slot == "transformer_2" else {}))
    pipeline.fuse_lora(components=[slot])
    pipeline.unload_lora_weights()
    loaded = getattr(pipeline, slot).state_dict()
    assert all(torch.equal(value, pipeline.transformer.state_dict()[key]) for key, value in untouched.items())
    merged = PeftModel.from_pretrained(spec.denoiser.load(config.model),
                                       _adapter_folder(config, records, tmp_path)).merge_and_unload().state_dict()
    assert set(loaded) == set(merged)
    assert any(not torch.equal(loaded[k], before[k]) for k in before)  # the adapter changed the weights
    for key in merged:
        torch.testing.assert_close(loaded[key], merged[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_adapter_loads_with_load_lora_weights_as_peft_merges_it(runs, models, family, tmp_path):
    config, records = runs[family]
    _loads_as_peft_merges(config, records, models[family], tmp_path)
    grid = sample_run(records["train"]["run"], ["a red circle on a blue background"], steps=2, device="cpu",
                      options=config.storage.options).grid()
    assert grid.size == (256, 256)
    # the model at a path given (a copy elsewhere): the run's other model settings kept, as its expert
    shutil.copytree(models[family], tmp_path / "copy")
    assert main(["sample", records["train"]["run"], "--model", str(tmp_path / "copy"), "--prompt",
                 "a red circle on a blue background", "--steps", "2", "--device", "cpu", "--out", str(tmp_path / "x.png"),
                 *_options(config)]) == 0
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "x.png").convert("RGB")), np.asarray(grid))


@pytest.mark.parametrize("family", FAMILIES)
def test_comfyui_export_patches_what_peft_merges(runs, family, tmp_path):
    config, records = runs[family]
    out = tmp_path / "lora.safetensors"
    assert main(["export", records["train"]["run"], "--format", "comfyui", "--out", str(out), *_options(config)]) == 0
    spec = family_of(config.model)
    base = spec.denoiser.load(config.model)
    diffusers_map, key_map = maps_for(base)
    weights = comfy_weights(base.state_dict(), diffusers_map)
    assert apply_lora(weights, load_file(out), key_map) == []  # every key is read
    merged = PeftModel.from_pretrained(base, _adapter_folder(config, records, tmp_path)).merge_and_unload()
    expected = comfy_weights(merged.state_dict(), diffusers_map)
    assert set(weights) == set(expected)
    for key in weights:
        torch.testing.assert_close(weights[key], expected[key], rtol=1e-5, atol=1e-6)


def test_a_dora_exports_for_the_pipelines_loader_as_peft_merges_it(runs, models, tmp_path):
    """`training.lora.dora` (PEFT's DoRA) on Chroma's caches: the diffusers export carries its
    magnitudes, and the pipeline's own loader fuses what PEFT merges; ComfyUI's export is refused,
    naming why."""
    from safetensors.torch import load

    from tasks.runs.export import export_adapter

    base_config, _ = runs["chroma"]
    config = base_config.model_copy(update={"training": base_config.training.updated({"lora.dora": True})})
    records = run_direct(config)  # its caches are the LoRA run's: only training runs
    assert all(records[stage]["work"]["shards_encoded"] == 0 for stage in ("encode-text", "encode-latents"))
    assert any(key.endswith("lora_magnitude_vector") for key in load(FinishedRun.at(records["train"]["run"]).adapter()[1]))
    _loads_as_peft_merges(config, records, models["chroma"], tmp_path)
    with pytest.raises(ValueError, match="DoRA, whose magnitudes ComfyUI's LoRA loader applies against"):
        export_adapter(records["train"]["run"], "comfyui")


def test_a_lokr_samples_through_a_pipeline_whose_loader_reads_lora_alone(runs, models):
    """A LoKr on Chroma's caches: ChromaPipeline's load_lora_weights reads LoRA weights alone, so
    `precast sample` merges the adapter with PEFT and draws through the pipeline with that transformer."""
    base_config, records = runs["chroma"]
    config = base_config.model_copy(update={"training": base_config.training.updated({"lora.adapter": "lokr"})})
    lokr = run_direct(config)["train"]["run"]
    drawn = [sample_run(run, ["a red circle on a blue background"], steps=2, device="cpu",
                        options=config.storage.options).grid() for run in (lokr, records["train"]["run"])]
    assert drawn[0].size == drawn[1].size and drawn[0].tobytes() != drawn[1].tobytes()


def test_true_cfg_scale_guides_flux_samples_as_the_pipeline_does(runs, models, tmp_path):
    """FLUX.1-dev's guidance_scale is its guidance input; true_cfg_scale adds classifier-free
    guidance with empty negatives, as FluxPipeline's own call with the adapter loaded does."""
    config, records = runs["flux"]
    out = tmp_path / "lora.safetensors"
    assert main(["export", records["train"]["run"], "--format", "diffusers", "--out", str(out), *_options(config)]) == 0
    pipeline = family_of(config.model).sampler.pipeline_class().from_pretrained(models["flux"])
    pipeline.load_lora_weights(str(out))
    prompt = "a red circle on a blue background"
    expected = pipeline([prompt], negative_prompt=[""], true_cfg_scale=3.0, guidance_scale=4.5, height=256, width=256,
                        num_inference_steps=2, max_sequence_length=512, generator=torch.Generator().manual_seed(0)).images[0]
    guided = sample_run(records["train"]["run"], [prompt], steps=2, true_cfg_scale=3.0, device="cpu",
                        options=config.storage.options).grid()
    plain = sample_run(records["train"]["run"], [prompt], steps=2, device="cpu", options=config.storage.options).grid()
    np.testing.assert_array_equal(np.asarray(guided), np.asarray(expected))
    assert not np.array_equal(np.asarray(plain), np.asarray(guided))


def test_a_chroma_runs_samples_drawn_from_prompts_are_its_sample_grid(runs):
    """`precast sample` reads prompts as the run's sample grid read its cache: T5 masked, and the
    transformer given a boolean mask (the pipeline's own float mask would not mask)."""
    config, records = runs["chroma"]
    store = Store(config.storage)
    grid = Image.open(io.BytesIO(store.read_bytes(store.key(records["train"]["samples"][-1]))))
    drawn = sample_run(records["train"]["run"], config.training.samples.prompts, steps=config.training.samples.steps,
                       guidance_scale=config.training.guidance_scale, seed=config.training.seed, device="cpu").grid()
    difference = np.abs(np.asarray(grid, dtype=float) - np.asarray(drawn, dtype=float))
    assert difference.mean() < 0.5, f"{difference.mean():.2f} RGB units apart on average"


def test_a_wan_comfyui_export_is_wans_own_layout_which_wan_pipeline_loads_as_peft_merges_it(runs, models, tmp_path):
    """ComfyUI converts no diffusers names for Wan: the export names Wan's own modules, and
    diffusers' loader of that layout (`_convert_non_diffusers_wan_lora_to_diffusers`, alphas
    folded in) gives the weights PEFT merges."""
    config, records = runs["wan"]
    out = tmp_path / "lora.safetensors"
    assert main(["export", records["train"]["run"], "--format", "comfyui", "--out", str(out), *_options(config)]) == 0
    tensors = load_file(out)
    assert all(key.startswith("diffusion_model.blocks.") and ".attn1." not in key for key in tensors)
    assert "diffusion_model.blocks.0.self_attn.q.lora_A.weight" in tensors
    pipeline = family_of(config.model).sampler.pipeline_class().from_pretrained(models["wan"])
    pipeline.load_lora_weights(str(out))
    pipeline.fuse_lora()
    pipeline.unload_lora_weights()
    merged = PeftModel.from_pretrained(family_of(config.model).denoiser.load(config.model),
                                       _adapter_folder(config, records, tmp_path)).merge_and_unload().state_dict()
    loaded = pipeline.transformer.state_dict()
    for key in merged:
        torch.testing.assert_close(loaded[key], merged[key], rtol=1e-5, atol=1e-6)
