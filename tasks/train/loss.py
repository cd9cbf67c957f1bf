"""The training objective: PixArt's diffusion loss on cached latents and text embeddings, with the
timestep sampling and loss weighting a run may choose instead of PixArt's."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from configs.schema import TrainingConfig


@dataclass(frozen=True)
class Objective:
    """How timesteps are drawn (uniform: PixArt; logit_normal: sigmoid of N(mean, std), as SD3
    trains) and how each sample's loss is weighed (none: PixArt; min_snr: Min-SNR-γ)."""

    timesteps: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    weighting: str = "none"
    gamma: float = 5.0

    @classmethod
    def of(cls, training: TrainingConfig) -> Objective:
        return cls(training.timestep_sampling, training.logit_mean, training.logit_std, training.loss_weighting,
                   training.min_snr_gamma)

    def draw_timesteps(self, count: int, steps: int, generator: torch.Generator) -> torch.Tensor:
        if self.timesteps == "uniform":
            return torch.randint(0, steps, (count,), generator=generator, device=generator.device)
        from diffusers.training_utils import compute_density_for_timestep_sampling

        u = compute_density_for_timestep_sampling("logit_normal", count, self.logit_mean, self.logit_std,
                                                  device=generator.device, generator=generator)
        return (u * steps).long().clamp(max=steps - 1)

    def weights(self, noise_scheduler, timesteps: torch.Tensor) -> torch.Tensor | None:
        """Per-sample loss weights (None: all one). Min-SNR-γ: min(SNR, γ) over what the model
        predicts' own scale: / SNR for the noise, / (SNR + 1) for the velocity, 1 for the sample."""
        if self.weighting == "none":
            return None
        from diffusers.training_utils import compute_snr

        snr = compute_snr(noise_scheduler, timesteps)
        clipped = snr.clamp(max=self.gamma)
        kind = noise_scheduler.config.prediction_type
        return clipped / snr if kind == "epsilon" else clipped / (snr + 1) if kind == "v_prediction" else clipped


PIXART = Objective()


def diffusion_loss(
    network, noise_scheduler, latents: torch.Tensor, text: torch.Tensor, mask: torch.Tensor,
    generator: torch.Generator, half: torch.dtype | None, objective: Objective = PIXART,
) -> torch.Tensor:
    """PixArt's training loss for one batch: noise the scaled latents at timesteps the objective
    draws (noise first, then timesteps, on the generator's device) and regress the model
    scheduler's target from the text-conditioned transformer: the noise (epsilon, PixArt), the
    velocity (v_prediction) or the clean latents (sample), each sample weighed as the objective
    says. Nothing here waits for the device."""
    device = latents.device
    noise = torch.randn(latents.shape, generator=generator, device=generator.device).to(device)
    timesteps = objective.draw_timesteps(len(latents), noise_scheduler.config.num_train_timesteps, generator)
    timesteps = timesteps.to(device)
    noisy = noise_scheduler.add_noise(latents, noise, timesteps)
    with torch.autocast(device.type, dtype=half or torch.float32, enabled=half is not None):
        prediction = network(noisy, encoder_hidden_states=text, encoder_attention_mask=mask, timestep=timesteps,
                             added_cond_kwargs={"resolution": None, "aspect_ratio": None}).sample
    if prediction.shape[1] == 2 * latents.shape[1]:  # learned sigma: the variance half is not trained by this loss
        prediction = prediction.chunk(2, dim=1)[0]
    kind = noise_scheduler.config.prediction_type  # one of TRAINABLE_PREDICTIONS: checked when loaded
    if kind == "epsilon":
        target = noise
    elif kind == "v_prediction":
        target = noise_scheduler.get_velocity(latents, noise, timesteps)
    else:
        target = latents
    weights = objective.weights(noise_scheduler, timesteps)
    if weights is None:
        return F.mse_loss(prediction.float(), target.float())
    per_sample = F.mse_loss(prediction.float(), target.float(), reduction="none").mean(dim=list(range(1, latents.ndim)))
    return (per_sample * weights).mean()
