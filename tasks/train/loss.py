"""The training objective: the diffusion loss of the model's family on cached latents and text
features, under the family's noise schedule with the run's timestep sampling and loss weighting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from configs.schema import ModelConfig, TrainingConfig
from tasks.families import Family, family_of
from tasks.families.spec import Conditioning


@dataclass(frozen=True)
class Objective:
    """What a family's transformer is trained on: its schedule (`Family.schedule`: how timesteps
    are drawn, latents noised, the target formed and each sample's loss weighed)."""

    family: Family
    schedule: Any
    options: dict[str, Any]  # the family's `call_options` of the run

    @classmethod
    def of(cls, model: ModelConfig, training: TrainingConfig) -> Objective:
        family = family_of(model)
        return cls(family, family.schedule(model, training), family.call_options(training))

    def plain(self) -> Objective:
        """The family's own: uniform timesteps, every sample weighed the same."""
        return Objective(self.family, self.schedule.plain(), self.options)


def diffusion_loss(
    network, objective: Objective, latents: torch.Tensor, text: Conditioning, generator: torch.Generator,
    half: torch.dtype | None,
) -> torch.Tensor:
    """The training loss for one batch: noise the scaled latents at timesteps the schedule draws
    (noise first, then timesteps, on the generator's device) and regress the schedule's target
    from the text-conditioned transformer, called as the family calls it, each sample weighed as
    the schedule says. Nothing here waits for the device."""
    family, schedule, device = objective.family, objective.schedule, latents.device
    noise = torch.randn(latents.shape, generator=generator, device=generator.device).to(device)
    drawn = schedule.draw(len(latents), generator, latents.shape).to(device)
    noisy = schedule.noised(latents, noise, drawn)
    with torch.autocast(device.type, dtype=half or torch.float32, enabled=half is not None):
        prediction = family.predict(network, noisy, text, schedule.timesteps(drawn), **objective.options)
    target = schedule.target(latents, noise, drawn)
    weights = schedule.weights(drawn)
    if weights is None:
        return F.mse_loss(prediction.float(), target.float())
    per_sample = F.mse_loss(prediction.float(), target.float(), reduction="none").mean(dim=list(range(1, latents.ndim)))
    return (per_sample * weights).mean()
