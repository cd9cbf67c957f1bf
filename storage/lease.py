"""A lease: at most one live holder of a piece of work (a training run) at a time, on any store.

Two pipelines started at once, or a retried flow whose first attempt still runs on a lost node,
must not train the same run side by side: their checkpoints would interleave. The holder's record
is `<prefix>/<generation>.json`, created only if absent (an atomic create: hard link locally,
conditional PUT on S3), so of two contenders exactly one wins. The holder renews its heartbeat
every HEARTBEAT_SECONDS, counting its beats; a lease is free again once released, once a contender
has seen its beats stand still for STALE_AFTER_SECONDS (a dead node), or at once when its holder
was a process of this host that no longer exists (a killed worker). Staleness is judged on the
contender's own monotonic clock, never by comparing the holder's timestamp with it: a node whose
clock is minutes off would otherwise lose a live lease (behind) or keep a dead one (ahead).
Taking over creates the next generation, which only one can do.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from storage.store import Store, json_bytes

HEARTBEAT_SECONDS = 10.0
STALE_AFTER_SECONDS = 60.0
log = logging.getLogger(__name__)


class LeaseLost(RuntimeError):
    """Another holder took the lease over: this one must stop writing."""


class Lease:
    def __init__(self, store: Store, prefix: str):
        self.store, self.prefix = store, prefix
        self.me = {"token": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid()}
        self.generation, self.beats = 0, 0
        self._watched: tuple[tuple[Any, ...], float] | None = None  # the holder's beat last seen to change, and when
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._lost: dict[str, Any] | None = None

    def acquire(self) -> bool:
        """Take the lease if it is free; False while another live holder has it."""
        generation, holder = self._current()
        if holder is not None and not self._free(generation, holder):
            return False
        generation += 1
        created = self.store.create(self._key(generation), json_bytes(self._record()))
        # a lost response to our own create looks like someone else's: read back whose it is
        if not created and self.store.read_json(self._key(generation))["token"] != self.me["token"]:
            return False
        self.generation = generation
        for older in range(1, generation):
            self.store.remove(self._key(older))
        self._heartbeat = threading.Thread(target=self._renew, name=f"lease {self.prefix}", daemon=True)
        self._heartbeat.start()
        return True

    def holder(self) -> dict[str, Any] | None:
        """The current holder's record (None when there is none)."""
        return self._current()[1]

    @property
    def lost(self) -> bool:
        return self._lost is not None

    def check(self) -> None:
        """Raise LeaseLost if another holder took over (call before writing shared state)."""
        if self._lost is not None:
            raise LeaseLost(f"{self.store.url(self.prefix)}: taken over by {self._lost['host']} "
                            f"(pid {self._lost['pid']}) after this holder's heartbeat went stale")

    def release(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        if self.generation and self._lost is None:
            self.store.write_bytes(self._key(self.generation), json_bytes({**self._record(), "released": True}))

    # ---------------------------------------------------------------------------------------
    def _key(self, generation: int) -> str:
        return f"{self.prefix}/{generation:08d}.json"

    def _record(self) -> dict[str, Any]:
        self.beats += 1  # what others watch; the time is for people reading the record
        return {**self.me, "beats": self.beats, "heartbeat": time.time()}

    def _current(self) -> tuple[int, dict[str, Any] | None]:
        while True:
            keys = self.store.list(self.prefix, ".json")
            if not keys:
                return 0, None
            try:
                return int(keys[-1].rsplit("/", 1)[1].removesuffix(".json")), self.store.read_json(keys[-1])
            except FileNotFoundError:  # removed by a newer holder since the listing: look again
                continue

    def _free(self, generation: int, holder: dict[str, Any]) -> bool:
        if holder.get("released"):
            return True
        if holder["host"] == self.me["host"] and holder["pid"] != self.me["pid"] and not _alive(holder["pid"]):
            return True
        beat, now = (generation, holder["token"], holder.get("beats"), holder.get("heartbeat")), time.monotonic()
        if self._watched is None or self._watched[0] != beat:
            self._watched = (beat, now)  # alive, or first seen: watched from now on
            return False
        return now - self._watched[1] > STALE_AFTER_SECONDS

    def _renew(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS) and self._beat():
            pass

    def _beat(self) -> bool:
        """Renew the heartbeat; False once another holder took over."""
        try:
            generation, holder = self._current()
            if generation != self.generation:
                self._lost = holder or {"host": "?", "pid": "?"}
                log.error("lease %s lost to %s", self.store.url(self.prefix), self._lost)
                return False
            self.store.write_bytes(self._key(self.generation), json_bytes(self._record()))
        except OSError as error:  # the next beat may get through; a long outage makes it stale
            log.warning("lease %s: heartbeat failed: %s", self.store.url(self.prefix), error)
        return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
