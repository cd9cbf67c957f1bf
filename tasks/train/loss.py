"""The training objective: the diffusion loss of the model's family on cached latents and text
features, under the family's noise schedule with the run's timestep sampling and loss weighting."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from configs.schema import ModelConfig, TrainingConfig
from tasks.families import Family, family_of
from tasks.families.spec import Conditioning


@dataclass(frozen=True)
class Objective:
    """What a family's transformer is trained on: its schedule (`Family.denoiser.schedule`: how timesteps
    are drawn, latents noised, the target formed and each sample's loss weighed)."""

    family: Family
    schedule: Any
    options: dict[str, Any]  # the family's `call_options` of the run
    image_to_video: float = 0.0  # the share of clips trained with their first frame given (training.image_to_video)
    image_to_video_warmup: int = 0  # steps that give every clip its first frame (training.image_to_video_warmup)

    @classmethod
    def of(cls, model: ModelConfig, training: TrainingConfig, family: Family | None = None) -> Objective:
        """The run's objective on `model` (of `family`; None: the model's, resolved here)."""
        family = family or family_of(model)
        for setting in ("image_to_video", "image_to_video_warmup"):
            if getattr(training, setting):
                family.sampler.image_pipeline_class(f"training.{setting}")
        return cls(family, family.denoiser.schedule(model, training), family.denoiser.call_options(training),
                   training.image_to_video, training.image_to_video_warmup)

    def at(self, step: int) -> Objective:
        """The objective of step `step` (from 1): every clip from its first frame in the warm-up."""
        return replace(self, image_to_video=1.0) if step <= self.image_to_video_warmup else self

    def plain(self) -> Objective:
        """The family's own: uniform timesteps, every sample weighed the same, every clip from text."""
        return Objective(self.family, self.schedule.plain(), self.options)


@dataclass(frozen=True)
class Weighing:
    """How each sample of a batch weighs in the loss beyond the schedule: what it takes from the
    dataset source it came from (`DatasetConfig.mix`), and its loss mask from the latent cache."""

    loss_weights: torch.Tensor | None  # [B]: each sample's loss multiplied by it (None: all 1)
    base_model: torch.Tensor | None  # [B] bool: trained toward the base model's prediction (None: none)
    masks: torch.Tensor | None = None  # [B, 1, (F,) h, w]: each latent pixel's weight in its sample's loss (None: all 1)

    def map(self, move: Callable[[torch.Tensor], torch.Tensor]) -> Weighing:
        """Each tensor moved (pinned, copied to the device)."""
        return Weighing(*(None if t is None else move(t) for t in (self.loss_weights, self.base_model, self.masks)))


def diffusion_loss(
    network, objective: Objective, latents: torch.Tensor, text: Conditioning, generator: torch.Generator,
    half: torch.dtype | None, weighing: Weighing | None = None, adapter: Any = None,
) -> torch.Tensor:
    """The training loss for one batch: noise the scaled latents at timesteps the schedule draws
    (noise first, then timesteps, on the generator's device) and regress the schedule's target
    from the text-conditioned transformer, called as the family calls it, each sample weighed as
    the schedule says, and as its source says (`weighing`). Clips drawn to train image to video (then, `objective.image_to_video` of
    them) have their first frame given clean and no loss on it. A regularisation sample of
    `base_model` regresses what `adapter` (the PEFT model) predicts with its adapter switched off
    for the same input, not the schedule's target. Nothing here waits for the device."""
    family, schedule, device = objective.family, objective.schedule, latents.device
    noise = torch.randn(latents.shape, generator=generator, device=generator.device).to(device)
    drawn = schedule.draw(len(latents), generator, latents.shape).to(device)
    noisy, timesteps, scored = schedule.noised(latents, noise, drawn), schedule.timesteps(drawn), None
    if objective.image_to_video and latents.ndim == 5 and latents.shape[2] > 1:
        given = torch.rand(len(latents), generator=generator, device=generator.device).to(device)
        noisy, timesteps, scored = family.denoiser.first_frame_given(latents, noisy, timesteps,
                                                                     given < objective.image_to_video)
    with torch.autocast(device.type, dtype=half or torch.float32, enabled=half is not None):
        prediction = family.denoiser.predict(network, noisy, text, timesteps, **objective.options)
    target = schedule.target(latents, noise, drawn)
    weights = schedule.weights(drawn)
    if weighing is not None and weighing.base_model is not None:
        with torch.no_grad(), adapter.disable_adapter(), \
                torch.autocast(device.type, dtype=half or torch.float32, enabled=half is not None):
            base = family.denoiser.predict(adapter, noisy, text, timesteps, **objective.options)
        regularised = weighing.base_model.to(device).view(-1, *[1] * (latents.ndim - 1))
        target = torch.where(regularised, base.float(), target.float())
    if weighing is not None and weighing.loss_weights is not None:
        sources = weighing.loss_weights.to(device)
        weights = sources if weights is None else weights * sources
    if weighing is not None and weighing.masks is not None:  # a sample's loss: the mean over what its mask covers
        masks = weighing.masks.to(device=device, dtype=torch.float32)
        scored = masks if scored is None else scored.to(torch.float32) * masks
    if weights is None and scored is None:
        return F.mse_loss(prediction.float(), target.float())
    error = F.mse_loss(prediction.float(), target.float(), reduction="none")
    dims = list(range(1, latents.ndim))
    scored = None if scored is None else scored.to(error.dtype).expand_as(error)  # fp32: half latents' counts overflow
    per_sample = error.mean(dim=dims) if scored is None else (error * scored).sum(dim=dims) / scored.sum(dim=dims).clamp_min(1e-6)
    return (per_sample * (1.0 if weights is None else weights)).mean()
