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
from tasks.families.spec import Buckets, ChatEncoderSpec, Conditioning, Denoiser, Family, Sampler, Text
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


QWEN_IMAGE = Family(
    "Qwen-Image", ("QwenImagePipeline",),
    # 512: the pipeline's max_sequence_length; the bare text model of Qwen2.5-VL, no vision tower
    Text((ChatEncoderSpec("qwen2_5_vl", model_class="Qwen2_5_VLTextModel", template=TEMPLATE, drop=DROPPED),),
         max_length=512),
    # sides multiples of 16: the VAE's 8× and the 2×2 packing
    FramesCodec(Buckets(step=16), vae="AutoencoderKLQwenImage"), QwenImageDenoiser(), QwenImageSampler())
FAMILIES = (QWEN_IMAGE,)
