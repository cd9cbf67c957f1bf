"""Stage 3 — encode-latents: VAE per image shard → posterior (`posterior`: mean+std, mean+logvar or
mean) per aspect-ratio bucket.

Each image goes to the nearest ratio of the model family's bucket table for its source's
resolution (its row's), else the configured one, is resized to cover it and cropped (centred, or at a seeded position), and encoded in
batches that never mix shapes. A clip (a video's, stored as an animated WebP) is cropped frame by
frame as its first frame's box says and encoded whole, for a family that takes clips of its frame
count (`Family.codec.clip_problem`; others quarantine it, naming why). The posterior (mean, std)
is stored unscaled so training samples a fresh latent each epoch; the VAE's scaling factor is
recorded in the shard and applied by the reader.
Output: `cache/latents/<vae_fp>/<shard_id>.safetensors`.
"""

from __future__ import annotations

import functools
import io
import logging
import random
import time
from collections import defaultdict
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from configs.schema import DatasetConfig, LatentEncodingConfig, ModelConfig, StorageConfig
from storage import layout
from storage.shards import bucket_name, pack_latents, read_image_shard, read_latent_rows, shard_id_of
from storage.store import ArtifactMissing, Damaged, Store
from tasks.encode.models import VAE_IN_USE, build_vae, load_vae
from tasks.ingest.untrusted import MASK_FROM_FILE, to_rgb
from tasks.ingest.video import clip_frames, clip_mask, frame_count
from tasks.families import family_of
from tasks.loading import DTYPES
from tasks.identity import LATENT_FORMAT
from tasks.records import CacheRecord
from tasks.prefetch import prefetched

log = logging.getLogger(__name__)


def nearest_ratio(table: dict[str, list[float]], width: int, height: int) -> str:
    """The bucket table's height/width ratio key nearest the image's."""
    return min(table, key=lambda r: abs(float(r) - height / width))


def crop_box(table: dict[str, list[float]], width: int, height: int, crop: str, seed: int,
             sample_id: str) -> list[int]:
    """[resized_w, resized_h, left, top, right, bottom]: resize to cover the bucket of `table`
    whose ratio is nearest the image's, then crop it (centred, or at a position drawn from the
    seed and the sample id)."""
    target_h, target_w = (int(side) for side in table[nearest_ratio(table, width, height)])
    scale = max(target_h / height, target_w / width)
    resized_w, resized_h = max(target_w, round(width * scale)), max(target_h, round(height * scale))
    if crop == "center":
        left, top = (resized_w - target_w) // 2, (resized_h - target_h) // 2
    else:
        rng = random.Random(f"{seed}/{sample_id}")
        left, top = rng.randint(0, resized_w - target_w), rng.randint(0, resized_h - target_h)
    return [resized_w, resized_h, left, top, left + target_w, top + target_h]


def preprocess(image_bytes: bytes, box: list[int], resample: Image.Resampling = Image.Resampling.BICUBIC
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pixels the VAE sees: resized (bicubic, or `resample`) and cropped by `box`, scaled to [-1, 1], [3, H, W];
    and a picture's loss mask, when ingest kept one as its alpha (a source's `masks`): the alpha
    resized (bilinear) and cropped alike, [1, H, W] in [0, 1]; a transparent picture's pixels
    composited on white, a mask file's left as they are."""
    with Image.open(io.BytesIO(image_bytes)) as opened:
        if opened.mode == "RGBA":
            whole = MASK_FROM_FILE in opened.info  # a mask file's: the pixels under it are real
            pixels = pixels_of(opened.convert("RGB") if whole else to_rgb(opened), box, resample)
            return pixels, mask_of(opened.getchannel("A"), box)
        return pixels_of(opened.convert("RGB"), box, resample), None


def latent_mask(mask: torch.Tensor | None, latent_shape: torch.Size) -> torch.Tensor:
    """A picture's or clip's loss mask on its latents' grid [1, 1, (F,) h, w]: the share of each
    latent pixel's pixels it covers (an area mean), a clip's the same in every latent frame; all
    ones for a sample without one."""
    if mask is None:
        return torch.ones(1, 1, *latent_shape)
    grid = F.interpolate(mask[None], size=tuple(latent_shape[-2:]), mode="area")  # [1, 1, h, w]
    return grid.reshape(1, 1, *[1] * (len(latent_shape) - 2), *latent_shape[-2:]).expand(1, 1, *latent_shape).clone()


def preprocess_clip(clip_bytes: bytes, box: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A clip's pixels, each frame as `preprocess` makes a picture's: [3, F, H, W]; and its loss
    mask (the same for every frame: ingest's `masks`), resized and cropped alike, [1, H, W]."""
    pixels = torch.stack([pixels_of(frame, box) for frame in clip_frames(clip_bytes)], dim=1)
    mask = clip_mask(clip_bytes)
    return pixels, None if mask is None else mask_of(mask, box)


def mask_of(grey: Image.Image, box: list[int]) -> torch.Tensor:
    """A loss mask (8-bit grey) resized (bilinear) and cropped by `box` as its pixels are: [1, H, W] in [0, 1]."""
    grey = grey.resize(tuple(box[:2]), Image.Resampling.BILINEAR).crop(tuple(box[2:]))
    return torch.from_numpy(np.asarray(grey, dtype=np.uint8).copy()).float().div(255.0)[None]


def pixels_of(image: Image.Image, box: list[int], resample: Image.Resampling = Image.Resampling.BICUBIC
              ) -> torch.Tensor:
    image = image.resize(tuple(box[:2]), resample).crop(tuple(box[2:]))
    pixels = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1)
    return pixels.float().div(127.5).sub(1.0)


def encode_pixels(vae, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior mean and log-variance [B, C, (F,) h, w] in fp32 on the CPU (`pixels` in pinned
    memory are copied to an accelerator without blocking this thread)."""
    posterior = vae.encode(pixels.to(vae.device, non_blocking=True).to(vae.dtype)).latent_dist
    return posterior.mean.float().cpu(), posterior.logvar.float().cpu()


def finite_rows(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.stack([t.flatten(1).isfinite().all(1) for t in tensors]).all(0)


def stored_parts(mean: torch.Tensor, logvar: torch.Tensor, posterior: str) -> dict[str, torch.Tensor]:
    if posterior == "mean":
        return {"mean": mean}
    if posterior == "mean_logvar":
        return {"mean": mean, "logvar": logvar}
    return {"mean": mean, "std": torch.exp(0.5 * logvar)}


def same_size_batches(samples: list[dict], boxes: dict[str, list[int]], batch_size: int,
                      frames: dict[str, int] | None = None) -> list[list[dict]]:
    """Batches of at most `batch_size` samples whose crops share one size (and clips one frame
    count, `frames` by sample id), bucket by bucket."""
    by_bucket: dict[tuple[int, int, int], list[dict]] = defaultdict(list)
    for sample in samples:
        box = boxes[sample["sample_id"]]
        by_bucket[((frames or {}).get(sample["sample_id"], 1), box[5] - box[3], box[4] - box[2])].append(sample)
    return [items[i : i + batch_size] for _, items in sorted(by_bucket.items()) for i in range(0, len(items), batch_size)]


def encode_finite(vae, pixels: torch.Tensor, fp32_vae, where: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Posterior mean, log-variance and which rows are finite; rows a half-precision VAE made
    non-finite are encoded again by `fp32_vae()`."""
    mean, logvar = encode_pixels(vae, pixels)
    ok = finite_rows(mean, logvar)
    if not ok.all() and vae.dtype != torch.float32:
        redo = (~ok).nonzero().flatten()
        mean[redo], logvar[redo] = encode_pixels(fp32_vae(), pixels[redo])
        ok = finite_rows(mean, logvar)
        log.warning("%s: %d latents were non-finite in %s, re-encoded in fp32", where, len(redo), vae.dtype)
    return mean, logvar, ok


@torch.inference_mode()
def encode_latents_shard(
    storage: StorageConfig, model: ModelConfig, latents: LatentEncodingConfig, fingerprint: str, shard_url: str
) -> dict[str, Any]:
    """Encode every image of one shard; returns the latent cache shard's commit record.

    Images are grouped by bucket from their recorded size (no decode needed), and the next batch is
    decoded and resized in a background thread while the VAE encodes the current one.
    """
    store = Store(storage)
    shard_id = shard_id_of(shard_url)
    key = layout.cache_shard("latents", fingerprint, shard_id)
    if (record := store.committed(key)) is not None:
        return {**record, "io_retries": len(store.retried)}
    samples = read_image_shard(store.read_verified(store.key(shard_url))).to_pylist()
    family = family_of(model)
    quarantined: list[dict[str, str]] = []
    frames = {s["sample_id"]: frame_count(s["image"]) for s in samples}  # a picture is one frame
    problems = {s["sample_id"]: problem for s in samples
                if (problem := family.codec.clip_problem(frames[s["sample_id"]]))}
    for sample_id, problem in problems.items():
        quarantined.append({"sample_id": sample_id, "reason": "frames", "message": problem})
        log.warning("quarantined sample %s of shard %s: %s", sample_id, shard_id, problem)
    for sample in samples:  # a target with more (or fewer) references than the family's pipeline takes
        if (sample.get("role") != "reference" and family.codec.references is not None
                and (problem := family.codec.references.count_problem(len(sample.get("references") or [])))):
            problems[sample["sample_id"]] = problem
            quarantined.append({"sample_id": sample["sample_id"], "reason": "references", "message": problem})
            log.warning("quarantined sample %s of shard %s: %s", sample["sample_id"], shard_id, problem)
    samples = [s for s in samples if s["sample_id"] not in problems]
    def table(sample: dict) -> dict[str, list[float]]:  # at its source's resolution, or the config's
        if sample.get("resolution"):
            return family.codec.bucket_table(sample["resolution"], f"the source of {sample['source']!r}: resolution")
        return family.codec.bucket_table(latents.resolution)

    def box(sample: dict) -> list[int]:
        if sample.get("role") == "reference" and family.codec.references is not None:  # as the pipeline sizes it
            return family.codec.references.box(sample["width"], sample["height"], latents.reference_resolution
                                               or sample.get("resolution") or latents.resolution)
        return crop_box(table(sample), sample["width"], sample["height"], latents.crop, latents.crop_seed,
                        sample["sample_id"])

    boxes = {s["sample_id"]: box(s) for s in samples}
    # a reference is resized as its pipeline resizes it (diffusers' image processor: Lanczos)
    resampling = {s["sample_id"]: Image.Resampling.LANCZOS if s.get("role") == "reference" else Image.Resampling.BICUBIC
                  for s in samples}
    # {sample_id: (bucket, stored parts)}: encoded here, or copied from a shard that holds the image
    results, factors = held_latents(store, fingerprint, samples, boxes)
    copied = len(results)
    batches = same_size_batches([s for s in samples if s["sample_id"] not in results], boxes, latents.batch_size,
                                frames)
    store_dtype = DTYPES[latents.storage_dtype]
    waited, began = 0.0, time.perf_counter()
    if batches or factors is None:
        vae = load_vae(model, family, latents.dtype, latents.device)
        began = time.perf_counter()
        factors = family.codec.latent_factors(vae)
        # only if a batch is non-finite
        fp32_vae = functools.cache(lambda: build_vae(model, family, "fp32", latents.device))

        def load_pixels(batch: list[dict]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
            if frames[batch[0]["sample_id"]] > 1:
                pixels, masks = zip(*(preprocess_clip(s["image"], boxes[s["sample_id"]]) for s in batch))
                pixels = torch.stack(pixels)
            else:
                pixels, masks = zip(*(preprocess(s["image"], boxes[s["sample_id"]], resampling[s["sample_id"]])
                                      for s in batch))
                pixels = family.codec.vae_pixels(torch.stack(pixels))
            return (pixels.pin_memory() if vae.device.type == "cuda" else pixels), list(masks)

        # with an accelerator, the next batches are decoded and resized (Pillow releases the GIL) by
        # this process's share of the cores while the VAE encodes: one thread decodes ~60 photos/s,
        # an H100 encodes several hundred. On a CPU they would only compete for the same cores.
        threads = 0 if vae.device.type == "cpu" else torch.get_num_threads()
        feed = prefetched(load_pixels, batches, ahead=threads + (threads > 0), threads=max(threads, 1))
        for batch in batches:
            asked = time.perf_counter()
            pixels, masks = next(feed)
            waited += time.perf_counter() - asked  # the device idle for want of data (on a CPU: the decoding itself)
            if latents.flip:
                pixels = torch.cat([pixels, pixels.flip(-1)])
            with VAE_IN_USE:  # the cached VAE is shared by shards of any config: both switches set every time
                vae.enable_tiling() if latents.tiling else vae.disable_tiling()
                vae.enable_slicing() if latents.slicing else vae.disable_slicing()
                mean, logvar, ok = encode_finite(vae, pixels, fp32_vae, f"shard {shard_id}")
            count = len(batch)
            for row, sample in enumerate(batch):
                sample_id = sample["sample_id"]
                if not (ok[row] and (not latents.flip or ok[row + count])):
                    quarantined.append({"sample_id": sample_id, "reason": "non_finite_latent",
                                        "message": f"VAE output is not finite, even in fp32 ({sample['width']}x"
                                                   f"{sample['height']})"})
                    log.warning("quarantined sample %s of shard %s: non-finite latent", sample_id, shard_id)
                    continue
                parts = stored_parts(mean[row : row + 1], logvar[row : row + 1], latents.posterior)
                if masks and masks[row] is not None:
                    parts["mask"] = latent_mask(masks[row], mean.shape[2:])
                if latents.flip:
                    flipped = stored_parts(mean[row + count : row + count + 1],
                                           logvar[row + count : row + count + 1], latents.posterior)
                    parts.update({f"flip_{part}": t for part, t in flipped.items()})
                    if "mask" in parts:
                        parts["flip_mask"] = parts["mask"].flip(-1)
                results[sample_id] = bucket_name(*mean.shape[2:]), {part: t.to(store_dtype) for part, t in parts.items()}
    # a shard with a masked picture stores a mask for every row (a bucket's rows share their parts)
    if any("mask" in parts for _, parts in results.values()):
        for name, parts in results.values():
            if "mask" not in parts:
                parts["mask"] = latent_mask(None, parts["mean"].shape[2:]).to(store_dtype)
                if "flip_mean" in parts:
                    parts["flip_mask"] = parts["mask"]
    # rows in the order one pass over every sample gives, whichever were copied
    encoded: dict[str, dict[str, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
    rows: dict[str, tuple[str, int]] = {}
    for batch in same_size_batches(samples, boxes, latents.batch_size, frames):
        for sample in batch:
            if (result := results.get(sample["sample_id"])) is None:  # quarantined
                continue
            name, parts = result
            for part, tensor in parts.items():
                encoded[name][part].append(tensor)
            rows[sample["sample_id"]] = (name, len(encoded[name]["mean"]) - 1)
    shift, scale = factors
    buckets = {name: {part: torch.cat(ts) for part, ts in parts.items()} for name, parts in encoded.items()}
    meta = {
        "format": LATENT_FORMAT, "fingerprint": fingerprint, "shard": shard_id, "resolution": latents.resolution,
        "posterior": latents.posterior, "flip": latents.flip, "crop": latents.crop,
        "crop_boxes": {sid: boxes[sid] for sid in rows}, "quarantined": quarantined,
        **({"reference_resolution": latents.reference_resolution} if latents.reference_resolution else {}),
        "scaling_factor": scale, "shift_factor": shift,
        # edit pairs: this shard's reference rows, and each target's references (which may be in other shards)
        **({"reference_rows": sorted(s["sample_id"] for s in samples if s.get("role") == "reference" and
                                     s["sample_id"] in rows),
            "references": {s["sample_id"]: s["references"] for s in samples if s.get("references")}}
           if any(s.get("role") == "reference" or s.get("references") for s in samples) else {}),
    }
    clips = sum(frames[sample_id] > 1 for sample_id in rows)
    record = store.commit(
        key, pack_latents(buckets, rows, meta), shard=shard_id, samples=len(rows), clips=clips, quarantined=quarantined,
        buckets={name: len(parts["mean"]) for name, parts in buckets.items()}, copied=copied,
        seconds=round(time.perf_counter() - began, 4), feed_wait_seconds=round(waited, 4),
    )
    log.info("encoded %s of shard %s into %d buckets (%d copied from the shards holding their images, %d "
             "quarantined)", samples_text(len(rows), clips), shard_id, len(buckets), copied, len(quarantined))
    return {**record, "io_retries": len(store.retried)}


def held_latents(store: Store, fingerprint: str, samples: list[dict], boxes: dict[str, list[int]]
                 ) -> tuple[dict[str, tuple], tuple | None]:
    """The latents of the samples whose image a shard holds with other captions or resolution
    (`pixels_from`: a re-captioned image, or its source's resolution changed), from that shard's
    latents of this fingerprint where they are committed and crop the image by the same box (its
    pixels, and so its latents, are the same): ({sample_id: (bucket, stored parts)}, and the latent
    factors those shards recorded, or None when none is)."""
    wanted: dict[str, dict[str, list[int]]] = defaultdict(dict)
    for sample in samples:
        if sample.get("pixels_from"):
            key = layout.cache_shard("latents", fingerprint, sample["pixels_from"])
            wanted[key][sample["sample_id"]] = boxes[sample["sample_id"]]
    found, factors = {}, None
    for (key, held), record in zip(wanted.items(), store.committed_all(list(wanted))):
        if record is None:
            continue
        try:  # their rows alone: a shard holding an image's pixels may hold thousands of others
            rows, meta = read_latent_rows(store, key, record["size"], held)
        except (ArtifactMissing, Damaged) as error:
            log.warning("latents not copied from %s, encoded instead: %s", store.url(key), error)
            continue
        factors = meta["shift_factor"], meta["scaling_factor"]
        found |= rows
    return found, factors


def check_latent_encoding(model: ModelConfig, latents: LatentEncodingConfig, dataset: DatasetConfig) -> None:
    """Refuse, naming the setting, a resolution the model's family has no buckets for (the config's,
    or a source's), reference images (or their resolution) it takes none of, and clip lengths it never encodes (Wan: 4N +
    1), so that nothing is ingested or encoded for latents that cannot be made. A model this process cannot read is left to the stage
    that reads it (as `check_training` does)."""
    try:
        family = family_of(model)
    except (OSError, ValueError):
        return
    family.codec.bucket_table(latents.resolution)  # raises, naming latent_encoding.resolution
    for source in dataset.sources:
        if source.resolution is not None:
            family.codec.bucket_table(source.resolution, f"dataset source {source.path!r}: resolution")
        if source.references != "none" and family.codec.references is None:
            raise ValueError(f"dataset source {source.path!r}: references: {source.references} pairs each picture "
                             f"with the reference images it was made from, and {family.name} takes none (an edit "
                             "family's model does)")
        most = family.codec.references and family.codec.references.most
        if most is not None and len(source.reference_folders()) > most:
            raise ValueError(f"dataset source {source.path!r}: reference_path names {len(source.reference_folders())} "
                             f"folders, a reference each, and {family.name} takes at most {most}")
    if latents.reference_resolution and family.codec.references is None:
        raise ValueError(f"latent_encoding.reference_resolution: {family.name} takes no reference images to size "
                         "(an edit family's model does); leave it unset")
    seeing = [spec.name for spec in family.text.encoders if spec.processor is not None]
    if latents.flip and seeing and any(source.references != "none" for source in dataset.sources):
        raise ValueError(f"latent_encoding.flip: {family.name}'s text encoder {seeing[0]} reads each pair's "
                         "references with its caption, unflipped, so a flipped pair would train against a caption "
                         "that saw the other side; leave flip off")
    video = dataset.video
    if problem := family.codec.clip_policy_problem(sorted({video.frames, *video.frame_buckets})):
        raise ValueError(f"dataset.video: {problem}")


def latent_cache_record(store: Store, fingerprint: str, shards: list[dict[str, Any]]) -> CacheRecord:
    """What the encode-latents stage returns, wherever its shards ran: the cache's URL, each shard's
    commit record, `amount` and `committed_at` (the newest)."""
    return {"url": store.url(layout.cache("latents", fingerprint)), "shards": shards,
            "amount": samples_text(sum(r["samples"] for r in shards),
                                   None if any("clips" not in r for r in shards) else sum(r["clips"] for r in shards)),
            "committed_at": max((r["committed_at"] for r in shards), default=0.0)}


def samples_text(samples: int, clips: int | None) -> str:
    """"600 images", "600 clips" or "590 images and 10 clips": what latents of `samples` hold
    ("600 samples" when shards committed before clips were counted are among them: None)."""
    if clips is None:
        return f"{samples} samples"
    if clips == 0:
        return f"{samples} images"
    return f"{clips} clips" if clips == samples else f"{samples - clips} images and {clips} clips"
