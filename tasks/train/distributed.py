"""Data-parallel training processes on one node or several: starting them and watching them until
the run is committed (`Launcher`), process-group setup and teardown, the device of each process,
gradient averaging (DDP) and the collective the trainer needs. The only trainer module that calls
torch.distributed or torch.multiprocessing; the nodes of one attempt meet through the store
(`tasks.train.rendezvous`).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from configs.schema import TrainingConfig
from storage import layout
from storage.lease import Lease, LeaseLost
from storage.store import Store
from tasks.loading import resolve_device
from tasks.train.rendezvous import NodeFailed, Rendezvous, free_port

JOIN_POLL_SECONDS = 1.0


@dataclass(frozen=True)
class Distributed:
    """One training process's place in the group: its rank among `world`, its device."""

    rank: int
    world: int
    device: torch.device

    @classmethod
    def from_config(cls, training: TrainingConfig, node: int, local: int, address: str) -> Distributed:
        """Process `local` of node `node` (rank node × processes + local). Reads `processes`,
        `world`, `device` and `node_timeout`."""
        spread = training.distribution
        return cls.start(node * spread.processes + local, training.world, local, address, training.device,
                         spread.node_timeout)

    @classmethod
    def start(cls, rank: int, world: int, local: int, address: str, device: str, timeout: float) -> Distributed:
        """Join the process group at `address` (host:port of rank 0) when world > 1: NCCL on GPUs,
        one per process (`local`: the index of this process on its node); gloo on CPUs. A collective
        that does not complete within `timeout` seconds fails instead of hanging."""
        target = resolve_device(device)
        if target.type == "cuda" and world > 1:
            target = torch.device("cuda", local)
            torch.cuda.set_device(target)
        if world > 1:
            host, port = address.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), world, rank == 0, timeout=datetime.timedelta(seconds=timeout),
                                  master_listen_fd=bound_listener(host, int(port)) if rank == 0 else None)
            if interface := interface_of(host):  # the collectives' own sockets too, unless the user chose
                for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                    os.environ.setdefault(variable, interface)
            dist.init_process_group("nccl" if target.type == "cuda" else "gloo", store=store, rank=rank,
                                    world_size=world, timeout=datetime.timedelta(seconds=timeout))
        return cls(rank, world, target)

    @property
    def leader(self) -> bool:
        """Rank 0: the process that logs, samples, checkpoints and publishes."""
        return self.rank == 0

    def wrap(self, network: torch.nn.Module) -> torch.nn.Module:
        """The module to run forward/backward through: DDP averages gradients in backward."""
        if self.world == 1:
            return network
        return DistributedDataParallel(network, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over every process, in place (all of them call this)."""
        if self.world > 1:
            dist.all_reduce(values)
        return values

    def total(self, count: int) -> int:
        """`count` summed over every process (all of them call this; one read of the device)."""
        return count if self.world == 1 else int(self.sum(torch.tensor([count], device=self.device)).item())

    def close(self) -> None:
        if self.world > 1:
            dist.barrier()
            dist.destroy_process_group()



@dataclass
class Launcher:
    """This node's `training.distribution.processes` data-parallel processes of the run `run` (gloo on CPUs,
    NCCL on GPUs), watched until the run is committed; with one process in all, this process.
    Rank 0 (node 0) writes the run and its progress, which the supervising process relays; across
    nodes each node beats a heartbeat and watches the others', and a node that failed, died or
    stopped answering ends every node's processes with an error naming it."""

    store: Store
    run: str
    training: TrainingConfig
    node: int = 0
    attempt: str | None = None

    def launch(self, target: Callable[..., None], finished: Callable[[], dict[str, Any] | None],
               progress: Callable[..., None] | None = None, lease: Lease | None = None) -> dict[str, Any]:
        """`target(local, node, address)` in each process (in this one: with `progress` and
        `lease`), then the run's commit record, `finished()`."""
        training = self.training
        if training.world == 1:
            target(0, self.node, "", progress=progress, lease=lease)
            return finished()
        rendezvous = None
        if training.distribution.nodes > 1:
            rendezvous = Rendezvous(self.store, layout.rendezvous(self.run, self.attempt), self.node,
                                    training.distribution.nodes, training.distribution.node_timeout)
            if self.node == 0:
                address = rendezvous.publish()
            elif (address := rendezvous.address(lambda: finished() is not None)) is None:
                return finished()
        else:
            address = f"127.0.0.1:{free_port()}"
        processes = torch.multiprocessing.spawn(_process, nprocs=training.distribution.processes, join=False,
                                                args=(target, self.node, address))
        self._watch(processes, rendezvous, progress, lease)
        if progress is not None:
            progress(training.steps, training.steps, float("nan"), None)
        # rank 0 commits the run just after every process left the group: the other nodes wait for it
        while (record := finished()) is None and rendezvous is not None and self.node > 0:
            rendezvous.beat()
            rendezvous.check()
            time.sleep(rendezvous.interval)
        if record is None:
            raise RuntimeError(f"training processes of {self.store.url(self.run)} ended without committing the run")
        return record

    def _watch(self, processes, rendezvous: Rendezvous | None, progress: Callable[..., None] | None,
               lease: Lease | None) -> None:
        """Until the processes end: the lease kept, the other nodes watched, rank 0's progress
        relayed; on a failure every process of this node ends, and the other nodes are told."""
        looked = 0.0
        try:
            while not processes.join(timeout=JOIN_POLL_SECONDS):
                if lease is not None:
                    lease.check()
                if rendezvous is not None and time.monotonic() - looked > rendezvous.interval:
                    rendezvous.beat()
                    rendezvous.check()
                    looked = time.monotonic()
                if progress is not None:
                    with contextlib.suppress(FileNotFoundError):  # rank 0 has not reported yet
                        progress(*self.store.read_json(layout.run_part(self.run, "progress")))
        except Exception as error:
            for process in processes.processes:
                if process.is_alive():
                    process.terminate()
            if rendezvous is None:
                raise
            local = isinstance(error, (NodeFailed, LeaseLost))  # known here: no other node to wait for
            cause = str(error) if local else rendezvous.culprits() or _last_line(error)
            rendezvous.beat(error=cause)  # the other nodes stop at once instead of at their timeout
            raise NodeFailed(f"training {self.store.url(self.run)} on {self.training.distribution.nodes} nodes failed "
                             f"on node {self.node}: {cause}") from error


def _process(local: int, target: Callable[..., None], node: int, address: str) -> None:
    """A spawned training process: `target(local, node, address)`. Killed by a signal (an abort in
    gloo's or NCCL's C++), it prints where each of its threads was."""
    faulthandler.enable(all_threads=True)
    target(local, node, address)


def bound_listener(host: str, port: int) -> int:
    """Rank 0's c10d store socket, listening on `host`'s interface alone (torch's own listens on
    every interface, and its protocol has no authentication: docs/security.md); the store owns
    the descriptor and closes it."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(1024)
    return listener.detach()


def interface_of(address: str) -> str | None:
    """The network interface that holds `address` (None when none here does)."""
    import psutil

    return next((name for name, addresses in psutil.net_if_addrs().items()
                 if any(entry.address.split("%")[0] == address for entry in addresses)), None)


def _last_line(error: BaseException) -> str:
    """The final line of an error from a training process (its traceback comes before it)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__
