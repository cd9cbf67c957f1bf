"""What the pipeline needs from a model family, in one spec.

A family module (one per family) subclasses `Family` and fills in what its diffusers pipeline does:
which folders hold its text encoders, what text they read, its aspect-ratio buckets, how its
transformer is loaded and called, what it is trained to predict, how it samples, and the layouts
its weights export to. The stages ask the model's family (`tasks.families.family_of`) and never
name one. The defaults are what most diffusers families share; a family overrides what it
differs in.
"""

from __future__ import annotations

from typing import Any

import torch

from configs.schema import ModelConfig, TrainingConfig
from tasks.loading import serialised


class Family:
    name: str = ""  # what reports and errors call it
    pipelines: tuple[str, ...] = ()  # the `_class_name`s of model_index.json this family reads
    pipeline_name: str = ""  # the diffusers pipeline that samples from it
    transformer_name: str = ""  # the diffusers class of its transformer
    # the folders of the text encoders and their tokenizers (what the text cache depends on)
    text_folders: tuple[str, ...] = ("text_encoder", "tokenizer")
    lora_targets: tuple[str, ...] = ()  # the modules LoRA adapts when training.target_modules is None
    # names the bucket tables in the latent cache's fingerprint; None: diffusers' PixArt tables,
    # which every fingerprint before families covered by `resolution` alone
    bucket_rule: str | None = None

    # --- text: what the encoders read ------------------------------------------------------
    def caption_rule(self, mode: str) -> str:
        """What decides the text `preprocess_captions` gives for `mode` (part of the text cache's
        fingerprint): "none" reads captions as written."""
        return mode

    def preprocess_captions(self, texts: list[str], mode: str) -> list[str]:
        """The text the encoders read of each caption under `text_encoding.caption_preprocessing`."""
        if mode != "none":
            raise ValueError(f"{self.name} has no caption preprocessing {mode!r}: use none")
        return list(texts)

    # --- latents: the aspect-ratio buckets images are cropped to ------------------------------
    def bucket_table(self, resolution: int) -> dict[str, list[float]]:
        """height/width ratio → [height, width] in pixels, for `latent_encoding.resolution`."""
        raise NotImplementedError

    # --- the transformer: loading, the call, the objective -------------------------------
    @serialised
    def load_transformer(self, model: ModelConfig, dtype: torch.dtype | None = None) -> torch.nn.Module:
        """The model's transformer by `from_pretrained`, its weights in `dtype` (None: as stored)."""
        return self.transformer_class().from_pretrained(model.path, subfolder="transformer", revision=model.revision,
                                                        torch_dtype=dtype)

    def transformer_class(self) -> type:
        import diffusers

        return getattr(diffusers, self.transformer_name)

    def noise_scheduler(self, model: ModelConfig) -> Any:
        """The scheduler training adds noise with and regresses the target of."""
        raise NotImplementedError

    def target_modules(self, training: TrainingConfig) -> list[str]:
        """The transformer modules that get LoRA layers: the config's, else the family's."""
        return list(training.target_modules if training.target_modules is not None else self.lora_targets)

    def blocks(self, transformer: torch.nn.Module) -> list[torch.nn.Module]:
        """The transformer's repeated blocks (what `training.compile` compiles one by one)."""
        return list(transformer.transformer_blocks)

    def noised(self, scheduler: Any, latents: torch.Tensor, noise: torch.Tensor,
               timesteps: torch.Tensor) -> torch.Tensor:
        """The latents noised to `timesteps` under the family's schedule."""
        raise NotImplementedError

    def target(self, scheduler: Any, latents: torch.Tensor, noise: torch.Tensor,
               timesteps: torch.Tensor) -> torch.Tensor:
        """What the transformer is trained to predict for those noised latents."""
        raise NotImplementedError

    def predict(self, network: torch.nn.Module, noisy: torch.Tensor, text: torch.Tensor, mask: torch.Tensor,
                timesteps: torch.Tensor) -> torch.Tensor:
        """The transformer's prediction for noisy latents, in the latents' shape."""
        raise NotImplementedError

    # --- sampling and export ----------------------------------------------------------------
    def sampling_scheduler(self, model: ModelConfig) -> Any:
        """The scheduler sample grids are drawn with during training: the model's own, as saved."""
        import diffusers

        config = diffusers.DDPMScheduler.load_config(model.path, subfolder="scheduler", revision=model.revision)
        return getattr(diffusers, config["_class_name"]).from_config(config)

    def pipeline_class(self) -> type:
        """The diffusers pipeline that samples from this family."""
        import diffusers

        return getattr(diffusers, self.pipeline_name)

    def embedding_pipeline(self, model: ModelConfig, vae: Any, transformer: torch.nn.Module) -> Any:
        """The family's pipeline without text encoders (prompts come pre-encoded from the cache)."""
        return self.pipeline_class()(**dict.fromkeys(self.text_folders), vae=vae, transformer=transformer,
                                          scheduler=self.sampling_scheduler(model))

    def prompt_options(self, pipeline: Any, text: dict[str, Any]) -> dict[str, Any]:
        """Arguments of the pipeline's call (and settings of `pipeline`) that make it read prompts
        as the run's text cache read captions (`text`: its caption_preprocessing and max_length)."""
        return {}

    def embedding_kwargs(self, embeds: torch.Tensor, mask: torch.Tensor, count: int) -> dict[str, Any]:
        """The pipeline's arguments for pre-encoded prompts (the first `count` rows of `embeds`)
        and their negative prompts (the rest)."""
        raise NotImplementedError

    def comfyui_prefix(self) -> str:
        """The prefix of the transformer's module names in ComfyUI's LoRA key map."""
        return "transformer."
