"""FLUX.2's references against its own pipelines: how each sizes a reference, and the transformer
call with the references' tokens after the target's at times 10, 20, … (klein; [dev] shares the
denoiser)."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from configs.schema import ModelConfig, TrainingConfig
from tasks.families import family_of
from tests.pipeline_calls import transformer_calls

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def klein(tiny_family):
    from diffusers import Flux2KleinPipeline

    model = ModelConfig(path=str(tiny_family("flux2-klein")))
    return model, Flux2KleinPipeline.from_pretrained(model.path)


def _patches(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:  # [B, h·w, 128] → [B, 128, h, w]
    return tokens.transpose(1, 2).reshape(len(tokens), -1, height, width)


@pytest.mark.parametrize("size", [(1500, 1000), (1000, 700), (333, 1000), (2048, 2048)])
def test_a_reference_is_sized_as_the_pipeline_sizes_it(klein, size, monkeypatch):
    """At 1024 (the pipeline's scale): downscaled only where larger than 1024², then cropped to
    sides that are multiples of 16, as the pipeline hands the picture to its image processor."""
    model, pipeline = klein
    seen = []
    preprocess = pipeline.image_processor.preprocess
    monkeypatch.setattr(pipeline.image_processor, "preprocess", lambda image, height=None, width=None, **kw: seen.append(
        (image.size, width, height)) or preprocess(image, height=height, width=width, **kw))
    embeds, _ = pipeline.encode_prompt(["make the background red"], device=CPU, max_sequence_length=32)
    pipeline(image=Image.new("RGB", size, (200, 30, 30)), prompt_embeds=embeds, height=32, width=32,
             num_inference_steps=1, output_type="latent")
    resized_width, resized_height, left, top, right, bottom = family_of(model).codec.references.box(*size, 1024)
    assert seen[0] == ((resized_width, resized_height), right - left, bottom - top)


def test_the_transformer_is_called_as_the_pipeline_calls_it_with_two_references(klein):
    """The pipeline's own call, recorded (a 96 × 64 target, references of 64 × 96 and 64 × 64):
    `predict` on its target patches with the references' patches as `reference_0`, `reference_1`
    gives its output for the target's tokens."""
    model, pipeline = klein
    family = family_of(model)
    embeds, _ = pipeline.encode_prompt(["make the background red"], device=CPU, max_sequence_length=32)
    calls = transformer_calls(pipeline)
    pipeline(image=[Image.new("RGB", (96, 64), (30, 200, 30)), Image.new("RGB", (64, 64), (30, 30, 200))],
             prompt_embeds=embeds, height=96, width=64, num_inference_steps=1, output_type="latent",
             generator=torch.Generator().manual_seed(0))
    (seen, output), *_ = calls
    target, first = (96 // 16) * (64 // 16), (64 // 16) * (96 // 16)
    tokens = seen["hidden_states"]
    assert tokens.shape[1] == target + first + 4 * 4
    assert seen["img_ids"][0, target, 0] == 10 and seen["img_ids"][0, target + first, 0] == 20
    text = {"qwen3_hidden": embeds, "reference_0": _patches(tokens[:, target:target + first], 64 // 16, 96 // 16),
            "reference_1": _patches(tokens[:, target + first:], 4, 4)}
    with torch.no_grad():
        ours = family.denoiser.predict(pipeline.transformer, _patches(tokens[:, :target], 96 // 16, 64 // 16), text,
                                       seen["timestep"] * 1000, **family.denoiser.call_options(TrainingConfig()))
    torch.testing.assert_close(ours, _patches(output[:, :target], 96 // 16, 64 // 16))


def test_pairs_train_klein_each_reference_encoded_as_the_pipeline_encodes_it(klein, tmp_path):
    """Edit pairs through every stage on the tiny klein: the reader's `reference_0` is what the
    pipeline's image processor and `_encode_vae_image` (argmax, patches, batch norm) make of the
    reference sized by the family's rule at the run's resolution; the run trains and draws its
    sample grid from a reference."""
    import hashlib

    from configs.schema import PipelineConfig
    from storage.store import Store
    from tasks.demo.data import write_edit_data
    from tasks.ingest.examine import REFERENCE
    from tasks.runner import run_direct
    from tasks.train.data import CachedFeatures

    model, pipeline = klein
    folder = write_edit_data(tmp_path / "pairs", count=4)
    config = PipelineConfig.model_validate({
        "storage": {"root": str(tmp_path / "store")}, "model": {"path": model.path},
        "dataset": {"sources": [{"path": str(folder / "targets"), "references": "files",
                                 "reference_path": str(folder / "references")}]},
        "text_encoding": {"dtype": "fp32", "max_length": 32},
        "latent_encoding": {"resolution": 128, "storage_dtype": "fp32", "batch_size": 4},
        "training": {"rank": 4, "alpha": 4, "steps": 2, "batch_size": 2, "validation_samples": 0,
                     "samples": {"prompts": ["make the background red"], "steps": 1,
                                 "references": [str(folder / "references" / "00002.png")]}}})
    done = run_direct(config)
    store = Store(config.storage)
    features = CachedFeatures(store, store.read_json(store.key(done["manifest"]["url"])), family_of(model))
    picture = Image.open(folder / "references" / "00002.png").convert("RGB")
    reference = hashlib.sha256((folder / "references" / "00002.png").read_bytes() + REFERENCE).hexdigest()
    sample = next(s for s, row in features.samples.items() if row["references"] == [reference])
    _, text, _ = features.batch([sample], torch.Generator().manual_seed(1), 0.0)
    sized = family_of(model).codec.references.picture(picture, 128)
    with torch.no_grad():
        want = pipeline._encode_vae_image(pipeline.image_processor.preprocess(sized, *sized.size[::-1]),
                                          torch.Generator())
    # (within the VAE's batch rounding: the stage encoded it beside other pictures, on this machine's
    # kernels; 0.006 seen on a fresh machine, against latents of about 1; flip is off)
    torch.testing.assert_close(text["reference_0"], want, rtol=1e-2, atol=1e-2)
    grid = Image.open(io.BytesIO(store.read_bytes(store.key(done["train"]["samples"][-1]))))
    assert grid.size == (128, 128)
