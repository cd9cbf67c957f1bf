"""PixArt-α and PixArt-Σ: one T5 encoder (masked), a 4-channel VAE, diffusers' aspect-ratio bucket
tables, `PixArtTransformer2DModel` on a DDPM noise schedule, sampled by `PixArtAlphaPipeline` /
`PixArtSigmaPipeline`.

Everything here is read from diffusers' own pipelines: their caption cleaning, their bucket tables
and the arguments they call the transformer with, so a cache and a run match what the pipeline
does at inference.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from configs.schema import ModelConfig, TrainingConfig
from storage.fingerprint import hash_json
from tasks.families.ddpm import Ddpm
from tasks.families.spec import (Buckets, Captions, Codec, Conditioning, Denoiser, Family, Sampler, Text,
                                 TextEncoderSpec)
from tasks.loading import library

@functools.lru_cache(maxsize=1)
def bucket_tables() -> dict[int, dict[str, list[float]]]:
    """diffusers' PixArt aspect-ratio tables (`ASPECT_RATIO_<resolution>_BIN`) by resolution:
    height/width ratio → [height, width] in pixels. Read from diffusers' source, not imported:
    importing its PixArt pipelines loads transformers' models as well, seconds that a process
    which only crops should not pay. Each table is a flat literal of strings and float pairs, read
    as JSON: not with `ast`, whose Python 3.11 builder keeps its depth count per interpreter, so a
    parse here beside one in a library's thread (shard threads look buckets up while others load
    models) fails one of them with "AST constructor recursion depth mismatch"."""
    package = Path(importlib.util.find_spec("diffusers").origin).parent / "pipelines" / "pixart_alpha"
    tables = {}
    for module, resolutions in (("pipeline_pixart_alpha", (256, 512, 1024)), ("pipeline_pixart_sigma", (2048,))):
        source = (package / f"{module}.py").read_text()
        for resolution in resolutions:
            if found := re.search(rf"^ASPECT_RATIO_{resolution}_BIN = (\{{.*?^\}})", source, re.MULTILINE | re.DOTALL):
                tables[resolution] = json.loads(re.sub(r",(\s*)\}$", r"\1}", found.group(1)))
    if missing := {256, 512, 1024, 2048} - set(tables):
        raise RuntimeError(f"diffusers at {package} defines no bucket table for {sorted(missing)}: "
                           "this diffusers is not one precast knows")
    return tables


@dataclass(frozen=True)
class PixArtBuckets(Buckets):
    """diffusers' PixArt tables (named in no fingerprint: every one before families covered them by
    `resolution` alone), for the resolutions the family has tables for."""

    resolutions: tuple[int, ...] = ()

    @property
    def rule(self) -> str | None:
        return None

    def table(self, resolution: int, setting: str = "latent_encoding.resolution") -> dict[str, list[float]]:
        if resolution not in self.resolutions:
            raise ValueError(f"{setting} {resolution}: {self.family} has aspect-ratio buckets for "
                             f"{', '.join(map(str, self.resolutions))} only")
        return bucket_tables()[resolution]


@dataclass(frozen=True)
class PipelineCleaning(Captions):
    """`diffusers`: the pipeline's own `_text_preprocessing` with `clean_caption=True` (what its
    `encode_prompt` feeds its tokenizer by default); `none`: as written."""

    pipeline: str

    def rule(self, mode: str) -> str:
        """For `diffusers`, the source of the pipeline's cleaning code, so a diffusers release that
        cleans otherwise re-encodes (and one that does not, does not)."""
        if mode == "none":
            return mode
        pipeline = library("diffusers", self.pipeline)
        return hash_json([inspect.getsource(pipeline._text_preprocessing), inspect.getsource(pipeline._clean_caption),
                          pipeline.bad_punct_regex.pattern])

    def preprocess(self, texts: list[str], mode: str) -> list[str]:
        if mode == "none":
            return list(texts)
        from diffusers.utils import is_bs4_available, is_ftfy_available

        if not (is_bs4_available() and is_ftfy_available()):  # the pipeline would fall back to lowercasing only
            raise ImportError("text_encoding.caption_preprocessing 'diffusers' needs beautifulsoup4 and ftfy, as the "
                              "pipeline's clean_caption does: pip install beautifulsoup4 ftfy")
        cleaner = object.__new__(library("diffusers", self.pipeline))  # the method uses no model: nothing is loaded
        return cleaner._text_preprocessing(list(texts), clean_caption=True)


@dataclass(frozen=True)
class PixArtDenoiser(Denoiser):
    """`PixArtTransformer2DModel` on a DDPM schedule, given the micro-conditions of its pipeline:
    α's 1024 px model each image's size and aspect ratio (`vae_scale` pixels a latent pixel), Σ's
    none (`vae_scale` None)."""

    transformer: str = "PixArtTransformer2DModel"
    lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2")
    vae_scale: int | None = None

    def schedule(self, model: ModelConfig, training: TrainingConfig | None = None) -> Ddpm:
        return Ddpm.load(model, self.family, training)

    def predict(self, network: torch.nn.Module, noisy: torch.Tensor, text: Conditioning,
                timesteps: torch.Tensor, **options: Any) -> torch.Tensor:
        """As the pipeline calls it, with its micro-conditions; a learned-sigma model's variance
        half is dropped, as the noise loss does not train it."""
        embeds = text["t5_hidden"]
        prediction = network(noisy, encoder_hidden_states=embeds, encoder_attention_mask=text["t5_hidden_mask"],
                             timestep=timesteps, added_cond_kwargs=self.micro_conditions(noisy, embeds)).sample
        return prediction.chunk(2, dim=1)[0] if prediction.shape[1] == 2 * noisy.shape[1] else prediction

    def micro_conditions(self, noisy: torch.Tensor, text: torch.Tensor) -> dict[str, torch.Tensor | None]:
        """The `added_cond_kwargs` the pipeline gives the transformer: for α, each image's [height,
        width] in pixels and height / width (a transformer without additional conditions ignores
        them); for Σ none."""
        if self.vae_scale is None:
            return {"resolution": None, "aspect_ratio": None}
        height, width = noisy.shape[2] * self.vae_scale, noisy.shape[3] * self.vae_scale
        conditions = {"resolution": torch.tensor([[height, width]], dtype=text.dtype, device=noisy.device),
                      "aspect_ratio": torch.tensor([[height / width]], dtype=text.dtype, device=noisy.device)}
        return {name: value.repeat(len(noisy), 1) for name, value in conditions.items()}


@dataclass(frozen=True)
class PixArtSampler(Sampler):
    """Sampled with DPM-Solver++, prompts and their masks as the pipelines take them."""

    def scheduler(self, model: ModelConfig) -> Any:
        """DPM-Solver++ with the model's scheduler config, as the published pipelines sample."""
        from diffusers import DPMSolverMultistepScheduler

        return DPMSolverMultistepScheduler.from_pretrained(model.path, subfolder="scheduler", revision=model.revision)

    def prompt_options(self, pipeline: Any, prompts: list[str], text: dict[str, Any]) -> dict[str, Any]:
        if text["caption_preprocessing"] == "none":  # the pipeline lowercases even without clean_caption
            pipeline._text_preprocessing = lambda texts, clean_caption=False: (
                [texts] if isinstance(texts, str) else list(texts))
        return {**super().prompt_options(pipeline, prompts, text), "clean_caption": True}

    def embedding_kwargs(self, text: Conditioning, count: int) -> dict[str, Any]:
        """Prompt embeddings and negatives (the rows after `count`), masks with them."""
        embeds, mask = text["t5_hidden"], text["t5_hidden_mask"]
        return {"prompt_embeds": embeds[:count], "prompt_attention_mask": mask[:count],
                "negative_prompt_embeds": embeds[count:], "negative_prompt_attention_mask": mask[count:],
                "negative_prompt": None}


def pixart(name: str, pipeline: str, resolutions: tuple[int, ...], vae_scale: int | None) -> Family:
    # 300 tokens: what precast always used for PixArt (PixArt-Σ's pipeline default; α's is 120)
    text = Text((TextEncoderSpec("t5"),), max_length=300, captions=PipelineCleaning(pipeline=pipeline))
    return Family(name, (pipeline,), text, Codec(PixArtBuckets(resolutions=resolutions)),
                  PixArtDenoiser(vae_scale=vae_scale), PixArtSampler(pipeline))


ALPHA = pixart("PixArt-α", "PixArtAlphaPipeline", (256, 512, 1024), vae_scale=8)
SIGMA = pixart("PixArt-Σ", "PixArtSigmaPipeline", (256, 512, 1024, 2048), vae_scale=None)
FAMILIES = (ALPHA, SIGMA)
