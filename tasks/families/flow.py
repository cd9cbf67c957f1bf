"""Flow matching (Flux, SD3, Chroma): latents noised along a straight line, x_σ = (1 − σ)·x₀ + σ·ε,
and the transformer trained to predict its velocity ε − x₀; σ drawn as diffusers' training
examples draw it (`train_dreambooth_lora_{flux,sd3}.py`): an index into the scheduler's own sigmas
(its `shift` applied), uniform, logit-normal or mode-weighted, and with a resolution-dependent
shift where the scheduler config has `use_dynamic_shifting` (as the pipeline samples)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from configs.schema import ModelConfig, TrainingConfig
from tasks.families.spec import run_sampling

WEIGHTINGS = ("none", "sigma_sqrt", "cosmap")


@dataclass(frozen=True)
class FlowMatching:
    scheduler: Any  # diffusers' FlowMatchEulerDiscreteScheduler with the model's config
    # the transformer's tokens for latents of height × width: what the dynamic shift is computed
    # from (used only when the scheduler config has use_dynamic_shifting); None: a family that
    # trains on the scheduler's sigmas unshifted whatever its pipeline does (FLUX.2's)
    tokens: Callable[[int, int], int] | None
    sampling: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    weighting: str = "none"
    # the scheduler's sigmas σ is drawn from: (first index, how many); None: all of them (an
    # expert of a two-expert model is trained on its own noise levels only)
    span: tuple[int, int] | None = None

    @classmethod
    def load(cls, model: ModelConfig, family: str, tokens: Callable[[int, int], int] | None,
             training: TrainingConfig | None = None) -> FlowMatching:
        """The model's own scheduler config; a DDPM scheduler, or a weighting flow matching has no
        form of, is refused by name."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        config = FlowMatchEulerDiscreteScheduler.load_config(model.path, subfolder="scheduler", revision=model.revision)
        if not config.get("_class_name", "").startswith("FlowMatch"):
            raise ValueError(f"{model.path}: its scheduler ({config.get('_class_name', 'unknown')}) cannot train "
                             f"{family}, which trains by flow matching")
        return cls.of(FlowMatchEulerDiscreteScheduler.from_config(config), family, tokens, training)

    @classmethod
    def of(cls, scheduler: Any, family: str, tokens: Callable[[int, int], int] | None,
           training: TrainingConfig | None = None) -> FlowMatching:
        """Flow matching on `scheduler`'s sigmas with the run's sampling and weighting (None: plain)."""
        schedule = cls(scheduler, tokens)
        if training is None:
            return schedule
        return replace(schedule, **run_sampling(training, family, "flow-matching schedule", WEIGHTINGS))

    def plain(self) -> FlowMatching:
        """Uniform draws (over the same noise levels), every sample weighed the same."""
        return FlowMatching(self.scheduler, self.tokens, span=self.span)

    def within(self, low: float, high: float) -> FlowMatching:
        """Draws only of the scheduler's sigmas in [low, high) (σ = 1 where high is above 1)."""
        sigmas = self.scheduler.sigmas[: self.scheduler.config.num_train_timesteps]
        inside = ((sigmas >= low) & (sigmas < high)).nonzero().flatten()
        if not len(inside):
            raise ValueError(f"the scheduler has no training sigma in [{low}, {high})")
        return replace(self, span=(int(inside[0]), len(inside)))

    def draw(self, count: int, generator: torch.Generator, shape: torch.Size) -> torch.Tensor:
        """σ of `count` samples of latents of `shape` [B, C, (F,) h, w], on the generator's device."""
        from diffusers.training_utils import compute_density_for_timestep_sampling

        steps = self.scheduler.config.num_train_timesteps
        u = compute_density_for_timestep_sampling(self.sampling if self.sampling != "uniform" else "none", count,
                                                  self.logit_mean, self.logit_std, self.mode_scale,
                                                  device=generator.device, generator=generator)
        first, count = self.span or (0, steps)
        sigmas = self.scheduler.sigmas.to(generator.device)[(u * count).long().clamp(max=count - 1) + first]
        if self.scheduler.config.use_dynamic_shifting and self.tokens is not None:
            sigmas = self.scheduler.time_shift(self.shift_of(shape), 1.0, sigmas)
        return sigmas

    def shift_of(self, shape: torch.Size) -> float:
        """μ of the resolution-dependent shift for latents of `shape`: the pipelines' `calculate_shift`
        of the image's tokens, linear between the scheduler config's base and max."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        config = self.scheduler.config
        return calculate_shift(self.tokens(shape[-2], shape[-1]), config.base_image_seq_len,
                               config.max_image_seq_len, config.base_shift, config.max_shift)

    def timesteps(self, sigmas: torch.Tensor) -> torch.Tensor:
        """What the pipeline gives the transformer's `timestep` before its own scaling: σ × 1000."""
        return sigmas * self.scheduler.config.num_train_timesteps

    @staticmethod
    def noised(latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
        sigma = sigmas.to(latents.dtype).view(-1, *[1] * (latents.ndim - 1))
        return (1.0 - sigma) * latents + sigma * noise

    @staticmethod
    def target(latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
        return noise - latents

    def weights(self, sigmas: torch.Tensor) -> torch.Tensor | None:
        """SD3's loss weighting (diffusers' `compute_loss_weighting_for_sd3`); None: all one."""
        if self.weighting == "none":
            return None
        from diffusers.training_utils import compute_loss_weighting_for_sd3

        return compute_loss_weighting_for_sd3(self.weighting, sigmas).float()
