"""What the pipeline needs from a model family, in one spec.

A family module (one per family) subclasses `Family` and fills in what its diffusers pipeline does:
its text encoders, each with its prompt function and what of its output is cached
(`TextEncoderSpec`; `ChatEncoderSpec` for a decoder-only LLM), what text they read, its
aspect-ratio buckets, how its transformer is loaded and called (packing latents into tokens, if it
does), its noise schedule and what it is trained to predict (`schedule`: tasks/families/ddpm.py,
tasks/families/flow.py), how it samples, and the layouts its weights export to. The stages ask the model's family (`tasks.families.family_of`) and never
name one. The defaults are what most diffusers families share; a family overrides what it
differs in.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch

from configs.schema import ModelConfig, TextEncodingConfig, TrainingConfig
from tasks.loading import library, serialised

Conditioning = dict[str, torch.Tensor]
"""A batch's cached text features by name (`TextEncoderSpec.keys`): a sequence output padded to
the batch's longest [B, L, D] with its mask `<key>_mask` [B, L]; a pooled output [B, D]."""


@dataclass(frozen=True)
class TextEncoderSpec:
    """One text encoder of a family and what of its output the text cache keeps: each is cached
    apart, under its own fingerprint, so two families whose encoders would produce the same bytes
    for a caption share them."""

    name: str  # its cache's name in the manifest and the prefix of its features: "t5", "clip_l", …
    folder: str = "text_encoder"  # the model folder's subfolders of the encoder and its tokenizer
    tokenizer: str = "tokenizer"
    model_class: str = "T5EncoderModel"  # its transformers class
    # False: `text_encoding.max_length` (T5's, which users set; unset, the family's own); True: the
    # tokenizer's own `model_max_length`, which the pipelines pad CLIP's captions to whatever
    # max_sequence_length says (their `tokenizer_max_length`: 77 in the published folders)
    tokenizer_length: bool = False
    # True: the encoder sees the attention mask and only the real tokens are kept (ragged);
    # False: the caption is padded to max_length and encoded without a mask, as Flux's and SD3's
    # pipelines call their encoders: the padded positions are real values, so all are kept
    masked: bool = True
    # masked: padding positions kept after the real tokens, encoded under the mask like them, for a
    # transformer that attends to them too (Chroma's attends to the first)
    pads_kept: int = 0
    # masked: the pipeline trims the states to the real tokens and zero-pads them to max_length, and
    # its transformer attends to every position (Wan's): the cache keeps the real tokens, the reader
    # rebuilds the zeros
    zero_padded: bool = False
    # hidden: the last hidden state; penultimate: the hidden states before the last layer;
    # pooled: the pooled (for a projection model, projected) vector. The first is the cache's main
    # tensor; the pooled one is stored as one row of one token
    outputs: tuple[str, ...] = ("hidden",)

    def keys(self) -> tuple[str, ...]:
        """The names its outputs have in a `Conditioning`."""
        return tuple(f"{self.name}_{output}" for output in self.outputs)

    # --- its prompt function, as the pipeline's `_get_*_prompt_embeds`: the stage batches the
    # captions by length, calls these, checks the numbers and commits what they give -------------
    def tokenize(self, tokenizer: Any, texts: list[str], max_length: int) -> tuple[list[list[int]], int]:
        """Token ids of each (preprocessed) caption as the pipeline makes them, and how many were
        cut at `max_length`: a masked encoder's real tokens, cut as the tokenizer's own truncation
        cuts (max_length - 1 tokens, then </s>); an unmasked one's padded to max_length."""
        full = tokenizer(texts, add_special_tokens=True).input_ids
        truncated = sum(len(x) > max_length for x in full)
        if not self.masked:
            return tokenizer(texts, padding="max_length", max_length=max_length, truncation=True).input_ids, truncated
        return [x if len(x) <= max_length else x[: max_length - 1] + [tokenizer.eos_token_id] for x in full], truncated

    def kept(self, ids: list[int], max_length: int) -> int:
        """How many positions of a caption's output sequence the cache keeps: a masked encoder's
        real tokens and the padding its transformer attends to (`pads_kept`), up to max_length; an
        unmasked one's every position."""
        return min(len(ids) + self.pads_kept, max_length) if self.masked else len(ids)

    def rebuilt(self, sequence: torch.Tensor, max_length: int) -> torch.Tensor:
        """What the transformer gets of a cached sequence: as stored, or (zero_padded) with the
        zeros to max_length that the pipeline pads the real tokens with."""
        if not self.zero_padded:
            return sequence
        return torch.nn.functional.pad(sequence, (0, 0, 0, max_length - len(sequence)))

    def encode(self, model: Any, input_ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each of `outputs` for a batch of right-padded token ids: sequences [B, L, D] whose
        first `kept` positions are a caption's, or pooled vectors [B, D] (a projection model's
        projected ones), as the pipeline takes them."""
        result = model(input_ids=input_ids, attention_mask=mask if self.masked else None,
                       output_hidden_states="penultimate" in self.outputs)
        return {output: self._output(result, output) for output in self.outputs}

    @staticmethod
    def _output(result: Any, output: str) -> torch.Tensor:
        if output == "hidden":
            return result.last_hidden_state
        if output == "penultimate":
            return result.hidden_states[-2]
        return result.text_embeds if getattr(result, "text_embeds", None) is not None else result.pooler_output

    def stored(self) -> dict[str, Any]:
        """What the text fingerprint adds for this layout: nothing for the masked last hidden state
        (what every fingerprint before families covered), else the layout."""
        if self.masked and self.outputs == ("hidden",) and not self.pads_kept:
            return {}
        return {"masked": self.masked, "outputs": list(self.outputs), "model_class": self.model_class,
                **({"pads_kept": self.pads_kept} if self.pads_kept else {})}


@dataclass(frozen=True)
class ChatEncoderSpec(TextEncoderSpec):
    """A decoder-only LLM as the pipelines conditioned on one call it (Z-Image's `_encode_prompt`,
    in the manner of Qwen-Image's and FLUX.2's): the caption as the user's message of the
    tokenizer's own chat template (after a `system` message where there is one, `enable_thinking`
    given where the template reads it), the hidden states of `layers` (-1 the last, -2 the one
    before it; several are joined into one width), the template's first `drop` tokens dropped, and
    the real tokens kept (ragged). Its model class is the bare decoder: the vocabulary head, which
    the cache never needs, is not loaded."""

    model_class: str = "Qwen3Model"
    system: str | None = None
    enable_thinking: bool | None = None
    layers: tuple[int, ...] = (-1,)
    drop: int = 0

    def tokenize(self, tokenizer: Any, texts: list[str], max_length: int) -> tuple[list[list[int]], int]:
        """The templated captions' ids, cut at max_length positions past the dropped ones."""
        options = {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        templated = [tokenizer.apply_chat_template([*system, {"role": "user", "content": text}], tokenize=False,
                                                   add_generation_prompt=True, **options) for text in texts]
        full = tokenizer(templated).input_ids
        limit = max_length + self.drop
        return [x[:limit] for x in full], sum(len(x) > limit for x in full)

    def kept(self, ids: list[int], max_length: int) -> int:
        return len(ids) - self.drop

    def encode(self, model: Any, input_ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        states = model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True).hidden_states
        return {"hidden": torch.cat([states[layer] for layer in self.layers], dim=-1)[:, self.drop:]}

    def stored(self) -> dict[str, Any]:
        """The layout, the template's inputs, the layers and the tokens dropped: a change to any
        of them makes another cache (the template itself is a tokenizer file, hashed with them)."""
        return {"masked": True, "outputs": list(self.outputs), "model_class": self.model_class,
                "chat": {"system": self.system, "enable_thinking": self.enable_thinking, "layers": list(self.layers),
                         "drop": self.drop}}


def run_sampling(training: TrainingConfig, family: str, schedule: str, weightings: tuple[str, ...]) -> dict[str, Any]:
    """The run's timestep sampling and loss weighting, for a schedule whose weightings are
    `weightings`; another weighting is refused naming the family and what it can use."""
    if training.loss_weighting not in weightings:
        raise ValueError(f"training.loss_weighting {training.loss_weighting!r} is not a weighting of {family}'s "
                         f"{schedule}: use {', '.join(weightings)}")
    return {"sampling": training.timestep_sampling, "logit_mean": training.logit_mean,
            "logit_std": training.logit_std, "mode_scale": training.mode_scale, "weighting": training.loss_weighting}


class Family:
    name: str = ""  # what reports and errors call it
    pipelines: tuple[str, ...] = ()  # the `_class_name`s of model_index.json this family reads
    pipeline_name: str = ""  # the diffusers pipeline that samples from it
    transformer_name: str = ""  # the diffusers class of its transformer
    vae_name: str = "AutoencoderKL"  # the diffusers class of its VAE
    text_encoders: tuple[TextEncoderSpec, ...] = ()  # in the order the family's pipeline joins them
    lora_targets: tuple[str, ...] = ()  # the modules LoRA adapts when training.target_modules is None
    # names the bucket tables in the latent cache's fingerprint; None: diffusers' PixArt tables,
    # which every fingerprint before families covered by `resolution` alone
    bucket_rule: str | None = None
    # the diffusers pipeline that samples a clip from text and a given first frame (None: none), as
    # runs of it can train (training.image_to_video, `first_frame_given`)
    image_pipeline_name: str | None = None

    def reads(self, index: dict) -> bool:
        """Whether this family reads a model whose model_index.json is `index` (its pipeline named
        in `pipelines`): by default every one."""
        return True

    # --- text: what the encoders read ------------------------------------------------------
    def caption_rule(self, mode: str) -> str:
        """What decides the text `preprocess_captions` gives for `mode` (part of the text cache's
        fingerprint). By default the pipeline feeds captions as written, so `diffusers` reads
        them as `none` does and the two share a cache."""
        return "none"

    def preprocess_captions(self, texts: list[str], mode: str) -> list[str]:
        """The text the encoders read of each caption under `text_encoding.caption_preprocessing`:
        by default, as written (what the pipeline's `encode_prompt` feeds its tokenizers)."""
        return list(texts)

    def default_max_length(self, model: ModelConfig) -> int:
        """T5's token limit when `text_encoding.max_length` is unset: the family's pipeline's."""
        raise NotImplementedError

    def text_length(self, model: ModelConfig, encoder: TextEncoderSpec, text: TextEncodingConfig) -> int:
        """The token limit of one of the family's encoders under `text`."""
        if not encoder.tokenizer_length:
            return text.max_length or self.default_max_length(model)
        from tasks.families import model_json

        name = f"{encoder.tokenizer}/tokenizer_config.json"
        settings = model_json(model.path, model.revision, name, f"the settings of {encoder.name}'s tokenizer")
        if not isinstance(settings.get("model_max_length"), int):
            raise ValueError(f"model.path {model.path}: {name} sets no model_max_length, the length "
                             f"{self.pipeline_name} pads {encoder.name}'s captions to")
        return settings["model_max_length"]

    # --- latents: the aspect-ratio buckets images are cropped to ------------------------------
    def bucket_table(self, resolution: int) -> dict[str, list[float]]:
        """height/width ratio → [height, width] in pixels, for `latent_encoding.resolution`."""
        raise NotImplementedError

    def sample_size(self, resolution: int) -> tuple[int, int]:
        """(height, width) of the samples of a run at `resolution`: its most nearly square bucket
        (the square itself where the resolution is a multiple of the buckets' step)."""
        height, width = min(self.bucket_table(resolution).values(), key=lambda sides: abs(math.log(sides[0] / sides[1])))
        return int(height), int(width)

    def vae_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """What the VAE encodes of a batch of pictures [B, 3, H, W] in [-1, 1]: the pictures."""
        return pixels

    def clip_problem(self, frames: int) -> str | None:
        """Why a sample of `frames` frames (a picture is one) cannot be encoded, None when it can:
        by default the family trains on pictures."""
        return None if frames == 1 else f"a clip of {frames} frames: {self.name} trains on pictures"

    def clip_policy_problem(self, lengths: list[int]) -> str | None:
        """Why no clip of these lengths (`dataset.video.frames` and `frame_buckets`) can ever be
        encoded, told before anything is ingested; None by default: a family that trains on
        pictures quarantines each clip of a dataset that mixes them, naming why."""
        return None

    def latent_factors(self, config: Any) -> tuple[float | list[float], float | list[float]]:
        """(shift, scale) that normalise the VAE's latents, `(z − shift) · scale`, per channel where
        lists, `config` being the VAE's config: its `shift_factor` (none: 0) and `scaling_factor`."""
        return config.get("shift_factor") or 0.0, config.scaling_factor

    # --- the transformer: loading, the call, the objective -------------------------------
    @serialised
    def load_transformer(self, model: ModelConfig, dtype: torch.dtype | None = None) -> torch.nn.Module:
        """The model's transformer by `from_pretrained`, its weights in `dtype` (None: as stored)."""
        return self.transformer_class().from_pretrained(model.path, subfolder=self.transformer_folder(model),
                                                        revision=model.revision, torch_dtype=dtype)

    def transformer_folder(self, model: ModelConfig) -> str:
        """The folder (and pipeline component) of the transformer a run trains: `transformer`; a
        `model.expert` is refused, the family's models having one transformer."""
        if model.expert is not None:
            raise ValueError(f"model.expert: {model.path} is a {self.name} model, which has one transformer; "
                             f"leave model.expert unset")
        return "transformer"

    def transformer_class(self) -> type:
        return library("diffusers", self.transformer_name)

    def schedule(self, model: ModelConfig, training: TrainingConfig | None = None) -> Any:
        """The noise schedule training draws timesteps from, noises latents with and regresses the
        target of (a `tasks.families.ddpm.Ddpm` or `tasks.families.flow.FlowMatching`), with the
        run's timestep sampling and loss weighting (None: the family's own)."""
        raise NotImplementedError

    def image_tokens(self, config: Any, *sides: int) -> int:
        """The transformer's tokens for latents of `sides` (height, width; or frames, height, width),
        `config` being its config (`training.batch_tokens` counts them)."""
        patch = config["patch_size"]
        return (sides[-2] // patch) * (sides[-1] // patch)

    def target_modules(self, training: TrainingConfig) -> list[str]:
        """The transformer modules that get LoRA layers: the config's, else the family's."""
        return list(training.target_modules if training.target_modules is not None else self.lora_targets)

    def blocks(self, transformer: torch.nn.Module) -> list[torch.nn.Module]:
        """The transformer's repeated blocks (what `training.compile` compiles one by one)."""
        return list(transformer.transformer_blocks)

    def call_options(self, training: TrainingConfig | None) -> dict[str, Any]:
        """What of the run's config `predict` is called with besides the batch (none by default)."""
        return {}

    def predict(self, network: torch.nn.Module, noisy: torch.Tensor, text: Conditioning,
                timesteps: torch.Tensor, **options: Any) -> torch.Tensor:
        """The transformer's prediction for noisy latents [B, C, h, w] at the schedule's
        `timesteps`, in the latents' shape (a family that packs latents into tokens packs and
        unpacks here), called as its pipeline calls it, with the run's `call_options`."""
        raise NotImplementedError

    def first_frame_given(self, latents: torch.Tensor, noisy: torch.Tensor, timesteps: torch.Tensor,
                          given: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For clips [B, C, F, h, w] whose first frame is `given` [B] (the rest from text): the
        transformer's input, its timesteps and what of the prediction the loss scores (a mask that
        broadcasts over the latents), as the family's image-to-video pipeline conditions on a frame.
        Only for a family with an `image_pipeline_name`."""
        raise NotImplementedError

    # --- sampling and export ----------------------------------------------------------------
    def sampling_scheduler(self, model: ModelConfig) -> Any:
        """The scheduler sample grids are drawn with during training: the model's own, as saved."""
        config = library("diffusers", "DDPMScheduler").load_config(model.path, subfolder="scheduler",
                                                                   revision=model.revision)
        return library("diffusers", config["_class_name"]).from_config(config)

    def pipeline_class(self) -> type:
        """The diffusers pipeline that samples from this family."""
        return library("diffusers", self.pipeline_name)

    def image_pipeline_class(self, setting: str) -> type:
        """The family's image-to-video pipeline, which samples from a first frame; refused, naming
        `setting` (what asked for it), for a family that has none."""
        if not self.image_pipeline_name:
            raise ValueError(f"{setting}: {self.name} samples from text alone (its pipeline takes no first frame, "
                             f"as Wan 2.2 TI2V's does); leave it out")
        return library("diffusers", self.image_pipeline_name)

    def image_pipeline(self, pipeline: Any) -> Any:
        """`pipeline`'s components, as they are, in the family's image-to-video pipeline with the
        settings of `pipeline` it takes (diffusers' `from_pipe` would cast every module to fp32:
        the training transformer's half-precision base among them)."""
        cls = self.image_pipeline_class("first frames")
        takes = inspect.signature(cls.__init__).parameters
        components = {name: module for name, module in pipeline.components.items() if name in takes}
        settings = {name: value for name, value in pipeline.config.items()
                    if name in takes and name not in pipeline.components}
        return cls(**components, **settings)

    def embedding_pipeline(self, model: ModelConfig, vae: Any, transformer: torch.nn.Module) -> Any:
        """The family's pipeline without text encoders (prompts come pre-encoded from the cache)."""
        encoders = [name for spec in self.text_encoders for name in (spec.folder, spec.tokenizer)]
        return self.pipeline_class()(**dict.fromkeys(encoders), vae=vae, transformer=transformer,
                                          scheduler=self.sampling_scheduler(model))

    def prompt_options(self, pipeline: Any, prompts: list[str], text: dict[str, Any]) -> dict[str, Any]:
        """The pipeline's prompt arguments for `prompts`, their negatives empty as the run's sample
        grids' are, with whatever else of its call (and settings of `pipeline`) makes it read them as
        the run's text cache read captions (`text`: its caption_preprocessing and max_length)."""
        return {"prompt": prompts, "negative_prompt": [""] * len(prompts)}

    def guidance(self, guidance_scale: float, true_cfg_scale: float) -> dict[str, Any]:
        """The pipeline's guidance arguments: `guidance_scale` is its classifier-free guidance, and
        there is nothing for `true_cfg_scale` to add."""
        return {"guidance_scale": guidance_scale}

    def frame_options(self, frames: int) -> dict[str, Any]:
        """What else the pipeline is called with to draw samples of `frames` frames (pictures: none)."""
        return {}

    def videos(self, output: Any) -> list[list[Any]]:
        """The pipeline's output as PIL frames, a list per sample (a picture is one frame)."""
        return [[image] for image in output.images]

    def clip_frames(self, latent_frames: int) -> int:
        """The frames of a clip whose latents have `latent_frames` (pictures: 1)."""
        return latent_frames

    def embedding_kwargs(self, text: Conditioning, count: int) -> dict[str, Any]:
        """The pipeline's arguments for pre-encoded prompts (the first `count` rows of `text`)
        and their negative prompts (the rest)."""
        raise NotImplementedError

    def comfyui_key(self, module: str) -> str:
        """A transformer module's name (diffusers') in ComfyUI's LoRA key map: under `transformer.`,
        which ComfyUI maps onto its own names for the families it converts from diffusers."""
        return f"transformer.{module}"
