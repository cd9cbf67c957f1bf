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
from pathlib import Path
from typing import Any

import torch

from configs.schema import ModelConfig
from configs.schema import TrainingConfig
from storage.fingerprint import hash_json
from tasks.families.ddpm import Ddpm
from tasks.families.spec import Conditioning, Family, TextEncoderSpec

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


class PixArt(Family):
    transformer_name = "PixArtTransformer2DModel"
    text_encoders = (TextEncoderSpec("t5"),)  # T5 masked, its real tokens kept
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2")  # attention and feed-forward
    resolutions: tuple[int, ...] = ()

    def caption_rule(self, mode: str) -> str:
        """For `diffusers`, the source of the pipeline's cleaning code, so a diffusers release that
        cleans otherwise re-encodes (and one that does not, does not)."""
        if mode == "none":
            return mode
        pipeline = self.pipeline_class()
        return hash_json([inspect.getsource(pipeline._text_preprocessing), inspect.getsource(pipeline._clean_caption),
                          pipeline.bad_punct_regex.pattern])

    def preprocess_captions(self, texts: list[str], mode: str) -> list[str]:
        """As written (`none`), or what the pipeline's `encode_prompt` feeds its tokenizer by
        default (`diffusers`: the pipeline's own `_text_preprocessing` with `clean_caption=True`)."""
        if mode == "none":
            return list(texts)
        from diffusers.utils import is_bs4_available, is_ftfy_available

        if not (is_bs4_available() and is_ftfy_available()):  # the pipeline would fall back to lowercasing only
            raise ImportError("text_encoding.caption_preprocessing 'diffusers' needs beautifulsoup4 and ftfy, as the "
                              "pipeline's clean_caption does: pip install beautifulsoup4 ftfy")
        cleaner = object.__new__(self.pipeline_class())  # the method uses no model: nothing is loaded
        return cleaner._text_preprocessing(list(texts), clean_caption=True)

    def default_max_length(self, model: ModelConfig) -> int:
        return 300  # what precast always used for PixArt (PixArt-Σ's pipeline default; α's is 120)

    def bucket_table(self, resolution: int) -> dict[str, list[float]]:
        if resolution not in self.resolutions:
            raise ValueError(f"latent_encoding.resolution {resolution}: {self.name} has aspect-ratio buckets for "
                             f"{', '.join(map(str, self.resolutions))} only")
        return bucket_tables()[resolution]

    def schedule(self, model: ModelConfig, training: TrainingConfig | None = None) -> Ddpm:
        return Ddpm.load(model, self.name, training)

    def predict(self, network: torch.nn.Module, noisy: torch.Tensor, text: Conditioning,
                timesteps: torch.Tensor, **options: Any) -> torch.Tensor:
        """As the pipeline calls it, with its micro-conditions; a learned-sigma model's variance
        half is dropped, as the noise loss does not train it."""
        embeds = text["t5_hidden"]
        prediction = network(noisy, encoder_hidden_states=embeds, encoder_attention_mask=text["t5_hidden_mask"],
                             timestep=timesteps, added_cond_kwargs=self.micro_conditions(noisy, embeds)).sample
        return prediction.chunk(2, dim=1)[0] if prediction.shape[1] == 2 * noisy.shape[1] else prediction

    def micro_conditions(self, noisy: torch.Tensor, text: torch.Tensor) -> dict[str, torch.Tensor | None]:
        """The `added_cond_kwargs` the pipeline gives the transformer: none (PixArt-Σ's pipeline)."""
        return {"resolution": None, "aspect_ratio": None}

    def sampling_scheduler(self, model: ModelConfig) -> Any:
        """DPM-Solver++ with the model's scheduler config, as the published pipelines sample."""
        from diffusers import DPMSolverMultistepScheduler

        return DPMSolverMultistepScheduler.from_pretrained(model.path, subfolder="scheduler", revision=model.revision)

    def prompt_options(self, pipeline: Any, prompts: list[str], text: dict[str, Any]) -> dict[str, Any]:
        if text["caption_preprocessing"] == "none":  # the pipeline lowercases even without clean_caption
            pipeline._text_preprocessing = lambda texts, clean_caption=False: (
                [texts] if isinstance(texts, str) else list(texts))
        return {**super().prompt_options(pipeline, prompts, text), "clean_caption": True,
                "max_sequence_length": text["max_length"]}

    def embedding_kwargs(self, text: Conditioning, count: int) -> dict[str, Any]:
        """The pipeline's arguments for pre-encoded prompts (the first `count` rows) and negative
        prompts (the rest), masks with them."""
        embeds, mask = text["t5_hidden"], text["t5_hidden_mask"]
        return {"prompt_embeds": embeds[:count], "prompt_attention_mask": mask[:count],
                "negative_prompt_embeds": embeds[count:], "negative_prompt_attention_mask": mask[count:],
                "negative_prompt": None}


class PixArtAlpha(PixArt):
    name = "PixArt-α"
    pipelines = ("PixArtAlphaPipeline",)
    pipeline_name = "PixArtAlphaPipeline"
    resolutions = (256, 512, 1024)
    vae_scale = 8  # pixels per latent pixel of its VAE

    def micro_conditions(self, noisy: torch.Tensor, text: torch.Tensor) -> dict[str, torch.Tensor | None]:
        """What PixArtAlphaPipeline gives its 1024 px model: each image's [height, width] in pixels
        and height / width (a transformer without additional conditions ignores them)."""
        height, width = noisy.shape[2] * self.vae_scale, noisy.shape[3] * self.vae_scale
        conditions = {"resolution": torch.tensor([[height, width]], dtype=text.dtype, device=noisy.device),
                      "aspect_ratio": torch.tensor([[height / width]], dtype=text.dtype, device=noisy.device)}
        return {name: value.repeat(len(noisy), 1) for name, value in conditions.items()}


class PixArtSigma(PixArt):
    name = "PixArt-Σ"
    pipelines = ("PixArtSigmaPipeline",)
    pipeline_name = "PixArtSigmaPipeline"
    resolutions = (256, 512, 1024, 2048)


FAMILIES = (PixArtAlpha(), PixArtSigma())
