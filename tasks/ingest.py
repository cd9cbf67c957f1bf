"""Stage 1 — ingest: any source format → validated, content-addressed parquet shards.

`sample_id` is the sha256 of the source image bytes; a shard's id is the hash of its sorted
(sample id, captions) records. Shards are append-only: a re-run over the same sources writes
nothing and yields the same dataset id; new samples, and samples whose captions changed, go to new
shards holding only them. Images already in a shard are not decoded again. A dataset version lists
its shards (and, for a shard only partly current, which of its samples). A bad input never fails
the stage: it is quarantined with a reason code; an unreachable source fails it, naming the source.

Images are untrusted bytes: only the formats the README lists are parsed (Pillow would otherwise
try every plugin it has, TGA among them, which has no magic number: noise behind a plausible
header decodes), a file larger than any `max_pixels` image can honestly be is refused undecoded,
and dimensions are checked before pixels are decoded. Names and messages are stored with control
characters escaped.
"""

from __future__ import annotations

import io
import json
import logging
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from configs.schema import DatasetConfig, StorageConfig
from storage import layout
from storage.fingerprint import hash_json, sha256_bytes
from storage.shards import pack_image_shard, read_image_shard, shard_id_of
from storage.store import Store, fsspec_options
from tasks.encode_latents import nearest_ratio
from tasks.sources import Candidate, Rejected, printable, read_source

log = logging.getLogger(__name__)

MAX_ASPECT_RATIO = 4.0  # the PixArt bucket tables span 1:4 … 4:1
KEEP_AS_IS = ("JPEG", "PNG", "WEBP")  # RGB files in these formats are stored byte for byte
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
# the largest honest encoding is 16-bit RGBA stored uncompressed, plus its metadata
MAX_BYTES_PER_PIXEL, METADATA_BYTES = 8, 16 << 20
CAPTION_WORD_BINS = [5, 10, 20, 50, 100, 200]


@dataclass
class Sample:
    sample_id: str
    image_file: Path | None  # the normalised bytes, spilled to local disk; None: already in a shard
    width: int
    height: int
    captions: list[str]
    source: str
    format: str


@dataclass
class Scan:
    spill: Path  # new images wait here, not in memory, until their shard is written
    samples: dict[str, Sample] = field(default_factory=dict)
    quarantined: list[dict[str, str]] = field(default_factory=list)
    formats: Counter = field(default_factory=Counter)

    def reject(self, candidate: Candidate, problem: Rejected) -> None:
        message = printable(problem.message)
        log.warning("quarantined %s: %s (%s)", candidate.source, problem.reason, message)
        self.quarantined.append({"source": candidate.source, "format": candidate.format,
                                 "reason": problem.reason, "message": message})


def max_image_bytes(config: DatasetConfig) -> int:
    return config.max_pixels * MAX_BYTES_PER_PIXEL + METADATA_BYTES


def check_geometry(width: int, height: int, config: DatasetConfig) -> None:
    if width * height > config.max_pixels:
        raise Rejected("too_large", f"{width}x{height} exceeds max_pixels={config.max_pixels}")
    if min(width, height) < config.min_side:
        raise Rejected("too_small", f"{width}x{height}, shorter side below min_side={config.min_side}")
    if max(width / height, height / width) > MAX_ASPECT_RATIO:
        raise Rejected("aspect_ratio", f"{width}x{height} is beyond 1:{MAX_ASPECT_RATIO:g}")


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB pixels of any mode: 16-bit scaled to 8, palette and LA through RGBA, alpha composited on
    white (what most trainers do), CMYK and grayscale converted."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        pixels = np.asarray(image, dtype=np.float64)
        peak = 65535.0 if image.mode != "I" or pixels.max() > 255 else 255.0
        image = Image.fromarray(np.clip(pixels * (255.0 / peak), 0, 255).round().astype(np.uint8), "L")
    if image.mode in ("P", "PA", "LA", "La", "RGBa") or "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode == "RGBA":
        canvas = Image.new("RGB", image.size, (255, 255, 255))
        canvas.paste(image, mask=image.getchannel("A"))
        return canvas
    return image.convert("RGB")


def normalise_image(data: bytes, config: DatasetConfig) -> tuple[bytes, int, int]:
    """Decode-check an image; returns its bytes (re-encoded as lossless PNG only when it needed
    conversion or rotation) and its size after EXIF orientation. Raises Rejected."""
    if not data:
        raise Rejected("empty_file", "zero bytes")
    if len(data) > max_image_bytes(config):
        raise Rejected("too_large", f"over {max_image_bytes(config)} bytes, more than max_pixels={config.max_pixels} needs")
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as opened:
            check_geometry(*opened.size, config)  # before decoding: a bomb is refused unread
            opened.load()
            rotated = opened.getexif().get(0x0112, 1) != 1  # EXIF orientation other than "as stored"
            image = ImageOps.exif_transpose(opened) if rotated else opened
            converted = rotated or opened.mode != "RGB" or opened.format not in KEEP_AS_IS
            if converted:
                image = to_rgb(image)
    except UnidentifiedImageError as error:
        raise Rejected("not_image", f"not {', '.join(IMAGE_FORMATS)}") from error
    except Image.DecompressionBombError as error:
        raise Rejected("too_large", str(error)) from error
    except (OSError, SyntaxError, ValueError) as error:
        raise Rejected("unreadable", f"cannot decode: {error}") from error
    check_geometry(*image.size, config)  # again: orientation swaps the sides
    if converted:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        data = buffer.getvalue()
    return data, image.width, image.height


def read_index(store: Store) -> tuple[dict[tuple[str, tuple[str, ...]], str], dict[str, tuple[int, int, str]]]:
    """Over every committed image shard: (sample id, captions) → shard id, and
    sample id → (width, height, a shard holding its bytes)."""
    records, images = {}, {}
    for key in store.list(layout.IMAGE_SHARDS, ".parquet"):
        if store.committed(key) is None:
            continue
        shard_id = shard_id_of(key)
        columns = ["sample_id", "captions", "width", "height"]
        for row in read_image_shard(store.read_bytes(key), columns=columns).to_pylist():
            records[(row["sample_id"], tuple(row["captions"]))] = shard_id
            images[row["sample_id"]] = (row["width"], row["height"], shard_id)
    return records, images


def source_options(path: str, storage: StorageConfig) -> dict[str, Any]:
    """Remote sources share the store's fsspec options (endpoint, region); local ones need none."""
    return fsspec_options(storage) if "://" in path and not path.startswith("file://") else {}


def scan_sources(
    storage: StorageConfig, dataset: DatasetConfig, images: dict[str, tuple[int, int, str]], spill: Path
) -> Scan:
    scan = Scan(spill)
    for source in dataset.sources:
        for candidate in read_source(source, source_options(source.path, storage), max_image_bytes(dataset)):
            scan.formats[candidate.format] += 1
            candidate.source = printable(candidate.source)
            try:
                if candidate.problem is not None:
                    raise candidate.problem
                if not candidate.image:
                    raise Rejected("empty_file", "zero bytes")
                sample_id = sha256_bytes(candidate.image)
                if sample_id in scan.samples:  # exact duplicate: kept once, captions merged
                    known = scan.samples[sample_id]
                    known.captions = sorted(set(known.captions) | set(candidate.captions))
                    continue
                if sample_id in images:  # validated when it was first ingested; only the rules may have changed
                    width, height, _ = images[sample_id]
                    check_geometry(width, height, dataset)
                    image_file = None
                else:
                    image, width, height = normalise_image(candidate.image, dataset)
                    image_file = scan.spill / sample_id
                    image_file.write_bytes(image)
            except Rejected as problem:
                scan.reject(candidate, problem)
                continue
            except Exception as error:  # one bad file never fails the stage
                scan.reject(candidate, Rejected("error", f"{type(error).__name__}: {error}"))
                continue
            # variants are a set (training picks one at random): sorted, so line order or which
            # duplicate came first never changes a sample's identity
            scan.samples[sample_id] = Sample(sample_id, image_file, width, height, sorted(set(candidate.captions)),
                                             candidate.source, candidate.format)
    return scan


def ingest_report(scan: Scan) -> dict[str, Any]:
    """Counts by reason, by format, by aspect-ratio bucket, and a caption length histogram."""
    accepted = Counter(s.format for s in scan.samples.values())
    rejected = Counter(q["format"] for q in scan.quarantined)
    words = Counter()
    for sample in scan.samples.values():
        for caption in sample.captions:
            count = len(caption.split())
            words[next((f"<={b}" for b in CAPTION_WORD_BINS if count <= b), f">{CAPTION_WORD_BINS[-1]}")] += 1
    return {
        "samples": len(scan.samples),
        "quarantined": len(scan.quarantined),
        "candidates": sum(scan.formats.values()),
        "duplicates": sum(scan.formats.values()) - len(scan.samples) - len(scan.quarantined),
        "caption_variants": sum(len(s.captions) for s in scan.samples.values()),
        "by_reason": dict(sorted(Counter(q["reason"] for q in scan.quarantined).items())),
        "by_format": {f: {"accepted": accepted[f], "quarantined": rejected[f]} for f in sorted(scan.formats)},
        "by_bucket": dict(sorted(Counter(nearest_ratio(s.width, s.height, 1024)
                                         for s in scan.samples.values()).items(), key=lambda kv: float(kv[0]))),
        "caption_words": {b: words[b] for b in [f"<={b}" for b in CAPTION_WORD_BINS] + [f">{CAPTION_WORD_BINS[-1]}"]},
    }


def ingest(storage: StorageConfig, dataset: DatasetConfig) -> dict[str, Any]:
    """Ingest every source; returns the dataset's record (`dataset_record`) and what was new."""
    store = Store(storage)
    records, images = read_index(store)
    with tempfile.TemporaryDirectory(prefix="precast-ingest-") as spill:
        scan = scan_sources(storage, dataset, images, Path(spill))
        if not scan.samples:
            raise RuntimeError(f"no usable samples in {[s.path for s in dataset.sources]}: "
                               f"{len(scan.quarantined)} quarantined")
        new, members = write_new_shards(store, dataset, scan, records, images)

    shards = []
    for shard_id in sorted(members):
        current = sorted(members[shard_id])
        # null means "the whole shard"; a list names the current samples of a partly superseded shard
        whole = len(current) == store.require(layout.image_shard(shard_id))["samples"]
        shards.append({"id": shard_id, "samples": None if whole else current})
    dataset_id = hash_json(shards)
    record = {"id": dataset_id, "shards": shards, "samples": len(scan.samples),
              "sources": [s.path for s in dataset.sources]}
    if store.committed(layout.dataset(dataset_id)) is None:  # an unchanged dataset writes nothing
        store.commit_json(layout.dataset(dataset_id), record, samples=len(scan.samples))
    report = {"dataset": dataset_id, **ingest_report(scan), "quarantine": scan.quarantined}
    write_if_changed(store, layout.dataset_report(dataset_id), report)
    write_if_changed(store, dataset_ref(dataset), {"dataset": dataset_id})
    return {**dataset_record(store, dataset_id), "new_shards": -(-len(new) // dataset.shard_size),
            "new_samples": len(new)}


def dataset_record(store: Store, dataset_id: str) -> dict[str, Any]:
    """What ingest returns for a committed dataset version, also when it ran elsewhere: the record
    (id, shards, samples, sources) with its URL, report, quarantined count, and the fields every
    stage's record has: `url`, `amount` and `committed_at` (its newest output's commit time)."""
    key = layout.dataset(dataset_id)
    record = {**json.loads(store.read_verified(key)), "url": store.url(key)}
    commits = [store.require(key)] + [store.require(layout.image_shard(s["id"])) for s in record["shards"]]
    report = store.read_json(layout.dataset_report(dataset_id))
    return {**record, "report": store.url(layout.dataset_report(dataset_id)), "quarantined": report["quarantined"],
            "amount": f"{record['samples']} samples in {len(record['shards'])} shards",
            "committed_at": max(c["committed_at"] for c in commits)}


def write_new_shards(
    store: Store, dataset: DatasetConfig, scan: Scan, records: dict, images: dict[str, tuple[int, int, str]]
) -> tuple[list[Sample], dict[str, list[str]]]:
    """Commit shards of the samples no shard holds with these captions; returns them and the
    current members of every shard the dataset uses."""
    members: dict[str, list[str]] = {}
    new: list[Sample] = []
    for sample in scan.samples.values():
        shard_id = records.get((sample.sample_id, tuple(sample.captions)))
        if shard_id is None:
            new.append(sample)
        else:
            members.setdefault(shard_id, []).append(sample.sample_id)
    spill_known_images([s for s in new if s.image_file is None], images, store, scan.spill)

    new.sort(key=lambda s: s.sample_id)
    for start in range(0, len(new), dataset.shard_size):
        chunk = new[start : start + dataset.shard_size]
        shard_id = hash_json([(s.sample_id, s.captions) for s in chunk])
        rows = [{"sample_id": s.sample_id, "image": s.image_file.read_bytes(), "width": s.width,
                 "height": s.height, "captions": s.captions, "source": s.source} for s in chunk]
        store.commit(layout.image_shard(shard_id), pack_image_shard(rows), samples=len(chunk))
        members[shard_id] = [s.sample_id for s in chunk]
    return new, members


def spill_known_images(
    samples: list[Sample], images: dict[str, tuple[int, int, str]], store: Store, spill: Path
) -> None:
    """Bytes of already-ingested images whose captions changed, from the shards that hold them."""
    by_shard: dict[str, list[Sample]] = {}
    for sample in samples:
        by_shard.setdefault(images[sample.sample_id][2], []).append(sample)
    for shard_id, wanted in by_shard.items():
        table = read_image_shard(store.read_bytes(layout.image_shard(shard_id)), columns=["sample_id", "image"])
        stored = dict(zip(table.column("sample_id").to_pylist(), table.column("image").to_pylist()))
        for sample in wanted:
            sample.image_file = spill / sample.sample_id
            sample.image_file.write_bytes(stored[sample.sample_id])


def write_if_changed(store: Store, key: str, obj: Any) -> None:
    if not store.exists(key) or store.read_json(key) != obj:
        store.write_json(key, obj)


def dataset_ref(dataset: DatasetConfig) -> str:
    """Key of the pointer to the latest dataset ingested from these sources and rules."""
    return layout.dataset_ref(hash_json(dataset.model_dump()))


def latest_dataset(storage: StorageConfig, dataset: DatasetConfig) -> dict[str, Any]:
    """The dataset record last ingested for this config (what `precast stage` starts from)."""
    store = Store(storage)
    ref = dataset_ref(dataset)
    if not store.exists(ref):
        raise FileNotFoundError(f"no dataset ingested yet for these sources in {store.root_url}; run ingest first")
    return dataset_record(store, store.read_json(ref)["dataset"])


def report_markdown(report: dict[str, Any]) -> str:
    """The ingest report as markdown (the Prefect artifact and `precast inspect`)."""
    lines = [f"# Ingest report — dataset `{report['dataset']}`", "",
             f"**{report['samples']}** samples accepted, **{report['quarantined']}** quarantined, "
             f"{report['duplicates']} exact duplicates merged, {report['caption_variants']} caption variants.", ""]

    def table(title: str, header: str, rows: list[tuple]) -> None:
        lines.extend([f"## {title}", "", header, "|" + " --- |" * (header.count("|") - 1)])
        lines.extend("| " + " | ".join(str(c) for c in row) + " |" for row in rows)
        lines.append("")

    table("By format", "| format | accepted | quarantined |",
          [(f, c["accepted"], c["quarantined"]) for f, c in report["by_format"].items()])
    table("Quarantined by reason", "| reason | count |", list(report["by_reason"].items()))
    table("By aspect-ratio bucket (height/width)", "| ratio | samples |", list(report["by_bucket"].items()))
    table("Caption length (words)", "| words | captions |", list(report["caption_words"].items()))
    if report["quarantine"]:
        table("Quarantined inputs", "| source | reason | message |",
              [(q["source"], q["reason"], q["message"]) for q in report["quarantine"][:200]])
    return "\n".join(lines)


def sources_signature(storage: StorageConfig, dataset: DatasetConfig) -> str:
    """Hash of every source file's name, size and modification stamp, plus the ingest rules."""
    import fsspec

    listing = []
    for source in dataset.sources:
        fs, root = fsspec.core.url_to_fs(source.path, **source_options(source.path, storage))
        files = fs.find(root, detail=True) if fs.exists(root) else {}
        for name, info in sorted(files.items()):
            stamp = info.get("mtime") or info.get("ETag") or info.get("LastModified")
            listing.append((name, info.get("size"), str(stamp)))
    return hash_json({"storage": storage.model_dump(), "dataset": dataset.model_dump(), "files": listing})
