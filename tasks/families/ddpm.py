"""DDPM noise schedules (PixArt's): integer timesteps, noise added by the scheduler's betas, and a
target of the noise, the velocity or the clean latents, as the model's scheduler config says."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from configs.schema import ModelConfig, TrainingConfig
from tasks.families.spec import run_sampling

TRAINABLE_PREDICTIONS = ("epsilon", "v_prediction", "sample")
WEIGHTINGS = ("none", "min_snr")


@dataclass(frozen=True)
class Ddpm:
    """A DDPM schedule with how timesteps are drawn (uniform; logit_normal: sigmoid of N(mean,
    std), as SD3 trains; mode: SD3's mode-weighted density) and how each sample's loss is weighed (none; min_snr: Min-SNR-γ)."""

    scheduler: Any  # diffusers' DDPMScheduler with the model's betas and prediction_type
    sampling: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    weighting: str = "none"
    gamma: float = 5.0

    @classmethod
    def load(cls, model: ModelConfig, family: str, training: TrainingConfig | None = None) -> Ddpm:
        """The betas, timesteps and `prediction_type` of the model's own scheduler config (what its
        samplers assume). A flow-matching scheduler, a prediction type DDPM cannot train, or a
        weighting it has no SNR for is refused by name."""
        from diffusers import DDPMScheduler

        config = DDPMScheduler.load_config(model.path, subfolder="scheduler", revision=model.revision)
        kind, prediction = config.get("_class_name", "unknown"), config.get("prediction_type", "epsilon")
        if kind.startswith("FlowMatch") or prediction not in TRAINABLE_PREDICTIONS:
            raise ValueError(f"{model.path}: its scheduler ({kind}, prediction_type {prediction!r}) cannot train "
                             f"{family}, which trains on DDPM noise schedules with prediction_type "
                             f"{', '.join(TRAINABLE_PREDICTIONS)}")
        schedule = cls(DDPMScheduler.from_config(config))
        if training is None:
            return schedule
        return replace(schedule, **run_sampling(training, family, "DDPM schedule", WEIGHTINGS),
                       gamma=training.timesteps.min_snr_gamma)

    def plain(self) -> Ddpm:
        """The family's own: uniform timesteps, every sample weighed the same."""
        return Ddpm(self.scheduler)

    def draw(self, count: int, generator: torch.Generator, shape: torch.Size) -> torch.Tensor:
        """Integer timesteps of `count` samples, on the generator's device."""
        steps = self.scheduler.config.num_train_timesteps
        if self.sampling == "uniform":
            return torch.randint(0, steps, (count,), generator=generator, device=generator.device)
        from diffusers.training_utils import compute_density_for_timestep_sampling

        u = compute_density_for_timestep_sampling(self.sampling, count, self.logit_mean, self.logit_std,
                                                  self.mode_scale, device=generator.device, generator=generator)
        return (u * steps).long().clamp(max=steps - 1)

    def timesteps(self, drawn: torch.Tensor) -> torch.Tensor:
        """What the transformer is given: the timesteps themselves."""
        return drawn

    def noised(self, latents: torch.Tensor, noise: torch.Tensor, drawn: torch.Tensor) -> torch.Tensor:
        return self.scheduler.add_noise(latents, noise, drawn)

    def target(self, latents: torch.Tensor, noise: torch.Tensor, drawn: torch.Tensor) -> torch.Tensor:
        """The noise (epsilon), the velocity (v_prediction) or the clean latents (sample)."""
        kind = self.scheduler.config.prediction_type
        if kind == "epsilon":
            return noise
        if kind == "v_prediction":
            return self.scheduler.get_velocity(latents, noise, drawn)
        return latents

    def weights(self, drawn: torch.Tensor) -> torch.Tensor | None:
        """Per-sample loss weights (None: all one). Min-SNR-γ: min(SNR, γ) over what the model
        predicts' own scale: / SNR for the noise, / (SNR + 1) for the velocity, 1 for the sample."""
        if self.weighting == "none":
            return None
        from diffusers.training_utils import compute_snr

        snr = compute_snr(self.scheduler, drawn)
        clipped = snr.clamp(max=self.gamma)
        kind = self.scheduler.config.prediction_type
        return clipped / snr if kind == "epsilon" else clipped / (snr + 1) if kind == "v_prediction" else clipped
