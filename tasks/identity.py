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

from configs.schema import (
    DatasetConfig, Identity, LatentEncodingConfig, ModelConfig, PipelineConfig, Section, SourceConfig,
    TextEncodingConfig, TrainingConfig, VideoConfig, flat, groups_of,
)
from storage import layout
from storage.fingerprint import component_fingerprint, hash_json, sha256_bytes
from tasks.families import Family, family_of

TEXT_FORMAT = "precast.text/3"  # the stored text layout or numerics
LATENT_FORMAT = "precast.latents/2"  # the stored posterior layout or preprocessing
TRAIN_FORMAT = "precast.train/5"  # the loss, sampling, data order or outputs of training
# the sections whose fields are hashed into an identity, each field declaring whether it counts
DECLARED = (SourceConfig, VideoConfig, DatasetConfig, TextEncodingConfig, LatentEncodingConfig, TrainingConfig,
            *groups_of(TrainingConfig).values())


def declaration(section: type[Section], name: str) -> Identity:
    """The identity rule declared beside field `name` of `section` (configs.schema.Identity)."""
    rules = [mark for mark in section.model_fields[name].metadata if isinstance(mark, Identity)]
    if len(rules) != 1:
        raise TypeError(f"{section.__name__}.{name} declares no identity rule: annotate it with one of "
                        "configs.schema's COUNTED, NOT_COUNTED, IF_NOT_DEFAULT (or another Identity), saying whether "
                        "it can change what its stage makes")
    return rules[0]


def _uncounted(section: Section) -> dict[Any, Any]:
    """model_dump's `exclude` for what of `section` (nested sections included) does not count."""
    exclude: dict[Any, Any] = {}
    for name in type(section).model_fields:
        value = getattr(section, name)
        if not declaration(type(section), name).applies(section, name):
            exclude[name] = True
        elif isinstance(value, Section) and (inner := _uncounted(value)):
            exclude[name] = inner
        elif isinstance(value, list) and (items := {index: inner for index, item in enumerate(value)
                                                    if isinstance(item, Section) and (inner := _uncounted(item))}):
            exclude[name] = items
    return exclude


def counted(section: Section) -> dict[str, Any]:
    """What of `section` counts in an identity, field by field as each declares, as model_dump gives it."""
    return section.model_dump(exclude=_uncounted(section))


def config_hash(dataset: DatasetConfig) -> str:
    """What names these sources and ingest rules (how many are read at once, and where, is no part of it)."""
    return hash_json(counted(dataset))


def units_hash(dataset: DatasetConfig) -> str:
    """What decides what each of the sources' units gives (its samples, captions as read): the
    config's hash without the sources' caption prefixes and resolutions, which ingest applies after
    (so the record of the units, and units staged by workers, serve any of them); a config without
    them hashes as `config_hash`."""
    settings = counted(dataset)
    for source in settings["sources"]:
        source.pop("caption_prefix", None)
        source.pop("resolution", None)
    return hash_json(settings)


def image_shard_id(rows: list[tuple[str, Any, int | None]]) -> str:
    """An image shard's id: the hash of its (sample_id, captions, resolution) rows, sorted by
    sample id, each without its resolution where its source has none of its own (every id made
    before sources had one stands)."""
    return hash_json([row[:2] if not row[2] else row for row in rows])


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
    fingerprints, settings = {}, counted(text)
    if "caption_preprocessing" in settings:  # the family's rule that the word names
        settings["captions"] = family.text.captions.rule(settings.pop("caption_preprocessing"))
    for encoder in family.text.encoders:
        # an encoder that sees pictures: its image processor's settings too
        seen = [encoder.processor] if encoder.processor else []
        files = component_fingerprint(model.path, [encoder.folder, encoder.tokenizer, *seen], model.revision)
        # max_length as the family resolves it for this encoder
        length = {"max_length": family.text.length(model, encoder, text)} if "max_length" in settings else {}
        fingerprints[encoder.name] = hash_json({
            "files": {"text_encoder": files[encoder.folder], "tokenizer": files[encoder.tokenizer],
                      **{"processor": files[folder] for folder in seen}},
            **settings, **length, "format": TEXT_FORMAT, **encoder.stored()})
    return fingerprints


def text_identity(fingerprints: dict[str, str]) -> str:
    """What the manifest's id counts of the text caches: a family of one encoder by its
    fingerprint (as every id before families had several), else all of them by name."""
    return next(iter(fingerprints.values())) if len(fingerprints) == 1 else hash_json(fingerprints)


def vae_fingerprint(model: ModelConfig, latents: LatentEncodingConfig) -> str:
    """Covers VAE weights, bucket table (the resolution, and the family's `codec.buckets.rule`), crop,
    posterior layout, flip, tiling, both dtypes and format; not device, batch size or slicing."""
    files = component_fingerprint(model.path, ["vae"], model.revision)
    settings = counted(latents)
    family = family_of(model)
    family.codec.bucket_table(latents.resolution)  # a resolution without buckets is refused before any stage
    if family.codec.buckets.rule:
        settings["buckets"] = family.codec.buckets.rule
    if family.codec.references is not None:  # how reference rows are sized (none elsewhere: ids unchanged)
        settings["references"] = family.codec.references.rule
    return hash_json({"files": files, **settings, "format": LATENT_FORMAT})


def transformer_fingerprint(model: ModelConfig, family: Family) -> str:
    """The trained transformer's files, under its folder's name (an expert's of a two-expert model),
    and the scheduler's."""
    folder = family.denoiser.folder(model)
    return hash_json(component_fingerprint(model.path, [folder, "scheduler"], model.revision))


# a text cache row `<sample_id>/empty`: an edit pair's empty caption, encoded with its references by
# an encoder that sees them (caption dropout); the others' empty caption is the prompts' ""
EMPTY = "empty"


# between a sample prompt and its reference picture's sha256: how the prompts of a family whose text
# encoder sees the references are named (`prompt_entries`)
SEEN = "\x00picture sha256 "


def prompt_entries(prompts: list[str], digests: list[str] | None) -> list[str]:
    """The sample prompts as the text caches, the manifest and its id name them: as written, or for
    a family whose text encoder reads each prompt with its reference (`digests`: the sha256 of each
    prompt's picture's bytes), each with its picture's digest, which its encoding depends on."""
    return list(prompts) if digests is None else [f"{prompt}{SEEN}{digest}" for prompt, digest in zip(prompts, digests)]


def sample_prompts(config: PipelineConfig) -> list[str]:
    """The run's sample prompts as `prompt_entries` names them: for a family whose text encoder sees
    pictures, each with the digest of its reference (`training.samples.references`), read here once."""
    from storage.store import fsspec_options
    from tasks.runs.sampling import read_picture_bytes

    samples = config.training.samples
    if not samples.references or all(spec.processor is None for spec in family_of(config.model).text.encoders):
        return list(samples.prompts)
    options = fsspec_options(config.storage)
    return prompt_entries(samples.prompts, [sha256_bytes(read_picture_bytes(path, options)[1])
                                            for path in samples.references])


def check_entry_picture(entry: str, path: str, data: bytes) -> None:
    """Refuse a sample prompt's picture (`path`, read as `data`) that is not the one its entry names
    (changed since the run named its prompts); an entry that names none takes any."""
    if SEEN in entry and entry_negative(entry) != SEEN + sha256_bytes(data):
        raise ValueError(f"training.samples.references: {path} changed since the run named its prompts by its "
                         "content; run again")


def entry_prompt(entry: str) -> str:
    """A prompt entry's text."""
    return entry.split(SEEN)[0]


def entry_negative(entry: str) -> str:
    """What guidance pairs a prompt entry with: the empty caption (seen with the same picture)."""
    return entry[len(entry_prompt(entry)):]


def prompt_rows(prompts: list[str]) -> list[str]:
    """The texts of a prompts shard: the empty caption first, then each distinct prompt."""
    return list(dict.fromkeys(["", *prompts]))


def prompts_cache_key(fingerprint: str, prompts: list[str]) -> str:
    return layout.text_prompts(fingerprint, hash_json(prompt_rows(prompts)))


def mix_identity(dataset: DatasetConfig, members: str | None = None) -> dict[str, Any] | None:
    """What a manifest's id counts of how training draws from the sources: None while they are one
    pool (every id made before sources could be mixed stands), else the sources, which source each
    sample came from (`members`: the sha256 of ingest's record of it, the dataset record's
    `members`) and each one's repeats, weight, loss weight, caption dropout and regularisation."""
    mix = dataset.mix
    return None if mix is None else {"members": members, "paths": [s.path for s in dataset.sources], "mix": mix}


def manifest_id(dataset: str, text_fps: dict[str, str], vae_fp: str, prompts: list[str],
                mix: dict[str, Any] | None = None) -> str:
    return hash_json({"dataset": dataset, "text": text_identity(text_fps), "vae": vae_fp, "prompts": prompts,
                      **({"mix": mix} if mix else {})})


def run_id_for(manifest: str, model: ModelConfig, training: TrainingConfig, family: Family,
               init: dict | None = None) -> str:
    # an explicit init_from URL counts by the adapter's bytes; "latest" by the word, so a re-run
    # over an unchanged manifest is the same run, and new data continues from the newest run
    init_id = init["sha256"] if init and training.init_from not in ("none", "latest") else None
    # the global batch's split over nodes, processes and accumulation does not count (the schema
    # says so), the micro-batches a step takes do; the modules LoRA adapts count resolved: the
    # family's defaults as if spelled in the config; the settings in the flat form they had before
    # the section was grouped, so grouping changed no run id
    settings = {**flat(TrainingConfig, counted(training)), "micro_batches": training.micro_batches,
                "target_modules": family.denoiser.target_modules(training)}
    return hash_json({"manifest": manifest, "transformer": transformer_fingerprint(model, family), "training": settings,
                      "init": init_id, "format": TRAIN_FORMAT})
