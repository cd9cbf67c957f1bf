"""FLUX.2 [dev] (`Flux2Pipeline`) and FLUX.2 [klein] 4B and 9B (`Flux2KleinPipeline`): an LLM's
hidden states after three of its layers joined into one width — [dev]'s Mistral Small 3.1 (24B,
layers 10, 20 and 30, the caption after the pipeline's system message), klein's Qwen3 (layers 9, 18
and 27, the caption as the user's message with `enable_thinking` false: the empty thinking block) —
padded to 512 and encoded under the mask, every position kept: the transformer attends to all
512, and the padding's states depend on the caption (a padded position still attends to the real
tokens before it), so they are cached with it. The 32-channel VAE (`AutoencoderKLFlux2`) whose
latents are cut into 2×2 patches (128 channels at half the sides) and normalised by its batch-norm
statistics; one token a patch with (t, h, w, l) positions; flow matching on the scheduler's own
sigmas, unshifted, as diffusers' FLUX.2 trainers draw them (the pipeline's shift,
`compute_empirical_mu`, depends on the step count, which training has none of). [dev] is guidance
distilled (its `guidance_scale` is the transformer's guidance input); klein is not.

Everything here is read from diffusers' `Flux2Pipeline`, `Flux2KleinPipeline` and
`train_dreambooth_lora_flux2_klein.py`; the tests call their functions on the other side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from configs.schema import ModelConfig, TrainingConfig
from tasks.families.flow import FlowMatching
from tasks.families.spec import (Buckets, ChatEncoderSpec, Codec, Conditioning, Denoiser, Family, References, Sampler,
                                  Text)


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] → [B, 4C, h/2, w/2], each 2×2 patch's values a channel's four, as
    `Flux2KleinPipeline._patchify_latents`."""
    batch, channels, height, width = latents.shape
    patches = latents.view(batch, channels, height // 2, 2, width // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return patches.reshape(batch, channels * 4, height // 2, width // 2)


def positions(batch: int, *grid: int) -> torch.Tensor:
    """[B, N, 4] (t, h, w, l) positions of the cartesian product of `grid` (t, h, w, l sizes), as
    `_prepare_latent_ids` (1, h, w, 1) and `_prepare_text_ids` (1, 1, 1, L) make them."""
    return torch.cartesian_prod(*(torch.arange(size) for size in grid)).unsqueeze(0).expand(batch, -1, -1)


@dataclass(frozen=True)
class Flux2References(References):
    """As the FLUX.2 pipelines size each reference: downscaled (Lanczos) to the area of a square at
    the resolution only where larger (1024² in the pipelines), then its centre cropped to sides
    that are multiples of 16 (`resize_mode="crop"`)."""

    rule: str = "flux2/area-crop"

    def box(self, width: int, height: int, resolution: int) -> list[int]:
        if width * height > resolution * resolution:  # `_resize_to_target_area`
            scale = math.sqrt(resolution * resolution / (width * height))
            width, height = int(width * scale), int(height * scale)
        wide, high = width // 16 * 16, height // 16 * 16
        left, top = (width - wide) // 2, (height - high) // 2  # `Flux2ImageProcessor._resize_and_crop`
        return [width, height, left, top, left + wide, top + high]


@dataclass(frozen=True)
class Flux2Codec(Codec):
    """`AutoencoderKLFlux2`: 2×2 patches of its 32 channels, normalised by its batch norm's running
    mean and variance (128 channels), as `_encode_vae_image` does."""

    buckets: Buckets = Buckets(step=16)  # the VAE's 8× and the 2×2 patches
    vae: str = "AutoencoderKLFlux2"
    references: References | None = Flux2References()  # the pipelines' `image`: one or several

    def latent_factors(self, vae: torch.nn.Module) -> tuple[list[float], list[float]]:
        """Per patch channel: (z − running_mean) / √(running_var + batch_norm_eps)."""
        eps = vae.config.batch_norm_eps
        return vae.bn.running_mean.tolist(), [1.0 / math.sqrt(var + eps) for var in vae.bn.running_var.tolist()]

    def normalised(self, latent: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """[32, h, w] → [128, h/2, w/2], its patches normalised per channel."""
        return super().normalised(patchify(latent[None])[0], shift, scale)


@dataclass(frozen=True)
class Flux2Denoiser(Denoiser):
    """`Flux2Transformer2DModel`: double then single (parallel) blocks over one token a patch."""

    transformer: str = "Flux2Transformer2DModel"
    text: str = "qwen3_hidden"  # the joined layers' feature (`TextEncoderSpec.keys`)
    # diffusers' train_dreambooth_lora_flux2_klein.py default: the double blocks' image attention and
    # the single blocks' fused projections (a single block's `to_out` is named by its index there:
    # a double block's `to_out` is a list, which LoRA cannot adapt); 48 covers FLUX.2 [dev]'s blocks
    lora_targets: tuple[str, ...] = ("to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj",
                                     *(f"single_transformer_blocks.{i}.attn.to_out" for i in range(48)))

    def schedule(self, model: ModelConfig, training: TrainingConfig | None = None) -> FlowMatching:
        return FlowMatching.load(model, self.family, None, training)

    def image_tokens(self, config: Any, *sides: int) -> int:
        return (sides[-2] // 2) * (sides[-1] // 2)  # a token a 2×2 patch of the VAE's latents

    def blocks(self, transformer: torch.nn.Module) -> list[torch.nn.Module]:
        return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]

    def call_options(self, training: TrainingConfig | None) -> dict[str, Any]:
        """The guidance value of a guidance-distilled transformer (`guidance_embeds`); klein has none."""
        return {"guidance": training.guidance_scale if training is not None else 1.0}

    def predict(self, network: torch.nn.Module, noisy: torch.Tensor, text: Conditioning,
                timesteps: torch.Tensor, guidance: float = 1.0) -> torch.Tensor:
        """As the pipeline calls it: the patches [B, 128, h, w] as h·w tokens with their (0, row,
        column, 0) positions, then each reference's (`reference_<n>`) with (10 + 10n, row, column,
        0), timestep / 1000, all of the caption's positions with (0, 0, 0, l); the prediction of
        the patches' own tokens."""
        batch, channels, height, width = noisy.shape
        embeds = text[self.text]
        tokens, ids = [noisy.flatten(2).transpose(1, 2)], [positions(batch, 1, height, width, 1)]
        for n in range(sum(name.startswith("reference_") for name in text)):  # `_prepare_image_ids`
            reference = text[f"reference_{n}"]
            tokens.append(reference.to(noisy.dtype).flatten(2).transpose(1, 2))
            ids.append(positions(batch, 1, *reference.shape[2:], 1) + torch.tensor([10 + 10 * n, 0, 0, 0]))
        with_guidance = getattr(network, "module", network).config.guidance_embeds  # DDP wraps it on several processes
        output = network(
            hidden_states=torch.cat(tokens, dim=1), timestep=timesteps / 1000,
            guidance=torch.full((batch,), guidance, device=noisy.device) if with_guidance else None,
            encoder_hidden_states=embeds, txt_ids=positions(batch, 1, 1, 1, embeds.shape[1]).to(noisy.device),
            img_ids=torch.cat(ids, dim=1).to(noisy.device), return_dict=False)[0]
        return output[:, : height * width].transpose(1, 2).reshape(batch, channels, height, width)


@dataclass(frozen=True)
class Flux2Sampler(Sampler):
    """[dev]'s pipeline: no negative prompts (its `guidance_scale` is the guidance input)."""

    pipeline_name: str = "Flux2Pipeline"
    reference_option: str | None = "image"
    text: str = "mistral3_hidden"

    def prompt_options(self, pipeline: Any, prompts: list[str], text: dict[str, Any]) -> dict[str, Any]:
        return {"prompt": prompts, "max_sequence_length": text["max_length"]}

    def embedding_kwargs(self, text: Conditioning, count: int) -> dict[str, Any]:
        return {"prompt_embeds": text[self.text][:count]}


@dataclass(frozen=True)
class Flux2KleinSampler(Sampler):
    """Classifier-free guidance with the negative prompts, which a distilled klein ignores (as its
    pipeline does: `is_distilled`)."""

    pipeline_name: str = "Flux2KleinPipeline"
    reference_option: str | None = "image"

    def prompt_options(self, pipeline: Any, prompts: list[str], text: dict[str, Any]) -> dict[str, Any]:
        """Its call takes no negative prompt: it encodes the empty one itself."""
        return {"prompt": prompts, "max_sequence_length": text["max_length"]}

    def embedding_kwargs(self, text: Conditioning, count: int) -> dict[str, Any]:
        embeds = text["qwen3_hidden"]
        return {"prompt_embeds": embeds[:count], "negative_prompt_embeds": embeds[count:]}


# Flux2Pipeline's system message (diffusers' `pipelines/flux2/system_messages.py`, from BFL's flux2)
SYSTEM_MESSAGE = ("You are an AI that reasons about image descriptions. You give structured responses focusing on "
                  "object relationships, object\nattribution and actions without speculation.")
DEV = Family(
    "FLUX.2 [dev]", ("Flux2Pipeline",),
    # 512: the pipeline's max_sequence_length, the system message, the templated caption and the
    # padding; the checkpoint is the whole Mistral3ForConditionalGeneration, whose language model
    # alone is loaded (its weights saved under `language_model.`)
    Text((ChatEncoderSpec("mistral3", model_class="MistralModel", system=SYSTEM_MESSAGE, layers=(10, 20, 30),
                          padded=True, removed=("[IMG]",), generation_prompt=False, blocks=True,
                          key_mapping=((r"^language_model\.", ""),)),), max_length=512),
    Flux2Codec(), Flux2Denoiser(text="mistral3_hidden"), Flux2Sampler())
KLEIN = Family(
    "FLUX.2 [klein]", ("Flux2KleinPipeline",),
    # 512: the pipeline's max_sequence_length, the templated tokens and the padding
    Text((ChatEncoderSpec("qwen3", enable_thinking=False, layers=(9, 18, 27), padded=True),), max_length=512),
    Flux2Codec(), Flux2Denoiser(), Flux2KleinSampler())
FAMILIES = (DEV, KLEIN)
