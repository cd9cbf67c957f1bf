"""FLUX.1 through the family seam, against `FluxPipeline`'s own functions: packing, image ids,
the text encoders' outputs as `encode_prompt` gives them, and the transformer called as the
pipeline calls it."""

from __future__ import annotations

import pytest
import torch
from diffusers import FluxPipeline

from configs.schema import ModelConfig, TextEncodingConfig, TrainingConfig
from tasks.encode.text import encode_captions
from tasks.families import family_of
from tasks.families.buckets import area_buckets
from tasks.families.flux import Flux, image_ids, pack, unpack
from tests.pipeline_calls import transformer_calls


def test_packing_and_image_ids_are_the_pipelines():
    latents = torch.randn(2, 16, 12, 20)
    packed = pack(latents)
    assert torch.equal(packed, FluxPipeline._pack_latents(latents, 2, 16, 12, 20))
    assert torch.equal(unpack(packed, 12, 20), latents)
    # the pipeline unpacks from pixel sides (its VAE downsamples 8×)
    assert torch.equal(FluxPipeline._unpack_latents(packed, 12 * 8, 20 * 8, 8), latents)
    assert torch.equal(image_ids(12, 20, torch.device("cpu"), torch.float32),
                       FluxPipeline._prepare_latent_image_ids(2, 6, 10, "cpu", torch.float32))


def test_area_buckets_have_sides_of_whole_tokens_and_the_target_area():
    for resolution in (256, 512, 1024):
        table = area_buckets(resolution)
        assert table["1.0000"] == [resolution, resolution]
        for ratio, (height, width) in table.items():
            assert height % 16 == 0 and width % 16 == 0 and abs(float(ratio) - height / width) < 1e-4
            assert abs(height * width / resolution ** 2 - 1) < 0.07
        assert min(map(float, table)) == 0.25 and max(map(float, table)) == 4.0


@pytest.fixture(scope="module")
def flux_dev(tmp_path_factory) -> ModelConfig:
    from tasks.demo.flow_models import write_tiny_family

    return ModelConfig(path=str(write_tiny_family(tmp_path_factory.mktemp("flux") / "flux", "flux",
                                                  random_vae=True)))


def test_the_cache_holds_what_encode_prompt_gives_the_transformer(flux_dev):
    """Every output, fp32: T5's states at every one of the 512 padded positions (the pipeline
    passes no mask), and CLIP-L's pooled vector; a caption past the limit is cut as the pipeline cuts it."""
    family = family_of(flux_dev)
    assert isinstance(family, Flux) and family.default_max_length(flux_dev) == 512
    text = TextEncodingConfig(dtype="fp32", device="cpu", numerics_samples=0)
    prompts = ["a red circle on a blue background", "stripes " * 520, ""]
    cached = {spec.name: encode_captions(prompts, flux_dev, text, spec)[0] for spec in family.text_encoders}
    pipeline = FluxPipeline.from_pretrained(flux_dev.path)
    embeds, pooled, _ = pipeline.encode_prompt(prompts, prompt_2=None, max_sequence_length=512)
    for index in range(len(prompts)):
        assert cached["t5"]["hidden"][index].shape == embeds[index].shape == (512, embeds.shape[-1])
        torch.testing.assert_close(cached["t5"]["hidden"][index], embeds[index], rtol=1e-4, atol=5e-5)  # batching
        torch.testing.assert_close(cached["clip_l"]["pooled"][index], pooled[index][None])


def test_the_transformer_is_called_as_the_pipeline_calls_it(flux_dev):
    """The pipeline's own call, recorded: its packed latents, timestep and guidance given to
    `predict` unpacked and in the schedule's units give the pipeline's prediction."""
    family = family_of(flux_dev)
    pipeline = FluxPipeline.from_pretrained(flux_dev.path)
    calls = transformer_calls(pipeline)
    embeds = torch.randn(1, 7, pipeline.transformer.config.joint_attention_dim)
    pooled = torch.randn(1, pipeline.transformer.config.pooled_projection_dim)
    pipeline(prompt_embeds=embeds, pooled_prompt_embeds=pooled, height=96, width=64, num_inference_steps=1,
             guidance_scale=3.5, output_type="latent", generator=torch.Generator().manual_seed(0))
    ((seen, output),) = calls
    noisy = unpack(seen["hidden_states"], 12, 8)
    with torch.no_grad():
        ours = family.predict(pipeline.transformer, noisy, {"t5_hidden": embeds, "clip_l_pooled": pooled},
                              seen["timestep"] * 1000, **family.call_options(TrainingConfig(guidance_scale=3.5)))
    torch.testing.assert_close(ours, unpack(output, 12, 8))
    assert torch.equal(seen["guidance"], torch.full((1,), 3.5))


def test_mode_scale_is_part_of_a_run_only_when_mode_draws_its_timesteps(flux_dev):
    from tasks.identity import run_id_for

    def run_id(**training):
        return run_id_for("a manifest", flux_dev, TrainingConfig(**training))

    assert run_id(mode_scale=0.5) == run_id()
    assert run_id(timestep_sampling="mode") != run_id(timestep_sampling="mode", mode_scale=0.5) != run_id()
