"""Z-Image (Turbo and Base, `ZImagePipeline`): Qwen3-4B's hidden states before its last layer, the
caption as the user's message of the tokenizer's chat template (`enable_thinking` true, so no empty
thinking block), cut at 512 templated tokens and trimmed to the real ones (ragged, as the pipeline
gives its transformer a list); FLUX.1's 16-channel VAE with shift and scale; a single-stream
transformer that takes each picture as a one-frame clip in a list, 2×2 patches inside it, the time
as 1 − σ, and predicts the negated velocity; flow matching with the scheduler config's shift.

Everything here is read from diffusers' `ZImagePipeline` and `train_dreambooth_lora_z_image.py`;
the tests call their functions on the other side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from configs.schema import ModelConfig, TrainingConfig
from tasks.families import flux
from tasks.families.flow import FlowMatching
from tasks.families.spec import ChatEncoderSpec, Conditioning, Denoiser, Family, Sampler, Text


def captions(text: Conditioning) -> list[torch.Tensor]:
    """Each caption's real tokens [L_i, D], the list the transformer takes."""
    return [embeds[mask.bool()] for embeds, mask in zip(text["qwen3_hidden"], text["qwen3_hidden_mask"])]


@dataclass(frozen=True)
class ZImageDenoiser(Denoiser):
    """`ZImageTransformer2DModel`: noise and caption refiners, then one stream of joint blocks."""

    transformer: str = "ZImageTransformer2DModel"
    # diffusers' train_dreambooth_lora_z_image.py default: every attention's projections
    lora_targets: tuple[str, ...] = ("to_k", "to_q", "to_v", "to_out.0")

    def schedule(self, model: ModelConfig, training: TrainingConfig | None = None) -> FlowMatching:
        # the pipeline's image_seq_len for a dynamic shift: latent pixels over the 2×2 patches
        return FlowMatching.load(model, self.family, lambda height, width: (height // 2) * (width // 2), training)

    def image_tokens(self, config: Any, *sides: int) -> int:
        patch = config["all_patch_size"][0]
        return (sides[-2] // patch) * (sides[-1] // patch)

    def blocks(self, transformer: torch.nn.Module) -> list[torch.nn.Module]:
        return [*transformer.noise_refiner, *transformer.context_refiner, *transformer.layers]

    def predict(self, network: torch.nn.Module, noisy: torch.Tensor, text: Conditioning,
                timesteps: torch.Tensor, **options: Any) -> torch.Tensor:
        """As the pipeline calls it: a list of one-frame clips [C, 1, h, w], the time (1000 − t) / 1000
        and the list of captions; its output negated is the velocity."""
        output = network(list(noisy.unsqueeze(2).unbind(0)), (1000 - timesteps) / 1000, captions(text),
                         return_dict=False)[0]
        return -torch.stack(output).squeeze(2)


@dataclass(frozen=True)
class ZImageSampler(Sampler):
    """Classifier-free guidance with the negative prompts, in the pipeline's own units."""

    pipeline_name: str = "ZImagePipeline"

    def guidance(self, guidance_scale: float, true_cfg_scale: float) -> dict[str, Any]:
        """`guidance_scale` as every other family's (1: none): the pipeline's is the step past the
        prompt's prediction, `pos + g · (pos − neg)`, so 0 is none (as Turbo samples) and g is ours − 1."""
        return {"guidance_scale": guidance_scale - 1.0}

    def embedding_kwargs(self, text: Conditioning, count: int) -> dict[str, Any]:
        embeds = captions(text)
        return {"prompt_embeds": embeds[:count], "negative_prompt_embeds": embeds[count:]}


ZIMAGE = Family(
    "Z-Image", ("ZImagePipeline",),
    # 512: the pipeline's max_sequence_length, which counts the template's tokens too
    Text((ChatEncoderSpec("qwen3", enable_thinking=True, layers=(-2,)),), max_length=512),
    flux.CODEC, ZImageDenoiser(), ZImageSampler())
FAMILIES = (ZIMAGE,)
