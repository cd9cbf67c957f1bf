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

from typing import Any

import torch

from configs.schema import ModelConfig, TrainingConfig
from tasks.families.flux import Flux, image_ids, pack, unpack
from tasks.families.spec import Conditioning, Family, TextEncoderSpec


def attention_mask(text_mask: torch.Tensor, image_tokens: int) -> torch.Tensor:
    """The transformer's boolean mask: the cached text positions, then every image token (the
    pipeline's `_prepare_attention_mask`, kept boolean)."""
    ones = torch.ones(len(text_mask), image_tokens, dtype=torch.bool, device=text_mask.device)
    return torch.cat([text_mask.bool(), ones], dim=1)


class Chroma(Flux):
    name = "Chroma"
    pipelines = ("ChromaPipeline",)
    pipeline_name = "ChromaPipeline"
    transformer_name = "ChromaTransformer2DModel"
    text_encoders = (TextEncoderSpec("t5", pads_kept=1),)

    def default_max_length(self, model: ModelConfig) -> int:
        return 512  # the pipeline's max_sequence_length

    def call_options(self, training: TrainingConfig | None) -> dict[str, Any]:
        return {}  # no guidance embedding

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

    def prompt_options(self, pipeline: Any, prompts: list[str], text: dict[str, Any]) -> dict[str, Any]:
        """The prompts and their empty negatives encoded by the pipeline's own `encode_prompt`, with
        their masks made boolean: its float masks would not mask."""
        embeds, _, mask, negatives, _, negative_mask = pipeline.encode_prompt(
            prompts, negative_prompt=[""] * len(prompts), device=pipeline._execution_device,
            do_classifier_free_guidance=True, max_sequence_length=text["max_length"])
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask.bool(),
                "negative_prompt_embeds": negatives, "negative_prompt_attention_mask": negative_mask.bool()}

    # its guidance_scale is classifier-free guidance: it has no guidance input (nor true_cfg_scale)
    guidance = Family.guidance

    def embedding_kwargs(self, text: Conditioning, count: int) -> dict[str, Any]:
        """Prompt embeddings with their boolean masks, negatives the same (Chroma uses true CFG)."""
        embeds, mask = text["t5_hidden"], text["t5_hidden_mask"].bool()
        return {"prompt_embeds": embeds[:count], "prompt_attention_mask": mask[:count],
                "negative_prompt_embeds": embeds[count:], "negative_prompt_attention_mask": mask[count:]}


FAMILIES = (Chroma(),)
