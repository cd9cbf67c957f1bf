"""FLUX.1 Kontext against its own pipeline: how it sizes a reference, and its transformer call with
the reference's tokens beside the target's."""

from __future__ import annotations

import hashlib
import io

import pytest
import torch
from PIL import Image

from configs.schema import ModelConfig, TrainingConfig
from tasks.families import family_of
from tasks.families.flux import unpack
from tasks.ingest.examine import REFERENCE
from tests.pipeline_calls import transformer_calls

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kontext(tiny_family):
    from diffusers import FluxKontextPipeline

    model = ModelConfig(path=str(tiny_family("flux-kontext")))
    return model, FluxKontextPipeline.from_pretrained(model.path)


def _text(pipeline, prompt: str) -> dict[str, torch.Tensor]:
    embeds, pooled, _ = pipeline.encode_prompt([prompt], prompt_2=None, device=CPU, max_sequence_length=512)
    return {"t5_hidden": embeds, "clip_l_pooled": pooled}


@pytest.mark.parametrize("size", [(1024, 1024), (1500, 600), (600, 1500), (900, 800), (333, 1000)])
def test_a_reference_is_sized_as_the_pipeline_sizes_it(kontext, size, monkeypatch):
    """At 1024 (the pipeline's scale) the size the family gives a reference is the one the
    pipeline resizes it to before its VAE (the preferred resolution nearest its ratio)."""
    model, pipeline = kontext
    seen = []
    resize = pipeline.image_processor.resize
    monkeypatch.setattr(pipeline.image_processor, "resize", lambda image, height, width, **kw: seen.append(
        (width, height)) or resize(image, height, width, **kw))
    text = _text(pipeline, "make the background red")
    pipeline(image=Image.new("RGB", size, (200, 30, 30)), prompt_embeds=text["t5_hidden"],
             pooled_prompt_embeds=text["clip_l_pooled"], max_area=32 * 32, num_inference_steps=1, output_type="latent")
    width, height, *crop = family_of(model).codec.references.box(*size, 1024)
    assert seen[0] == (width, height) and crop == [0, 0, width, height]  # (preprocess resizes to it again)


def test_the_transformer_is_called_as_kontext_calls_it_with_a_reference(kontext):
    """The pipeline's own call, recorded (a 96 × 64 target, a 48 × 80 reference at its own size):
    `predict` on its target latents with the reference's latents as `reference_0` gives its output
    for the target's tokens."""
    model, pipeline = kontext
    family = family_of(model)
    text = _text(pipeline, "make the background red")
    calls = transformer_calls(pipeline)
    pipeline(image=Image.new("RGB", (80, 48), (30, 200, 30)), prompt_embeds=text["t5_hidden"],
             pooled_prompt_embeds=text["clip_l_pooled"], height=96, width=64, max_area=96 * 64, _auto_resize=False,
             guidance_scale=3.5, num_inference_steps=1, output_type="latent", generator=torch.Generator().manual_seed(0))
    (seen, output), = calls
    target = (96 // 8) * (64 // 8) // 4
    assert seen["hidden_states"].shape[1] == target + (48 // 8) * (80 // 8) // 4
    assert (seen["img_ids"][target:, 0] == 1).all() and (seen["img_ids"][:target, 0] == 0).all()
    latents = unpack(seen["hidden_states"][:, :target], 96 // 8, 64 // 8)
    reference = unpack(seen["hidden_states"][:, target:], 48 // 8, 80 // 8)
    with torch.no_grad():
        ours = family.denoiser.predict(pipeline.transformer, latents, {**text, "reference_0": reference},
                                       seen["timestep"] * 1000,
                                       **family.denoiser.call_options(TrainingConfig(guidance_scale=3.5)))
    torch.testing.assert_close(ours, unpack(output[:, :target], 96 // 8, 64 // 8))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_family):
    """Edit pairs (tasks.demo.data.write_edit_data) trained through every stage on the tiny Kontext."""
    from configs.schema import PipelineConfig
    from tasks.demo.data import write_edit_data
    from tasks.runner import run_direct

    folder = write_edit_data(tmp_path_factory.mktemp("kontext") / "pairs", count=8)
    config = PipelineConfig.model_validate({
        "storage": {"root": str(folder / "store")}, "model": {"path": str(tiny_family("flux-kontext"))},
        "dataset": {"sources": [{"path": str(folder / "targets"), "references": "files",
                                 "reference_path": str(folder / "references")}], "shard_size": 4},
        "text_encoding": {"dtype": "fp32", "max_length": 32},
        "latent_encoding": {"resolution": 128, "storage_dtype": "fp32", "batch_size": 4},
        "training": {"rank": 4, "alpha": 4, "steps": 4, "batch_size": 2, "validation_samples": 0,
                     "samples": {"prompts": ["make the background red"], "steps": 2,
                                 "references": [str(folder / "references" / "00006.png")]}}})
    return folder, config, run_direct(config)


def test_pairs_train_through_every_stage_each_reference_encoded_as_the_pipeline_encodes_it(trained, kontext):
    """Each target's manifest row names its reference's latents; the reader hands them to the
    transformer beside the target's as `reference_0`, their mean normalised, and they are what the
    pipeline's own image processor and `_encode_vae_image` make of the reference at the size the
    family gives it at the run's resolution."""
    from storage.store import Store
    from tasks.train.data import CachedFeatures

    folder, config, done = trained
    _, pipeline = kontext
    store = Store(config.storage)
    manifest = store.read_json(store.key(done["manifest"]["url"]))
    features = CachedFeatures(store, manifest, family_of(config.model))
    assert len(features.samples) == 8 and all(len(row["references"]) == 1 for row in features.samples.values())
    assert all("+" in group for group in features.buckets)  # batched by the target's bucket and the reference's
    assert done["train"]["final_loss"] == done["train"]["final_loss"]  # finite: trained
    family = family_of(config.model)
    for name in ("00000", "00003"):
        picture = Image.open(folder / "references" / f"{name}.png").convert("RGB")
        width, height, *_ = family.codec.references.box(*picture.size, 128)
        pixels = pipeline.image_processor.preprocess(pipeline.image_processor.resize(picture, height, width),
                                                     height, width)
        with torch.no_grad():
            want = pipeline._encode_vae_image(pixels, generator=torch.Generator().manual_seed(0))
        sample = next(s for s, row in features.samples.items()
                      if row["references"][0] == hashlib.sha256(
                          (folder / "references" / f"{name}.png").read_bytes() + REFERENCE).hexdigest())
        _, text, _ = features.batch([sample], torch.Generator().manual_seed(1), 0.0)
        got = text["reference_0"]
        if not torch.allclose(got, want, atol=1e-4):  # the reader flipped it with its target
            got = got.flip(-1)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_redrawn_reference_encodes_its_pair_alone(trained):
    """A nightly run after one reference was redrawn: the new reference's latents and its target's
    (its id changed) are encoded, and that target's caption; nothing else."""
    from tasks.runner import run_direct

    folder, config, _ = trained
    redrawn = Image.open(folder / "references" / "00004.png").convert("RGB").transpose(Image.Transpose.ROTATE_180)
    redrawn.save(folder / "references" / "00004.png")
    again = run_direct(config, until="manifest")
    assert again["ingest"]["work"]["units_read"] == 1
    assert again["encode-latents"]["work"]["samples_encoded"] == 2
    assert again["encode-text"]["work"]["samples_encoded"] == 1
    assert again["manifest"]["samples"] == 8


def test_samples_are_drawn_from_references_as_the_pipeline_draws_them_with_the_adapter(trained, capfd):
    """The run's sample grid is drawn from its reference at the run's size; `precast sample
    --reference` draws what FluxKontextPipeline, the adapter loaded by its own `load_lora_weights`,
    draws from the reference resized as training resized references (its own 1024² resize left off)."""
    import numpy as np
    from diffusers import FluxKontextPipeline

    from flows.cli import main
    from storage.store import Store
    from tasks.runs.sampling import sample_run

    folder, config, done = trained
    store = Store(config.storage)
    grid = Image.open(io.BytesIO(store.read_bytes(store.key(done["train"]["samples"][-1]))))
    assert grid.size == (128, 128)
    reference = Image.open(folder / "references" / "00006.png").convert("RGB")
    ours = sample_run(done["train"]["run"], ["make the background red"], steps=2, pictures=[reference],
                      setting="--reference", device="cpu")
    exported = folder / "lora.safetensors"
    assert main(["export", done["train"]["run"], "--format", "diffusers", "--out", str(exported)]) == 0
    pipeline = FluxKontextPipeline.from_pretrained(config.model.path)
    pipeline.load_lora_weights(str(exported))
    sides = family_of(config.model).codec.references.box(*reference.size, 128)[:2]
    theirs = pipeline(image=reference.resize(sides, Image.Resampling.LANCZOS), _auto_resize=False,
                      prompt=["make the background red"], negative_prompt=[""], max_sequence_length=32, height=128,
                      width=128, max_area=128 * 128, num_inference_steps=2, guidance_scale=4.5,
                      generator=torch.Generator().manual_seed(0)).images[0]
    np.testing.assert_array_equal(np.asarray(ours[0][0]), np.asarray(theirs))
    with pytest.raises(ValueError, match=r"--reference: 1 pictures for 2 prompts"):
        sample_run(done["train"]["run"], ["a", "b"], pictures=[reference], setting="--reference", device="cpu")
    assert main(["sample", done["train"]["run"], "--prompt", "a", "--reference", str(folder / "none.png"),
                 "--out", str(folder / "out.png"), "--device", "cpu"]) == 1


def test_the_plan_counts_a_pairs_reference_tokens_as_the_trainers_step_holds_them(tiny_family):
    """`precast plan` for Kontext on pairs: the step it counts on fake tensors, the reference's
    latents beside the target's, is what the trainer's own step holds on real ones, and more than
    the same step without references."""
    import contextlib
    from dataclasses import replace

    from configs.schema import PipelineConfig
    from tasks.train.network import trainable_network
    from tasks.train.plan import config_shapes, footprint, step_ledger

    run = PipelineConfig(dataset={"sources": [{"path": "unused", "references": "files", "reference_path": "refs"}]},
                         model={"path": str(tiny_family("flux-kontext"))}, latent_encoding={"resolution": 64},
                         training={"batch_size": 2, "mixed_precision": "bf16", "base_precision": "bf16"})
    family = family_of(run.model)
    shapes = config_shapes(run, family)
    assert shapes.references == ((16, 8, 8),)  # the rule's size of a square reference at 64 px: 64 × 64
    planned = footprint(run.model, run.training, family, shapes, "bf16", "none")
    network = trainable_network(run.model, family, run.training)
    real = step_ledger(run.model, family, run.training, network, contextlib.nullcontext(), shapes, planned.batch)
    assert planned.step == pytest.approx(real.peak, rel=0.02)
    alone = footprint(run.model, run.training, family, replace(shapes, references=(), sides=shapes.sides[:1]), "bf16",
                      "none")
    assert planned.tokens == alone.tokens + 16 and planned.step > alone.step


def test_a_half_precision_runs_grid_is_drawn_from_a_reference(trained):
    """The run's sample grid with a bf16 transformer (a bf16 base's): the reference's pixels reach
    the fp32 VAE in bf16 (the pipeline casts them to the prompts') and its latents come back to join
    the noise; and Kontext refuses two reference folders before any stage (its pipeline takes one)."""
    from diffusers import FluxTransformer2DModel

    from configs.schema import PipelineConfig
    from storage.store import Store
    from tasks.encode.latents import check_latent_encoding
    from tasks.runs.sampling import sample_grid
    from tasks.train.data import CachedFeatures

    folder, config, done = trained
    store = Store(config.storage)
    family = family_of(config.model)
    features = CachedFeatures(store, store.read_json(store.key(done["manifest"]["url"])), family)
    transformer = FluxTransformer2DModel.from_pretrained(config.model.path, subfolder="transformer",
                                                         torch_dtype=torch.bfloat16)
    reference = Image.open(folder / "references" / "00006.png").convert("RGB")
    samples = sample_grid(config.model, family, transformer, [features.text.prompt("make the background red")],
                          [features.text.prompt("")], 1, 3.5, 1.0, 0, 128, 1, [reference], "training.samples.references")
    assert samples.grid().size == (128, 128)
    two = PipelineConfig.model_validate({**config.model_dump(), "dataset": {"sources": [{
        "path": "t", "references": "files", "reference_path": ["a", "b"]}]}})
    with pytest.raises(ValueError, match=r"reference_path names 2 folders, a reference each, and FLUX.1 Kontext takes "
                                         r"at most 1"):
        check_latent_encoding(two.model, two.latent_encoding, two.dataset)
