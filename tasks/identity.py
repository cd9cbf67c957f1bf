"""Every identity precast keys its outputs by, computed here and nowhere else.

Each is a function of config sections, upstream identities and the model's files (hashed, or read
from the hub's listing), so a stage, the runner and the flow that plans it agree on every key
without asking each other. An identity covers what changes an
output and nothing else (not devices, batch sizes, concurrency). The format constants are part of
them: bump one with any change to code that changes what its stage produces, so the next run
encodes or trains anew instead of returning what the old code made.
"""

from __future__ import annotations

from typing import Any

from configs.schema import DatasetConfig, LatentEncodingConfig, ModelConfig, TextEncodingConfig, TrainingConfig, VideoConfig
from storage import layout
from storage.fingerprint import component_fingerprint, hash_json
from tasks.families import family_of

TEXT_FORMAT = "precast.text/3"  # the stored text layout or numerics
LATENT_FORMAT = "precast.latents/2"  # the stored posterior layout or preprocessing
TRAIN_FORMAT = "precast.train/5"  # the loss, sampling, data order or outputs of training
# settings that cannot change the trained weights or samples stay out of the run id; how the
# global batch is split over nodes, processes and accumulation is one of them (the run id holds the
# micro-batches per step), so a run is the same run on any number of nodes; so are the memory and
# speed settings whose math is the same (checkpointing recomputes exactly; compiled blocks compute
# the same within float tolerance, as another device does)
NOT_IN_RUN_ID = {"device", "checkpoint_every", "keep_checkpoints", "nodes", "processes", "node_timeout",
                 "gradient_accumulation", "global_batch", "gradient_checkpointing", "compile", "prefetch",
                 "log_every", "trackers", "tracker_project", "mlflow_tracking_uri", "sample_fps"}


def config_hash(dataset: DatasetConfig) -> str:
    """What names these sources and ingest rules (how many are read at once, and where, is no part of it)."""
    # the clip policy where it is not the default (and frame buckets where there are some), so the
    # names of rules from before videos, and before buckets, stand
    unnamed: dict[str, Any] = {"read_concurrency": True, "partition_size": True}
    if dataset.video == VideoConfig():
        unnamed["video"] = True
    elif not dataset.video.frame_buckets:
        unnamed["video"] = {"frame_buckets": True}
    return hash_json(dataset.model_dump(exclude=unnamed))


def image_shard_id(rows: list[tuple[str, Any]]) -> str:
    """An image shard's id: the hash of its (sample_id, captions) rows, sorted by sample id."""
    return hash_json(rows)


def dataset_id(shards: list[dict[str, Any]]) -> str:
    """A dataset's id: the hash of its shards (and, for partly superseded ones, their current samples)."""
    return hash_json(shards)


def text_fingerprints(model: ModelConfig, text: TextEncodingConfig) -> dict[str, str]:
    """The fingerprint of each of the family's text encoders' caches, by encoder name. Each covers
    the encoder's weights and tokenizer files (by role, not folder name: the same T5 in two
    families' folders shares its cache), max_length, dtype (quantisation included), caption
    preprocessing, what of its output is stored and format; not device, offload or batch size,
    which change nothing beyond float noise."""
    family = family_of(model)
    fingerprints = {}
    for encoder in family.text_encoders:
        files = component_fingerprint(model.path, [encoder.folder, encoder.tokenizer], model.revision)
        fingerprints[encoder.name] = hash_json({
            "files": {"text_encoder": files[encoder.folder], "tokenizer": files[encoder.tokenizer]},
            "max_length": family.text_length(model, encoder, text), "dtype": text.dtype, "format": TEXT_FORMAT,
            "captions": family.caption_rule(text.caption_preprocessing), **encoder.stored()})
    return fingerprints


def text_identity(fingerprints: dict[str, str]) -> str:
    """What the manifest's id counts of the text caches: a family of one encoder by its
    fingerprint (as every id before families had several), else all of them by name."""
    return next(iter(fingerprints.values())) if len(fingerprints) == 1 else hash_json(fingerprints)


def vae_fingerprint(model: ModelConfig, latents: LatentEncodingConfig) -> str:
    """Covers VAE weights, bucket table (the resolution, and the family's `bucket_rule`), crop,
    posterior layout, flip, tiling, both dtypes and format; not device, batch size or slicing."""
    files = component_fingerprint(model.path, ["vae"], model.revision)
    # tiling blends overlapping tiles, so it changes the latents; slicing does not
    settings: dict[str, Any] = latents.model_dump(exclude={"device", "batch_size", "slicing"})
    if latents.crop == "center":
        settings.pop("crop_seed")  # unused: changing it must not re-encode
    family = family_of(model)
    family.bucket_table(latents.resolution)  # a resolution the family has no buckets for is refused before any stage
    if family.bucket_rule:
        settings["buckets"] = family.bucket_rule
    return hash_json({"files": files, **settings, "format": LATENT_FORMAT})


def transformer_fingerprint(model: ModelConfig) -> str:
    """The trained transformer's files, under its folder's name (an expert's of a two-expert model),
    and the scheduler's."""
    folder = family_of(model).transformer_folder(model)
    return hash_json(component_fingerprint(model.path, [folder, "scheduler"], model.revision))


def prompt_rows(prompts: list[str]) -> list[str]:
    """The texts of a prompts shard: the empty caption first, then each distinct prompt."""
    return list(dict.fromkeys(["", *prompts]))


def prompts_cache_key(fingerprint: str, prompts: list[str]) -> str:
    return layout.text_prompts(fingerprint, hash_json(prompt_rows(prompts)))


def manifest_id(dataset: str, text_fps: dict[str, str], vae_fp: str, prompts: list[str]) -> str:
    return hash_json({"dataset": dataset, "text": text_identity(text_fps), "vae": vae_fp, "prompts": prompts})


def run_id_for(manifest: str, model: ModelConfig, training: TrainingConfig, init: dict | None = None) -> str:
    # an explicit init_from URL counts by the adapter's bytes; "latest" by the word, so a re-run
    # over an unchanged manifest is the same run, and new data continues from the newest run
    init_id = init["sha256"] if init and training.init_from not in ("none", "latest") else None
    # the modules LoRA adapts, resolved: the family's defaults count as if spelled in the config
    # mode_scale shapes only the mode density: other runs' ids do not hold it (nor change with it);
    # so do true_cfg_scale's and image_to_video_warmup's defaults and the runs from before them
    unused = (NOT_IN_RUN_ID | ({"mode_scale"} if training.timestep_sampling != "mode" else set())
              | ({"true_cfg_scale"} if training.true_cfg_scale == 1 else set())
              | ({"image_to_video_warmup"} if not training.image_to_video_warmup else set()))
    settings = {**training.model_dump(exclude=unused), "micro_batches": training.micro_batches,
                "target_modules": family_of(model).target_modules(training)}
    return hash_json({"manifest": manifest, "transformer": transformer_fingerprint(model), "training": settings,
                      "init": init_id, "format": TRAIN_FORMAT})
