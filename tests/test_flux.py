"""FLUX.1 through the family seam, against `FluxPipeline`'s own functions: packing, image ids,
the text encoders' outputs as `encode_prompt` gives them, and the transformer called as the
pipeline calls it."""

from __future__ import annotations

import pytest
import torch
from diffusers import FluxPipeline

from configs.schema import ModelConfig, TrainingConfig
from tasks.families.buckets import area_buckets
from tasks.families.flux import image_ids, pack, unpack


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
def flux_dev(tiny_family) -> ModelConfig:
    return ModelConfig(path=str(tiny_family("flux")))


def test_mode_scale_is_part_of_a_run_only_when_mode_draws_its_timesteps(flux_dev):
    from tasks.families import family_of
    from tasks.identity import run_id_for

    def run_id(**training):
        return run_id_for("a manifest", flux_dev, TrainingConfig(**training), family_of(flux_dev))

    assert run_id(mode_scale=0.5) == run_id()
    assert run_id(timestep_sampling="mode") != run_id(timestep_sampling="mode", mode_scale=0.5) != run_id()
