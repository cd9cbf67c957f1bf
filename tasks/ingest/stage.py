"""Stage 1 — ingest: any source format → validated, content-addressed parquet shards.

`sample_id` is the sha256 of the source image bytes; a shard's id is the hash of its sorted
(sample id, captions) records. Shards are append-only: a re-run over the same sources writes
nothing and yields the same dataset id; new samples, and samples whose captions changed, go to new
shards holding only them. Images already in a shard are not decoded again. A dataset version lists
its shards (and, for a shard only partly current, which of its samples). A bad input never fails
the stage: it is quarantined with a reason code; an unreachable source fails it, naming the source.

Each source is listed once and read as units (tasks/ingest/sources.py), `read_concurrency` at once, each
image hashed and checked in the reading thread (Pillow decodes without holding the GIL). The
units and what each became are recorded beside the dataset ref; the next ingest of the same
sources and rules takes every unit whose objects are listed unchanged (path, size, ETag or mtime)
from that record instead of reading it, so a nightly run reads only new or rewritten objects.
Outcomes are merged in listing order, so duplicates, quarantine and shards are what one
sequential pass would give. Everything the stage keeps while it runs (listings, the last record,
samples, outcomes) is a table of its ledger (tasks/ingest/ledger.py) on local disk, so memory does not
grow with the number of objects.

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
import os
import socket
import tempfile
import threading
import uuid
import itertools
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import PIL
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageOps, UnidentifiedImageError

from configs.schema import DatasetConfig, StorageConfig
from storage import layout
from storage.fingerprint import hash_json, sha256_bytes
from storage.shards import pack_image_shard, read_image_shard, shard_id_of
from storage.store import COMMIT_SUFFIX, ArtifactMissing, Damaged, Store, file_sha256, fsspec_options
from tasks.encode.latents import nearest_ratio
from tasks.ingest.ledger import PAGE, Ledger
from tasks.ingest.sources import Candidate, Rejected, Unit, count_units, list_source, printable, read_unit, source_units

log = logging.getLogger(__name__)

MAX_ASPECT_RATIO = 4.0  # the PixArt bucket tables span 1:4 … 4:1
KEEP_AS_IS = ("JPEG", "PNG", "WEBP")  # RGB files in these formats are stored byte for byte
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
# the largest honest encoding is 16-bit RGBA stored uncompressed, plus its metadata
MAX_BYTES_PER_PIXEL, METADATA_BYTES = 8, 16 << 20
CAPTION_WORD_BINS = [5, 10, 20, 50, 100, 200]


@dataclass
class Outcome:
    """What one candidate became: a sample (its image spilled when it was new), or quarantined."""

    source: str
    format: str
    sample_id: str | None = None
    captions: list[str] | None = None
    width: int = 0
    height: int = 0
    reason: str | None = None
    message: str | None = None
    spilled: bool = False


@dataclass
class Scan:
    """What the sources gave: the samples (exact duplicates merged), the quarantine and each keyed
    unit's outcomes are rows of the ledger; new images wait in `spill`, not in memory, until their
    shard is written. Here only counters."""

    ledger: Ledger
    spill: Path
    formats: Counter = field(default_factory=Counter)
    units_read: int = 0  # units whose objects were read now
    units_reused: int = 0  # units taken from the last ingest's record, unread
    bytes_read: int = 0  # listed bytes of the objects read
    position: int = 0  # outcomes so far: the listing order that decides which duplicate comes first
    # added since the last flush: keyed units' outcomes, quarantined and accepted candidates
    keyed: list[tuple] = field(default_factory=list)
    refused: list[tuple] = field(default_factory=list)
    accepted: list[tuple] = field(default_factory=list)

    def add(self, unit: Unit, outcomes: list[Outcome], read: bool) -> None:
        """A unit's outcomes, in order (written to the ledger a page at a time)."""
        if unit.key:
            self.keyed.append((unit.key, json.dumps([vars(o) for o in outcomes])))
        if unit.key or unit.size:  # not a metadata row that was refused before any read
            self.units_read += read
            self.units_reused += not read
        self.bytes_read += unit.size if read else 0
        for outcome in outcomes:
            self.formats[outcome.format] += 1
            self.position += 1
            if outcome.reason is not None:
                log.warning("quarantined %s: %s (%s)", outcome.source, outcome.reason, outcome.message)
                self.refused.append((self.position, outcome.source, outcome.format, outcome.reason, outcome.message))
            else:
                self.accepted.append((outcome.sample_id, self.position, json.dumps(outcome.captions), outcome.width,
                                      outcome.height, outcome.source, outcome.format, outcome.spilled))
        if len(self.keyed) + len(self.accepted) + len(self.refused) >= PAGE:
            self.flush()

    def flush(self) -> None:
        """What was added since the last flush, into the ledger: a sample seen before (an exact
        duplicate) keeps its first source and gains the later one's captions."""
        ledger = self.ledger
        with ledger.transaction():
            ledger.run_many("INSERT INTO units (key, outcomes) VALUES (?, ?)", self.keyed)
            ledger.run_many("INSERT INTO quarantined VALUES (?, ?, ?, ?, ?)", self.refused)
            ledger.run_many("INSERT INTO accepted VALUES (?, ?, ?, ?, ?, ?, ?, ?)", self.accepted)
            ledger.run("INSERT OR IGNORE INTO samples SELECT *, NULL FROM accepted ORDER BY position")
            for sample_id, captions, spilled in ledger.all(
                    "SELECT sample_id, accepted.captions, accepted.spilled FROM accepted JOIN samples USING (sample_id) "
                    "WHERE samples.position != accepted.position ORDER BY accepted.position"):
                known = ledger.one("SELECT captions FROM samples WHERE sample_id = ?", (sample_id,))[0]
                merged = sorted(set(json.loads(known)) | set(json.loads(captions)))
                ledger.run("UPDATE samples SET captions = ?, spilled = spilled OR ? WHERE sample_id = ?",
                           (json.dumps(merged), spilled, sample_id))
            ledger.run("DELETE FROM accepted")
        for added in (self.keyed, self.refused, self.accepted):
            added.clear()

    def count(self, table: str) -> int:
        return self.ledger.one(f"SELECT count(*) FROM {table}")[0]


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


def read_index(store: Store, ledger: Ledger) -> None:
    """Every committed image shard's samples into the ledger's `stored` table."""
    for key in store.list(layout.IMAGE_SHARDS, ".parquet"):
        if store.committed(key) is None:
            continue
        table = read_image_shard(store.read_bytes(key), columns=["sample_id", "captions", "width", "height"])
        ledger.run_many("INSERT OR REPLACE INTO stored VALUES (?, ?, ?, ?, ?)",
                        ((row["sample_id"], json.dumps(row["captions"]), row["width"], row["height"], shard_id_of(key))
                         for row in table.to_pylist()))


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def source_options(path: str, storage: StorageConfig) -> dict[str, Any]:
    """Remote sources share the store's fsspec options (endpoint, region); local ones need none."""
    return fsspec_options(storage) if is_remote(path) else {}


def examine(candidate: Candidate, dataset: DatasetConfig, stored: Callable[[str], tuple[int, int] | None],
            keep: Callable[[str, bytes], None]) -> Outcome:
    """One candidate checked: hashed, its geometry checked, and a new image (one `stored` does not
    give the size of) decoded, normalised and handed to `keep` under its sample id. Never raises:
    one bad file never fails the stage."""
    outcome = Outcome(printable(candidate.source), candidate.format)
    try:
        if candidate.problem is not None:
            raise candidate.problem
        if not candidate.image:
            raise Rejected("empty_file", "zero bytes")
        outcome.sample_id = sha256_bytes(candidate.image)
        if (size := stored(outcome.sample_id)) is not None:  # validated when first ingested; only the rules may have changed
            outcome.width, outcome.height = size
            check_geometry(outcome.width, outcome.height, dataset)
        else:
            image, outcome.width, outcome.height = normalise_image(candidate.image, dataset)
            keep(outcome.sample_id, image)
            outcome.spilled = True
        # variants are a set (training picks one at random): sorted, so line order or which
        # duplicate came first never changes a sample's identity
        outcome.captions = sorted(set(candidate.captions))
    except Rejected as problem:
        outcome.reason, outcome.message = problem.reason, printable(problem.message)
    except Exception as error:  # one bad file never fails the stage
        outcome.reason, outcome.message = "error", printable(f"{type(error).__name__}: {error}")
    if outcome.reason is not None:
        outcome.sample_id = outcome.captions = None
        outcome.spilled = False
    return outcome


def spill_image(spill: Path, sample_id: str, image: bytes) -> None:
    """A new image into the spill folder, where its shard is written from (two duplicates may
    spill at once)."""
    partial = spill / f"{sample_id}.{uuid.uuid4().hex}"
    partial.write_bytes(image)
    partial.replace(spill / sample_id)


@dataclass
class Batch:
    """Units read together: the unread units of up to `span` units of the listing in a row."""

    units: list[Unit] = field(default_factory=list)
    future: Future | None = None  # once sent
    left: int = 0  # its units not yet taken


def in_order(read: Callable[[list[Unit]], Future], units: Iterable[Unit], known: Callable[[Unit], Any],
             window: int, full: Callable[[list[Unit]], bool] = bool, span: int = 1) -> Iterator[tuple[Unit, Any, bool]]:
    """Each unit's outcomes in the units' order, with whether it was read: `known(unit)` when it
    has them, else from `read(batch)`, a Future of the outcomes of a batch of units. A batch is
    sent once `full(batch)` (by default: a unit per batch) or once it covers `span` units of the
    listing, known ones included (so sparse new units, as on a nightly run, still fill `window`
    batches). At most `window` batches are in flight and `window * span` units wait to be taken,
    so memory holds a bounded number of outcomes."""
    pending: deque[tuple[Unit, Batch | None, Any, bool]] = deque()  # unit, its batch (None: known), place or outcomes
    batch: Batch | None = None
    opened = in_flight = 0

    def send() -> None:
        nonlocal batch
        batch.future = read(batch.units)
        batch = None

    def first() -> tuple[Unit, Any, bool]:
        nonlocal in_flight
        unit, owner, place, was_read = pending.popleft()
        if owner is None:
            return unit, place, was_read
        if owner.future is None:  # the batch still gathering
            send()
        owner.left -= 1
        in_flight -= owner.left == 0
        return unit, owner.future.result()[place], was_read

    for position, unit in enumerate(units):
        if (outcomes := known(unit)) is None:
            if batch is None:
                batch, opened = Batch(), position
                in_flight += 1
            pending.append((unit, batch, len(batch.units), True))
            batch.units.append(unit)
            batch.left += 1
            if full(batch.units):
                send()
        else:
            pending.append((unit, None, outcomes, False))
        if batch is not None and position + 1 - opened >= span:
            send()
        while in_flight >= window or len(pending) >= window * span:
            yield first()
    while pending:
        yield first()


PARTITION_BYTES = 256 << 20  # a partition's listed bytes: what a worker stages for the ingest to fetch (a tar
                             # or parquet file larger than this is a partition of its own)


@dataclass(frozen=True)
class Partitions:
    """Ingest on workers: `run(source index, format, [[key, plan], ...])` has a worker examine a
    partition of a source's units (`examine_partition`) and returns its staged key; `slots`
    partitions are examined at once, each of up to `size` units and PARTITION_BYTES."""

    run: Callable[[int, str, list[list]], str]
    slots: int
    size: int

    def full(self, units: list[Unit]) -> bool:
        return len(units) >= self.size or sum(unit.size for unit in units) >= PARTITION_BYTES


def reading_threads(path: str, dataset: DatasetConfig) -> int:
    """Reads in flight for a source: a local disk has no request latency to hide, so more threads
    than cores would only contend."""
    return dataset.read_concurrency if is_remote(path) else min(dataset.read_concurrency, os.cpu_count() or 1)


def scan_sources(storage: StorageConfig, dataset: DatasetConfig, ledger: Ledger, spill: Path,
                 progress: Callable[[int, int], None] | None = None, partitions: Partitions | None = None) -> Scan:
    """Every source listed once and its units read `read_concurrency` at once (or, with
    `partitions`, a partition at a time on workers), except those the ledger's `known` table holds
    (recorded by an earlier ingest, its objects unchanged); `progress(units done, units listed)`
    after each unit."""
    scan, store = Scan(ledger, spill), Store(storage)
    limit, keep = max_image_bytes(dataset), partial(spill_image, spill)

    def stored(sample_id: str) -> tuple[int, int] | None:
        return ledger.one("SELECT width, height FROM stored WHERE sample_id = ? LIMIT 1", (sample_id,))

    recorded = ledger.one("SELECT 1 FROM known LIMIT 1") is not None
    failed = threading.Event()

    def known(unit: Unit) -> list[Outcome] | None:
        return known_outcomes(ledger, unit.key) if unit.key and recorded else None

    # every source listed before any is read: the total is known from the first unit on
    listings = [list_source(source, source_options(source.path, storage), ledger, index)
                for index, source in enumerate(dataset.sources)]
    total, done = sum(map(count_units, listings)), 0
    for index, (source, listing) in enumerate(zip(dataset.sources, listings)):
        def here(unit: Unit) -> list[Outcome]:
            return [examine(candidate, dataset, stored, keep)
                    for candidate in read_unit(listing.fs, listing.format, source, unit.plan, limit)]

        def on_workers(units: list[Unit]) -> list[list[Outcome]]:
            """Keyed units on a worker; one that names an object not listed (it reads nothing, or
            a missing file) here: a staged partition is reused only for the same listed objects."""
            keyed = [[unit.key, unit.plan] for unit in units if unit.key]
            staged = iter(merged(keyed) if keyed else ())
            return [next(staged) if unit.key else here(unit) for unit in units]

        def merged(keyed: list[list]) -> list[list[Outcome]]:
            for again in (False, True):
                key = partitions.run(index, listing.format, keyed)
                if failed.is_set():  # left staged for the next run to take
                    return []
                try:
                    return unstage(store, key, len(keyed), spill)
                except (ArtifactMissing, Damaged) as error:
                    if again:
                        raise
                    # another ingest of these sources merged it first, or a write of it was cut short
                    log.warning("staged partition %s: %s; examined again", key, error)
                    store.remove(key + COMMIT_SUFFIX)

        threads = partitions.slots if partitions else reading_threads(source.path, dataset)
        with ThreadPoolExecutor(threads, thread_name_prefix="ingest-read") as pool, ledger.transaction():
            if partitions:
                read = lambda units: pool.submit(on_workers, units)  # noqa: E731
                window, full, span = 2 * partitions.slots, partitions.full, partitions.size
            else:
                read = lambda units: pool.submit(lambda: [here(unit) for unit in units])  # noqa: E731
                window, full, span = 4 * threads, bool, 1
            units = in_order(read, source_units(listing, source), known, window, full, span)
            try:
                for unit, outcomes, was_read in units:
                    scan.add(unit, outcomes, was_read)
                    done += 1
                    if progress is not None:
                        progress(done, total)
            except BaseException:  # the stage fails: what waits to be read is not read
                failed.set()
                pool.shutdown(cancel_futures=True)
                raise
    scan.flush()
    return scan


STAGED_VERSION = 1  # with Pillow's version, part of a staged partition's key: what decodes and normalises
STAGED_PAGE = 64  # staged rows written and read at a time: each may hold an image
STAGED_COLUMNS = {"unit": pa.int32(), "source": pa.string(), "format": pa.string(), "sample_id": pa.string(),
                  "captions": pa.list_(pa.string()), "width": pa.int32(), "height": pa.int32(),
                  "reason": pa.string(), "message": pa.string(), "spilled": pa.bool_(), "image": pa.binary()}


def examine_partition(storage: StorageConfig, dataset: DatasetConfig, index: int, fmt: str, units: list[list]) -> str:
    """A partition of source `index`'s units (`[key, plan]`, listed by the ingest that sent them)
    read and examined here, on a worker: each unit's outcomes, and the normalised bytes of each
    image it accepted, are committed to the store, one row per outcome (a unit that gave no
    candidate: one row without a source), for that ingest to merge (`unstage`). Returns the staged
    key. The key names the partition's listed objects and the ingest's rules, so a partition staged
    already (a retry, or a run that died before merging it) is not read again.

    A worker has no index of the store's shards at hand: it normalises every image it reads, also
    one a shard holds already (the same bytes again: normalising is deterministic)."""
    store = Store(storage)
    key = layout.ingest_partition(hash_json([STAGED_VERSION, PIL.__version__, config_hash(dataset), index, fmt, units]))
    if store.committed(key) is not None:
        return key
    source = dataset.sources[index]
    fs, root = fsspec.core.url_to_fs(source.path, **source_options(source.path, storage))
    if not fs.exists(root):  # not a sample's problem: this worker does not see the source (a local path?)
        raise RuntimeError(f"dataset source {source.path!r} cannot be read on worker {socket.gethostname()}")
    limit, threads = max_image_bytes(dataset), reading_threads(source.path, dataset)
    schema = pa.schema(STAGED_COLUMNS)
    with tempfile.TemporaryDirectory(prefix="precast-partition-") as folder, \
            ThreadPoolExecutor(threads, thread_name_prefix="ingest-read") as pool:
        spill = Path(folder)

        def work(unit: Unit) -> list[Outcome]:  # new images wait on local disk, not in memory
            return [examine(candidate, dataset, lambda _: None, partial(spill_image, spill))
                    for candidate in read_unit(fs, fmt, source, unit.plan, limit)]

        def row(position: int, outcome: Outcome | None) -> dict[str, Any]:
            if outcome is None:  # a unit that gave no candidate
                return {"unit": position}
            image = (spill / outcome.sample_id).read_bytes() if outcome.spilled else None
            return {**vars(outcome), "unit": position, "image": image}

        local = spill / "partition.parquet"
        with pq.ParquetWriter(local, schema, compression="none") as writer:  # images are compressed already
            page: list[dict[str, Any]] = []
            read = lambda batch: pool.submit(lambda: [work(unit) for unit in batch])  # noqa: E731
            examined = in_order(read, (Unit(key, 0, plan) for key, plan in units), lambda _: None, 4 * threads)
            for position, (_, outcomes, _) in enumerate(examined):
                page += [row(position, outcome) for outcome in outcomes or [None]]
                if len(page) >= STAGED_PAGE:
                    writer.write_table(pa.Table.from_pylist(page, schema=schema))
                    page = []
            writer.write_table(pa.Table.from_pylist(page, schema=schema))
        store.commit_file(local, key, units=len(units))
    return key


def unstage(store: Store, key: str, count: int, spill: Path) -> list[list[Outcome]]:
    """The outcomes of a staged partition's `count` units, its images spilled as a read here
    spills them (checked against its commit record first); the staged partition is then deleted."""
    local = Path(store.local_path(key, cache_dir=spill))
    outcomes: list[list[Outcome]] = [[] for _ in range(count)]
    for batch in pq.ParquetFile(local).iter_batches(STAGED_PAGE):
        for row in batch.to_pylist():
            unit, image = row.pop("unit"), row.pop("image")
            if row["source"] is None:
                continue
            if image is not None:
                spill_image(spill, row["sample_id"], image)
            outcomes[unit].append(Outcome(**row))
    if not store.is_local:
        local.unlink()
    store.remove(key + COMMIT_SUFFIX)
    store.remove(key)
    return outcomes


def known_outcomes(ledger: Ledger, key: str) -> list[Outcome] | None:
    """The outcomes the last ingest recorded for a unit, None if it did not record the unit (they
    were spilled then, not now: a reused outcome's image is in a shard)."""
    rows = ledger.all("SELECT source, format, sample_id, captions, width, height, reason, message FROM known "
                      "WHERE key = ? ORDER BY position", (key,))
    if not rows:
        return None
    return [Outcome(source, fmt, sample_id, captions and json.loads(captions), width, height, reason, message)
            for source, fmt, sample_id, captions, width, height, reason, message in rows if source is not None]


def ingest_report(scan: Scan) -> dict[str, Any]:
    """Counts by reason, by format, by aspect-ratio bucket, and a caption length histogram."""
    ledger = scan.ledger
    accepted = dict(ledger.rows("SELECT format, count(*) FROM samples GROUP BY format"))
    rejected = dict(ledger.rows("SELECT format, count(*) FROM quarantined GROUP BY format"))
    words, buckets, variants = Counter(), Counter(), 0
    for width, height, captions in ledger.rows("SELECT width, height, captions FROM samples"):
        buckets[nearest_ratio(width, height, 1024)] += 1
        for caption in json.loads(captions):
            variants += 1
            count = len(caption.split())
            words[next((f"<={b}" for b in CAPTION_WORD_BINS if count <= b), f">{CAPTION_WORD_BINS[-1]}")] += 1
    samples, quarantined = scan.count("samples"), scan.count("quarantined")
    return {
        "samples": samples,
        "quarantined": quarantined,
        "candidates": sum(scan.formats.values()),
        "duplicates": sum(scan.formats.values()) - samples - quarantined,
        "caption_variants": variants,
        "by_reason": dict(ledger.rows("SELECT reason, count(*) FROM quarantined GROUP BY reason ORDER BY reason")),
        "by_format": {f: {"accepted": accepted.get(f, 0), "quarantined": rejected.get(f, 0)} for f in sorted(scan.formats)},
        "by_bucket": dict(sorted(buckets.items(), key=lambda kv: float(kv[0]))),
        "caption_words": {b: words[b] for b in [f"<={b}" for b in CAPTION_WORD_BINS] + [f">{CAPTION_WORD_BINS[-1]}"]},
    }


def ingest(storage: StorageConfig, dataset: DatasetConfig, progress: Callable[[int, int], None] | None = None,
           partitions: Partitions | None = None) -> dict[str, Any]:
    """Ingest every source; returns the dataset's record (`dataset_record`), what was new, and what
    was read (`work`); `progress(units done, units listed)` as the sources are read. With
    `partitions` the sources' units are read and examined on workers, a partition each."""
    store = Store(storage)
    with tempfile.TemporaryDirectory(prefix="precast-ingest-") as folder:
        spill = Path(folder)
        ledger = Ledger(spill)
        try:
            previous = read_sources_record(store, dataset, ledger)
            if previous is None:  # no earlier ingest of these sources: every shard of the store counts
                read_index(store, ledger)
            scan = scan_sources(storage, dataset, ledger, spill, progress, partitions)
            samples = scan.count("samples")
            if not samples:
                raise RuntimeError(f"no usable samples in {[s.path for s in dataset.sources]}: "
                                   f"{scan.count('quarantined')} quarantined")
            new, members = write_new_shards(store, dataset, scan)

            shards = []
            commits = store.require_all([layout.image_shard(shard_id) for shard_id in sorted(members)],
                                        dataset.read_concurrency)
            for shard_id, commit in zip(sorted(members), commits):
                # null means "the whole shard"; a list names the current samples of a partly superseded shard
                whole = members[shard_id] == commit["samples"]
                shards.append({"id": shard_id, "samples": None if whole else [
                    sample_id for (sample_id,) in ledger.rows(
                        "SELECT sample_id FROM samples WHERE shard = ? ORDER BY sample_id", (shard_id,))]})
            dataset_id = hash_json(shards)
            record = {"id": dataset_id, "shards": shards, "samples": samples,
                      "sources": [s.path for s in dataset.sources]}
            if store.committed(layout.dataset(dataset_id)) is None:  # an unchanged dataset writes nothing
                store.commit_json(layout.dataset(dataset_id), record, samples=samples)
            quarantine = [dict(zip(("source", "format", "reason", "message"), row)) for row in ledger.rows(
                "SELECT source, format, reason, message FROM quarantined ORDER BY position")]
            report = {"dataset": dataset_id, **ingest_report(scan), "quarantine": quarantine}
            write_if_changed(store, layout.dataset_report(dataset_id), report)
            write_if_changed(store, layout.dataset_ref(config_hash(dataset)), {"dataset": dataset_id})
            record_file = write_sources_record(scan)
            if file_sha256(record_file) != previous:
                store.put_file(record_file, layout.sources_record(config_hash(dataset)))
        finally:
            ledger.close()
    work = {"bytes_read": scan.bytes_read, "units_read": scan.units_read, "units_reused": scan.units_reused}
    return {**dataset_record(store, dataset_id, dataset.read_concurrency),
            "new_shards": -(-new // dataset.shard_size), "new_samples": new, "work": work}


RECORD_PAGE = 10_000  # record rows written and read at a time
RECORD_COLUMNS = {"kind": pa.string(), "key": pa.string(), "source": pa.string(), "format": pa.string(),
                  "sample_id": pa.string(), "captions": pa.list_(pa.string()), "width": pa.int32(),
                  "height": pa.int32(), "reason": pa.string(), "message": pa.string(), "shard": pa.string()}


def write_sources_record(scan: Scan) -> Path:
    """The units this ingest read or reused with their outcomes ("unit" rows; a unit that gave no
    candidate is one row without a source), and where each sample's bytes are ("member" rows), as
    a parquet file in the spill folder, written a page at a time."""
    ledger, path = scan.ledger, scan.spill / "sources-record.parquet"

    def rows() -> Iterator[dict[str, Any]]:
        for key, outcomes in ledger.rows("SELECT key, outcomes FROM units ORDER BY position"):
            yield from ({"kind": "unit", "key": key, **o} for o in json.loads(outcomes)) or [{"kind": "unit", "key": key}]
        for sample_id, captions, width, height, shard in ledger.rows(
                "SELECT sample_id, captions, width, height, shard FROM samples ORDER BY position"):
            yield {"kind": "member", "sample_id": sample_id, "captions": json.loads(captions), "width": width,
                   "height": height, "shard": shard}

    schema = pa.schema(RECORD_COLUMNS)
    with pq.ParquetWriter(path, schema, compression="zstd") as writer:
        records = rows()
        while page := list(itertools.islice(records, RECORD_PAGE)):
            writer.write_table(pa.Table.from_pylist([{name: row.get(name) for name in RECORD_COLUMNS}
                                                     for row in page], schema=schema))
    return path


def read_sources_record(store: Store, dataset: DatasetConfig, ledger: Ledger) -> str | None:
    """The last ingest's record of these sources and rules into the ledger: what each unit became
    (`known`) and where each of its samples is (`stored`, as `read_index` gives for every shard).
    Returns the record's sha256, None when there is none. Units whose samples were in shards
    deleted since are dropped from both: they are read again."""
    key = layout.sources_record(config_hash(dataset))
    if not store.exists(key):
        return None
    local = ledger.folder / "last-sources-record.parquet"
    store.get_file(key, local)
    position = 0
    for batch in pq.ParquetFile(local).iter_batches(RECORD_PAGE):
        units, members = [], []
        for row in batch.to_pylist():
            captions = row["captions"] if row["captions"] is None else json.dumps(row["captions"])
            if row["kind"] == "member":
                members.append((row["sample_id"], captions, row["width"], row["height"], row["shard"]))
            else:
                position += 1
                units.append((row["key"], position, row["source"], row["format"], row["sample_id"], captions,
                              row["width"], row["height"], row["reason"], row["message"], False))
        ledger.run_many("INSERT INTO known VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", units)
        ledger.run_many("INSERT OR REPLACE INTO stored VALUES (?, ?, ?, ?, ?)", members)
    shards = [shard for (shard,) in ledger.rows("SELECT DISTINCT shard FROM stored ORDER BY shard")]
    commits = store.committed_all([layout.image_shard(shard) for shard in shards], dataset.read_concurrency)
    if gone := [shard for shard, commit in zip(shards, commits) if commit is None]:
        # someone deleted shards the record points at: what they held is read from the sources again
        log.warning("%d image shard(s) of the last ingest are gone (%s): their samples are read again",
                    len(gone), ", ".join(gone[:3]) + (", …" if len(gone) > 3 else ""))
        with ledger.transaction():
            for shard in gone:
                ledger.run("DELETE FROM known WHERE key IN (SELECT known.key FROM known JOIN stored "
                           "ON known.sample_id = stored.sample_id WHERE stored.shard = ?)", (shard,))
                ledger.run("DELETE FROM stored WHERE shard = ?", (shard,))
    return file_sha256(local)


def dataset_record(store: Store, dataset_id: str, concurrency: int = 32) -> dict[str, Any]:
    """What ingest returns for a committed dataset version, also when it ran elsewhere: the record
    (id, shards, samples, sources) with its URL, report, quarantined count, and the fields every
    stage's record has: `url`, `amount` and `committed_at` (its newest output's commit time)."""
    key = layout.dataset(dataset_id)
    record = {**json.loads(store.read_verified(key)), "url": store.url(key)}
    commits = [store.require(key)] + store.require_all([layout.image_shard(s["id"]) for s in record["shards"]],
                                                       concurrency)
    report = store.read_json(layout.dataset_report(dataset_id))
    return {**record, "report": store.url(layout.dataset_report(dataset_id)), "quarantined": report["quarantined"],
            "amount": f"{record['samples']} samples in {len(record['shards'])} shards",
            "committed_at": max(c["committed_at"] for c in commits)}


def write_new_shards(store: Store, dataset: DatasetConfig, scan: Scan) -> tuple[int, dict[str, int]]:
    """Commit shards of the samples no shard holds with these captions, in sample id order; returns
    how many there were, and how many current samples each shard the dataset uses holds (every
    sample's shard is set in the ledger)."""
    ledger = scan.ledger
    with ledger.transaction():
        ledger.run("UPDATE samples SET shard = (SELECT shard FROM stored WHERE stored.sample_id = samples.sample_id "
                   "AND stored.captions = samples.captions)")
    new = ledger.one("SELECT count(*) FROM samples WHERE shard IS NULL")[0]
    spill_known_images(store, scan)
    last = ""
    while True:
        chunk = list(ledger.rows("SELECT sample_id, captions, width, height, source FROM samples "
                                 "WHERE shard IS NULL AND sample_id > ? ORDER BY sample_id LIMIT ?",
                                 (last, dataset.shard_size)))
        if not chunk:
            break
        last = chunk[-1][0]
        shard_id = hash_json([(sample_id, json.loads(captions)) for sample_id, captions, *_ in chunk])
        rows = [{"sample_id": sample_id, "image": (scan.spill / sample_id).read_bytes(), "width": width,
                 "height": height, "captions": json.loads(captions), "source": source}
                for sample_id, captions, width, height, source in chunk]
        store.commit(layout.image_shard(shard_id), pack_image_shard(rows), samples=len(chunk))
        ledger.run_many("UPDATE samples SET shard = ? WHERE sample_id = ?", ((shard_id, row[0]) for row in chunk))
    return new, dict(ledger.rows("SELECT shard, count(*) FROM samples GROUP BY shard"))


def spill_known_images(store: Store, scan: Scan) -> None:
    """Bytes of already-ingested images whose captions changed, from a shard that holds them."""
    wanted = scan.ledger.rows("SELECT (SELECT shard FROM stored WHERE stored.sample_id = samples.sample_id LIMIT 1) "
                              "AS holder, sample_id FROM samples WHERE shard IS NULL AND NOT spilled ORDER BY holder")
    for shard_id, group in itertools.groupby(wanted, key=lambda row: row[0]):
        ids = {sample_id for _, sample_id in group}
        table = read_image_shard(store.read_bytes(layout.image_shard(shard_id)), columns=["sample_id", "image"])
        for sample_id, image in zip(table.column("sample_id").to_pylist(), table.column("image").to_pylist()):
            if sample_id in ids:
                (scan.spill / sample_id).write_bytes(image)


def write_if_changed(store: Store, key: str, obj: Any) -> None:
    if not store.exists(key) or store.read_json(key) != obj:
        store.write_json(key, obj)


def config_hash(dataset: DatasetConfig) -> str:
    """What names these sources and ingest rules (how many are read at once, and where, is no part of it)."""
    return hash_json(dataset.model_dump(exclude={"read_concurrency", "partition_size"}))


def latest_dataset(storage: StorageConfig, dataset: DatasetConfig) -> dict[str, Any]:
    """The dataset record last ingested for this config (what `precast stage` starts from)."""
    store = Store(storage)
    ref = layout.dataset_ref(config_hash(dataset))
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
