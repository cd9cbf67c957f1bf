"""Wan 2.x text-to-video (`WanPipeline`: Wan 2.1 T2V 1.3B and 14B, Wan 2.2 TI2V-5B): umT5-XXL's
hidden states encoded as `WanPipeline.encode_prompt` encodes them (the prompt cleaned by its
`prompt_clean`, encoded under the tokenizer's mask, trimmed to the real tokens and zero-padded to
`max_sequence_length`; the transformer attends to all of them, zeros included), so the cache keeps
the real tokens and the reader rebuilds the zeros. The causal 3-D VAE (`AutoencoderKLWan`, 4×
in time, 8× in space) normalised per channel by its `latents_mean` / `latents_std`; latents
[C, F, h, w], a picture one frame; 1×2×2 patches inside the transformer; flow matching with the
shift of the model's scheduler (`flow_shift` of its UniPC config), the transformer given σ·1000.

Everything here is read from diffusers' `WanPipeline`; the tests call its functions on the other side.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any

import torch

from configs.schema import ModelConfig, TrainingConfig
from storage.fingerprint import hash_json
from tasks.families.flow import FlowMatching
from tasks.families.spec import (Buckets, Captions, Codec, Conditioning, Denoiser, Export, Family, Sampler, Text,
                                 TextEncoderSpec)
from tasks.loading import library

PIPELINE_MODULE = "diffusers.pipelines.wan.pipeline_wan"  # its caption cleaning is the pipeline's own

# diffusers' module names → Wan's own (its reference code's, ComfyUI's), as diffusers'
# scripts/convert_wan_to_diffusers.py renames them: in each block, then outside the blocks
BLOCK_NAMES = {
    **{f"attn1.{ours}": f"self_attn.{theirs}" for ours, theirs in (("to_q", "q"), ("to_k", "k"), ("to_v", "v"),
                                                                 ("to_out.0", "o"))},
    **{f"attn2.{ours}": f"cross_attn.{theirs}" for ours, theirs in (("to_q", "q"), ("to_k", "k"), ("to_v", "v"),
                                                                  ("to_out.0", "o"), ("add_k_proj", "k_img"),
                                                                  ("add_v_proj", "v_img"))},
    "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2",
}
TOP_NAMES = {
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "condition_embedder.time_proj": "time_projection.1", "proj_out": "head.head",
}


def _index(model: ModelConfig) -> dict:
    from tasks.families import model_index

    return model_index(model.path, model.revision)


def frames_rule(frames: int, temporal: int = 4) -> int:
    """The frame count a Wan pipeline makes of `frames`: 4N + 1 (`temporal` the VAE's time
    compression), as `WanPipeline.__call__` rounds it (8 → 9, 7 → 5), at least 1."""
    if frames % temporal != 1:
        frames = frames // temporal * temporal + 1
    return max(frames, 1)


def latent_frames(frames: int, temporal: int = 4) -> int:
    """Latent frames of a 4N + 1 frame clip: the first frame alone, then each 4 (the causal VAE)."""
    return (frames - 1) // temporal + 1


@dataclass(frozen=True)
class WanCleaning(Captions):
    """`diffusers`: the pipeline's own `prompt_clean`; `none`: as written."""

    def rule(self, mode: str) -> str:
        """For `diffusers`, the source of the pipeline's `prompt_clean` (and whether ftfy, which it
        uses when installed, is)."""
        if mode == "none":
            return mode
        from diffusers.utils import is_ftfy_available

        cleaning = [library(PIPELINE_MODULE, name) for name in ("prompt_clean", "basic_clean", "whitespace_clean")]
        return hash_json([inspect.getsource(f) for f in cleaning] + [is_ftfy_available()])

    def preprocess(self, texts: list[str], mode: str) -> list[str]:
        if mode == "none":
            return list(texts)
        prompt_clean = library(PIPELINE_MODULE, "prompt_clean")
        return [prompt_clean(text) for text in texts]


@dataclass(frozen=True)
class FramesCodec(Codec):
    """A causal 3-D VAE of Wan's kind (Wan's, Qwen-Image's): a picture a one-frame clip, latents
    [C, F, h, w] normalised per channel by the VAE config's latents_mean and latents_std."""

    vae: str = "AutoencoderKLWan"

    def vae_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pictures [B, 3, H, W] are one-frame clips [B, 3, 1, H, W] to the 3-D VAE."""
        return pixels.unsqueeze(2) if pixels.ndim == 4 else pixels

    def latent_factors(self, vae: torch.nn.Module) -> tuple[list[float], list[float]]:
        """Per channel: (z − latents_mean) / latents_std, as the pipelines normalise."""
        return list(vae.config.latents_mean), [1.0 / std for std in vae.config.latents_std]


@dataclass(frozen=True)
class WanCodec(FramesCodec):
    """Wan's: clips of 4N + 1 frames too."""

    def clip_problem(self, frames: int) -> str | None:
        """Clips of 4N + 1 frames: the causal VAE encodes the first alone and then 4 a latent frame."""
        if frames % 4 == 1:
            return None
        return (f"a clip of {frames} frames: Wan's VAE takes 4N + 1 (such as {frames_rule(frames - 2)} or "
                f"{frames_rule(frames + 2)}; dataset.video.frames and frame_buckets set it)")

    def clip_policy_problem(self, lengths: list[int]) -> str | None:
        return next(filter(None, map(self.clip_problem, lengths)), None)

    def clip_frames(self, latent_frames: int) -> int:
        return (latent_frames - 1) * 4 + 1  # the first frame alone, then 4 a latent frame


@dataclass(frozen=True)
class WanDenoiser(Denoiser):
    """`WanTransformer3DModel` (or, of Wan 2.2 A14B, the expert `model.expert` names), given σ·1000,
    flow matching shifted by the model scheduler's `flow_shift`."""

    transformer: str = "WanTransformer3DModel"
    # every linear layer of the blocks' self- and cross-attention and feed-forward, as the Wan
    # trainers adapt them (musubi-tuner's and diffusion-pipe's WanAttentionBlock, finetrainers)
    lora_targets: tuple[str, ...] = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q",
                                     "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")

    def schedule(self, model: ModelConfig, training: TrainingConfig | None = None) -> FlowMatching:
        """Flow matching shifted by the model scheduler's `flow_shift` (a fixed shift); an expert of
        a two-expert model draws σ only on its side of `boundary_ratio` (the pipeline gives
        `transformer` the timesteps at or above boundary_ratio × 1000, `transformer_2` the rest)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        config = FlowMatchEulerDiscreteScheduler.load_config(model.path, subfolder="scheduler", revision=model.revision)
        if not config.get("use_flow_sigmas") and not config.get("_class_name", "").startswith("FlowMatch"):
            raise ValueError(f"{model.path}: its scheduler ({config.get('_class_name', 'unknown')}) has no flow sigmas: "
                             f"it cannot train {self.family}, which trains by flow matching")
        shift = config.get("flow_shift") or config.get("shift") or 1.0
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=config.get("num_train_timesteps", 1000),
                                                    shift=shift)
        schedule = FlowMatching.of(scheduler, self.family, lambda height, width: (height // 2) * (width // 2), training)
        folder = self.folder(model)  # checks model.expert against the model
        if model.expert is None:
            return schedule
        boundary = _index(model)["boundary_ratio"]
        return schedule.within(boundary, 2.0) if folder == "transformer" else schedule.within(0.0, boundary)

    def folder(self, model: ModelConfig) -> str:
        """Of Wan 2.2 A14B (two transformers and the boundary between their noise levels), the
        expert `model.expert` names: `transformer` the high-noise one, `transformer_2` the low."""
        index = _index(model)
        experts = (index.get("transformer_2") or [None])[0] is not None and index.get("boundary_ratio") is not None
        if not experts:
            return super().folder(model)
        if model.expert is None:
            raise ValueError(f"model.expert: {model.path} has two experts, transformer/ for the noise levels at or above "
                             f"its boundary_ratio {index['boundary_ratio']} and transformer_2/ below it: set model.expert "
                             f"to high_noise or low_noise (each is trained on its own levels)")
        return "transformer" if model.expert == "high_noise" else "transformer_2"

    def image_tokens(self, config: Any, *sides: int) -> int:
        """Latent frames × h/2 × w/2 (patches of 1×2×2)."""
        frames, height, width = (1, *sides) if len(sides) == 2 else sides
        patch = config["patch_size"]
        return frames // patch[0] * (height // patch[1]) * (width // patch[2])

    def blocks(self, transformer: torch.nn.Module) -> list[torch.nn.Module]:
        return list(transformer.blocks)

    def predict(self, network: torch.nn.Module, noisy: torch.Tensor, text: Conditioning,
                timesteps: torch.Tensor, **options: Any) -> torch.Tensor:
        """As the pipeline calls it: latents [B, C, F, h, w], timestep in [0, 1000], umT5's states
        zero-padded to max_length, no mask."""
        return network(hidden_states=noisy, timestep=timesteps, encoder_hidden_states=text["umt5_hidden"]).sample


@dataclass(frozen=True)
class TokenTimesteps(WanDenoiser):
    """Wan 2.2 TI2V-5B's: one timestep per latent token, which the pipeline forms from its
    first-frame mask (all ones for text to video)."""

    def predict(self, network: torch.nn.Module, noisy: torch.Tensor, text: Conditioning,
                timesteps: torch.Tensor, **options: Any) -> torch.Tensor:
        """As the pipeline calls it with `expand_timesteps`: each sample's timestep for each of its
        latent tokens (frames × h/2 × w/2), [B, tokens], from one a sample [B] or one a latent
        frame [B, F] (`first_frame_given`'s)."""
        patch = getattr(network, "module", network).config.patch_size
        frames = noisy.shape[2] // patch[0]
        per_frame = timesteps.view(len(noisy), -1).expand(-1, frames)
        tokens = self.image_tokens({"patch_size": patch}, 1, *noisy.shape[-2:])
        return super().predict(network, noisy, text, per_frame.repeat_interleave(tokens, dim=1), **options)

    def first_frame_given(self, latents: torch.Tensor, noisy: torch.Tensor, timesteps: torch.Tensor,
                          given: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As `WanImageToVideoPipeline` (`expand_timesteps`) conditions on a picture: its first-frame
        mask 0 on the first latent frame (the causal VAE encodes the first frame alone, so the
        clip's cached first latent frame is the picture's), the input `(1 − mask)·condition +
        mask·noisy`, the timesteps `mask·t`; the loss on the frames after it. `given` [B] chooses
        the clips so conditioned; the others keep a mask of ones (text to video). The given frame
        is the clip's first latent frame as the reader draws it: the posterior's mean under
        `latent_encoding.posterior: mean`, else a draw around it, where the pipeline takes the
        picture's mean (the draws' spread is the VAE's posterior std, small beside the latents')."""
        mask = torch.ones(len(latents), 1, latents.shape[2], 1, 1, dtype=latents.dtype, device=latents.device)
        mask[:, 0, 0] = (~given).to(latents.dtype)[:, None, None]
        return (1 - mask) * latents + mask * noisy, timesteps[:, None] * mask[:, 0, :, 0, 0], mask


@dataclass(frozen=True)
class WanSampler(Sampler):
    """`WanPipeline`, drawing clips; with an expert, both experts."""

    pipeline_name: str = "WanPipeline"

    def embedding_pipeline(self, model: ModelConfig, vae: Any, transformer: torch.nn.Module,
                           encoders: tuple[TextEncoderSpec, ...], denoiser: Denoiser) -> Any:
        """With an expert, the other expert beside it (as stored, in the trained one's dtype and
        device) and the boundary between them: the pipeline samples with both."""
        trained = denoiser.folder(model)
        if model.expert is None:
            return super().embedding_pipeline(model, vae, transformer, encoders, denoiser)
        other = "transformer_2" if trained == "transformer" else "transformer"
        parameter = next(transformer.parameters())
        frozen = denoiser.transformer_class().from_pretrained(
            model.path, subfolder=other, revision=model.revision, torch_dtype=parameter.dtype).to(parameter.device)
        slots = {trained: transformer, other: frozen}
        pipeline = super().embedding_pipeline(model, vae, slots["transformer"], encoders, denoiser)
        pipeline.register_modules(transformer_2=slots["transformer_2"])
        pipeline.register_to_config(boundary_ratio=_index(model)["boundary_ratio"])
        return pipeline

    def frame_options(self, frames: int) -> dict[str, Any]:
        return {"num_frames": frames, "output_type": "pil"}

    def videos(self, output: Any) -> list[list[Any]]:
        return [list(frames) for frames in output.frames]

    def embedding_kwargs(self, text: Conditioning, count: int) -> dict[str, Any]:
        embeds = text["umt5_hidden"]
        return {"prompt_embeds": embeds[:count], "negative_prompt_embeds": embeds[count:]}


@dataclass(frozen=True)
class TokenTimestepsSampler(WanSampler):
    """From text (`WanPipeline`) or from text and a first frame (`WanImageToVideoPipeline`), both
    with `expand_timesteps`."""

    image_pipeline_name: str | None = "WanImageToVideoPipeline"

    def embedding_pipeline(self, model: ModelConfig, vae: Any, transformer: torch.nn.Module,
                           encoders: tuple[TextEncoderSpec, ...], denoiser: Denoiser) -> Any:
        pipeline = super().embedding_pipeline(model, vae, transformer, encoders, denoiser)
        pipeline.register_to_config(expand_timesteps=True)
        return pipeline


@dataclass(frozen=True)
class WanExport(Export):
    def comfyui_key(self, module: str) -> str:
        """Wan's own name under `diffusion_model.`: ComfyUI maps no diffusers names for Wan, only
        its model's own (which diffusers' Wan LoRA loader reads too)."""
        block = re.fullmatch(r"blocks\.(\d+)\.(.+)", module)
        native = f"blocks.{block[1]}.{BLOCK_NAMES.get(block[2])}" if block and block[2] in BLOCK_NAMES \
            else TOP_NAMES.get(module)
        if native is None:
            raise ValueError(f"module {module} has no name in Wan's own layout, which ComfyUI loads LoRAs by: adapt "
                             f"the blocks' attention and feed-forward ({', '.join(BLOCK_NAMES)}), the embedders or "
                             f"proj_out")
        return f"diffusion_model.{native}"


def one_timestep_a_sample(index: dict) -> bool:
    """Wan 2.1 T2V and Wan 2.2 A14B, not TI2V (`expand_timesteps`)."""
    return not index.get("expand_timesteps")


def token_timesteps(index: dict) -> bool:
    return bool(index.get("expand_timesteps"))


# umT5 masked, trimmed to the real tokens and zero-padded to max_length (512, the pipeline's)
TEXT = Text((TextEncoderSpec("umt5", model_class="UMT5EncoderModel", zero_padded=True),), max_length=512,
            captions=WanCleaning())
WAN = Family("Wan", ("WanPipeline",), TEXT, WanCodec(Buckets(step=16)), WanDenoiser(), WanSampler(),
             WanExport(), reads=one_timestep_a_sample)
# Wan 2.2 TI2V-5B (its model_index.json's `expand_timesteps`): the Wan 2.2 VAE (48 channels, patches
# of 2 x 2 pixels inside it, so 16x in space), sides a multiple of 32, the VAE's 16 times the
# transformer's patch of 2; one timestep per latent token; sampled from text or from a first frame
TI2V = Family("Wan 2.2 TI2V", ("WanPipeline",), TEXT, WanCodec(Buckets(step=32)), TokenTimesteps(),
              TokenTimestepsSampler(), WanExport(), reads=token_timesteps)
FAMILIES = (WAN, TI2V)
