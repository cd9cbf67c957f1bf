"""Sample images through diffusers' PixArtSigmaPipeline from pre-encoded prompts.

The pipeline gets no tokenizer and no text encoder: prompts come from the text cache. Training
loads the VAE only here, for decoding.
"""

from __future__ import annotations

import torch
from PIL import Image

from configs.schema import ModelConfig
from tasks.features import pad_sequences
from tasks.models import load_vae


def sample_grid(
    model: ModelConfig,
    transformer,
    prompt_embeddings: list[torch.Tensor],
    empty_embedding: torch.Tensor,
    steps: int,
    guidance_scale: float,
    seed: int,
) -> Image.Image:
    """One image per prompt, side by side."""
    from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline

    device = next(transformer.parameters()).device
    vae = load_vae(model, "fp32", str(device))
    scheduler = DPMSolverMultistepScheduler.from_pretrained(model.path, subfolder="scheduler", revision=model.revision)
    pipeline = PixArtSigmaPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer,
                                   scheduler=scheduler)
    pipeline.set_progress_bar_config(disable=True)
    # positive and negative embeddings must share one length for classifier-free guidance
    embeds, mask = pad_sequences(prompt_embeddings + [empty_embedding] * len(prompt_embeddings))
    count = len(prompt_embeddings)
    dtype = next(transformer.parameters()).dtype
    images = pipeline(
        prompt_embeds=embeds[:count].to(device, dtype), prompt_attention_mask=mask[:count].to(device),
        negative_prompt_embeds=embeds[count:].to(device, dtype), negative_prompt_attention_mask=mask[count:].to(device),
        negative_prompt=None, num_inference_steps=steps, guidance_scale=guidance_scale,
        generator=torch.Generator(device="cpu").manual_seed(seed),
    ).images
    grid = Image.new("RGB", (sum(i.width for i in images), max(i.height for i in images)))
    x = 0
    for image in images:
        grid.paste(image, (x, 0))
        x += image.width
    return grid
