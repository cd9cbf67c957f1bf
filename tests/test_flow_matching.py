"""Flow matching as diffusers trains and samples it: σ drawn as `train_dreambooth_lora_{sd3,flux}.py`
draw it (an index into the scheduler's own shifted sigmas), the noisy input and target they form,
SD3's loss weighting, and the resolution-dependent shift as the scheduler applies it at inference."""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

from configs.schema import ModelConfig, TrainingConfig
from tasks.families.flow import FlowMatching


def packed_tokens(height: int, width: int) -> int:
    return (height // 2) * (width // 2)


def schedule_in(tmp_path, training: TrainingConfig | None = None, **config) -> FlowMatching:
    FlowMatchEulerDiscreteScheduler(**config).save_pretrained(tmp_path / "scheduler")
    return FlowMatching.load(ModelConfig(path=str(tmp_path)), "a flow family", packed_tokens, training)


@pytest.mark.parametrize("sampling, weighting", [("uniform", "none"), ("logit_normal", "sigma_sqrt"),
                                                  ("logit_normal", "cosmap"), ("mode", "none")])
def test_draws_noisy_input_target_and_weights_are_the_diffusers_training_examples(tmp_path, sampling, weighting):
    training = TrainingConfig(timestep_sampling=sampling, logit_mean=0.2, logit_std=1.1, mode_scale=1.1,
                              loss_weighting=weighting)
    schedule = schedule_in(tmp_path, training, shift=3.0)
    latents, noise = torch.randn(6, 16, 8, 8), torch.randn(6, 16, 8, 8)
    sigmas = schedule.draw(6, torch.Generator().manual_seed(3), latents.shape)

    # the example: u → an index into the scheduler's timesteps, σ the scheduler's at that timestep
    reference = FlowMatchEulerDiscreteScheduler.from_pretrained(tmp_path, subfolder="scheduler")
    u = compute_density_for_timestep_sampling("none" if sampling == "uniform" else sampling, 6, logit_mean=0.2,
                                              logit_std=1.1, mode_scale=1.1, generator=torch.Generator().manual_seed(3))
    timesteps = reference.timesteps[(u * reference.config.num_train_timesteps).long()]
    step_indices = [(reference.timesteps == t).nonzero().item() for t in timesteps]
    expected = reference.sigmas[step_indices].flatten()
    torch.testing.assert_close(sigmas, expected)
    torch.testing.assert_close(schedule.timesteps(sigmas), timesteps)
    sigma = expected.view(-1, 1, 1, 1)
    torch.testing.assert_close(schedule.noised(latents, noise, sigmas), (1.0 - sigma) * latents + sigma * noise)
    torch.testing.assert_close(schedule.target(latents, noise, sigmas), noise - latents)
    weights = schedule.weights(sigmas)
    if weighting == "none":
        assert weights is None
    else:
        torch.testing.assert_close(weights, compute_loss_weighting_for_sd3(weighting, expected))
    assert schedule.plain().sampling == "uniform" and schedule.plain().weights(sigmas) is None


def test_dynamic_shift_is_the_schedulers_own_for_the_images_tokens(tmp_path):
    """With `use_dynamic_shifting` (FLUX.1-dev) σ is shifted by μ of the image's packed tokens, as
    `set_timesteps(mu=…)` shifts the sigmas the pipeline samples with."""
    schedule = schedule_in(tmp_path, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                           base_image_seq_len=256, max_image_seq_len=4096)
    for shape in [(4, 16, 64, 64), (4, 16, 128, 96)]:
        generator = torch.Generator().manual_seed(0)
        sigmas = schedule.draw(4, generator, torch.Size(shape))
        unshifted = torch.rand(4, generator=torch.Generator().manual_seed(0))
        unshifted = schedule.scheduler.sigmas[(unshifted * 1000).long()]
        config = schedule.scheduler.config
        mu = calculate_shift(packed_tokens(*shape[2:]), config.base_image_seq_len, config.max_image_seq_len,
                             config.base_shift, config.max_shift)
        reference = FlowMatchEulerDiscreteScheduler.from_pretrained(tmp_path, subfolder="scheduler")
        reference.set_timesteps(sigmas=unshifted.numpy(), mu=mu)
        torch.testing.assert_close(sigmas, reference.sigmas[:-1], rtol=1e-5, atol=1e-6)
        assert (sigmas >= unshifted).all()  # larger images are noised more


def test_a_ddpm_scheduler_or_an_snr_weighting_is_refused_by_name(tmp_path):
    from diffusers import DDPMScheduler

    DDPMScheduler().save_pretrained(tmp_path / "ddpm" / "scheduler")
    with pytest.raises(ValueError, match="its scheduler \\(DDPMScheduler\\) cannot train a flow family"):
        FlowMatching.load(ModelConfig(path=str(tmp_path / "ddpm")), "a flow family", packed_tokens)
    with pytest.raises(ValueError, match="loss_weighting 'min_snr' is not a weighting of a flow family's flow-matching schedule: use none, sigma_sqrt, cosmap"):
        schedule_in(tmp_path, TrainingConfig(loss_weighting="min_snr"))
