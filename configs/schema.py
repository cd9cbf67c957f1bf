"""The one configuration schema of precast.

YAML files in this folder, the CLI's `--set` overrides and the Prefect UI form are all this model.
Each stage receives only its own section, so a change to training settings never invalidates the
text or latent caches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

CONFIG_DIR = Path(__file__).parent
QUICKSTART = CONFIG_DIR / "quickstart.yaml"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def updated(self, changes: dict[str, Any]) -> Section:
        """A validated copy with `changes` applied: {"lora.rank": 8, "steps": 2}, dotted within the section."""
        raw = self.model_dump()
        for key, value in changes.items():
            set_dotted(raw, key, value)
        return type(self).model_validate(raw)


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set `key` ("training.lora.rank") in the nested mapping `raw`, making the sections on its way."""
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"{key}: {part} is not a section")
    node[leaf] = value


@dataclass(frozen=True)
class Identity:
    """Whether a field counts in the identity of what its stage makes (the dataset's rules, a text
    or latent cache's fingerprint, a run's id): declared beside every field of the sections those
    are made of, and read by tasks/identity.py alone. A field that can change the output counts;
    one that changes only how it is made (a device, a batch size, concurrency) does not. `when`
    (the section, the field's name): counted only while it holds. `through`: not counted itself,
    only through the section's property of that name, which the identity holds."""
    counts: bool
    when: Callable[[Section, str], bool] | None = None
    through: str | None = None

    def applies(self, section: Section, name: str) -> bool:
        return self.counts and (self.when is None or self.when(section, name))


def _not_default(section: Section, name: str) -> bool:
    return getattr(section, name) != type(section).model_fields[name].get_default(call_default_factory=True)


COUNTED = Identity(True)
# where and how fast an output is made (devices, batch sizes, concurrency, memory modes whose math
# is the same: checkpointing recomputes exactly, compiled blocks compute the same within float
# tolerance, as another device does), and what is only logged or written beside it
NOT_COUNTED = Identity(False)
# a setting added after ids were made: at its default it is left out, so every older id stands
IF_NOT_DEFAULT = Identity(True, _not_default)
# settings their section uses in one mode only: changing one in another mode must not change an id
IF_RANDOM_CROP = Identity(True, lambda latents, name: latents.crop == "random")
IF_MODE = Identity(True, lambda timesteps, name: timesteps.sampling == "mode")
# how the global batch is split over nodes, processes and accumulation: the run id holds the
# micro-batches a step takes, so a run is the same run on any number of nodes
IN_MICRO_BATCHES = Identity(False, through="micro_batches")
# how training draws from a dataset's sources (repeats, weights, …): not the dataset's identity,
# which names what ingest reads; counted in the manifest's through DatasetConfig.mix
MIXED = Identity(False, through="mix")


class StorageConfig(Section):
    root: str = Field(
        "precast-store",
        description="fsspec URL of the store every stage reads and writes: a local path, "
        "file://…, s3://bucket/prefix or gs://bucket/prefix.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec storage options for the root (e.g. {'endpoint_url': …} for an S3-compatible "
        "service). Credentials belong in the environment or in credentials_block, not here.",
    )
    credentials_block: str | None = Field(
        None, description="Name of a Prefect Secret block whose JSON value holds fsspec credential options "
        "(for s3: {\"key\": …, \"secret\": …}) for precast's own reads and writes; read at run time, never "
        "copied into any artifact. Prefect's result storage still takes credentials from the worker's environment "
        "or role. None: credentials from the environment or the node's role.",
    )
    io_attempts: int = Field(
        5, ge=1, description="Attempts per storage operation on transient errors (connection reset, timeout, "
        "EIO, throttling), with exponential backoff; then the stage fails naming the object.",
    )
    io_backoff_seconds: float = Field(
        0.5, ge=0, description="Wait before the first retry of a storage operation (between half of it and all of "
        "it, at random, so throttled workers do not return at once); doubled for each further one.",
    )
    # credentials_block's fsspec options once resolved (storage.store.fsspec_options): no field, so
    # never in the config's JSON (Prefect parameters, cache keys, logs); pickled with it to the
    # processes it is sent to (Dask workers, spawned training processes)
    _credentials: dict[str, Any] | None = PrivateAttr(None)

    @property
    def credentials(self) -> dict[str, Any] | None:
        return self._credentials

    def keep_credentials(self, credentials: dict[str, Any]) -> None:
        self._credentials = credentials

    @field_validator("options")
    @classmethod
    def _no_credentials(cls, options: dict[str, Any]) -> dict[str, Any]:
        """The options travel with the config (deployment parameters, the run page, lineage, the
        Prefect UI): a credential there would be everywhere."""
        if found := credential_keys(options):
            raise ValueError(f"options holds credentials ({', '.join(found)}): they would be copied wherever the "
        "config goes (deployments, run pages, lineage). Give them in the environment, the "
        "node's role, or a Prefect Secret block named in storage.credentials_block")
        return options


# the fsspec option names that carry a secret (s3fs, gcsfs, adlfs), at any depth (client_kwargs, target_options),
# and gcsfs's `token` values that only name where credentials come from
CREDENTIAL_OPTIONS = {"key", "secret", "token", "password", "aws_access_key_id", "aws_secret_access_key",
                      "aws_session_token", "account_key", "sas_token", "connection_string", "client_secret",
        "credentials"}
CREDENTIAL_SOURCES = {"anon", "google_default", "cloud", "cache", "browser"}


def credential_keys(options: Any, where: str = "") -> list[str]:
    """The dotted names of `options` entries that hold a credential."""
    if not isinstance(options, dict):
        return []
    return [found for name, value in options.items()
            for found in ([f"{where}{name}"] if name.lower() in CREDENTIAL_OPTIONS and value not in (None, "")
                          and value not in CREDENTIAL_SOURCES else credential_keys(value, f"{where}{name}."))]


MAX_REFERENCES = 8  # reference images a target may have (FLUX.2 takes up to 10, Qwen-Image-Edit-Plus 3)


class SourceConfig(Section):
    path: Annotated[str, COUNTED] = Field(
        ..., description="Local path or fsspec URL (s3://…) of a folder, a metadata.jsonl/.csv, a parquet file or "
        "folder of them, or a webdataset .tar or folder of them."
    )
    format: Annotated[Literal["auto", "folder", "jsonl", "csv", "parquet", "webdataset"], COUNTED] = Field(
        "auto",
        description="folder: images with sibling .txt/.caption files (one caption variant per line); jsonl/csv: "
        "HF-style metadata with file_name and a caption column; parquet: image bytes and caption columns; "
        "webdataset: tars of x.jpg + x.txt/x.json. auto: by extension or by what the folder holds.",
    )
    caption_column: Annotated[str, COUNTED] = Field(
        "text", description="Caption field of jsonl/csv/parquet rows and webdataset .json.")
    image_column: Annotated[str, COUNTED] = Field(
        "image", description="Parquet column with image bytes (or a struct with `bytes`).")
    file_column: Annotated[str, COUNTED] = Field(
        "file_name", description="jsonl/csv field with the image path, relative to the file.")
    masks: Annotated[Literal["none", "alpha", "files", "column"], IF_NOT_DEFAULT] = Field(
        "none", description="Where each picture's loss mask comes from, cached at latent resolution beside the latents: "
        "the loss of each latent pixel is weighed by the share of its pixels the mask covers, so what it leaves out "
        "is not learned. alpha: the picture's alpha channel (kohya's alpha_mask), its pixels composited on white; a "
        "picture without alpha trains whole. files: a grayscale picture in `mask_path` at the picture's own relative "
        "path, any picture extension (x/a.jpg: x/a.png; ai-toolkit's mask_path); folder, jsonl and csv sources. "
        "column: each row's `mask_column`, a mask file's name relative to a jsonl/csv file, or the mask's bytes in a "
        "parquet file. A mask is white where learned, black or transparent where not, of any size (resized to the "
        "picture), and the picture's pixels stay as they are (its own transparency is not learned either); a video's "
        "mask is a picture that every frame of its clips takes. A picture or video without its mask is quarantined "
        "(missing_mask), as is one whose mask is 0 everywhere (empty_mask). "
        "none: alpha is composited on white.")
    mask_path: Annotated[str | None, IF_NOT_DEFAULT] = Field(
        None, description="With masks: files, the folder of the masks (local path or fsspec URL), laid out as the "
        "source's pictures are (a metadata file's names relative to it).")
    mask_column: Annotated[str, IF_NOT_DEFAULT] = Field(
        "mask", description="With masks: column, the jsonl/csv field naming each row's mask file (relative to the "
        "metadata file), or the parquet column of its bytes (or a struct with `bytes`).")
    references: Annotated[Literal["none", "files", "column"], IF_NOT_DEFAULT] = Field(
        "none", description="Where each picture's reference images come from, for edit and reference training "
        "(FLUX.1 Kontext, Qwen-Image-Edit, FLUX.2): the picture is the target, its references what it was made from, "
        "in order (Picture 1, Picture 2, …). files: a picture in each folder of `reference_path` at the target's own "
        "relative path, any picture extension (ai-toolkit's control_path, diffusion-pipe's and musubi-tuner's "
        "control folders; a list of folders for several references); folder, jsonl and csv sources. column: each "
        "row's `reference_column`, a file name relative to a jsonl/csv file or a list of them; in a parquet file the "
        "reference's bytes (or a struct with `bytes`) or a list of them; in a webdataset tar the members "
        "`x.<reference_column>.<ext>`, then `x.<reference_column>_2.<ext>`, … A reference is stored once however many "
        "targets name it, and the target's sample id covers its references' bytes, so a changed reference reads, "
        "stores and encodes only what depends on it. A target whose reference is missing, unreadable or refused is "
        "quarantined with the reference's reason (missing_reference, bad_reference); a video cannot have references "
        "(reference_on_clip). none: pictures alone.")
    reference_path: Annotated[str | list[str] | None, IF_NOT_DEFAULT] = Field(
        None, description="With references: files, the folder of the references (local path or fsspec URL), laid "
        "out as the source's pictures are, or a list of folders, one reference each, in order.")
    reference_column: Annotated[str, IF_NOT_DEFAULT] = Field(
        "reference", description="With references: column, the jsonl/csv field naming each row's reference file(s), "
        "the parquet column of their bytes, or the webdataset member name before the extension.")
    caption_prefix: Annotated[str, IF_NOT_DEFAULT] = Field(
        "", max_length=1000, description="A trigger word (or any text) for this source's captions: it replaces "
        "`[trigger]` where a caption has it (ai-toolkit's trigger_word), else starts every caption variant, followed "
        "by \", \" (unless the caption starts with it already). Changing it reads no file again and encodes no "
        "latent: the captions are re-encoded, the latents copied.")
    resolution: Annotated[int | None, IF_NOT_DEFAULT] = Field(
        None, ge=64, le=4096, description="This source's base resolution, in place of latent_encoding.resolution: "
        "its pictures and clips go to the family's buckets for it (SimpleTuner's, musubi-tuner's and ai-toolkit's "
        "resolution per dataset: a few close-ups at 1024 beside a large set at 512). Training draws batches of one "
        "bucket, so they never mix sizes. Changing it reads no file again and encodes this source's latents "
        "alone (copied where they crop alike, as at the config's resolution written out); its captions are "
        "encoded again with them, since its samples move to shards of their own. A file in two sources at two "
        "resolutions is trained at the first's. None: latent_encoding.resolution.")
    # how training draws from the source: ingest and the caches never read these, so changing one
    # ingests and encodes nothing again; they count in the manifest's id (DatasetConfig.mix), and so in the run's
    repeats: Annotated[int, MIXED] = Field(
        1, ge=1, le=10_000, description="Times each of this source's samples is seen per epoch of the sources "
        "without a `weight` (kohya's and musubi-tuner's num_repeats): a small set of a subject beside a large set "
        "of styles.")
    weight: Annotated[float | None, MIXED] = Field(
        None, gt=0, le=1, description="The share of batches drawn from this source, whatever its size "
        "(SimpleTuner's probability): 0.3 draws 3 batches in 10 from it. The sources without one share what is "
        "left by their samples × repeats; if every source has one, they are scaled to add up to 1. None: by size.")
    loss_weight: Annotated[float, MIXED] = Field(
        1.0, ge=0, le=100, description="Each of this source's samples' loss is multiplied by this "
        "(OneTrainer's loss_weight, ai-toolkit's loss_multiplier, sd-scripts' prior_loss_weight).")
    caption_dropout: Annotated[float | None, MIXED] = Field(
        None, ge=0, le=1, description="The share of this source's samples trained with the empty caption. "
        "None: training.caption_dropout.")
    regularisation: Annotated[Literal["off", "captions", "base_model"], MIXED] = Field(
        "off", description="A regularisation set (prior preservation). captions: its pictures trained with their "
        "own captions, as any source, and reported as regularisation (DreamBooth, sd-scripts' reg images; weigh them "
        "with loss_weight). base_model: trained toward what the base model predicts for the same noisy latents and "
        "caption, the adapter switched off, so the adapter learns to leave these prompts as they were "
        "(SimpleTuner's and ai-toolkit's regularisation data); a LoRA or DoRA only.")

    @model_validator(mode="after")
    def _masks_have_their_folder(self) -> SourceConfig:
        if (self.masks == "files") != (self.mask_path is not None):
            raise ValueError(f"dataset source {self.path!r}: masks: files reads its masks from mask_path, and "
                             "mask_path is read with masks: files only")
        if self.masks != "column" and self.mask_column != "mask":
            raise ValueError(f"dataset source {self.path!r}: mask_column is read with masks: column only")
        if (self.references == "files") != bool(self.reference_path):
            raise ValueError(f"dataset source {self.path!r}: references: files reads its references from "
                             "reference_path, and reference_path is read with references: files only")
        if self.references != "column" and self.reference_column != "reference":
            raise ValueError(f"dataset source {self.path!r}: reference_column is read with references: column only")
        if len(self.reference_folders()) > MAX_REFERENCES:
            raise ValueError(f"dataset source {self.path!r}: reference_path names more than {MAX_REFERENCES} folders")
        return self

    def reference_folders(self) -> list[str]:
        """The folders of `reference_path`, in the order of the references they hold."""
        folders = self.reference_path or []
        return [folders] if isinstance(folders, str) else list(folders)

    def mixing(self) -> dict[str, Any]:
        """This source's settings of how training draws from it (the fields marked MIXED)."""
        return {name: getattr(self, name) for name, field in type(self).model_fields.items() if MIXED in field.metadata}


class VideoConfig(Section):
    frames: Annotated[int, COUNTED] = Field(
        81, ge=2, le=1024, description="Frames per clip, after resampling to fps. The model family may require a "
        "count (Wan: 4N + 1, such as 17, 33, 49, 81); clips of another count are quarantined when latents are "
        "encoded, naming the rule.",
    )
    frame_buckets: Annotated[list[Annotated[int, Field(ge=2, le=1024)]], IF_NOT_DEFAULT] = Field(
        default_factory=list, description="Shorter clip lengths for videos too short for `frames`: each video's clips "
        "take the longest of `frames` and these that it holds (diffusion-pipe's frame_buckets, musubi-tuner's "
        "target_frames; Wan: 4N + 1 each, such as [17, 33, 49]), none longer than `frames`. Empty: `frames` only; "
        "a shorter video is quarantined as too_short.",
    )
    fps: Annotated[float | None, COUNTED] = Field(
        16.0, gt=0, le=240, description="Frames per second clips are resampled to, by the frames' own timestamps "
        "(Wan 2.1 was trained at 16). None: each video's own average rate.",
    )
    clips: Annotated[Literal["head", "uniform", "sliding"], COUNTED] = Field(
        "head", description="Where a video's clips start: head: one, at the start; uniform: max_clips spread evenly "
        "from the start to the end; sliding: every `stride` frames from the start, at most max_clips.",
    )
    max_clips: Annotated[int, COUNTED] = Field(
        1, ge=1, le=10_000, description="Clips a video gives at most (uniform, sliding).")
    stride: Annotated[int | None, COUNTED] = Field(
        None, ge=1, description="sliding: frames (at fps) from one clip's start to the next. None: the clips' length, "
        "clips that do not overlap.",
    )
    frame_pixels: Annotated[int, COUNTED] = Field(
        1280 * 720, ge=64 * 64, description="Frames are stored scaled down to at most this many pixels (a clip is "
        "stored as an animated WebP); the latent stage crops and scales them to its buckets as it does pictures.",
    )
    quality: Annotated[int, COUNTED] = Field(92, ge=1, le=100, description="WebP quality of the stored frames.")
    max_seconds: Annotated[float, COUNTED] = Field(
        3600.0, gt=0, description="Videos longer than this are quarantined unread (a duration bomb).",
    )
    max_bytes: Annotated[int, COUNTED] = Field(
        2 << 30, ge=1, description="Video files larger than this are quarantined unread.")

    @model_validator(mode="after")
    def _clip_lengths(self) -> VideoConfig:
        if longer := sorted(n for n in self.frame_buckets if n > self.frames):
            raise ValueError(f"frame_buckets {longer}: clip lengths for videos too short for frames ({self.frames}) "
                             f"are shorter")
        shortest = min([self.frames, *self.frame_buckets])
        if self.fps and shortest / self.fps > self.max_seconds:  # N frames at fps take N / fps seconds of video
            raise ValueError(f"a clip of {shortest} frames at fps {self.fps:g} takes {shortest / self.fps:g} s of "
                             f"video, more than max_seconds ({self.max_seconds:g}): no video could give one")
        return self


class DatasetConfig(Section):
    sources: Annotated[list[SourceConfig], COUNTED] = Field(
        ..., min_length=1, description="Where the training images and captions come from (at least one source).",
    )
    shard_size: Annotated[int, COUNTED] = Field(
        256, ge=1, description="Samples per image shard (one encoding task per shard).")
    min_side: Annotated[int, COUNTED] = Field(
        64, ge=1, description="Images whose shorter side is below this are quarantined.")
    max_pixels: Annotated[int, COUNTED] = Field(
        89_478_485, ge=1, description="Images with more pixels than this are quarantined (decompression bombs)."
    )
    read_concurrency: Annotated[int, NOT_COUNTED] = Field(
        32, ge=1, description="Source objects read (and images checked) at once: enough requests in flight to hide "
        "an object store's per-request latency (~20 ms on S3). A local source uses at most one thread per core: "
        "there is no latency to hide, and Pillow decodes in parallel threads. On workers: per worker.",
    )
    partition_size: Annotated[int, NOT_COUNTED] = Field(
        1000, ge=1, description="When ingest runs on workers (execution.workers > 1 or execution.cluster): units (an "
        "image with its caption file or metadata row, or a whole parquet or tar file) a worker reads and examines in "
        "one task, up to 256 MiB of them. Outputs do not depend on it.",
    )
    video: Annotated[VideoConfig, IF_NOT_DEFAULT] = Field(
        default_factory=VideoConfig, description="How video files (mp4, mov, webm, mkv) become clips, a sample each. "
        "Pictures are one-frame samples.",
    )

    @property
    def mix(self) -> list[dict[str, Any]] | None:
        """How training draws from each source (`SourceConfig.mixing`), None while every source
        keeps the defaults: then the sources are one pool, each sample drawn once an epoch."""
        mixing = [source.mixing() for source in self.sources]
        default = SourceConfig(path="-").mixing()
        return None if all(settings == default for settings in mixing) else mixing

    def shares(self, samples: list[int]) -> list[float]:
        """The share of training's draws each source takes, given each one's `samples`: a weighted
        source its weight (all weights scaled to add up to 1 when every source has one), the others
        what is left, by samples × repeats."""
        weights = [source.weight for source in self.sources]
        given = sum(w for w in weights if w is not None)
        if all(w is not None for w in weights):
            return [w / given for w in weights]
        pooled = [n * source.repeats if source.weight is None else 0 for n, source in zip(samples, self.sources)]
        total = sum(pooled) or 1
        return [w if w is not None else (1 - given) * p / total for w, p in zip(weights, pooled)]

    def drawn(self, samples: list[int]) -> list[dict[str, Any]]:
        """How training draws from each source, given each one's `samples`: its path, samples,
        mixing settings and share of the draws (what the manifest, the ingest report and the run
        page show)."""
        return [{"path": source.path, "samples": count, **source.mixing(), "share": share}
                for source, count, share in zip(self.sources, samples, self.shares(samples))]

    @model_validator(mode="after")
    def _shares(self) -> DatasetConfig:
        if both := [source.path for source in self.sources if source.weight is not None and source.repeats != 1]:
            raise ValueError(f"dataset.sources {', '.join(both)}: repeats has no effect on a source with a weight "
                             "(its share of the batches is the weight, whatever its size): give one of them")
        weights = [source.weight for source in self.sources if source.weight is not None]
        if weights and len(weights) < len(self.sources) and sum(weights) >= 1:
            unweighted = ", ".join(source.path for source in self.sources if source.weight is None)
            raise ValueError(f"sources' weights add up to {sum(weights):g}, which leaves no batch for the sources "
                             f"without one ({unweighted}): give those a weight too, or make the weights add up to "
                             "less than 1")
        return self


class ModelConfig(Section):
    path: str = Field(
        ...,
        description="Hub id or local folder in the diffusers hub layout (model_index.json, text_encoder/, "
        "tokenizer/, vae/, transformer/, scheduler/); the pipeline model_index.json names picks the model family.",
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) when path is a hub id.")
    expert: Literal["high_noise", "low_noise"] | None = Field(
        None, description="Which transformer of a two-expert model to train (Wan 2.2 A14B: its model_index.json names "
        "transformer and transformer_2 and a boundary_ratio). high_noise: transformer/, trained on the noise levels "
        "the pipeline gives it, σ at or above boundary_ratio; low_noise: transformer_2/, below it. Required for such "
        "a model, refused for any other.",
    )


Dtype = Literal["fp32", "bf16", "fp16"]


class TextEncodingConfig(Section):
    max_length: Annotated[int | None, COUNTED] = Field(
        None, ge=1, description="T5 token limit; longer captions are truncated. None: the model family's own, as its "
        "pipeline is called (docs/families.md gives each family's).")
    caption_preprocessing: Annotated[Literal["diffusers", "none"], COUNTED] = Field(
        "diffusers",
        description="What T5 reads of a caption or prompt. diffusers: exactly what the model family's diffusers "
        "pipeline feeds its tokenizer by default (e.g. its own clean_caption: lowercased; URLs, HTML, hashtags, IDs "
        "removed), so an adapter sees the same tokens in training as where it is used. none: the caption as "
        "written. Applied alike to captions, sample prompts and `precast sample`; part of the encoder "
        "fingerprint.",
    )
    dtype: Annotated[Literal["fp32", "bf16", "fp16", "int8"], COUNTED] = Field(
        "bf16",
        description="T5 precision. fp16 loads through from_pretrained(dtype=float16), which keeps T5's wo layers "
        "in fp32; int8 is torchao int8 weight-only quantisation with bf16 activations. Embeddings are stored in "
        "the activation dtype (fp32, bf16, fp16; bf16 for int8).",
    )
    offload: Annotated[Literal["none", "model", "sequential"], NOT_COUNTED] = Field(
        "none",
        description="none: T5 lives on the device. model: weights wait in CPU memory and move to the device for "
        "each shard. sequential: each layer moves to the device only for its own forward (T5-XXL on a GPU "
        "smaller than its weights). Results do not depend on it.",
    )
    batch_tokens: Annotated[int, NOT_COUNTED] = Field(
        16384, ge=1, description="Token budget of one encoder batch (captions are sorted by length first)."
    )
    numerics_samples: Annotated[int, NOT_COUNTED] = Field(
        8, ge=0, description="Captions re-encoded in fp32 to measure the precision's error (0: skip the check)."
    )
    device: Annotated[str, NOT_COUNTED] = Field("auto", description="Torch device for T5: auto, cpu, cuda, cuda:1, …")


class LatentEncodingConfig(Section):
    resolution: Annotated[int, COUNTED] = Field(
        512, ge=64, le=4096, description="Base resolution in pixels: the model family's aspect-ratio buckets for it "
        "(as its diffusers pipeline or its trainers bucket). A family with fixed tables has them for 256, 512, 1024 "
        "and 2048 and refuses other sizes before any stage runs; area buckets (FLUX.1, SD3, Chroma, Wan) take any side, "
        "the buckets' area its square's: 632 gives Wan 2.1's 480p (832 x 480), 960 its 720p (1280 x 720). Samples "
        "are drawn at the most nearly square bucket."
    )
    crop: Annotated[Literal["center", "random"], COUNTED] = Field(
        "center", description="Crop after resizing to cover the bucket: centre (the families' own recipes) or "
        "random, seeded by crop_seed and the sample id. The crop box is recorded per sample."
    )
    crop_seed: Annotated[int, IF_RANDOM_CROP] = Field(0, description="Seed of random crops.")
    reference_resolution: Annotated[int | None, IF_NOT_DEFAULT] = Field(
        None, ge=64, le=4096, description="The resolution an edit pair's references are sized for, by their family's "
        "rule (Qwen-Image-Edit: about its square's area at the reference's ratio; Kontext: its preferred sizes "
        "scaled to it), for training and for the samples drawn from references; None: the run's (resolution, or the "
        "target's source's). The Qwen-Image-Edit pipelines size references for 1024 whatever they draw: 1024 trains "
        "on the references they sample from, at the cost of the references' tokens (4 times a 512 target's)."
    )
    posterior: Annotated[Literal["mean_std", "mean_logvar", "mean"], COUNTED] = Field(
        "mean_std", description="What is stored of the VAE posterior: mean and std (training samples a fresh latent "
        "each epoch), mean and log-variance, or the mean only."
    )
    flip: Annotated[bool, COUNTED] = Field(
        False, description="Also store the posterior of the horizontally flipped image.")
    dtype: Annotated[Dtype, COUNTED] = Field(
        "fp32", description="Precision of the VAE encoder; a non-finite result is re-encoded in fp32, and a sample "
        "still non-finite is quarantined."
    )
    storage_dtype: Annotated[Dtype, COUNTED] = Field("fp16", description="Precision of the stored posterior.")
    batch_size: Annotated[int, NOT_COUNTED] = Field(8, ge=1, description="Images per VAE call (one bucket per batch).")
    tiling: Annotated[bool, COUNTED] = Field(
        False, description="Tiled VAE encoding, for large resolutions on small GPUs (changes the latents slightly).")
    slicing: Annotated[bool, NOT_COUNTED] = Field(
        False, description="Encode a batch one image at a time inside the VAE (less memory).")
    device: Annotated[str, NOT_COUNTED] = Field("auto", description="Torch device for the VAE: auto, cpu, cuda, …")


class Group(Section):
    """A group of a section's fields (training.lora, training.optimizer, …), written nested. `FLAT`:
    the names its fields had before the section was grouped, where they differ: the section reads
    them too (`read_flat`), so older configs and deployments load as they did, and identities hash
    the flat form they always hashed (`flat`)."""
    FLAT: ClassVar[dict[str, str]] = {}

    @classmethod
    def flat_names(cls) -> dict[str, str]:
        """Each field's name in the section's flat form."""
        return {name: cls.FLAT.get(name, name) for name in cls.model_fields}


def grouped(kind: type[Group], description: str) -> Any:
    """The field of a section that holds the group `kind`, at its defaults unless given."""
    return Field(default_factory=kind, description=description)


def groups_of(section: type[Section]) -> dict[str, type[Group]]:
    """The section's groups by field name."""
    return {name: field.annotation for name, field in section.model_fields.items()
            if isinstance(field.annotation, type) and issubclass(field.annotation, Group)}


def read_flat(section: type[Section], raw: Any) -> Any:
    """`raw` with the flat names of `section`'s grouped fields (training.rank) moved into their
    groups (training.lora.rank); a field given both ways is refused by its two names."""
    if not isinstance(raw, dict):
        return raw
    raw = dict(raw)
    for group, kind in groups_of(section).items():
        # a flat name may be the group's own (training.optimizer: adamw8bit): a value, not a mapping
        found = {name: raw.pop(flat) for name, flat in kind.flat_names().items()
                 if flat in raw and (flat != group or not isinstance(raw[flat], dict))}
        if not found:
            continue
        into = raw.get(group, {})
        if not isinstance(into, dict):
            raise ValueError(f"{group}: a mapping of {', '.join(kind.model_fields)}")
        if both := sorted(set(found) & set(into)):
            raise ValueError(f"{', '.join(kind.flat_names()[name] for name in both)} given twice: flat and as "
                             f"{', '.join(f'{group}.{name}' for name in both)}; keep one")
        raw[group] = {**into, **found}
    return raw


def flat(section: type[Section], values: dict[str, Any]) -> dict[str, Any]:
    """`values` of `section` (a model_dump, whole or in part) with its groups' fields under their flat names."""
    out = {name: value for name, value in values.items() if name not in groups_of(section)}
    for group, kind in groups_of(section).items():
        names = kind.flat_names()
        out.update({names[name]: value for name, value in values.get(group, {}).items()})
    return out


class LoraConfig(Group):
    FLAT: ClassVar[dict[str, str]] = {"dropout": "lora_dropout"}
    rank: Annotated[int, COUNTED] = Field(32, ge=1, description="LoRA rank r.")
    alpha: Annotated[float, COUNTED] = Field(16.0, gt=0, description="LoRA alpha (the scale is alpha / rank).")
    dropout: Annotated[float, COUNTED] = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA branch.")
    dora: Annotated[bool, IF_NOT_DEFAULT] = Field(
        False, description="Weight-decomposed LoRA (DoRA, PEFT's use_dora): each adapted weight's norm per output "
        "channel trains as a magnitude of its own beside the low-rank update of its direction: one vector a "
        "module more, and each step computes the adapted weights' norms. Exported with its magnitudes for the "
        "family pipeline's load_lora_weights; ComfyUI's loader applies them against other norms, so that export "
        "is refused.",
    )
    adapter: Annotated[Literal["lora", "loha", "lokr"], IF_NOT_DEFAULT] = Field(
        "lora", description="The kind of adapter, each PEFT's: lora (a low-rank update B·A); loha (LyCORIS' LoHa: "
        "the Hadamard product of two rank-r updates, rank r² of expressiveness for twice LoRA's weights); lokr "
        "(LyCORIS' LoKr: the Kronecker product of a small factor and a rank-r one, far fewer weights). rank, alpha "
        "(scale alpha / rank) and target_modules apply to each; dropout is LoHa's and LoKr's rank dropout. "
        "Exported for ComfyUI's loader (which reads LyCORIS' keys); the diffusers pipelines' load_lora_weights "
        "reads LoRA alone, so that export of the others is refused (load them with PEFT).",
    )
    factor: Annotated[int, IF_NOT_DEFAULT] = Field(
        -1, ge=-1, description="lokr: the Kronecker factor's size (PEFT's decompose_factor, LyCORIS' factor; "
        "-1: the most balanced split of each dimension).",
    )
    target_modules: Annotated[list[str] | None, COUNTED] = Field(
        None, description="Transformer modules that get LoRA layers (PEFT target_modules). None: the model family's "
        "own (attention q/k/v/out and feed-forward; docs/families.md).",
    )

    @model_validator(mode="after")
    def _one_kind(self) -> LoraConfig:
        if self.dora and self.adapter != "lora":
            raise ValueError(f"lora.dora with lora.adapter {self.adapter}: DoRA decomposes a LoRA's update; "
                             "choose one")
        if self.factor != -1 and self.adapter != "lokr":
            raise ValueError(f"lora.factor is LoKr's (lora.adapter lokr), not {self.adapter}'s")
        return self


class OptimizerConfig(Group):
    FLAT: ClassVar[dict[str, str]] = {"name": "optimizer"}
    name: Annotated[Literal["adamw", "adamw8bit"], COUNTED] = Field(
        "adamw", description="adamw (torch) or adamw8bit (bitsandbytes: 8-bit optimizer state, about a quarter of "
        "AdamW's memory for large tensors)."
    )
    learning_rate: Annotated[float, COUNTED] = Field(1e-4, gt=0, description="AdamW learning rate after warm-up.")
    weight_decay: Annotated[float, COUNTED] = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup_steps: Annotated[int, COUNTED] = Field(0, ge=0, description="Linear learning-rate warm-up steps.")
    max_grad_norm: Annotated[float, COUNTED] = Field(1.0, gt=0, description="Gradient clipping norm.")
    ema_decay: Annotated[float, COUNTED] = Field(
        0.0, ge=0, lt=1, description="Decay of an exponential moving average of the trained weights (0: off); "
        "when on, the averaged weights are what the run saves."
    )


class TimestepsConfig(Group):
    FLAT: ClassVar[dict[str, str]] = {"sampling": "timestep_sampling"}
    sampling: Annotated[Literal["uniform", "logit_normal", "mode"], COUNTED] = Field(
        "uniform", description="How training timesteps are drawn (diffusers' compute_density_for_timestep_sampling): "
        "uniform over the schedule; logit_normal: sigmoid of N(logit_mean, logit_std), favouring the middle of the "
        "schedule; mode: the mode-weighted density of the SD3 paper, shaped by mode_scale.")
    logit_mean: Annotated[float, COUNTED] = Field(0.0, description="Mean of the logit-normal timestep distribution.")
    logit_std: Annotated[float, COUNTED] = Field(
        1.0, gt=0, description="Standard deviation of the logit-normal timestep distribution.")
    mode_scale: Annotated[float, IF_MODE] = Field(
        1.29, description="Scale of the mode timestep density (SD3's and diffusers' default "
        "1.29; 0 is uniform); used only by sampling mode.")
    loss_weighting: Annotated[Literal["none", "min_snr", "sigma_sqrt", "cosmap"], COUNTED] = Field(
        "none", description="none: every timestep weighs the same (the families' own); min_snr (DDPM families): "
        "Min-SNR-γ weighting, min(SNR, γ) / SNR for epsilon, / (SNR + 1) for v_prediction, min(SNR, γ) for sample; "
        "sigma_sqrt, cosmap (flow-matching families): σ⁻² and 2 / (π(1 − 2σ + 2σ²)), diffusers' "
        "compute_loss_weighting_for_sd3.")
    min_snr_gamma: Annotated[float, COUNTED] = Field(5.0, gt=0, description="γ of min_snr loss weighting.")


class SamplesConfig(Group):
    FLAT: ClassVar[dict[str, str]] = {"prompts": "sample_prompts", "first_frames": "sample_first_frames",
                                      "references": "sample_references", "every": "sample_every",
                                      "steps": "sample_steps", "fps": "sample_fps"}
    prompts: Annotated[list[str], COUNTED] = Field(
        default_factory=lambda: ["a red circle on a blue background"],
        description="Prompts rendered into the run's sample grid (encoded by the text stage, not here).",
    )
    first_frames: Annotated[list[str], COUNTED] = Field(
        default_factory=list,
        description="Pictures (paths or URLs, read with the storage options) the sample videos start from, one a "
        "sample prompt in order: drawn image to video by the family's image-to-video pipeline (Wan 2.2 TI2V: "
        "WanImageToVideoPipeline), to see what training.image_to_video learns. Empty: drawn from text alone.",
    )
    references: Annotated[list[str], IF_NOT_DEFAULT] = Field(
        default_factory=list,
        description="Pictures (paths or URLs, read with the storage options) the sample prompts edit, one a prompt "
        "in order, for an edit family (FLUX.1 Kontext): each drawn by the family's pipeline from its reference, "
        "sized as training sizes references (held-out pairs' references show what the edit learned). Empty: drawn "
        "from text alone.",
    )
    every: Annotated[int, COUNTED] = Field(
        0, ge=0, description="Steps between sample grids during training (0: at the end only).")
    steps: Annotated[int, COUNTED] = Field(20, ge=1, description="Denoising steps per sample image.")
    fps: Annotated[float, NOT_COUNTED] = Field(
        16.0, gt=0, le=240, description="Frames a second of the sample videos of a run on clips "
        "(the run's samples/step-N.webp; `precast sample`'s default): the clips' `dataset.video.fps` "
        "shows motion at the speed the clips show it (16: Wan's).")
    true_cfg_scale: Annotated[float, IF_NOT_DEFAULT] = Field(
        1.0, ge=1, description="Classifier-free guidance of the samples on top of the "
        "guidance input of a guidance-distilled transformer (its pipeline's true_cfg_scale): "
        "for a transformer trained on dropped captions; 1: none. Unused where guidance_scale "
        "is the classifier-free guidance.")

    @model_validator(mode="after")
    def _a_first_frame_a_prompt(self) -> SamplesConfig:
        for name in ("first_frames", "references"):
            if (pictures := getattr(self, name)) and len(pictures) != len(self.prompts):
                raise ValueError(f"{name}: {len(pictures)} pictures for {len(self.prompts)} prompts; give one a prompt")
        if self.first_frames and self.references:
            raise ValueError("first_frames and references: a sample is drawn from one picture, a first frame (video "
                             "families) or a reference (edit families)")
        return self

    def pictures(self) -> tuple[str, list[str]]:
        """The setting that gives the samples' pictures (first frames, or references) and their paths."""
        return ("training.samples.references", self.references) if self.references else \
            ("training.samples.first_frames", self.first_frames)


class ValidationConfig(Group):
    FLAT: ClassVar[dict[str, str]] = {"samples": "validation_samples", "every": "validation_every"}
    samples: Annotated[int, COUNTED] = Field(
        8, ge=0, description="Samples of the manifest held out of training (chosen by a hash of seed and sample id) "
        "to score a validation loss with fixed draws, noise and timesteps (0: no validation)."
    )
    every: Annotated[int, COUNTED] = Field(
        50, ge=0, description="Steps between validation losses (0: at the end only); logged in metrics.jsonl, the "
        "loss curve and the run's progress."
    )


class DistributionConfig(Group):
    processes: Annotated[int, IN_MICRO_BATCHES] = Field(
        1, ge=1, description="Data-parallel training processes per node: one per GPU (NCCL), or CPU processes "
        "(gloo). Each takes every n-th micro-batch of the global batch; gradients are averaged."
    )
    nodes: Annotated[int, IN_MICRO_BATCHES] = Field(
        1, ge=1, description="Nodes that train together, each running `processes` processes. Above 1 the train stage "
        "starts one flow run per node through execution.placement's train deployment; they find each other through "
        "the store (rank 0 publishes its address) and train as one torch.distributed group."
    )
    node_timeout: Annotated[float, NOT_COUNTED] = Field(
        300.0, gt=0, description="Seconds a node may stay silent (no heartbeat, a collective not completing, not "
        "joining) before the whole run fails naming it; a re-run resumes from the last checkpoint."
    )
    gradient_accumulation: Annotated[int, IN_MICRO_BATCHES] = Field(
        1, ge=1, description="Micro-batches each process adds up per optimizer step (when global_batch is not set).")
    global_batch: Annotated[int | None, IN_MICRO_BATCHES] = Field(
        None, ge=1, description="Samples per optimizer step over every process of every node. Set, each process "
        "accumulates global_batch / (batch_size × processes × nodes) micro-batches, so a run trains the same "
        "(same id, same results within float tolerance) on any number of nodes and processes that divides it; "
        "gradient_accumulation must then stay 1. None: batch_size × gradient_accumulation × processes × nodes.")


class TrackingConfig(Group):
    FLAT: ClassVar[dict[str, str]] = {"project": "tracker_project"}
    trackers: Annotated[list[Literal["tensorboard", "mlflow", "wandb"]], NOT_COUNTED] = Field(
        default_factory=lambda: ["tensorboard"], description="Experiment trackers that get the losses, learning rate, "
        "gradient norm, samples/s, peak memory, sample grids and the run's config and lineage: tensorboard (event "
        "files in the run folder on the store), mlflow (to mlflow_tracking_uri), wandb (as WANDB_* say; "
        "WANDB_MODE=offline needs no network). mlflow and wandb are the package's extras. A tracker that fails "
        "warns and is dropped; training never fails or waits for one.")
    project: Annotated[str, NOT_COUNTED] = Field(
        "precast", description="The MLflow experiment and W&B project runs are logged to.")
    mlflow_tracking_uri: Annotated[str | None, NOT_COUNTED] = Field(
        None, description="MLflow tracking URI (a server, or file:/path for a local store); None: MLflow's own "
        "default (MLFLOW_TRACKING_URI, else ./mlruns).")


class TrainingConfig(Section):
    method: Annotated[Literal["lora", "full"], COUNTED] = Field(
        "lora", description="lora: a PEFT LoRA adapter on the frozen transformer; full: every transformer weight "
        "(saved in diffusers format)."
    )
    init_from: Annotated[str, COUNTED] = Field(
        "none", description="none; latest: continue from the newest finished LoRA run of this model in the store "
        "(nightly retraining); or a run/adapter URL. Only the weights carry over, not the optimizer."
    )
    steps: Annotated[int, COUNTED] = Field(1000, ge=1, description="Optimizer steps.")
    batch_size: Annotated[int, COUNTED] = Field(
        4, ge=1, description="Samples per micro-batch of one process (what fits its device); a micro-batch comes "
        "from one aspect-ratio bucket.")
    caption_dropout: Annotated[float, COUNTED] = Field(
        0.1, ge=0, le=1, description="Probability of training on the empty caption (for classifier-free guidance)."
    )
    image_to_video: Annotated[float, COUNTED] = Field(
        0.0, ge=0, le=1, description="Share of the clips (of more than one latent frame) trained image to video, for a "
        "family whose pipeline also samples from a first frame (Wan 2.2 TI2V: WanImageToVideoPipeline with "
        "expand_timesteps): the first latent frame given clean at timestep 0, the loss on the frames after it; "
        "the others train text to video (and the validation loss is text to video, so runs compare). 0: text to "
        "video only."
    )
    image_to_video_warmup: Annotated[int, IF_NOT_DEFAULT] = Field(
        0, ge=0, description="Steps at the start of the run in which every clip trains image to video (as "
        "image_to_video describes), before image_to_video's share takes over: a model first learns how the words "
        "move a given first frame, then also to draw the first frame from text (the wan demo: 2,000 of 6,000 steps, "
        "then 0.2). 0: image_to_video's share from the first step."
    )
    batch_tokens: Annotated[int | None, COUNTED] = Field(
        None, ge=1, description="Image tokens per micro-batch instead of a sample count: a bucket whose images are t "
        "tokens each (latent height × width / patch²) gets batch_tokens // t samples (at least 1), so every "
        "micro-batch carries about the same work and small buckets fill the device. None: batch_size samples.")
    gradient_checkpointing: Annotated[Literal["none", "recompute", "offload", "auto"], NOT_COUNTED] = Field(
        "none", description="none: keep every activation for backward; recompute: keep only each transformer "
        "block's input and recompute the block in backward (less memory, ~1/3 more compute); offload: recompute, "
        "and the kept block inputs wait in pinned host memory (non-blocking copies), so the device holds almost no "
        "activations; auto: the fastest of these (and, for LoRA, the fewest blocks_to_swap) that the memory plan "
        "fits in the memory free on the training device at the run's base_precision, chosen when training starts and "
        "logged (`precast plan` prints the same choice beforehand). The same weights in every mode. true/false "
        "read as recompute/none.")
    blocks_to_swap: Annotated[int, NOT_COUNTED] = Field(
        0, ge=0, description="Transformer blocks whose frozen weights wait in pinned host memory and are copied to "
        "the device just ahead of use, forward and backward, on a side stream (the first blocks; LoRA only, with "
        "gradient_checkpointing recompute or offload): a transformer larger than the card trains, at the cost of "
        "copying those weights twice a step. `precast plan` says how many a card needs. The same weights as 0.")
    mixed_precision: Annotated[Literal["no", "bf16", "fp16"], COUNTED] = Field(
        "no", description="Autocast precision of the forward pass; fp16 also scales the loss (GradScaler)."
    )
    base_precision: Annotated[Literal["fp32", "bf16", "fp16", "int8", "fp8"], COUNTED] = Field(
        "fp32", description="How the frozen transformer weights are held for LoRA (the LoRA weights, optimizer state "
        "and loss stay fp32): fp32; bf16 or fp16 (half the memory; needs mixed_precision of the same type); int8 "
        "or fp8 (e4m3, weight-only, torchao: a quarter; each weight is widened as its layer runs). method full "
        "trains in fp32.")
    log_every: Annotated[int, NOT_COUNTED] = Field(
        10, ge=1, description="Steps between the losses leaving the device (metrics, log, progress): the loop never "
        "waits for the device in between. Also at validation, checkpoints and the last step.")
    prefetch: Annotated[int, NOT_COUNTED] = Field(
        2, ge=1, description="Batches read ahead of the device (with an accelerator).")
    compile: Annotated[bool, NOT_COUNTED] = Field(
        False, description="torch.compile each transformer block (compiles once per bucket shape).")
    checkpoint_every: Annotated[int, NOT_COUNTED] = Field(
        500, ge=0, description="Steps between resumable checkpoints (0: none). A re-run resumes from the latest."
    )
    keep_checkpoints: Annotated[int, NOT_COUNTED] = Field(
        2, ge=1, description="Newest checkpoints kept in the run folder.")
    seed: Annotated[int, COUNTED] = Field(0, description="Seed of data order, noise and LoRA initialisation.")
    guidance_scale: Annotated[float, COUNTED] = Field(
        4.5, ge=1, description="Guidance scale of the samples: classifier-free guidance, "
        "or the guidance input of a guidance-distilled transformer (which training gives it too).")
    device: Annotated[str, NOT_COUNTED] = Field("auto", description="Torch device for training: auto, cpu, cuda, …")
    # each group counts in the run id field by field, as its fields declare
    lora: Annotated[LoraConfig, COUNTED] = grouped(LoraConfig, "The LoRA adapter (method lora).")
    optimizer: Annotated[OptimizerConfig, COUNTED] = grouped(
        OptimizerConfig, "The optimizer, its schedule, clipping and weight averaging.")
    timesteps: Annotated[TimestepsConfig, COUNTED] = grouped(
        TimestepsConfig, "How training timesteps are drawn and their losses weighed.")
    samples: Annotated[SamplesConfig, COUNTED] = grouped(SamplesConfig, "The run's sample grids.")
    validation: Annotated[ValidationConfig, COUNTED] = grouped(
        ValidationConfig, "The validation loss on held-out samples.")
    distribution: Annotated[DistributionConfig, COUNTED] = grouped(
        DistributionConfig, "Processes, nodes and how the global batch splits over them.")
    tracking: Annotated[TrackingConfig, COUNTED] = grouped(TrackingConfig, "Experiment trackers.")

    @model_validator(mode="before")
    @classmethod
    def _flat_names(cls, raw: Any) -> Any:
        return read_flat(cls, raw)

    @field_validator("gradient_checkpointing", mode="before")
    @classmethod
    def _checkpointing_as_bool(cls, value: Any) -> Any:
        return {True: "recompute", False: "none"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _streaming_fits(self) -> TrainingConfig:
        if self.blocks_to_swap and (self.method != "lora" or self.gradient_checkpointing == "none" or self.compile):
            raise ValueError(f"blocks_to_swap {self.blocks_to_swap} streams a LoRA run's frozen blocks under gradient "
                             f"checkpointing, uncompiled: it needs method lora (it is {self.method}), "
                             f"gradient_checkpointing recompute or offload (it is {self.gradient_checkpointing}) "
                             f"and compile false (it is {str(self.compile).lower()})")
        return self

    @model_validator(mode="after")
    def _precision_fits(self) -> TrainingConfig:
        if self.base_precision in ("bf16", "fp16") and self.mixed_precision != self.base_precision:
            raise ValueError(f"base_precision {self.base_precision} needs mixed_precision {self.base_precision} "
                             f"(it is {self.mixed_precision}): a half-precision base computes under autocast")
        if self.base_precision != "fp32" and self.method == "full":
            raise ValueError(f"base_precision {self.base_precision} is for LoRA: method full trains every weight "
                             f"in fp32")
        if self.lora.adapter != "lora" and self.base_precision in ("int8", "fp8"):
            raise ValueError(f"lora.adapter {self.lora.adapter} with base_precision {self.base_precision}: PEFT's "
                             f"{self.lora.adapter} layers add their update to the base weight itself, which a "
                             f"quantised base does not hold; use base_precision bf16")
        if self.lora.dora and self.base_precision in ("int8", "fp8"):
            raise ValueError(f"lora.dora with base_precision {self.base_precision}: PEFT's DoRA dequantises each "
                             f"adapted weight to fp32 in every forward (a full-precision copy a layer, kept for "
                             f"backward under lora.dropout), which the memory plan does not count; use "
                             f"base_precision bf16")
        return self

    @model_validator(mode="after")
    def _global_batch_splits(self) -> TrainingConfig:
        batch = self.distribution
        if batch.global_batch is None:
            return self
        if self.batch_tokens is not None:
            raise ValueError("set global_batch or batch_tokens, not both: with batch_tokens a micro-batch's sample "
        "count depends on its bucket; set gradient_accumulation instead")
        if batch.gradient_accumulation != 1:
            raise ValueError("set global_batch or gradient_accumulation, not both: global_batch fixes the "
        "accumulation of every process")
        share = self.batch_size * self.world
        if batch.global_batch % share:
            raise ValueError(f"global_batch {batch.global_batch} is not a multiple of batch_size × processes × nodes "
                             f"= {self.batch_size} × {batch.processes} × {batch.nodes} = {share}")
        return self

    @property
    def world(self) -> int:
        """Training processes over every node."""
        return self.distribution.processes * self.distribution.nodes

    @property
    def accumulation(self) -> int:
        """Micro-batches each process adds up per optimizer step."""
        batch = self.distribution
        if batch.global_batch is None:
            return batch.gradient_accumulation
        return batch.global_batch // (self.batch_size * self.world)

    @property
    def micro_batches(self) -> int:
        """Micro-batches per optimizer step over every process."""
        return self.world * self.accumulation


Stage = Literal["ingest", "encode-text", "encode-latents", "manifest", "train"]
STAGES: tuple[str, ...] = get_args(Stage)  # in pipeline order


class ExecutionConfig(Section):
    retries: int = Field(2, ge=0, description="Prefect retries of each stage task.")
    retry_delay_seconds: float = Field(10, ge=0, description="Wait between retries.")
    max_parallel_shards: int = Field(
        2, ge=1, description="Shards encoded at once in this process's threads (with one worker), or, when an "
        "encoding stage is placed elsewhere, its child flow runs (one per group of shards: one per node to use)."
    )
    workers: int | None = Field(
        None, ge=1, description="Encoder worker processes for each encoding stage (a Dask cluster for the stage): each "
        "is pinned to its own GPU, loads the model once and encodes shard after shard. Default: one per visible GPU; "
        "on a node without one, 1 (no worker processes: shards run in threads, max_parallel_shards at once).",
    )
    cluster: str | None = Field(
        None, description="Address of a running Dask scheduler (tls://host:8786) whose workers encode the shards, e.g. "
        "one `dask worker` per GPU on every node of the encoding pool; replaces the stage's own workers. Beyond "
        "this machine it must be tls:// with cluster_tls: whoever reaches a scheduler runs code on every worker.",
    )
    cluster_tls: str | None = Field(
        None, description="The TLS credentials of a tls:// cluster (mutual: the scheduler and workers refuse a client "
        "without them): a folder holding ca.pem, cert.pem and key.pem (`precast certificates DIR` writes a CA and "
        "them), or 'secret:<name>', a Prefect Secret block whose JSON value holds the three PEM texts as "
        "{\"ca\": …, \"cert\": …, \"key\": …}.",
    )
    placement: dict[str, str] = Field(
        default_factory=dict,
        description="Where each stage runs: 'local' (in the pipeline's own flow run, the default) or a deployment "
        "name such as 'precast-stage/encode-text' (its work pool's workers run it; an encoder gets "
        "max_parallel_shards child flow runs, each encoding its group of shards on its node's workers). Keys: "
        "ingest, encode-text, encode-latents, manifest, train.",
    )

    @field_validator("placement")
    @classmethod
    def _known_stages(cls, placement: dict[str, str]) -> dict[str, str]:
        unknown = set(placement) - set(STAGES)
        if unknown:
            raise ValueError(f"unknown stage(s) {sorted(unknown)}; stages are {list(STAGES)}")
        for stage, target in placement.items():
            if target != "local" and "/" not in target:
                raise ValueError(f"{stage}: {target!r} is neither 'local' nor a '<flow>/<deployment>' name")
        return placement

    @model_validator(mode="after")
    def _cluster_secured(self) -> ExecutionConfig:
        """A scheduler beyond loopback takes pickled code from whoever connects: only over mutual TLS."""
        if self.cluster is None:
            if self.cluster_tls is not None:
                raise ValueError("cluster_tls is set but cluster is not: the credentials are for a tls:// cluster")
            return self
        scheme, _, rest = self.cluster.partition("://")
        host = rest.rsplit(":", 1)[0].strip("[]")
        if scheme not in ("tcp", "tls"):
            raise ValueError(f"cluster {self.cluster}: the address is tls://host:port (or tcp:// on loopback)")
        if scheme == "tls" and self.cluster_tls is None:
            raise ValueError(f"cluster {self.cluster}: set cluster_tls, the folder or Secret block of the cluster's "
        "CA and this client's certificate and key")
        if scheme == "tcp" and self.cluster_tls is not None:
            raise ValueError(f"cluster {self.cluster} is plain tcp:// but cluster_tls is set: use tls://")
        if scheme == "tcp" and host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"cluster {self.cluster} listens beyond this machine without TLS: anyone who reaches it "
        "runs code on every worker. Start the scheduler and workers with TLS (`precast "
        "certificates DIR`; docs/security.md) and give tls://… with cluster_tls")
        return self


class PipelineConfig(Section):
    storage: StorageConfig = Field(default_factory=StorageConfig, description="Where artifacts live.")
    dataset: DatasetConfig = Field(..., description="Sources and ingest rules.")
    model: ModelConfig = Field(..., description="The model folder or hub id.")
    text_encoding: TextEncodingConfig = Field(default_factory=TextEncodingConfig, description="T5 caching.")
    latent_encoding: LatentEncodingConfig = Field(default_factory=LatentEncodingConfig, description="VAE caching.")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="Training: a LoRA adapter or a full fine-tune.")
    execution: ExecutionConfig = Field(default_factory=ExecutionConfig, description="Retries and parallelism.")

    @field_validator("training")
    @classmethod
    def _warmup_within_steps(cls, training: TrainingConfig) -> TrainingConfig:
        if training.optimizer.warmup_steps > training.steps:
            raise ValueError(f"optimizer.warmup_steps ({training.optimizer.warmup_steps}) exceeds steps "
                             f"({training.steps})")
        return training

    @model_validator(mode="after")
    def _base_model_targets_need_an_adapter(self) -> PipelineConfig:
        regularised = [s.path for s in self.dataset.sources if s.regularisation == "base_model"]
        if regularised and self.training.method != "lora":
            raise ValueError(f"dataset.sources {', '.join(regularised)}: regularisation base_model trains toward the "
                             "base model's prediction with the adapter switched off, and training.method full has no "
                             "adapter to switch off: use method lora, or regularisation captions")
        return self


def load_config(path: str | Path, overrides: list[str] = ()) -> PipelineConfig:
    """Read a YAML config and apply `dotted.key=value` overrides.

    Values in overrides are parsed as YAML, so `--set training.steps=10` gives an int and
    `--set training.samples.prompts=[a,b]` a list.
    """
    source = Path(path)
    raw = yaml.safe_load(source.read_text()) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: top level must be a mapping of sections")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r}: expected dotted.key=value")
        try:
            set_dotted(raw, key, yaml.safe_load(value))
        except ValueError as error:
            raise ValueError(f"override {item!r}: {error}") from None
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as error:  # one line per field, named as in the file: model.path: Field required
        fields = "; ".join(f"{'.'.join(map(str, problem['loc']))}: {problem['msg']}" for problem in error.errors())
        raise ValueError(f"{source}: {fields}") from None
