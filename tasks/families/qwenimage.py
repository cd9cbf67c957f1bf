"""Qwen-Image (`QwenImagePipeline`): Qwen2.5-VL-7B's last hidden states of the caption in the
pipeline's own template (a system message that asks for the picture's details, the caption as the
user's message; the template's first 34 tokens dropped), the real tokens only (ragged; the
transformer gets them zero-padded to the batch's longest under their mask); a causal 3-D VAE of
Wan's kind, a picture a one-frame clip, normalised per channel; latents packed 2×2 into tokens;
flow matching with the resolution-dependent (exponential) shift of the scheduler config; the
pipeline's classifier-free guidance is its `true_cfg_scale`.

Everything here is read from diffusers' `QwenImagePipeline` and `train_dreambooth_lora_qwen_image.py`;
the tests call their functions on the other side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from configs.schema import ModelConfig, TrainingConfig
from tasks.families.flow import FlowMatching
from tasks.families.flux import pack, unpack
from tasks.families.kontext import references_of
from tasks.families.spec import (Buckets, ChatEncoderSpec, Conditioning, Denoiser, Family, References, Sampler,
                                 SeeingEncoderSpec, Text, area_sides)
from tasks.families.wan import FramesCodec

# `QwenImagePipeline.prompt_template_encode` and `prompt_template_encode_start_idx`: the pipeline
# formats every caption with it, whatever the tokenizer's own chat template, and drops its first
# 34 tokens (the system message and the user's turn's opening)
TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
            "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
            "<|im_start|>assistant\n")
DROPPED = 34


@dataclass(frozen=True)
class QwenImageDenoiser(Denoiser):
    """`QwenImageTransformer2DModel`: dual-stream blocks over packed latents and the caption's
    tokens under their mask, given the picture's shape."""

    transformer: str = "QwenImageTransformer2DModel"
    # diffusers' train_dreambooth_lora_qwen_image.py default: the image stream's attention
    lora_targets: tuple[str, ...] = ("to_k", "to_q", "to_v", "to_out.0")

    def schedule(self, model: ModelConfig, training: TrainingConfig | None = None) -> FlowMatching:
        # the pipeline's image_seq_len for its dynamic shift: latent pixels over the 2×2 packing
        return FlowMatching.load(model, self.family, lambda height, width: (height // 2) * (width // 2), training)

    def image_tokens(self, config: Any, *sides: int) -> int:
        return (sides[-2] // 2) * (sides[-1] // 2)  # 2×2 latent pixels a token

    def predict(self, network: torch.nn.Module, noisy: torch.Tensor, text: Conditioning,
                timesteps: torch.Tensor, **options: Any) -> torch.Tensor:
        """As the pipeline calls it: a picture's latents [B, C, 1, h, w] packed 2×2, timestep / 1000,
        the caption's states under their mask and the picture's shape in tokens."""
        height, width = noisy.shape[-2:]
        output = network(hidden_states=pack(noisy[:, :, 0]), timestep=timesteps / 1000,
                         encoder_hidden_states=text["qwen2_5_vl_hidden"],
                         encoder_hidden_states_mask=text["qwen2_5_vl_hidden_mask"],
                         img_shapes=[[(1, height // 2, width // 2)]] * len(noisy), return_dict=False)[0]
        return unpack(output, height, width).unsqueeze(2)


@dataclass(frozen=True)
class QwenImageSampler(Sampler):
    """Prompts with their masks; classifier-free guidance is the pipeline's `true_cfg_scale` (with
    the negative prompts), as it has no guidance input."""

    pipeline_name: str = "QwenImagePipeline"

    def guidance(self, guidance_scale: float, true_cfg_scale: float) -> dict[str, Any]:
        return {"true_cfg_scale": guidance_scale}

    def embedding_kwargs(self, text: Conditioning, count: int) -> dict[str, Any]:
        embeds, mask = text["qwen2_5_vl_hidden"], text["qwen2_5_vl_hidden_mask"]
        return {"prompt_embeds": embeds[:count], "prompt_embeds_mask": mask[:count],
                "negative_prompt_embeds": embeds[count:], "negative_prompt_embeds_mask": mask[count:]}


# `QwenImageEditPipeline.prompt_template_encode` and its start index: the reference's tokens in the
# user's turn before the caption; the first 64 tokens (the system message) dropped
EDIT_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
                 "objects, background), then explain how the user's text instruction should alter or modify the image. "
                 "Generate a new image that meets the user's requirements while maintaining consistency with the "
                 "original input where appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
                 "<|im_start|>assistant\n")
EDIT_DROPPED = 64
PICTURE = "<|vision_start|><|image_pad|><|vision_end|>"
# `QwenImageEditPlusPipeline`: each reference as "Picture N: …" before the caption, read at 384²
PLUS_PICTURE = "Picture {}: " + PICTURE
PLUS_AREA = 384 * 384


@dataclass(frozen=True)
class EditReferences(References):
    """Resized whole (no crop) to about the run's resolution squared at the reference's own ratio,
    sides rounded to 32: the Qwen-Image-Edit pipelines' `calculate_dimensions(1024 * 1024, ratio)`
    at 1024."""

    rule: str = "qwen-image-edit/area"

    def box(self, width: int, height: int, resolution: int) -> list[int]:
        wide, high = area_sides(width, height, resolution * resolution)
        return [wide, high, 0, 0, wide, high]


@dataclass(frozen=True)
class QwenImageEditDenoiser(QwenImageDenoiser):
    """Qwen-Image's transformer with each reference's packed latents after the target's, their
    shapes in `img_shapes` after its, as the Edit pipelines call it; the prediction is the target's
    tokens' output."""

    def predict(self, network: torch.nn.Module, noisy: torch.Tensor, text: Conditioning,
                timesteps: torch.Tensor, **options: Any) -> torch.Tensor:
        height, width = noisy.shape[-2:]
        references = [r[:, :, 0] if r.ndim == 5 else r for r in references_of(text)]  # one-frame clips
        tokens = torch.cat([pack(noisy[:, :, 0]), *(pack(r.to(noisy.dtype)) for r in references)], dim=1)
        shapes = [(1, height // 2, width // 2), *((1, r.shape[-2] // 2, r.shape[-1] // 2) for r in references)]
        output = network(hidden_states=tokens, timestep=timesteps / 1000,
                         encoder_hidden_states=text["qwen2_5_vl_hidden"],
                         encoder_hidden_states_mask=text["qwen2_5_vl_hidden_mask"],
                         img_shapes=[shapes] * len(noisy), return_dict=False)[0]
        return unpack(output[:, : (height // 2) * (width // 2)], height, width).unsqueeze(2)


@dataclass(frozen=True)
class QwenImageEditSampler(QwenImageSampler):
    """`QwenImageEditPipeline`, drawing from a reference with the prompts encoded with it."""

    pipeline_name: str = "QwenImageEditPipeline"
    reference_option: str | None = "image"


def edit_text(area: int, prefix: str, template: str) -> Text:
    """Qwen2.5-VL with its vision tower, reading the caption with its references."""
    return Text((SeeingEncoderSpec("qwen2_5_vl", template=template, drop=EDIT_DROPPED, area=area, prefix=prefix),),
                max_length=1024)


QWEN_IMAGE = Family(
    "Qwen-Image", ("QwenImagePipeline",),
    # 512: the pipeline's max_sequence_length; the bare text model of Qwen2.5-VL, no vision tower
    Text((ChatEncoderSpec("qwen2_5_vl", model_class="Qwen2_5_VLTextModel", template=TEMPLATE, drop=DROPPED),),
         max_length=512),
    # sides multiples of 16: the VAE's 8× and the 2×2 packing
    FramesCodec(Buckets(step=16), vae="AutoencoderKLQwenImage"), QwenImageDenoiser(), QwenImageSampler())
# Edit: one reference (its template holds one picture: a target without one is quarantined), read by
# the text encoder at 1024² as the pipeline reads it, whatever the run's resolution
QWEN_IMAGE_EDIT = Family(
    "Qwen-Image-Edit", ("QwenImageEditPipeline",),
    edit_text(1024 * 1024, "", EDIT_TEMPLATE.replace("{}", PICTURE + "{}")),
    FramesCodec(Buckets(step=16), vae="AutoencoderKLQwenImage", references=EditReferences(most=1, least=1)),
    QwenImageEditDenoiser(), QwenImageEditSampler())
# Edit-Plus (2509, 2511): any number of references (none: the caption alone), each read by the text
# encoder at 384²
QWEN_IMAGE_EDIT_PLUS = Family(
    "Qwen-Image-Edit-Plus", ("QwenImageEditPlusPipeline",),
    edit_text(PLUS_AREA, PLUS_PICTURE, EDIT_TEMPLATE),
    FramesCodec(Buckets(step=16), vae="AutoencoderKLQwenImage", references=EditReferences()),
    QwenImageEditDenoiser(), QwenImageEditSampler(pipeline_name="QwenImageEditPlusPipeline"))
FAMILIES = (QWEN_IMAGE, QWEN_IMAGE_EDIT, QWEN_IMAGE_EDIT_PLUS)
