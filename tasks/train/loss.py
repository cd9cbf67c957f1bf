"""The training objective: the diffusion loss of the model's family on cached latents and text
embeddings, with the timestep sampling and loss weighting a run may choose instead of the family's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from configs.schema import ModelConfig, TrainingConfig
from tasks.families import Family, family_of


@dataclass(frozen=True)
class Objective:
    """What a family's transformer is trained to predict under its noise schedule, how timesteps
    are drawn (uniform; logit_normal: sigmoid of N(mean, std), as SD3 trains) and how each sample's
    loss is weighed (none; min_snr: Min-SNR-γ)."""

    family: Family
    noise_scheduler: Any
    timesteps: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    weighting: str = "none"
    gamma: float = 5.0

    @classmethod
    def of(cls, model: ModelConfig, training: TrainingConfig) -> Objective:
        family = family_of(model)
        return cls(family, family.noise_scheduler(model), training.timestep_sampling, training.logit_mean,
                   training.logit_std, training.loss_weighting, training.min_snr_gamma)

    def plain(self) -> Objective:
        """The family's own: uniform timesteps, every sample weighed the same."""
        return Objective(self.family, self.noise_scheduler)

    def draw_timesteps(self, count: int, steps: int, generator: torch.Generator) -> torch.Tensor:
        if self.timesteps == "uniform":
            return torch.randint(0, steps, (count,), generator=generator, device=generator.device)
        from diffusers.training_utils import compute_density_for_timestep_sampling

        u = compute_density_for_timestep_sampling("logit_normal", count, self.logit_mean, self.logit_std,
                                                  device=generator.device, generator=generator)
        return (u * steps).long().clamp(max=steps - 1)

    def weights(self, timesteps: torch.Tensor) -> torch.Tensor | None:
        """Per-sample loss weights (None: all one). Min-SNR-γ: min(SNR, γ) over what the model
        predicts' own scale: / SNR for the noise, / (SNR + 1) for the velocity, 1 for the sample."""
        if self.weighting == "none":
            return None
        from diffusers.training_utils import compute_snr

        snr = compute_snr(self.noise_scheduler, timesteps)
        clipped = snr.clamp(max=self.gamma)
        kind = self.noise_scheduler.config.prediction_type
        return clipped / snr if kind == "epsilon" else clipped / (snr + 1) if kind == "v_prediction" else clipped


def diffusion_loss(
    network, objective: Objective, latents: torch.Tensor, text: torch.Tensor, mask: torch.Tensor,
    generator: torch.Generator, half: torch.dtype | None,
) -> torch.Tensor:
    """The training loss for one batch: noise the scaled latents at timesteps the objective
    draws (noise first, then timesteps, on the generator's device) and regress the family's
    target (under its noise schedule) from the text-conditioned transformer, called as the family
    calls it, each sample weighed as the objective says. Nothing here waits for the device."""
    family, noise_scheduler, device = objective.family, objective.noise_scheduler, latents.device
    noise = torch.randn(latents.shape, generator=generator, device=generator.device).to(device)
    timesteps = objective.draw_timesteps(len(latents), noise_scheduler.config.num_train_timesteps, generator)
    timesteps = timesteps.to(device)
    noisy = family.noised(noise_scheduler, latents, noise, timesteps)
    with torch.autocast(device.type, dtype=half or torch.float32, enabled=half is not None):
        prediction = family.predict(network, noisy, text, mask, timesteps)
    target = family.target(noise_scheduler, latents, noise, timesteps)
    weights = objective.weights(timesteps)
    if weights is None:
        return F.mse_loss(prediction.float(), target.float())
    per_sample = F.mse_loss(prediction.float(), target.float(), reduction="none").mean(dim=list(range(1, latents.ndim)))
    return (per_sample * weights).mean()
