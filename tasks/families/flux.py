"""FLUX.1 (dev and schnell): CLIP-L's pooled vector and T5-XXL's hidden states, both encoded as
`FluxPipeline.encode_prompt` encodes them (padded, without an attention mask: every padded T5
position is a real value the transformer attends to), a 16-channel VAE with shift and scale,
latents packed 2×2 into tokens with their image ids, and flow matching with the resolution-
dependent shift of the model's scheduler config. FLUX.1-dev (`guidance_embeds`) is given the
guidance value it was distilled on in training as at sampling; schnell has no guidance input.

Everything here is read from diffusers' `FluxPipeline` and `train_dreambooth_lora_flux.py`; the
tests call their functions on the other side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from configs.schema import ModelConfig, TrainingConfig
from tasks.families.flow import FlowMatching
from tasks.families.spec import Buckets, Codec, Conditioning, Denoiser, Family, Sampler, Text, TextEncoderSpec
from tasks.loading import library


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] latents → [B, h/2 · w/2, 4C] tokens, as `FluxPipeline._pack_latents`."""
    batch, channels, height, width = latents.shape
    tokens = latents.view(batch, channels, height // 2, 2, width // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return tokens.reshape(batch, (height // 2) * (width // 2), channels * 4)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of `pack` for latents of height × width, as `FluxPipeline._unpack_latents`."""
    batch, _, channels = tokens.shape
    latents = tokens.view(batch, height // 2, width // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return latents.reshape(batch, channels // 4, height, width)


def image_ids(height: int, width: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[h/2 · w/2, 3] positions of the packed tokens (0, row, column), as
    `FluxPipeline._prepare_latent_image_ids`."""
    ids = torch.zeros(height // 2, width // 2, 3)
    ids[..., 1] = torch.arange(height // 2)[:, None]
    ids[..., 2] = torch.arange(width // 2)[None, :]
    return ids.reshape(-1, 3).to(device=device, dtype=dtype)


def flux_max_length(model: ModelConfig) -> int:
    """512 for FLUX.1-dev (a guidance embedding), 256 for schnell, as their pipelines are called."""
    config = library("diffusers", "FluxTransformer2DModel").load_config(model.path, subfolder="transformer",
                                                                        revision=model.revision)
    return 512 if config.get("guidance_embeds") else 256


@dataclass(frozen=True)
class PackedFlow(Denoiser):
    """A transformer of FLUX.1's kind: latents packed 2×2 into tokens with their image ids, double
    then single blocks, flow matching with the resolution-dependent shift of the model's scheduler."""

    def schedule(self, model: ModelConfig, training: TrainingConfig | None = None) -> FlowMatching:
        return FlowMatching.load(model, self.family, lambda height, width: (height // 2) * (width // 2), training)

    def image_tokens(self, config: Any, *sides: int) -> int:
        return (sides[-2] // 2) * (sides[-1] // 2)  # 2×2 latent pixels a token

    def blocks(self, transformer: torch.nn.Module) -> list[torch.nn.Module]:
        return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]


@dataclass(frozen=True)
class FluxDenoiser(PackedFlow):
    """FLUX.1's transformer, given CLIP's pooled vector and, for dev, the guidance value."""

    transformer: str = "FluxTransformer2DModel"
    # diffusers' train_dreambooth_lora_flux.py default: the double blocks' attention (image and
    # text streams) and both feed-forwards
    lora_targets: tuple[str, ...] = (
        "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
        "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")

    def call_options(self, training: TrainingConfig | None) -> dict[str, Any]:
        """The guidance value FLUX.1-dev's guidance embedding is given (`training.guidance_scale`,
        what its samples use too); ignored by schnell, which has none."""
        return {"guidance": training.guidance_scale if training is not None else 1.0}

    def predict(self, network: torch.nn.Module, noisy: torch.Tensor, text: Conditioning,
                timesteps: torch.Tensor, guidance: float = 1.0) -> torch.Tensor:
        """As the pipeline calls it: packed latents with their image ids (and whatever tokens
        `tokens` adds after them), T5's states with zero text ids, CLIP's pooled vector, timestep /
        1000 and, for dev, the guidance value; the prediction of the latents' own tokens."""
        height, width = noisy.shape[2:]
        embeds = text["t5_hidden"]
        tokens, ids = self.tokens(noisy, text, embeds.dtype)
        with_guidance = getattr(network, "module", network).config.guidance_embeds  # DDP wraps it on several processes
        prediction = network(
            hidden_states=torch.cat(tokens, dim=1), timestep=timesteps / 1000,
            guidance=torch.full((len(noisy),), guidance, device=noisy.device) if with_guidance else None,
            pooled_projections=text["clip_l_pooled"], encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3, device=noisy.device, dtype=embeds.dtype),
            img_ids=torch.cat(ids)).sample
        return unpack(prediction[:, : tokens[0].shape[1]], height, width)

    def tokens(self, noisy: torch.Tensor, text: Conditioning, dtype: torch.dtype
               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The image tokens the transformer is given and their ids: the noisy latents' alone."""
        return [pack(noisy)], [image_ids(*noisy.shape[2:], noisy.device, dtype)]


@dataclass(frozen=True)
class FluxSampler(Sampler):
    pipeline_name: str = "FluxPipeline"

    def guidance(self, guidance_scale: float, true_cfg_scale: float) -> dict[str, Any]:
        """`guidance_scale` is dev's guidance input (schnell ignores it); `true_cfg_scale` > 1 adds
        classifier-free guidance with the negative prompts, as FluxPipeline does."""
        return {"guidance_scale": guidance_scale, "true_cfg_scale": true_cfg_scale}

    def embedding_kwargs(self, text: Conditioning, count: int) -> dict[str, Any]:
        """Prompt embeddings and pooled vectors; the negatives for true CFG (`true_cfg_scale` > 1)."""
        return {"prompt_embeds": text["t5_hidden"][:count], "pooled_prompt_embeds": text["clip_l_pooled"][:count],
                "negative_prompt_embeds": text["t5_hidden"][count:],
                "negative_pooled_prompt_embeds": text["clip_l_pooled"][count:]}


# the 16-channel VAE with shift and scale, pictures in buckets of 16 px sides
CODEC = Codec(Buckets(step=16))
FLUX = Family(
    "FLUX.1", ("FluxPipeline",),
    # T5 first: its max_length is the one `text_encoding.max_length` sets (512 for dev, 256 for
    # schnell, as their pipelines are called); CLIP-L reads its tokenizer's length (77) for the
    # pooled vector
    Text((TextEncoderSpec("t5", "text_encoder_2", "tokenizer_2", "T5EncoderModel", masked=False),
          TextEncoderSpec("clip_l", "text_encoder", "tokenizer", "CLIPTextModel", tokenizer_length=True,
                          masked=False, outputs=("pooled",))), max_length=flux_max_length),
    CODEC, FluxDenoiser(), FluxSampler())
FAMILIES = (FLUX,)
