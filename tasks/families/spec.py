"""What the pipeline needs from a model family: a record of parts, as torchtitan's `TrainSpec`.

A family module (one per family) declares its `Family`: the pipelines of model_index.json it reads
and its parts, each what its diffusers pipeline does, read from that pipeline:
- `text`: its text encoders, each with its prompt function and what of its output is cached
  (`TextEncoderSpec`; `ChatEncoderSpec` for a decoder-only LLM), their token limits and what they
  read of a caption (`Captions`);
- `codec`: its VAE, the aspect-ratio buckets pictures are cropped to and the latents'
  normalisation;
- `denoiser`: how its transformer is loaded and called (packing latents into tokens, if it does),
  the modules LoRA adapts, its noise schedule and what it is trained to predict (`schedule`:
  tasks/families/ddpm.py, tasks/families/flow.py);
- `sampler`: the pipeline that samples from it, on cached prompts or on text;
- `export`: the names its LoRA takes outside diffusers.
The defaults are what most diffusers families share. Families that share a way of doing a thing
declare the same part (Chroma declares FLUX.1's codec); a part never undoes another's methods. The
stages resolve the model's family once (`tasks.families.family_of`), pass it down and never name one.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from configs.schema import ModelConfig, TextEncodingConfig, TrainingConfig
from tasks.families.buckets import area_buckets
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
    # an encoder that reads an edit pair's reference pictures with its caption: the model folder's
    # subfolder of its image processor (`SeeingEncoderSpec`); None: it reads text only
    processor: str | None = None

    def load_options(self) -> dict[str, Any]:
        """What else its `from_pretrained` is given (none: the class loads its folder as saved)."""
        return {}

    def width(self, config: dict[str, Any], output: str) -> int:
        """The width of one of its outputs, read from the encoder's config.json (`config`): a
        projection model's pooled vector is projected; otherwise the model's hidden width (a
        multimodal model's language model's)."""
        if output == "pooled" and self.model_class.endswith("WithProjection"):
            return config["projection_dim"]
        text = config.get("text_config") or config
        return text.get("d_model") or text["hidden_size"]

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

    def pads_left(self, tokenizer: Any) -> bool:
        """Whether a caption's padding goes before its tokens (where what is kept includes the padding)."""
        return False

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

    def picture_tokens(self, model: ModelConfig, count: int) -> int:
        """The positions `count` square references add to a caption's states (an encoder that sees
        them: `SeeingEncoderSpec`), for the memory plan."""
        return 0

    def planned(self, model: ModelConfig, settings: Any, batch: int, length: int,
                pictures: int) -> tuple[Callable[..., Any], dict[str, Any]]:
        """What `precast plan` calls on fake tensors for a batch of the stage's longest captions
        (`length` positions, each with `pictures` references' tokens among them; `settings`: the
        encoder's config): the prompt function and its arguments past the model, each a `Blank`
        (made under the fake mode, its bytes counted) or a real tensor whose values the call
        reads (made a constant of the mode)."""
        return self.encode, {"input_ids": Blank((batch, length), torch.long), "mask": Blank((batch, length), torch.long)}

    def head(self, tokenizer: Any, ids: list[int]) -> int:
        """How many of a caption's kept positions (of its token `ids`) its pictures alone decide,
        whatever its words (an encoder that sees them: `SeeingEncoderSpec`); the text stage stores
        them once for every caption read with the same pictures."""
        return 0

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
    Qwen-Image's `_get_qwen_prompt_embeds`): the caption as the user's message of the tokenizer's
    own chat template (after a `system` message where there is one, `enable_thinking` given where
    the template reads it), or in the pipeline's own `template` (a format string, which a pipeline
    such as Qwen-Image's applies whatever the tokenizer's template says); the hidden states of
    `layers` (-1 the last, -2 the one before it; several are joined into one width), the template's
    first `drop` tokens dropped, and the real tokens kept (ragged), or (`padded`) every position up
    to max_length, padding included, on the tokenizer's padding side and encoded under the mask, for a
    transformer that attends to all of them (FLUX.2's: the padding's states depend on the caption,
    so they are cached with it). `removed`: strings the pipeline takes out of a caption first
    (FLUX.2 [dev]'s `[IMG]`); `generation_prompt`: whether the template is rendered with the
    assistant's turn opened (`add_generation_prompt`); `blocks`: each message's content given as a
    list of text blocks, as FLUX.2 [dev]'s pipeline gives it (Mistral Small 3.1's published template
    reads its system message only from a block). Its model class is the bare decoder: the
    vocabulary head (and a vision tower), which the cache never needs, is not loaded; `key_mapping`
    renames a multimodal checkpoint's language-model weights to the bare decoder's (transformers'
    `from_pretrained(key_mapping=…)`)."""

    model_class: str = "Qwen3Model"
    system: str | None = None
    enable_thinking: bool | None = None
    template: str | None = None
    layers: tuple[int, ...] = (-1,)
    drop: int = 0
    padded: bool = False
    removed: tuple[str, ...] = ()
    generation_prompt: bool = True
    blocks: bool = False
    key_mapping: tuple[tuple[str, str], ...] = ()

    def load_options(self) -> dict[str, Any]:
        return {"key_mapping": dict(self.key_mapping)} if self.key_mapping else {}

    def width(self, config: dict[str, Any], output: str) -> int:
        return super().width(config, output) * len(self.layers)  # the layers' states side by side

    def templated(self, tokenizer: Any, texts: list[str]) -> list[str]:
        for removed in self.removed:
            texts = [text.replace(removed, "") for text in texts]
        if self.template is not None:
            return [self.template.format(text) for text in texts]
        options = {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}

        def message(role: str, text: str) -> dict[str, Any]:
            return {"role": role, "content": [{"type": "text", "text": text}] if self.blocks else text}

        system = [message("system", self.system)] if self.system is not None else []
        return [tokenizer.apply_chat_template([*system, message("user", text)], tokenize=False,
                                              add_generation_prompt=self.generation_prompt, **options)
                for text in texts]

    def tokenize(self, tokenizer: Any, texts: list[str], max_length: int) -> tuple[list[list[int]], int]:
        """The templated captions' ids, cut at max_length positions past the dropped ones; a
        template that writes the tokenizer's begin token itself is tokenized without another, as
        transformers' processors tokenize their chat templates."""
        templated = self.templated(tokenizer, texts)
        bos = tokenizer.bos_token
        specials = not (bos is not None and templated and templated[0].startswith(bos))
        full = tokenizer(templated, add_special_tokens=specials).input_ids
        limit = max_length + self.drop
        return [x[:limit] for x in full], sum(len(x) > limit for x in full)

    def pads_left(self, tokenizer: Any) -> bool:
        return self.padded and tokenizer.padding_side == "left"

    def kept(self, ids: list[int], max_length: int) -> int:
        return max_length if self.padded else len(ids) - self.drop

    def encode(self, model: Any, input_ids: torch.Tensor, mask: torch.Tensor, **inputs: Any) -> dict[str, torch.Tensor]:
        """`inputs`: what else the model reads (a seeing encoder's pictures, cut into patches)."""
        states = model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True, **inputs).hidden_states
        return {"hidden": torch.cat([states[layer] for layer in self.layers], dim=-1)[:, self.drop:]}

    def stored(self) -> dict[str, Any]:
        """The layout, the template's inputs, the layers and the tokens dropped: a change to any
        of them makes another cache (the tokenizer's own template is a tokenizer file, hashed with them)."""
        chat = {"system": self.system, "enable_thinking": self.enable_thinking, "layers": list(self.layers),
                "drop": self.drop, **({"template": self.template} if self.template is not None else {}),
                **({"padded": True} if self.padded else {}),
                **({"removed": list(self.removed)} if self.removed else {}),
                **({"generation_prompt": False} if not self.generation_prompt else {}),
                **({"blocks": True} if self.blocks else {}),
                **({"key_mapping": [list(pair) for pair in self.key_mapping]} if self.key_mapping else {})}
        return {"masked": True, "outputs": list(self.outputs), "model_class": self.model_class, "chat": chat}


@dataclass(frozen=True)
class Blank:
    """A tensor of this shape and dtype (None: the model's) whose values a call does not read
    (`TextEncoderSpec.planned`)."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None = None


def area_sides(width: int, height: int, area: int) -> tuple[int, int]:
    """About `area` pixels at the ratio width / height, sides rounded to 32 (at least 32): the
    Qwen-Image-Edit pipelines' `calculate_dimensions`."""
    wide = (area * width / height) ** 0.5
    return max(32, round(wide / 32) * 32), max(32, round(wide * height / width / 32) * 32)


def sized_to_area(picture: Any, area: int) -> Any:
    """A picture resized whole (Lanczos) to `area_sides`, as those pipelines' `image_processor.resize`."""
    from PIL import Image

    return picture.resize(area_sides(*picture.size, area), Image.Resampling.LANCZOS)


VISION_TOKENS = ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>")  # Qwen2.5-VL's


@dataclass(frozen=True)
class SeeingEncoderSpec(ChatEncoderSpec):
    """A multimodal LLM that reads an edit pair's reference pictures with its caption, as the
    Qwen-Image-Edit pipelines call theirs (`_get_qwen_prompt_embeds` with `image`): each picture
    resized whole to about `area` pixels (`sized_to_area`), then read by the image processor of
    the `processor` folder, and `prefix` (with the picture's number from 1) written before the
    caption once a picture (Edit-Plus's "Picture N: …"; Edit's template holds its one picture's
    tokens itself). The image processor's patches replace each `<|image_pad|>` with a token each
    merged patch, as transformers' processor expands it. Nothing is cut: the pipelines cut no
    prompt. The cache keys a caption's states by the caption and its pictures."""

    model_class: str = "Qwen2_5_VLModel"  # the language model and its vision tower, no vocabulary head
    processor: str | None = "processor"
    # the image processor's backend: PIL's on every machine (transformers takes torchvision's where it
    # is installed, which resizes otherwise), so a cache is one whatever a worker has installed
    backend: str = "pil"
    area: int = 1024 * 1024
    prefix: str = ""
    picture_token: str = "<|image_pad|>"

    def picture(self, picture: Any) -> Any:
        """A picture (PIL) as the pipeline hands it to its processor."""
        return sized_to_area(picture, self.area)

    def image_processor(self, model: ModelConfig) -> Any:
        """The model's image processor, as the stage and the plan load it (PIL's backend)."""
        return library("transformers", "AutoImageProcessor").from_pretrained(
            model.path, subfolder=self.processor, revision=model.revision, backend=self.backend)

    def picture_tokens(self, model: ModelConfig, count: int) -> int:
        """A token each merged patch of each square picture at `area`, as the model's image processor cuts it."""
        images = self.image_processor(model)
        side, _ = area_sides(1, 1, self.area)
        return count * (images.get_number_of_image_patches(side, side, {}) // images.merge_size ** 2)

    def planned(self, model: ModelConfig, settings: Any, batch: int, length: int,
                pictures: int) -> tuple[Callable[..., Any], dict[str, Any]]:
        """The language model's call with a square picture at `area` for each reference of each
        caption, as `encode` makes it: the patches blank, their grid as the image processor cuts
        such a picture, and the vision tower's window and position indices (which transformers
        computes from the grid's values, which a fake tensor has not) computed here by
        transformers' own functions."""
        call, inputs = super().planned(model, settings, batch, length, pictures)
        if not pictures:
            return call, inputs
        from PIL import Image
        from transformers import vision_utils

        images, vision = self.image_processor(model), settings.vision_config
        side, _ = area_sides(1, 1, self.area)
        cut = images(images=[Image.new("RGB", (side, side))], return_tensors="pt")
        grid = cut["image_grid_thw"].repeat(batch * pictures, 1)
        ids = torch.zeros(batch, length, dtype=torch.long)
        ids[:, :pictures * int(grid[0].prod()) // images.merge_size ** 2] = settings.image_token_id
        window_index, cu_window_seqlens = vision_utils.get_vision_window_index(
            grid, vision.spatial_merge_size, vision.window_size, vision.patch_size)
        patches, channels = cut["pixel_values"].shape
        return super().encode, {  # the language model's call, the pictures already cut
            "input_ids": ids, "mask": inputs["mask"], "image_grid_thw": grid,
            "pixel_values": Blank((batch * pictures * patches, channels)),
            "image_position_ids": vision_utils.get_vision_position_ids(grid, vision.spatial_merge_size),
            "image_cu_seqlens": vision_utils.get_vision_cu_seqlens(grid),
            "image_window_index": window_index, "image_cu_window_seqlens": cu_window_seqlens}

    def templated_with(self, tokenizer: Any, texts: list[str], counts: list[int]) -> list[str]:
        """The captions after their pictures' prefixes, in the template. A caption's own vision
        tokens would take a picture's place (the pipelines' processor fails on them): taken out."""
        for token in VISION_TOKENS:
            texts = [text.replace(token, "") for text in texts]
        return self.templated(tokenizer, ["".join(self.prefix.format(n + 1) for n in range(count)) + text
                                          for text, count in zip(texts, counts)])

    def tokenize_with(self, tokenizer: Any, images: Any, texts: list[str], pictures: list[list[Any]]) -> list[list[int]]:
        """Each caption's ids with its pictures' tokens (`pictures`: each caption's, as `picture`
        sized them), a token each patch the image processor `images` will merge."""
        ids = []
        for text, shown in zip(self.templated_with(tokenizer, texts, [len(p) for p in pictures]), pictures):
            pieces = text.split(self.picture_token)
            if len(pieces) - 1 != len(shown):
                raise ValueError(f"text encoder {self.name}: its template holds {len(pieces) - 1} pictures' places, "
                                 f"and the caption has {len(shown)} pictures")
            merged = [self.picture_token * (images.get_number_of_image_patches(p.height, p.width, {})
                                            // images.merge_size ** 2) for p in shown]
            ids.append(tokenizer("".join(p + m for p, m in zip(pieces, [*merged, ""]))).input_ids)
        return ids

    def encode(self, model: Any, input_ids: torch.Tensor, mask: torch.Tensor, vision: list[list[Any]] | None = None,
               images: Any = None) -> dict[str, torch.Tensor]:
        """As the pipeline calls the encoder: the batch's pictures (`vision`: each caption's) cut
        into patches (`cut`) and read with the captions."""
        return super().encode(model, input_ids, mask, **self.cut(vision or [], images, model.dtype, input_ids.device))

    def cut(self, vision: list[list[Any]], images: Any, dtype: torch.dtype, device: Any) -> dict[str, torch.Tensor]:
        """The pictures of a batch (each caption's) cut into patches by the image processor `images`,
        in the captions' order, as it cuts a list (one picture after another), on `device` in
        `dtype`; a batch at a time, so a shard's patches are never all held at once, and each
        picture once a batch, however many of its captions read it, in as many threads as torch
        computes in (PIL and numpy let go of the GIL: about 0.1 s of one core a picture at 1024²)."""
        from concurrent.futures import ThreadPoolExecutor

        shown = [picture for pictures in vision for picture in pictures]
        if not shown:
            return {}
        distinct = list({id(p): p for p in shown}.values())
        with ThreadPoolExecutor(min(len(distinct), torch.get_num_threads())) as pool:
            cut = dict(zip(map(id, distinct), pool.map(lambda p: images(images=[p], return_tensors="pt"), distinct)))
        return {"pixel_values": torch.cat([cut[id(p)]["pixel_values"] for p in shown]).to(device, dtype),
                "image_grid_thw": torch.cat([cut[id(p)]["image_grid_thw"] for p in shown]).to(device)}

    def head(self, tokenizer: Any, ids: list[int]) -> int:
        """The kept positions up to the last picture's end: the template's start and the pictures
        come before the caption, and a causal model's states there do not depend on what follows."""
        end = tokenizer.convert_tokens_to_ids("<|vision_end|>")
        last = max((index for index, token in enumerate(ids) if token == end), default=None)
        return 0 if last is None else last + 1 - self.drop

    def stored(self) -> dict[str, Any]:
        """The chat layout, and how the pictures are read (the processor folder's files count in the
        fingerprint beside the encoder's)."""
        # "heads": the pictures' positions stored once a shard (`head`), which a reader from before
        # would take for whole rows: another layout, another cache
        return {**super().stored(), "pictures": {"processor": self.processor, "area": self.area,
                                                  "prefix": self.prefix, "backend": self.backend, "heads": True}}


def run_sampling(training: TrainingConfig, family: str, schedule: str, weightings: tuple[str, ...]) -> dict[str, Any]:
    """The run's timestep sampling and loss weighting, for a schedule whose weightings are
    `weightings`; another weighting is refused naming the family and what it can use."""
    timesteps = training.timesteps
    if timesteps.loss_weighting not in weightings:
        raise ValueError(f"training.timesteps.loss_weighting {timesteps.loss_weighting!r} is not a weighting of "
                         f"{family}'s {schedule}: use {', '.join(weightings)}")
    return {"sampling": timesteps.sampling, "logit_mean": timesteps.logit_mean, "logit_std": timesteps.logit_std,
            "mode_scale": timesteps.mode_scale, "weighting": timesteps.loss_weighting}


@dataclass(frozen=True)
class Part:
    """A part of a family. `family` is the family's name, which its errors give: the `Family` that
    declares the part fills it in, so two families can declare the same part."""

    family: str = field(default="", compare=False, kw_only=True)


# --- text: what the encoders read, and their token limits ----------------------------------
@dataclass(frozen=True)
class Captions(Part):
    """The text the encoders read of each caption under `text_encoding.caption_preprocessing`: by
    default as written, what the pipeline's `encode_prompt` feeds its tokenizers, so `diffusers`
    reads captions as `none` does and the two share a cache."""

    def rule(self, mode: str) -> str:
        """What decides the text `preprocess` gives for `mode` (part of the text cache's fingerprint)."""
        return "none"

    def preprocess(self, texts: list[str], mode: str) -> list[str]:
        return list(texts)


@dataclass(frozen=True)
class Text(Part):
    """The family's text encoders (in the order its pipeline joins them), T5's token limit when
    `text_encoding.max_length` is unset (the pipeline's own; a function of the model where it
    depends on it) and what the encoders read of a caption."""

    encoders: tuple[TextEncoderSpec, ...]
    max_length: int | Callable[[ModelConfig], int]
    captions: Captions = Captions()

    def default_max_length(self, model: ModelConfig) -> int:
        return self.max_length if isinstance(self.max_length, int) else self.max_length(model)

    def length(self, model: ModelConfig, encoder: TextEncoderSpec, text: TextEncodingConfig) -> int:
        """The token limit of one of the encoders under `text`: `text_encoding.max_length` (unset,
        the family's), or for a `tokenizer_length` encoder its tokenizer's `model_max_length`."""
        if not encoder.tokenizer_length:
            return text.max_length or self.default_max_length(model)
        from tasks.families import model_json

        name = f"{encoder.tokenizer}/tokenizer_config.json"
        settings = model_json(model.path, model.revision, name, f"the settings of {encoder.name}'s tokenizer")
        if not isinstance(settings.get("model_max_length"), int):
            raise ValueError(f"model.path {model.path}: {name} sets no model_max_length, the length "
                             f"{self.family}'s pipeline pads {encoder.name}'s captions to")
        return settings["model_max_length"]


# --- latents: the buckets pictures are cropped to, and the VAE ------------------------------
@dataclass(frozen=True)
class Buckets(Part):
    """Aspect-ratio buckets by area (`tasks.families.buckets.area_buckets`), sides multiples of
    `step` pixels; `rule` names the tables in the latent cache's fingerprint."""

    step: int = 16

    @property
    def rule(self) -> str | None:
        return f"area/{self.step}"

    def table(self, resolution: int, setting: str = "latent_encoding.resolution") -> dict[str, list[float]]:
        """height/width ratio → [height, width] in pixels, for `resolution` (the value of `setting`,
        which a family without buckets for it names in its refusal)."""
        return area_buckets(resolution, step=self.step)


@dataclass(frozen=True)
class References(Part):
    """How an edit or reference family's pipeline sizes a target's reference images for the VAE;
    `rule` names it in the latent cache's fingerprint. The pipelines size them for 1024² outputs:
    here at the run's resolution (the pipeline's own rule at 1024)."""

    rule: str
    most: int | None = None  # the references a target may have (None: as many as a source gives)
    least: int = 0  # the references a target must have (its pipeline's prompt holds that many pictures)

    def count_problem(self, count: int) -> str | None:
        """Why a target with `count` references cannot train (None: it can)."""
        if self.most is not None and count > self.most:
            return f"{count} references: {self.family} takes at most {self.most}"
        if count < self.least:
            return f"{count} references: {self.family} takes at least {self.least}"
        return None

    def box(self, width: int, height: int, resolution: int) -> list[int]:
        """[resized width, resized height, left, top, right, bottom]: the size a reference of width
        × height is resized to, then the crop of it the VAE sees (`encode.latents.crop_box`'s form)."""
        raise NotImplementedError

    def picture(self, picture: Any, resolution: int) -> Any:
        """A reference picture (PIL) as training sizes it at `resolution` (Lanczos, as the
        pipelines' image processors resize)."""
        from PIL import Image

        box = self.box(*picture.size, resolution)
        return picture.resize(tuple(box[:2]), Image.Resampling.LANCZOS).crop(tuple(box[2:]))


@dataclass(frozen=True)
class Codec(Part):
    """The VAE (its diffusers class), the buckets pictures are cropped to and the normalisation of
    its latents; by default for pictures, each one latent image."""

    buckets: Buckets = Buckets()
    vae: str = "AutoencoderKL"
    # how the pipeline sizes a target's reference images for the VAE (edit and reference families);
    # None: the family takes no reference images, and a paired dataset is refused before any stage
    references: References | None = None

    def bucket_table(self, resolution: int, setting: str = "latent_encoding.resolution") -> dict[str, list[float]]:
        return self.buckets.table(resolution, setting)

    def sample_size(self, resolution: int) -> tuple[int, int]:
        """(height, width) of the samples of a run at `resolution`: its most nearly square bucket
        (the square itself where the resolution is a multiple of the buckets' step)."""
        height, width = min(self.bucket_table(resolution).values(), key=lambda sides: abs(math.log(sides[0] / sides[1])))
        return int(height), int(width)

    def vae_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """What the VAE encodes of a batch of pictures [B, 3, H, W] in [-1, 1]: the pictures."""
        return pixels

    def clip_problem(self, frames: int) -> str | None:
        """Why a sample of `frames` frames (a picture is one) cannot be encoded, None when it can."""
        return None if frames == 1 else f"a clip of {frames} frames: {self.family} trains on pictures"

    def clip_policy_problem(self, lengths: list[int]) -> str | None:
        """Why no clip of these lengths (`dataset.video.frames` and `frame_buckets`) can ever be
        encoded, told before anything is ingested; None for pictures: each clip of a dataset that
        mixes them is quarantined, naming why."""
        return None

    def latent_factors(self, vae: torch.nn.Module) -> tuple[float | list[float], float | list[float]]:
        """(shift, scale) that normalise the VAE's latents, `(z − shift) · scale` (`normalised`), per
        channel where lists: its config's `shift_factor` (none: 0) and `scaling_factor`."""
        return vae.config.get("shift_factor") or 0.0, vae.config.scaling_factor

    def normalised(self, latent: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """A sample's latents [C, (F,) h, w] as the transformer is trained on them: `(z − shift) · scale`,
        per channel where `shift` and `scale` are [C]."""
        per_channel = (-1, *[1] * (latent.ndim - 1))
        return (latent - shift.view(per_channel)) * scale.view(per_channel)

    def clip_frames(self, latent_frames: int) -> int:
        """The frames of a clip whose latents have `latent_frames` (pictures: 1)."""
        return latent_frames


# --- the transformer: loading, the call, the objective -------------------------------------
@dataclass(frozen=True)
class Denoiser(Part):
    """The transformer a run trains (its diffusers class), the modules LoRA adapts unless
    `training.lora.target_modules` says, how it is called and the noise schedule it is trained on."""

    transformer: str
    lora_targets: tuple[str, ...]

    @serialised
    def load(self, model: ModelConfig, dtype: torch.dtype | None = None) -> torch.nn.Module:
        """The model's transformer by `from_pretrained`, its weights in `dtype` (None: as stored)."""
        return self.transformer_class().from_pretrained(model.path, subfolder=self.folder(model),
                                                        revision=model.revision, torch_dtype=dtype)

    def folder(self, model: ModelConfig) -> str:
        """The folder (and pipeline component) of the transformer a run trains: `transformer`; a
        `model.expert` is refused, the family's models having one transformer."""
        if model.expert is not None:
            raise ValueError(f"model.expert: {model.path} is a {self.family} model, which has one transformer; "
                             f"leave model.expert unset")
        return "transformer"

    def transformer_class(self) -> type:
        return library("diffusers", self.transformer)

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
        return list(training.lora.target_modules if training.lora.target_modules is not None else self.lora_targets)

    def blocks(self, transformer: torch.nn.Module) -> list[torch.nn.Module]:
        """The transformer's repeated blocks (what `training.compile` compiles one by one)."""
        return list(transformer.transformer_blocks)

    def call_options(self, training: TrainingConfig | None) -> dict[str, Any]:
        """What of the run's config `predict` is called with besides the batch (none by default)."""
        return {}

    def predict(self, network: torch.nn.Module, noisy: torch.Tensor, text: Conditioning,
                timesteps: torch.Tensor, **options: Any) -> torch.Tensor:
        """The transformer's prediction for noisy latents [B, C, h, w] at the schedule's
        `timesteps`, in the latents' shape (a transformer that packs latents into tokens packs and
        unpacks here), called as its pipeline calls it, with the run's `call_options`."""
        raise NotImplementedError

    def first_frame_given(self, latents: torch.Tensor, noisy: torch.Tensor, timesteps: torch.Tensor,
                          given: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For clips [B, C, F, h, w] whose first frame is `given` [B] (the rest from text): the
        transformer's input, its timesteps and what of the prediction the loss scores (a mask that
        broadcasts over the latents), as the family's image-to-video pipeline conditions on a frame.
        Only for a family whose sampler has an `image_pipeline_name`."""
        raise NotImplementedError


# --- sampling: the pipeline, called on cached prompts or on text ---------------------------
@dataclass(frozen=True)
class Sampler(Part):
    """The diffusers pipeline that samples from the family (and the image-to-video one that samples
    from a first frame, None: none), as the run's sample grids and the runs' pages call it."""

    pipeline_name: str
    image_pipeline_name: str | None = None
    reference_option: str | None = None  # the pipeline's argument that takes references (None: it takes none)

    def scheduler(self, model: ModelConfig) -> Any:
        """The scheduler sample grids are drawn with during training: the model's own, as saved."""
        config = library("diffusers", "DDPMScheduler").load_config(model.path, subfolder="scheduler",
                                                                   revision=model.revision)
        return library("diffusers", config["_class_name"]).from_config(config)

    def pipeline_class(self) -> type:
        return library("diffusers", self.pipeline_name)

    def image_pipeline_class(self, setting: str) -> type:
        """The family's image-to-video pipeline, which samples from a first frame; refused, naming
        `setting` (what asked for it), for a family that has none."""
        if not self.image_pipeline_name:
            raise ValueError(f"{setting}: {self.family} samples from text alone (its pipeline takes no first frame, "
                             f"as Wan 2.2 TI2V's does); leave it out")
        return library("diffusers", self.image_pipeline_name)

    def image_pipeline(self, pipeline: Any) -> Any:
        """`pipeline`'s components, as they are, in the family's image-to-video pipeline with the
        settings of `pipeline` it takes (diffusers' `from_pipe` would cast every module to fp32:
        the training transformer's half-precision base among them)."""
        cls = self.picture_pipeline_class("first frames")
        takes = inspect.signature(cls.__init__).parameters
        components = {name: module for name, module in pipeline.components.items() if name in takes}
        settings = {name: value for name, value in pipeline.config.items()
                    if name in takes and name not in pipeline.components}
        return cls(**components, **settings)

    # --- samples drawn from a picture a prompt: a video family's first frames (its image-to-video
    # pipeline), an edit family's references (its own pipeline) ---------------------------------
    def picture_pipeline_class(self, setting: str) -> type:
        """The pipeline that draws from the pictures `setting` gives (references: the family's own;
        first frames: its image-to-video one); refused, naming it, for a family that takes none of
        that kind."""
        if "reference" not in setting:
            return self.image_pipeline_class(setting)
        if self.reference_option is None:
            raise ValueError(f"{setting}: {self.family} takes no reference images (an edit family's pipeline "
                             "does); leave it out")
        return self.pipeline_class()

    def picture_pipeline(self, pipeline: Any) -> Any:
        """`pipeline`'s components in the pipeline that draws from a picture (`picture_pipeline_class`)."""
        return pipeline if self.reference_option else self.image_pipeline(pipeline)

    def picture_options(self, picture: Any, size: tuple[int, int] | None) -> dict[str, Any]:
        """How that pipeline is given a sample's picture (RGB): a reference as it is (sized already,
        `Family.picture_options`), a first frame centre-cropped to the samples' `size` (width,
        height; None: as it is) rather than stretched."""
        from PIL import ImageOps

        if self.reference_option:
            return {self.reference_option: picture}
        return {"image": ImageOps.fit(picture, size) if size else picture}

    def size_options(self, height: int, width: int) -> dict[str, Any]:
        """The pipeline's arguments for samples of height × width pixels."""
        return {"height": height, "width": width}

    def embedding_pipeline(self, model: ModelConfig, vae: Any, transformer: torch.nn.Module,
                           encoders: tuple[TextEncoderSpec, ...], denoiser: Denoiser) -> Any:
        """The pipeline without text encoders (`encoders`' slots empty: prompts come pre-encoded
        from the cache), the trained `transformer` in its `transformer` slot (a sampler of a model
        with several transformers asks `denoiser` which one was trained)."""
        slots = [name for spec in encoders for name in (spec.folder, spec.tokenizer, spec.processor) if name]
        return self.pipeline_class()(**dict.fromkeys(slots), vae=vae, transformer=transformer,
                                     scheduler=self.scheduler(model))

    def prompt_options(self, pipeline: Any, prompts: list[str], text: dict[str, Any]) -> dict[str, Any]:
        """The pipeline's prompt arguments for `prompts`, their negatives empty as the run's sample
        grids' are, with whatever else of its call (and settings of `pipeline`) makes it read them as
        the run's text cache read captions (`text`: its caption_preprocessing and max_length)."""
        return {"prompt": prompts, "negative_prompt": [""] * len(prompts), "max_sequence_length": text["max_length"]}

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

    def embedding_kwargs(self, text: Conditioning, count: int) -> dict[str, Any]:
        """The pipeline's arguments for pre-encoded prompts (the first `count` rows of `text`)
        and their negative prompts (the rest)."""
        raise NotImplementedError


# --- export: where the trained weights load ------------------------------------------------
@dataclass(frozen=True)
class Export(Part):
    """How the family's LoRA names its modules outside diffusers."""

    def comfyui_key(self, module: str) -> str:
        """A transformer module's name (diffusers') in ComfyUI's LoRA key map: under `transformer.`,
        which ComfyUI maps onto its own names for the families it converts from diffusers."""
        return f"transformer.{module}"


def named(part: Part, family: str) -> Part:
    """`part`, and each part inside it, as the part of `family` (which its errors name)."""
    inner = {f.name: named(getattr(part, f.name), family) for f in fields(part)
             if isinstance(getattr(part, f.name), Part)}
    return replace(part, family=family, **inner)


def every_model(index: dict) -> bool:
    return True


PARTS = ("text", "codec", "denoiser", "sampler", "export")


@dataclass(frozen=True)
class Family:
    """A model family: the `_class_name`s of model_index.json it reads (`reads` says which settings
    of them, where one pipeline serves several families) and its parts. Families that do something
    the same way declare the same part."""

    name: str  # what reports and errors call it
    pipelines: tuple[str, ...]
    text: Text
    codec: Codec
    denoiser: Denoiser
    sampler: Sampler
    export: Export = Export()
    reads: Callable[[dict], bool] = every_model

    def __post_init__(self) -> None:
        for part in PARTS:
            object.__setattr__(self, part, named(getattr(self, part), self.name))

    def embedding_pipeline(self, model: ModelConfig, vae: Any, transformer: torch.nn.Module) -> Any:
        """The sampler's pipeline on cached prompts, the trained transformer in its slot."""
        return self.sampler.embedding_pipeline(model, vae, transformer, self.text.encoders, self.denoiser)

    def picture_options(self, picture: Any, size: tuple[int, int] | None, resolution: int | None) -> dict[str, Any]:
        """A sample's picture as the sampler's pipeline is given it: a reference sized as training
        sized references at the run's `resolution` (the codec's rule), a first frame as it is taken."""
        if self.sampler.reference_option and resolution is not None:
            picture = self.codec.references.picture(picture, resolution)
        return self.sampler.picture_options(picture, size)
