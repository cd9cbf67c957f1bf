"""Data-parallel training processes on one node: process-group setup and teardown, the device of
each process, gradient averaging (DDP) and the two collectives the trainer needs. The only module
that calls torch.distributed."""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tasks.models import resolve_device


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class Distributed:
    rank: int
    world: int
    device: torch.device

    @classmethod
    def start(cls, rank: int, world: int, port: int, device: str) -> Distributed:
        """Join the process group (NCCL on GPUs, one per process; gloo on CPUs) when world > 1."""
        target = resolve_device(device)
        if target.type == "cuda" and world > 1:
            target = torch.device("cuda", rank)
            torch.cuda.set_device(target)
        if world > 1:
            dist.init_process_group("nccl" if target.type == "cuda" else "gloo",
                                    init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
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

    def mean(self, value: float) -> float:
        """The mean of a number over every process (all of them call this)."""
        if self.world == 1:
            return value
        total = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(total)
        return total.item() / self.world

    def gather(self, state: torch.Tensor) -> list[torch.Tensor]:
        """Every process's copy of a tensor, in rank order (all of them call this)."""
        if self.world == 1:
            return [state]
        states = [torch.empty_like(state) for _ in range(self.world)]
        dist.all_gather(states, state)
        return states

    def close(self) -> None:
        if self.world > 1:
            dist.barrier()
            dist.destroy_process_group()
