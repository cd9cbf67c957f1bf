"""Ingest's working tables, in a SQLite file on local disk beside the spilled images.

An ingest of ten million objects must not hold ten million of anything in memory: the sources'
listings, the last ingest's record, the samples found so far and what each unit became all live
here, and are read back in pages. Memory then stays flat however many objects are listed (SQLite's
page cache is capped; sorting the listing happens in SQLite, on disk).

The file is scratch: it is made for one ingest and deleted with it, so nothing is synced to disk.
One connection serves every thread under a lock (reading threads ask only which images are
already stored; the main thread does all writing).
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from storage.store import disk_full

SCHEMA = """
-- every listed object of every source, in code point order of its path (a BLOB: a local name's
-- undecodable bytes are kept as surrogates, which UTF-8 text cannot hold)
-- and the path split at its last dot (stem, extension), to find a caption file beside its image
CREATE TABLE objects (source INTEGER, path BLOB, size INTEGER, stamp TEXT, stem BLOB, ext TEXT,
                      PRIMARY KEY (source, path)) WITHOUT ROWID;
CREATE INDEX objects_stem ON objects (source, stem, ext);
-- the last ingest's record: what each unit became, in order ...
CREATE TABLE known (key TEXT, position INTEGER, source TEXT, format TEXT, sample_id TEXT, captions TEXT,
                    width INTEGER, height INTEGER, reason TEXT, message TEXT, spilled INTEGER, video INTEGER,
                    role TEXT, refs TEXT);
CREATE INDEX known_key ON known (key, position);
CREATE INDEX known_sample ON known (sample_id);
-- ... and the samples shards hold: (sample id, captions) -> shard, with the image's size
-- (resolution: the source's own, 0 for latent_encoding's)
CREATE TABLE stored (sample_id TEXT, captions TEXT, width INTEGER, height INTEGER, shard TEXT, resolution INTEGER,
                     PRIMARY KEY (sample_id, captions, resolution)) WITHOUT ROWID;
CREATE INDEX stored_shard ON stored (shard);
-- what this ingest found: each unit's outcomes (for the next record), the samples (and the
-- references of paired ones: role 'reference'; refs, a target's references' ids as JSON), the quarantine
CREATE TABLE units (position INTEGER PRIMARY KEY, key TEXT, outcomes TEXT);
CREATE TABLE samples (sample_id TEXT PRIMARY KEY, position INTEGER, captions TEXT, width INTEGER, height INTEGER,
                      source TEXT, format TEXT, spilled INTEGER, resolution INTEGER, role TEXT, refs TEXT,
                      shard TEXT);
CREATE INDEX samples_position ON samples (position);
CREATE TABLE accepted (sample_id TEXT, position INTEGER, captions TEXT, width INTEGER, height INTEGER, source TEXT,
                       format TEXT, spilled INTEGER, resolution INTEGER, role TEXT,
                       refs TEXT);  -- candidates on their way into `samples`
CREATE TABLE quarantined (position INTEGER PRIMARY KEY, source TEXT, format TEXT, reason TEXT, message TEXT);
"""
PAGE = 1000  # rows read back at a time
CACHE_KIB = 32 << 10  # SQLite's page cache: what the tables may hold in memory


def encode_path(path: str) -> bytes:
    """A path as stored: UTF-8 with lone surrogates kept (bytes order = code point order)."""
    return path.encode("utf-8", "surrogatepass")


def decode_path(data: bytes) -> str:
    return data.decode("utf-8", "surrogatepass")


class Ledger:
    def __init__(self, folder: Path):
        self.folder = folder
        self.db = sqlite3.connect(folder / "ledger.sqlite", check_same_thread=False, isolation_level=None)
        self.lock = threading.Lock()
        with self.locked():
            for pragma in ("journal_mode=OFF", "synchronous=OFF", f"cache_size=-{CACHE_KIB}", "temp_store=FILE"):
                self.db.execute(f"PRAGMA {pragma}")
            self.db.executescript(SCHEMA)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The connection, one thread at a time; SQLite's "database or disk is full" raised as the
        disk full it is, naming the ledger's folder."""
        with self.lock:
            try:
                yield
            except sqlite3.OperationalError as error:
                if "full" not in str(error):
                    raise
                raise disk_full(self.folder / "ledger.sqlite", "about 1 GB a million listed objects (TMPDIR "
                                "sets where ingest keeps its working tables)") from error

    def run(self, sql: str, params: tuple = ()) -> int:
        """Runs a statement; returns how many rows it changed."""
        with self.locked():
            return self.db.execute(sql, params).rowcount

    def run_many(self, sql: str, rows: Iterable[Iterable[Any]]) -> None:
        """`sql` for every row, in one transaction a page at a time (rows may be a generator)."""
        page: list[tuple] = []
        for row in rows:
            page.append(tuple(row))
            if len(page) == PAGE:
                self._insert(sql, page)
                page = []
        self._insert(sql, page)

    def _insert(self, sql: str, page: list[tuple]) -> None:
        with self.transaction():
            with self.locked():
                self.db.executemany(sql, page)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Statements run inside it are one transaction (many small ones cost a commit each); a
        transaction inside another is part of it."""
        with self.locked():
            outer = self.db.in_transaction
            if not outer:
                self.db.execute("BEGIN")
        try:
            yield
        except BaseException:  # the stage is failing: what it half wrote is its own, and goes
            if not outer:
                with self.lock:
                    if self.db.in_transaction:  # SQLite ends it itself on some errors (a full disk)
                        self.db.execute("ROLLBACK")
            raise
        if not outer:
            with self.locked():
                self.db.execute("COMMIT")

    def one(self, sql: str, params: tuple = ()) -> tuple | None:
        with self.locked():
            return self.db.execute(sql, params).fetchone()

    def all(self, sql: str, params: tuple = ()) -> list[tuple]:
        """The rows of a query known to be short."""
        with self.locked():
            return self.db.execute(sql, params).fetchall()

    def rows(self, sql: str, params: tuple = ()) -> Iterator[tuple]:
        """The rows of a query, fetched a page at a time; the caller may write between pages."""
        with self.locked():
            cursor = self.db.execute(sql, params)
        while True:
            with self.locked():
                page = cursor.fetchmany(PAGE)
            if not page:
                return
            yield from page

    def close(self) -> None:
        with self.locked():
            self.db.close()
