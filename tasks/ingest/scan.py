"""Scanning the sources: every unit read and examined (or taken from the last ingest's record), its
outcomes merged into the ledger in listing order.

Every source is listed once (tasks/ingest/listing.py) before any is read, so the progress total is
known from the first unit on. A source's units are read `read_concurrency` at once in this process,
or a partition at a time on workers (tasks/ingest/staging.py); either way `in_order`
(tasks/ingest/scheduler.py) gives the outcomes back in listing order, so duplicates, quarantine and
shards are what one sequential pass would give.
"""

from __future__ import annotations

import json
import logging
import threading
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from configs.schema import DatasetConfig, SourceConfig, StorageConfig
from storage.store import Store
from tasks.ingest.examine import Outcome, examine_unit, reading_threads, spill_image, video_decodes
from tasks.ingest.formats import Unit, count_units, source_units
from tasks.ingest.ledger import PAGE, Ledger
from tasks.ingest.listing import Listing, list_source, source_options
from tasks.ingest.record import known_outcomes
from tasks.ingest.scheduler import in_order
from tasks.ingest.staging import Partitions, merged_partition
from tasks.ingest.untrusted import with_prefix

log = logging.getLogger(__name__)


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
    starts: list[int] = field(default_factory=list)  # the position before each source's first outcome
    # what each source gives its samples beyond their files (its caption prefix, how training draws
    # from it): a duplicate from a source that differs keeps its first source's captions alone
    signatures: list[Any] = field(default_factory=list)
    kept_apart: int = 0  # such duplicates
    # added since the last flush: keyed units' outcomes, quarantined and accepted candidates
    keyed: list[tuple] = field(default_factory=list)
    refused: list[tuple] = field(default_factory=list)
    accepted: list[tuple] = field(default_factory=list)

    def add(self, unit: Unit, outcomes: list[Outcome], read: bool, source: SourceConfig) -> None:
        """A unit's outcomes, in order (written to the ledger a page at a time), as read: its samples
        take their source's `caption_prefix` and `resolution` only here, so the record of what each
        unit gave holds neither, and another prefix or resolution reads no unit again."""
        if unit.key:
            self.keyed.append((unit.key, json.dumps([vars(o) for o in outcomes])))
        if unit.key or unit.size:  # not a metadata row that was refused before any read
            self.units_read += read
            self.units_reused += not read
        self.bytes_read += unit.size if read else 0
        for outcome in outcomes:
            self.position += 1
            if outcome.role != "reference":  # a reference is no candidate of its own: its target's
                self.formats[outcome.format] += 1
            if outcome.reason is not None:
                log.warning("quarantined %s: %s (%s)", outcome.source, outcome.reason, outcome.message)
                self.refused.append((self.position, outcome.source, outcome.format, outcome.reason, outcome.message))
            else:
                captions = json.dumps(with_prefix(outcome.captions, source.caption_prefix))
                self.accepted.append((outcome.sample_id, self.position, captions, outcome.width, outcome.height,
                                      outcome.source, outcome.format, outcome.spilled, source.resolution or 0,
                                      outcome.role, outcome.references and json.dumps(outcome.references)))
        if len(self.keyed) + len(self.accepted) + len(self.refused) >= PAGE:
            self.flush()

    def flush(self) -> None:
        """What was added since the last flush, into the ledger: a sample seen before (an exact
        duplicate) keeps its first source and gains the later one's captions; a reference named again
        is the same reference (it has no captions)."""
        ledger = self.ledger
        with ledger.transaction():
            ledger.run_many("INSERT INTO units (key, outcomes) VALUES (?, ?)", self.keyed)
            ledger.run_many("INSERT INTO quarantined VALUES (?, ?, ?, ?, ?)", self.refused)
            ledger.run_many("INSERT INTO accepted VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", self.accepted)
            ledger.run("INSERT OR IGNORE INTO samples SELECT *, NULL FROM accepted ORDER BY position")
            for sample_id, captions, spilled, first, later in ledger.all(
                    "SELECT sample_id, accepted.captions, accepted.spilled, samples.position, accepted.position "
                    "FROM accepted JOIN samples USING (sample_id) "
                    "WHERE samples.position != accepted.position AND accepted.role IS NULL ORDER BY accepted.position"):
                known = ledger.one("SELECT captions FROM samples WHERE sample_id = ?", (sample_id,))[0]
                apart = self.signature(first) != self.signature(later)
                self.kept_apart += apart
                merged = json.loads(known) if apart else sorted(set(json.loads(known)) | set(json.loads(captions)))
                ledger.run("UPDATE samples SET captions = ?, spilled = spilled OR ? WHERE sample_id = ?",
                           (json.dumps(merged), spilled, sample_id))
            ledger.run("DELETE FROM accepted")
        for added in (self.keyed, self.refused, self.accepted):
            added.clear()

    def count(self, table: str) -> int:
        return self.ledger.one(f"SELECT count(*) FROM {table}")[0]

    def samples(self) -> int:
        """The samples found (a paired sample's references are none)."""
        return self.ledger.one("SELECT count(*) FROM samples WHERE role IS NULL")[0]

    def source_at(self, position: int) -> int:
        """The index of the source whose outcome is at `position`."""
        return bisect_left(self.starts, position) - 1

    def signature(self, position: int) -> Any:
        return self.signatures[self.source_at(position)] if self.signatures else None

    def members(self) -> Iterator[tuple[str, int]]:
        """(sample id, index of the source it came from, the first that gave it), by sample id."""
        for sample_id, position in self.ledger.rows("SELECT sample_id, position FROM samples WHERE role IS NULL "
                                                    "ORDER BY sample_id"):
            yield sample_id, self.source_at(position)


def scan_sources(storage: StorageConfig, dataset: DatasetConfig, ledger: Ledger, spill: Path,
                 progress: Callable[[int, int], None] | None = None, partitions: Partitions | None = None) -> Scan:
    """Every source listed once and its units read `read_concurrency` at once (or, with
    `partitions`, a partition at a time on workers), except those the ledger's `known` table holds
    (recorded by an earlier ingest, its objects unchanged); `progress(units done, units listed)`
    after each unit."""
    scanner = Scanner(storage, dataset, ledger, spill, progress, partitions)
    scanner.scan.signatures = [(source.caption_prefix, source.resolution, source.mixing()) for source in dataset.sources]
    for index in range(len(dataset.sources)):
        scanner.scan.starts.append(scanner.scan.position)
        scanner.read_source(index)
    scanner.scan.flush()
    return scanner.scan


class Scanner:
    """One scan of the sources: their listings, and where each unit's outcomes come from — the last
    ingest's record, a read here (`read_here`), or a partition examined on a worker
    (`read_on_workers`)."""

    def __init__(self, storage: StorageConfig, dataset: DatasetConfig, ledger: Ledger, spill: Path,
                 progress: Callable[[int, int], None] | None, partitions: Partitions | None):
        self.dataset, self.ledger, self.spill, self.store = dataset, ledger, spill, Store(storage)
        self.progress, self.partitions = progress, partitions
        self.scan = Scan(ledger, spill)
        self.recorded = ledger.one("SELECT 1 FROM known LIMIT 1") is not None
        self.failed = threading.Event()  # set when the stage fails: what waits to be read is not read
        self.decoding = video_decodes()
        # every source listed before any is read: the total is known from the first unit on
        self.listings: list[Listing] = [list_source(source, source_options(source.path, storage), ledger, index)
                                        for index, source in enumerate(dataset.sources)]
        self.total, self.done = sum(map(count_units, self.listings)), 0

    def read_source(self, index: int) -> None:
        """Source `index`'s units, each read (a batch at a time on a pool) or taken from the
        record, their outcomes added to the scan in listing order."""
        source, listing = self.dataset.sources[index], self.listings[index]
        if self.partitions:  # a batch is a partition, examined on a worker
            threads = self.partitions.slots
            read = partial(self.read_on_workers, index)
            window, full, span = 2 * threads, self.partitions.full, self.partitions.size
        else:  # a batch is one unit, read and examined here
            threads = reading_threads(source.path, self.dataset)
            read = partial(self.read_here, index)
            window, full, span = 4 * threads, bool, 1
        with ThreadPoolExecutor(threads, thread_name_prefix="ingest-read") as pool, self.ledger.transaction():
            units = in_order(partial(pool.submit, read), source_units(listing, source), self.known, window, full, span)
            try:
                for unit, outcomes, was_read in units:
                    self.scan.add(unit, outcomes, was_read, source)
                    self.done += 1
                    if self.progress is not None:
                        self.progress(self.done, self.total)
            except BaseException:  # the stage fails: what waits to be read is not read
                self.failed.set()
                pool.shutdown(cancel_futures=True)
                raise

    def known(self, unit: Unit) -> list[Outcome] | None:
        """A unit's outcomes as the last ingest recorded them, None when it must be read."""
        return known_outcomes(self.ledger, unit.key) if unit.key and self.recorded else None

    def stored(self, sample_id: str) -> tuple[int, int] | None:
        """The size of an image a shard holds already (it is not decoded again), else None."""
        return self.ledger.one("SELECT width, height FROM stored WHERE sample_id = ? LIMIT 1", (sample_id,))

    def examine_here(self, index: int, unit: Unit) -> list[Outcome]:
        """One unit of source `index` read and examined in this process."""
        listing = self.listings[index]
        return examine_unit(listing.fs, listing.format, self.dataset.sources[index], unit.plan, self.dataset,
                            self.stored, partial(spill_image, self.spill), self.decoding)

    def read_here(self, index: int, units: list[Unit]) -> list[list[Outcome]]:
        """The outcomes of a batch of source `index`'s units, read and examined in this process."""
        return [self.examine_here(index, unit) for unit in units]

    def read_on_workers(self, index: int, units: list[Unit]) -> list[list[Outcome]]:
        """Keyed units on a worker; one that names an object not listed (it reads nothing, or
        a missing file) here: a staged partition is reused only for the same listed objects."""
        keyed = [[unit.key, unit.plan] for unit in units if unit.key]
        staged = iter(merged_partition(self.partitions, self.store, index, self.listings[index].format, keyed,
                                       self.spill, self.failed) if keyed else ())
        return [next(staged) if unit.key else self.examine_here(index, unit) for unit in units]
