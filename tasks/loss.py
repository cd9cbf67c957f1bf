"""The training objective: PixArt's diffusion loss on cached latents and text embeddings."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def diffusion_loss(
    network, noise_scheduler, latents: torch.Tensor, text: torch.Tensor, mask: torch.Tensor,
    generator: torch.Generator, half: torch.dtype | None,
) -> torch.Tensor:
    """PixArt's training loss for one batch: noise the scaled latents at uniformly drawn timesteps
    and regress the model scheduler's target from the text-conditioned transformer: the noise
    (epsilon, PixArt), the velocity (v_prediction) or the clean latents (sample)."""
    device = latents.device
    noise = torch.randn(latents.shape, generator=generator).to(device)
    steps = noise_scheduler.config.num_train_timesteps
    timesteps = torch.randint(0, steps, (len(latents),), generator=generator).to(device)
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
    return F.mse_loss(prediction.float(), target.float())
