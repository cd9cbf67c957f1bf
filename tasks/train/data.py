"""Training data from the caches alone: bucketed batches of latents and text features (each of
the family's encoders' outputs, sequences padded to the batch's longest).

Shards are checked against the manifest's checksums in the read that is used (16 fetched and
checked at once when training starts), then read memory-mapped, a row at a time. Every random
choice is seeded: the batch order by `bucket_batches`' seed and epoch (and, with sources mixed, each
batch's source by `mixed_batches`' seed); flips, caption variants,
caption dropout and latent draws, then noise and timesteps, by generators seeded by the
micro-batch's index in that order (`draws`). A
micro-batch is the same whichever process of however many trains it, so a run is reproducible,
resumes exactly from its step alone, and trains the same on any number of processes and nodes.
"""

from __future__ import annotations

import hashlib
import random
from collections import defaultdict
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

import torch

from configs.schema import TrainingConfig
from storage.shards import LatentShard, RaggedShard, bucket_sides, collate, read_parquet_bytes
from storage.store import Store
from tasks.families.spec import Conditioning, Family, TextEncoderSpec
from tasks.identity import EMPTY, entry_prompt
from tasks.prefetch import prefetched
from tasks.records import manifest_encoders, text_shards_of
from tasks.train.distributed import Distributed
from tasks.train.loss import Weighing


class TextCaches:
    """The text features of a caption from each encoder's cache shards (`checksums`: their keys'
    sha256) and of the prompts (`prompts`: each encoder's prompts shard, one of them), memory-mapped; remote
    shards are read through a local copy, checked against the manifest's checksum."""

    def __init__(self, store: Store, encoders: tuple[TextEncoderSpec, ...], checksums: dict[str, str],
                 prompts: dict[str, str] | None = None):
        self.encoders = encoders
        self._shards = {key: RaggedShard(path) for key, path in store.local_paths(checksums).items()}
        self.prompts = [self._shards[key] for key in (prompts or {}).values()]

    def features(self, shards: list[RaggedShard], rows: str | list[str]) -> dict[str, torch.Tensor]:
        """Each encoder's outputs for `rows` (one for all its shards, or one each) of its shard:
        sequences [len, D] (a zero-padded encoder's with its zeros to the shard's max_length), pooled vectors [D]."""
        features = {}
        for spec, shard, row in zip(self.encoders, shards, [rows] * len(shards) if isinstance(rows, str) else rows):
            for index, (output, key) in enumerate(zip(spec.outputs, spec.keys())):
                value = shard.get(row, None if index == 0 else output)
                features[key] = value[0] if output == "pooled" else spec.rebuilt(value, shard.meta["max_length"])
        return features

    def caption(self, shard_keys: list[str], sample_id: str, variant: int) -> dict[str, torch.Tensor]:
        return self.features([self._shards[key] for key in shard_keys], f"{sample_id}/{variant}")

    def dropped(self, shard_keys: list[str], sample_id: str) -> dict[str, torch.Tensor]:
        """The empty caption's features for `sample_id` (caption dropout): an encoder that sees a
        pair's pictures has it with them in the sample's shard (`identity.EMPTY`), the others
        once, in the prompts' shard."""
        row, own = f"{sample_id}/{EMPTY}", [self._shards[key] for key in shard_keys]
        return self.features([mine if row in mine else prompts for mine, prompts in zip(own, self.prompts)],
                             [row if row in mine else "" for mine in own])

    def prompt(self, entry: str) -> dict[str, torch.Tensor]:
        """A sample prompt's features ("": the empty caption's), by its entry (`identity.prompt_entries`):
        an encoder that sees pictures keys its rows by the entries, the others by the prompts' text."""
        return self.features(self.prompts, [entry if entry in shard else entry_prompt(entry) for shard in self.prompts])


class CachedFeatures:
    """A manifest's samples as `family` reads them: its encoders' caches (which caches the
    manifest names) and its codec's normalisation of the latents."""

    def __init__(self, store: Store, manifest: dict[str, Any], family: Family):
        # every byte read below is checked against the manifest's checksum in the read that uses it
        checksums = manifest["checksums"]
        table = read_parquet_bytes(store.read_verified(manifest["table"], checksums[manifest["table"]]))
        self.samples = {row["sample_id"]: row for row in table.to_pylist()}
        encoders, self.codec = family.text.encoders, family.codec
        named = manifest_encoders(manifest)
        if list(named) != [spec.name for spec in encoders]:
            raise ValueError(f"manifest {manifest['id']} holds the text encoders {', '.join(named)}; the model's "
                             f"family reads {', '.join(spec.name for spec in encoders)}")
        text_keys = {key for row in self.samples.values() for key in text_shards_of(row)}
        latent_keys = {key for row in self.samples.values() for key in [row["latent_shard"],
                                                                         *(row.get("reference_shards") or [])]}
        self.text = TextCaches(store, encoders, {key: checksums[key] for key in {*text_keys, *named.values()}}, named)
        self._latents = {key: LatentShard(path) for key, path in
                         store.local_paths({key: checksums[key] for key in latent_keys}).items()}
        first = next(iter(self._latents.values())).meta
        # the family's normalisation (`Family.codec.latent_factors`): numbers, or one per channel
        self.shift, self.scale = (torch.tensor(first[key], dtype=torch.float32) for key in ("shift_factor", "scaling_factor"))
        # latent_encoding.resolution (a source's own changes its samples' buckets): the samples' side
        self.resolution = first["resolution"]
        # what an edit pair's references were sized for (latent_encoding.reference_resolution, else the run's)
        self.reference_resolution: int = first.get("reference_resolution") or self.resolution
        # the samples by bucket: an edit pair's by its own and its references' (`group_name`), so a
        # batch's references stack as its latents do
        self.buckets: dict[str, list[str]] = defaultdict(list)
        for sample_id, row in sorted(self.samples.items()):
            self.buckets[group_name(row["bucket"], *(row.get("reference_buckets") or []))].append(sample_id)
        # how training draws from each source of the dataset (None: one pool), as the manifest says
        self.mix: list[dict[str, Any]] | None = manifest.get("mix")

    def source_index(self, sample_id: str) -> int:
        """The index of the dataset source `sample_id` came from (0 in manifests before sources mixed)."""
        return self.samples[sample_id].get("source") or 0

    def source(self, sample_id: str) -> dict[str, Any]:
        """The mix settings of the source `sample_id` came from (`SourceConfig.mixing`)."""
        return self.mix[self.source_index(sample_id)]

    def caption_dropouts(self, sample_ids: list[str], default: float) -> float | list[float]:
        """Each sample's rate of the empty caption: its source's, or the run's `default` (for all
        of them while the sources are one pool)."""
        if self.mix is None:
            return default
        return [default if (rate := self.source(s)["caption_dropout"]) is None else rate for s in sample_ids]

    def weighing(self, sample_ids: list[str], masks: torch.Tensor | None = None) -> Weighing | None:
        """Each sample's loss weight and whether it trains toward the base model's prediction (a
        regularisation source's `base_model`), with the batch's loss `masks`; None when every one is plain."""
        if self.mix is None:
            return None if masks is None else Weighing(None, None, masks)
        sources = [self.source(s) for s in sample_ids]
        weights = [source["loss_weight"] for source in sources]
        base = [source["regularisation"] == "base_model" for source in sources]
        return Weighing(None if all(w == 1.0 for w in weights) else torch.tensor(weights),
                        torch.tensor(base) if any(base) else None, masks)

    def batch(
        self, sample_ids: list[str], generator: torch.Generator, caption_dropout: float | list[float]
    ) -> tuple[torch.Tensor, Conditioning, torch.Tensor | None]:
        """Normalised latents [B, C, (F,) h, w] (as the family's codec normalises them) drawn from the stored posteriors (of the flipped image half of
        the time when flips are stored) and the text features of a caption variant of each (the
        empty caption's, at the rate of `caption_dropout`: one for all, or each sample's),
        collated (`storage.shards.collate`), with an edit pair's references' latents as
        `reference_<n>` [B, C, h, w] (their posterior's mean, as the pipelines take it, flipped with
        their target); and their loss masks [B, 1, (F,) h, w] (flipped with their latents), None
        when no sample of the batch has one."""
        latents, texts, masks, references = [], [], [], defaultdict(list)
        rates = [caption_dropout] * len(sample_ids) if isinstance(caption_dropout, float) else caption_dropout
        for sample_id, rate in zip(sample_ids, rates):
            row = self.samples[sample_id]
            shard = self._latents[row["latent_shard"]]
            flipped = shard.meta["flip"] and torch.rand((), generator=generator).item() < 0.5
            mean, std = shard.get(sample_id, flipped)
            masks.append(shard.mask(sample_id, flipped))
            latent = mean.float()
            if std is not None:  # a fresh draw from the posterior every time the sample is seen
                latent = latent + std.float() * torch.randn(mean.shape, generator=generator)
            latents.append(self.codec.normalised(latent, self.shift, self.scale))
            for n, (reference, key) in enumerate(zip(row.get("references") or [], row.get("reference_shards") or [])):
                held, _ = self._latents[key].get(reference, flipped)
                references[f"reference_{n}"].append(self.codec.normalised(held.float(), self.shift, self.scale))
            if torch.rand((), generator=generator).item() < rate:
                texts.append(self.text.dropped(text_shards_of(row), sample_id))
            else:
                variant = int(torch.randint(row["variants"], (), generator=generator))
                texts.append(self.text.caption(text_shards_of(row), sample_id, variant))
        conditioning = {**collate(texts), **{name: torch.stack(held) for name, held in references.items()}}
        if all(mask is None for mask in masks):
            return torch.stack(latents), conditioning, None
        whole = torch.ones(1, *latents[0].shape[1:])
        return torch.stack(latents), conditioning, torch.stack([whole if m is None else m.float() for m in masks])


class Batches:
    """This process's micro-batches on its device, each with its index in the global stream of
    bucket batches: every world-th of that stream from this process's rank, so the processes of a
    step share its micro-batches out; its draws are seeded by that index. Reads `seed`,
    `batch_size`, `batch_tokens`, `caption_dropout`, `accumulation` and `prefetch`."""

    def __init__(self, training: TrainingConfig, features: CachedFeatures, buckets: dict[str, list[str]],
                 dist: Distributed, tokens: Callable[..., int]):
        self.features, self.training, self.device = features, training, dist.device
        sizes = batch_sizes(buckets, training.batch_size, training.batch_tokens, tokens)
        batches = bucket_batches(buckets, sizes, training.seed) if features.mix is None else \
            mixed_batches(buckets, sizes, training.seed, features)
        self.stream = islice(enumerate(batches), dist.rank, None, dist.world)
        self.reader: Iterator | None = None  # started by `resume`

    def resume(self, step: int) -> None:
        """Start reading at the micro-batches of step `step` + 1: the position is the step's alone
        (the reader reads ahead, so its own position is never what a checkpoint keeps)."""
        for _ in range(step * self.training.accumulation):
            next(self.stream)
        # with an accelerator the next batches are read while the model works; on a CPU that gains
        # nothing (both share the same cores)
        ahead = 0 if self.device.type == "cpu" else self.training.prefetch
        self.reader = prefetched(self._load, self.stream, ahead)

    def _load(self, item: tuple[int, list[str]]) -> tuple[int, tuple[torch.Tensor, Conditioning, Weighing | None]]:
        index, sample_ids = item
        features = self.features
        latents, text, masks = features.batch(sample_ids, draws(self.training.seed, index, "data"),
                                              features.caption_dropouts(sample_ids, self.training.caption_dropout))
        weighing = features.weighing(sample_ids, masks)
        if self.device.type == "cuda":  # pinned, so the copy to the device does not hold the host
            latents, text = latents.pin_memory(), {name: value.pin_memory() for name, value in text.items()}
            weighing = weighing and weighing.map(torch.Tensor.pin_memory)
        return index, (latents, text, weighing)

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> tuple[int, tuple[torch.Tensor, Conditioning, Weighing | None]]:
        index, (latents, text, weighing) = next(self.reader)

        def moved(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(self.device, non_blocking=True)

        return index, (moved(latents), {name: moved(value) for name, value in text.items()},
                       weighing and weighing.map(moved))

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()


def batch_sizes(buckets: dict[str, list[str]], batch_size: int, batch_tokens: int | None,
                tokens: Callable[..., int]) -> dict[str, int]:
    """Samples per micro-batch of each bucket (named by its latents' sides, `bucket_name`, or an
    edit pair's `group_name`): batch_size, or as many samples as `batch_tokens` tokens hold (at
    least one), `tokens(*sides)` being a sample's (the family's `image_tokens`: a pair's, its
    target's and its references')."""
    if batch_tokens is None:
        return {name: batch_size for name in buckets}
    return {name: max(1, batch_tokens // group_tokens(name, tokens)) for name in buckets}


def group_name(bucket: str, *references: str) -> str:
    """The group a sample is batched in: its bucket, and an edit pair's references' buckets after it."""
    return "+".join((bucket, *references))


def group_tokens(name: str, tokens: Callable[..., int]) -> int:
    """The image tokens a sample of group `name` gives the transformer: its own and its references'."""
    return sum(tokens(*bucket_sides(part)) for part in name.split("+"))


def bucket_batches(buckets: dict[str, list[str]], sizes: dict[str, int] | int, seed: int) -> Iterator[list[str]]:
    """Endless batches of sample ids, each from one bucket, of its size in `sizes` (or that many
    for every bucket); epoch e shuffles with seed + e."""
    epoch = 0
    while True:
        rng = random.Random(seed * 100_003 + epoch)
        batches = []
        for name in sorted(buckets):
            ids, size = list(buckets[name]), sizes if isinstance(sizes, int) else sizes[name]
            rng.shuffle(ids)
            batches += [ids[i : i + size] for i in range(0, len(ids), size)]
        rng.shuffle(batches)
        yield from batches
        epoch += 1


def mixed_batches(buckets: dict[str, list[str]], sizes: dict[str, int] | int, seed: int,
                  features: CachedFeatures) -> Iterator[list[str]]:
    """Endless batches drawn from the sources as `features.mix` says: each batch from one source
    with a `weight`, chosen at its share, or from the pool of the others (each of their samples
    `repeats` times an epoch of the pool), which takes what is left. The choices are a sequence
    seeded by `seed` alone, so every process, and a resumed run, draws the same batches."""
    mix = features.mix
    groups: dict[int | None, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))  # None: the pool
    for name, ids in buckets.items():
        for sample_id in ids:
            source = features.source_index(sample_id)
            if mix[source]["weight"] is None:
                groups[None][name] += [sample_id] * mix[source]["repeats"]
            else:
                groups[source][name].append(sample_id)
    weighted = [index for index, source in enumerate(mix) if source["weight"] is not None]
    shares = {index: mix[index]["weight"] for index in weighted}
    if len(weighted) < len(mix):
        shares[None] = 1.0 - sum(shares.values())
    for group in shares:
        if group not in groups:
            named = [mix[group]["path"]] if group is not None else [m["path"] for m in mix if m["weight"] is None]
            raise ValueError(f"dataset sources {', '.join(named)}: no sample of theirs is left to train on, and "
                             f"training draws {shares[group]:.0%} of its batches from them")
    order = sorted(shares, key=lambda group: -1 if group is None else group)
    streams = [bucket_batches(dict(groups[group]), sizes, seed if group is None else seed + 1 + group) for group in order]
    return _chosen(streams, [shares[group] for group in order], random.Random(seed * 100_003 + 99_991))


def _chosen(streams: list[Iterator[list[str]]], shares: list[float], choices: random.Random) -> Iterator[list[str]]:
    """Each next batch from a stream chosen at its share (checked before the first is drawn)."""
    while True:
        yield next(streams[choices.choices(range(len(streams)), weights=shares)[0] if len(streams) > 1 else 0])


def seed_of(seed: int, index: int, purpose: str) -> int:
    """The seed of micro-batch `index`'s draws for `purpose` ("data", "noise", "dropout")."""
    digest = hashlib.sha256(f"{seed}/{index}/{purpose}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def draws(seed: int, index: int, purpose: str, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on `device` for micro-batch `index`'s draws for `purpose`: noise and timesteps
    are drawn where the model runs, with no copy from the host."""
    return torch.Generator(device).manual_seed(seed_of(seed, index, purpose))
