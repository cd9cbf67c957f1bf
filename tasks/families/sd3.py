"""Stable Diffusion 3 and 3.5 (`StableDiffusion3Pipeline`): CLIP-L's and CLIP-G's penultimate hidden
states and pooled (projected) vectors and T5-XXL's hidden states, each encoded as the pipeline's
`encode_prompt` encodes it (padded, no attention mask: every position is a value the transformer
reads), joined as it joins them: the two CLIP sequences side by side, zero-padded to T5's width and
followed by T5's; the pooled vectors side by side. A 16-channel VAE with shift and scale, 2×2
patches inside the transformer, flow matching with the scheduler's fixed `shift`.

Everything here is read from diffusers' `StableDiffusion3Pipeline` and `train_dreambooth_lora_sd3.py`;
the tests call their functions on the other side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from configs.schema import ModelConfig, TrainingConfig
from tasks.families import flux
from tasks.families.flow import FlowMatching
from tasks.families.spec import Conditioning, Denoiser, Family, Sampler, Text, TextEncoderSpec

CLIP = dict(model_class="CLIPTextModelWithProjection", tokenizer_length=True, masked=False,
            outputs=("penultimate", "pooled"))


def joined(text: Conditioning) -> tuple[torch.Tensor, torch.Tensor]:
    """The transformer's text sequence and pooled vector, as `encode_prompt` joins its encoders'."""
    clip = torch.cat([text["clip_l_penultimate"], text["clip_g_penultimate"]], dim=-1)
    t5 = text["t5_hidden"]
    clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
    return torch.cat([clip, t5], dim=-2), torch.cat([text["clip_l_pooled"], text["clip_g_pooled"]], dim=-1)


@dataclass(frozen=True)
class SD3Denoiser(Denoiser):
    """`SD3Transformer2DModel`: 2×2 patches inside it, flow matching with the scheduler's `shift`."""

    transformer: str = "SD3Transformer2DModel"
    # diffusers' train_dreambooth_lora_sd3.py default: the joint blocks' attention, both streams
    lora_targets: tuple[str, ...] = ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
                                     "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v")

    def schedule(self, model: ModelConfig, training: TrainingConfig | None = None) -> FlowMatching:
        # the pipeline's image_seq_len for a dynamic shift: latent pixels over the 2×2 patches
        return FlowMatching.load(model, self.family, lambda height, width: (height // 2) * (width // 2), training)

    def predict(self, network: torch.nn.Module, noisy: torch.Tensor, text: Conditioning,
                timesteps: torch.Tensor, **options: Any) -> torch.Tensor:
        """As the pipeline calls it: the joined text, the pooled vectors, timestep in [0, 1000]."""
        embeds, pooled = joined(text)
        return network(hidden_states=noisy, timestep=timesteps, encoder_hidden_states=embeds,
                       pooled_projections=pooled).sample


@dataclass(frozen=True)
class SD3Sampler(Sampler):
    pipeline_name: str = "StableDiffusion3Pipeline"

    def embedding_kwargs(self, text: Conditioning, count: int) -> dict[str, Any]:
        embeds, pooled = joined(text)
        return {"prompt_embeds": embeds[:count], "pooled_prompt_embeds": pooled[:count],
                "negative_prompt_embeds": embeds[count:], "negative_pooled_prompt_embeds": pooled[count:]}


SD3 = Family(
    "SD3", ("StableDiffusion3Pipeline",),
    Text((TextEncoderSpec("clip_l", "text_encoder", "tokenizer", **CLIP),
          TextEncoderSpec("clip_g", "text_encoder_2", "tokenizer_2", **CLIP),
          TextEncoderSpec("t5", "text_encoder_3", "tokenizer_3", "T5EncoderModel", masked=False)),
         max_length=256),  # the pipeline's max_sequence_length
    flux.CODEC, SD3Denoiser(), SD3Sampler())
FAMILIES = (SD3,)
