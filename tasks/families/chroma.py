"""Chroma (`ChromaPipeline`): FLUX.1-schnell's transformer without its per-block modulation (a small
network computes it from the timestep), conditioned on T5-XXL alone, masked: T5 encodes the real
tokens under the tokenizer's mask, and the transformer attends to them and to the first padding
position, as Chroma was trained (its reference trainer, ComfyUI, and diffusers#12508).

The cache keeps those positions only (ragged) and the transformer gets a boolean mask over them.
diffusers 0.42's pipeline turns its mask into floats, which attention adds instead of masking
(diffusers#12116, #13619: open), so the pipeline attends to all 512 positions unless it is given a
boolean mask; precast's samples give it one, and the tests pin both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tasks.families import flux
from tasks.families.flux import FluxDenoiser, PackedFlow, image_ids, pack, unpack
from tasks.families.spec import Conditioning, Family, Sampler, Text, TextEncoderSpec


def attention_mask(text_mask: torch.Tensor, image_tokens: int) -> torch.Tensor:
    """The transformer's boolean mask: the cached text positions, then every image token (the
    pipeline's `_prepare_attention_mask`, kept boolean)."""
    ones = torch.ones(len(text_mask), image_tokens, dtype=torch.bool, device=text_mask.device)
    return torch.cat([text_mask.bool(), ones], dim=1)


@dataclass(frozen=True)
class ChromaDenoiser(PackedFlow):
    """FLUX.1's packing, blocks and schedule; no pooled vector nor guidance input; the boolean mask."""

    transformer: str = "ChromaTransformer2DModel"
    lora_targets: tuple[str, ...] = FluxDenoiser.lora_targets

    def predict(self, network: torch.nn.Module, noisy: torch.Tensor, text: Conditioning,
                timesteps: torch.Tensor, **options: Any) -> torch.Tensor:
        """As the pipeline calls it (packed latents, image ids, zero text ids, timestep / 1000),
        with the boolean mask."""
        height, width = noisy.shape[2:]
        embeds, packed = text["t5_hidden"], pack(noisy)
        prediction = network(
            hidden_states=packed, timestep=timesteps / 1000, encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3, device=noisy.device, dtype=embeds.dtype),
            img_ids=image_ids(height, width, noisy.device, embeds.dtype),
            attention_mask=attention_mask(text["t5_hidden_mask"], packed.shape[1])).sample
        return unpack(prediction, height, width)


@dataclass(frozen=True)
class ChromaSampler(Sampler):
    """Its guidance_scale is classifier-free guidance with the negative prompts (it has no guidance
    input, nor true_cfg_scale); prompts with boolean masks."""

    pipeline_name: str = "ChromaPipeline"

    def prompt_options(self, pipeline: Any, prompts: list[str], text: dict[str, Any]) -> dict[str, Any]:
        """The prompts and their empty negatives encoded by the pipeline's own `encode_prompt`, with
        their masks made boolean: its float masks would not mask."""
        embeds, _, mask, negatives, _, negative_mask = pipeline.encode_prompt(
            prompts, negative_prompt=[""] * len(prompts), device=pipeline._execution_device,
            do_classifier_free_guidance=True, max_sequence_length=text["max_length"])
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask.bool(),
                "negative_prompt_embeds": negatives, "negative_prompt_attention_mask": negative_mask.bool()}

    def embedding_kwargs(self, text: Conditioning, count: int) -> dict[str, Any]:
        """Prompt embeddings with their boolean masks, negatives the same (Chroma uses true CFG)."""
        embeds, mask = text["t5_hidden"], text["t5_hidden_mask"].bool()
        return {"prompt_embeds": embeds[:count], "prompt_attention_mask": mask[:count],
                "negative_prompt_embeds": embeds[count:], "negative_prompt_attention_mask": mask[count:]}


# T5 masked, its real tokens and the first padding position kept; 512: the pipeline's max_sequence_length
CHROMA = Family("Chroma", ("ChromaPipeline",), Text((TextEncoderSpec("t5", pads_kept=1),), max_length=512),
                flux.CODEC, ChromaDenoiser(), ChromaSampler())
FAMILIES = (CHROMA,)
