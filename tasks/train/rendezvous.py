"""How the nodes of one training attempt find and watch each other (`Rendezvous`).

Nodes meet through the store, the one place every node already reaches: node 0 publishes the
address of rank 0's c10d TCP store under the attempt's folder, the other nodes read it and join;
each node's supervising process beats a heartbeat there and reads the others', so a node that died
or hangs fails the whole run within `training.distribution.node_timeout`, by name. An attempt's folder is named
by its id, so the state of a crashed attempt is never read by a new one.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlparse

from storage.store import Store


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def node_address() -> str:
    """The address the other nodes reach this one at: PRECAST_NODE_ADDRESS when set, else that of
    the interface that routes to the Prefect API (the network every node of a pool shares), else the
    hostname's."""
    if address := os.environ.get("PRECAST_NODE_ADDRESS"):
        return address
    api = urlparse(os.environ.get("PREFECT_API_URL", ""))
    if api.hostname:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((socket.gethostbyname(api.hostname), api.port or 80))  # sends nothing
                return probe.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:  # a host whose own name does not resolve: a single machine
        return "127.0.0.1"


class NodeFailed(RuntimeError):
    """Another node of the run failed, died or stopped answering."""


@dataclass
class Rendezvous:
    """The nodes of one training attempt, met through the store folder `folder`
    (`runs/<run>/rendezvous/<attempt>`): node 0 publishes rank 0's address, every node beats a
    heartbeat and watches the others'. Heartbeats are compared by whether they advance on this
    node's clock, never across clocks."""

    store: Store
    folder: str
    node: int
    nodes: int
    timeout: float
    beats: int = 0
    seen: dict[int, tuple[int, float]] = field(default_factory=dict)  # node → (its beats, when they last changed here)
    started: float = field(default_factory=time.monotonic)

    @property
    def interval(self) -> float:
        """Seconds between heartbeats (and between looks at the others')."""
        return min(5.0, self.timeout / 4)

    def publish(self) -> str:
        """Node 0: the address rank 0 listens at, published for the other nodes."""
        address = f"{node_address()}:{free_port()}"
        self.store.write_json(f"{self.folder}/address.json", {"address": address})
        return address

    def address(self, finished: Callable[[], bool]) -> str | None:
        """The other nodes: rank 0's address once node 0 published it (None: the run finished
        meanwhile, nothing to join); fails after `timeout` seconds without it."""
        key = f"{self.folder}/address.json"
        deadline = time.monotonic() + self.timeout
        while not self.store.exists(key):
            if finished():
                return None
            if time.monotonic() > deadline:
                raise NodeFailed(f"node 0 published no address at {self.store.url(key)} within {self.timeout:g} s "
                                 f"(training.distribution.node_timeout): it did not start, or waits for another "
                                 "trainer of this run")
            time.sleep(self.interval)
        return self.store.read_json(key)["address"]

    def beat(self, error: str | None = None) -> None:
        """This node's heartbeat (or, with `error`, its failure) for the others to read."""
        self.beats += 1
        self.store.write_json(f"{self.folder}/node-{self.node}.json", {
            "node": self.node, "host": socket.gethostname(), "pid": os.getpid(), "beats": self.beats, "error": error})

    def _look(self, silence: float) -> dict[int, str]:
        """What is wrong with the other nodes now: node → reason (failed, silent for more than
        `silence` seconds, not joined that long after this node started)."""
        now, wrong = time.monotonic(), {}
        for node in range(self.nodes):
            if node == self.node:
                continue
            try:
                record = self.store.read_json(f"{self.folder}/node-{node}.json")
            except FileNotFoundError:  # not joined yet
                record = None
            if record is None and node not in self.seen:
                if now - self.started > silence:
                    wrong[node] = f"node {node} never joined ({now - self.started:.0f} s after this node)"
                continue
            if record is not None and record["error"]:
                wrong[node] = f"node {node} ({record['host']}) failed: {record['error']}"
                continue
            beats = record["beats"] if record else self.seen[node][0]
            if node not in self.seen or self.seen[node][0] != beats:
                self.seen[node] = (beats, now)
            elif now - self.seen[node][1] > silence:
                where = f" ({record['host']}, pid {record['pid']})" if record else ""
                wrong[node] = f"node {node}{where} stopped answering: no heartbeat for {now - self.seen[node][1]:.0f} s"
        return wrong

    def check(self) -> None:
        """Raise NodeFailed naming every node that failed or has been silent past the timeout."""
        if wrong := self._look(self.timeout):
            raise NodeFailed("; ".join(wrong[node] for node in sorted(wrong)))

    def culprits(self) -> str:
        """After this node's processes failed (a collective broke): which other nodes failed or
        died, told by heartbeats that stop advancing within three intervals; '' when all answer. It
        keeps beating while it looks: the other nodes are looking too, and must not take its
        silence for the failure."""
        deadline = time.monotonic() + 3 * self.interval
        while not (wrong := self._look(2.5 * self.interval)) and time.monotonic() < deadline:
            self.beat()
            time.sleep(self.interval / 2)
        return "; ".join(wrong[node] for node in sorted(wrong))
