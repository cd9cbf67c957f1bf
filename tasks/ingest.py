"""Stage 1 — ingest: image folders with captions → validated, content-addressed parquet shards.

`sample_id` is the sha256 of the source image bytes; a shard's id is the hash of its sorted
(sample id, captions) records. Shards are append-only: a re-run over the same sources writes
nothing and yields the same dataset id; new or changed samples go to new shards. A dataset version
is the list of shards (and, where a shard is only partly current, which of its samples) it uses.
A bad file never fails the stage: it is quarantined with a reason code.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass, field
from typing import Any

import fsspec
from PIL import Image, ImageOps, UnidentifiedImageError
from prefect import task

from configs.schema import DatasetConfig, StorageConfig
from storage.fingerprint import hash_json, sha256_bytes
from storage.shards import pack_image_shard, read_image_shard, shard_id_of
from storage.store import Store

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
MAX_ASPECT_RATIO = 4.0  # the PixArt bucket tables span 0.25 … 4.0
SHARDS = "shards/images"


@dataclass
class Sample:
    sample_id: str
    image: bytes
    width: int
    height: int
    captions: list[str]
    source: str


@dataclass
class Scan:
    samples: dict[str, Sample] = field(default_factory=dict)
    quarantined: list[dict[str, str]] = field(default_factory=list)

    def reject(self, source: str, reason: str, message: str) -> None:
        log.warning("quarantined %s: %s (%s)", source, reason, message)
        self.quarantined.append({"source": source, "reason": reason, "message": message})


def normalise_image(data: bytes, source: str, config: DatasetConfig) -> tuple[bytes, int, int]:
    """Decode-check an image; returns bytes (re-encoded as PNG only when needed) and its size.

    Raises ValueError("<reason>: <message>") for anything that is not a usable training image.
    """
    if not data:
        raise ValueError("empty_file: zero bytes")
    try:
        with Image.open(io.BytesIO(data)) as probe:
            width, height = probe.size
            if width * height > config.max_pixels:
                raise ValueError(f"too_large: {width}x{height} exceeds max_pixels={config.max_pixels}")
            probe.load()
            image = ImageOps.exif_transpose(probe)
            needs_conversion = image is not probe or probe.mode != "RGB" or probe.format not in ("JPEG", "PNG", "WEBP")
            if needs_conversion:
                image = image.convert("RGBA") if "A" in image.getbands() or image.mode == "P" else image
                if image.mode == "RGBA":  # alpha is composited on white, as most trainers do
                    canvas = Image.new("RGB", image.size, (255, 255, 255))
                    canvas.paste(image, mask=image.getchannel("A"))
                    image = canvas
                image = image.convert("RGB")
    except Image.DecompressionBombError as error:
        raise ValueError(f"too_large: {error}") from error
    except (UnidentifiedImageError, OSError, SyntaxError) as error:
        raise ValueError(f"unreadable: {error}") from error
    width, height = image.size
    if min(width, height) < config.min_side:
        raise ValueError(f"too_small: {width}x{height}, shorter side below min_side={config.min_side}")
    if max(width / height, height / width) > MAX_ASPECT_RATIO:
        raise ValueError(f"aspect_ratio: {width}x{height} is beyond 1:{MAX_ASPECT_RATIO:g}")
    if needs_conversion:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        data = buffer.getvalue()
    return data, width, height


def read_captions(raw: bytes) -> list[str]:
    """Caption variants of a caption file: one per non-empty line, whitespace-normalised."""
    text = raw.decode("utf-8-sig")
    return [" ".join(line.split()) for line in text.splitlines() if line.strip()]


def list_source(path: str, options: dict[str, Any]) -> tuple[fsspec.AbstractFileSystem, dict[str, dict]]:
    """The filesystem of a source and every file below it with its fsspec info."""
    try:
        fs, root = fsspec.core.url_to_fs(path, **options)
        files = fs.find(root, detail=True)
    except Exception as error:  # an unreachable source fails the stage, naming it
        raise RuntimeError(f"dataset source {path!r} cannot be read: {error}") from error
    if not files:
        raise RuntimeError(f"dataset source {path!r} is empty or does not exist")
    return fs, files


def source_options(path: str, storage: StorageConfig) -> dict[str, Any]:
    """Remote sources share the store's fsspec options (endpoint, region); local ones need none."""
    return storage.options if "://" in path and not path.startswith("file://") else {}


def scan_folder(path: str, options: dict[str, Any], config: DatasetConfig, scan: Scan) -> None:
    fs, files = list_source(path, options)
    for file in sorted(files):
        stem, dot, ext = file.rpartition(".")
        if not dot or f".{ext.lower()}" not in IMAGE_EXTENSIONS:
            continue
        source = fs.unstrip_protocol(file)
        caption_file = f"{stem}.txt"
        if caption_file not in files:
            scan.reject(source, "missing_caption", f"no {caption_file.rsplit('/', 1)[-1]} beside the image")
            continue
        try:
            captions = read_captions(fs.cat_file(caption_file))
        except UnicodeDecodeError as error:
            scan.reject(source, "caption_encoding", f"caption is not UTF-8: {error}")
            continue
        if not captions:
            scan.reject(source, "empty_caption", "caption file has no text")
            continue
        raw = fs.cat_file(file)
        try:
            image, width, height = normalise_image(raw, source, config)
        except ValueError as error:
            reason, _, message = str(error).partition(": ")
            scan.reject(source, reason, message)
            continue
        sample_id = sha256_bytes(raw)
        if sample_id in scan.samples:  # exact duplicate: keep once, merge captions
            known = scan.samples[sample_id]
            known.captions = list(dict.fromkeys(known.captions + captions))
            continue
        scan.samples[sample_id] = Sample(sample_id, image, width, height, captions, source)


def existing_records(store: Store) -> dict[tuple[str, tuple[str, ...]], str]:
    """(sample id, captions) → shard id, over every committed image shard."""
    records = {}
    for key in store.list(SHARDS, ".parquet"):
        if store.committed(key) is None:
            continue
        table = read_image_shard(store.read_bytes(key), columns=["sample_id", "captions"]).to_pylist()
        shard_id = shard_id_of(key)
        for row in table:
            records[(row["sample_id"], tuple(row["captions"]))] = shard_id
    return records


def ingest(storage: StorageConfig, dataset: DatasetConfig) -> dict[str, Any]:
    """Ingest every source; returns the dataset record (id, shards, counts) with its URL."""
    store = Store(storage)
    scan = Scan()
    for source in dataset.sources:
        scan_folder(source.path, source_options(source.path, storage), dataset, scan)
    if not scan.samples:
        raise RuntimeError(f"no usable samples in {[s.path for s in dataset.sources]}: "
                           f"{len(scan.quarantined)} quarantined")

    known = existing_records(store)
    members: dict[str, list[str]] = {}
    new: list[Sample] = []
    for sample in scan.samples.values():
        shard_id = known.get((sample.sample_id, tuple(sample.captions)))
        if shard_id is None:
            new.append(sample)
        else:
            members.setdefault(shard_id, []).append(sample.sample_id)

    new.sort(key=lambda s: s.sample_id)
    for start in range(0, len(new), dataset.shard_size):
        chunk = new[start : start + dataset.shard_size]
        shard_id = hash_json([(s.sample_id, s.captions) for s in chunk])
        store.commit(f"{SHARDS}/{shard_id}.parquet", pack_image_shard([vars(s) for s in chunk]), samples=len(chunk))
        members[shard_id] = [s.sample_id for s in chunk]

    shards = []
    for shard_id in sorted(members):
        record = store.require(f"{SHARDS}/{shard_id}.parquet")
        current = sorted(members[shard_id])
        # null means "the whole shard"; a list names the current samples of a partly superseded shard
        shards.append({"id": shard_id, "samples": None if len(current) == record["samples"] else current})
    dataset_id = hash_json(shards)
    record = {
        "id": dataset_id,
        "shards": shards,
        "samples": len(scan.samples),
        "sources": [s.path for s in dataset.sources],
    }
    if store.committed(f"datasets/{dataset_id}.json") is None:  # an unchanged dataset writes nothing
        store.write_json(f"quarantine/{dataset_id}.json", scan.quarantined)
        store.commit_json(f"datasets/{dataset_id}.json", record, samples=len(scan.samples))
    ref = dataset_ref(dataset)
    if not store.exists(ref) or store.read_json(ref) != {"dataset": dataset_id}:
        store.write_json(ref, {"dataset": dataset_id})
    return {**record, "url": store.url(f"datasets/{dataset_id}.json"),
            "new_shards": -(-len(new) // dataset.shard_size), "quarantined": len(scan.quarantined)}


def dataset_ref(dataset: DatasetConfig) -> str:
    """Key of the pointer to the latest dataset ingested from these sources and rules."""
    return f"refs/datasets/{hash_json(dataset.model_dump())}.json"


def latest_dataset(storage: StorageConfig, dataset: DatasetConfig) -> dict[str, Any]:
    """The dataset record last ingested for this config (what `precast stage` starts from)."""
    store = Store(storage)
    ref = dataset_ref(dataset)
    if not store.exists(ref):
        raise FileNotFoundError(f"no dataset ingested yet for these sources in {store.root_url}; run ingest first")
    key = f"datasets/{store.read_json(ref)['dataset']}.json"
    store.require(key)
    return {**store.read_json(key), "url": store.url(key)}



def sources_signature(storage: StorageConfig, dataset: DatasetConfig) -> str:
    """Hash of every source file's name, size and modification stamp, plus the ingest rules."""
    listing = []
    for source in dataset.sources:
        _, files = list_source(source.path, source_options(source.path, storage))
        for name, info in sorted(files.items()):
            stamp = info.get("mtime") or info.get("ETag") or info.get("LastModified")
            listing.append((name, info.get("size"), str(stamp)))
    return hash_json({"storage": storage.model_dump(), "dataset": dataset.model_dump(), "files": listing})


@task(name="ingest", persist_result=True, result_serializer="json",
      cache_key_fn=lambda _, parameters: "ingest-" + sources_signature(parameters["storage"], parameters["dataset"]))
def ingest_task(storage: StorageConfig, dataset: DatasetConfig) -> dict[str, Any]:
    return ingest(storage, dataset)
