"""Training checkpoints: everything needed to resume bit-exactly, in one safetensors object.

A checkpoint holds the trainable weights (and their EMA) and the optimizer's tensors, and as JSON
metadata the optimizer's hyper-parameters and scalars, the LR schedule state and the step. The step
is all the rest needs: batches are a pure function of seed, epoch and index, and every random draw
of a micro-batch comes from generators seeded by its index (`tasks.train.data.draws`), so no
generator state is saved and a run resumes on any number of processes and nodes. It is committed
like every other artifact, so a run killed mid-write resumes from the previous one. No pickle is
involved.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load, save

from storage import layout
from storage.lease import Lease
from storage.store import Store
from tasks.train.publisher import write_metrics


def trainable_state(network: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in network.named_parameters() if p.requires_grad}


@dataclass
class TrainingState:
    """What a checkpoint saves and restores besides the step: the trainable weights (and their
    moving average, when kept), the optimiser and the LR schedule."""

    network: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: Any
    ema: dict[str, torch.Tensor] | None = None


@dataclass
class Checkpointer:
    """A run's checkpoint policy: every `every` steps before the last (0: never), keeping the
    newest `keep`; writes stop with LeaseLost once `lease` was taken over."""

    store: Store
    run: str
    every: int
    keep: int
    lease: Lease | None = None

    def due(self, step: int, steps: int) -> bool:
        return bool(self.every) and step % self.every == 0 and step < steps

    def save(self, step: int, state: TrainingState, metrics: list[dict[str, Any]]) -> None:
        """Commit the checkpoint of `step` after the metrics so far (resuming reads them back), then
        drop all but the newest `keep`."""
        if self.lease is not None:
            self.lease.check()
        write_metrics(self.store, self.run, metrics)
        self.store.commit(layout.checkpoint(self.run, step), pack_checkpoint(step, state), step=step)
        for old in self.steps()[: -self.keep]:
            self.store.remove(layout.checkpoint(self.run, old) + ".done")  # uncommit first: never a record without data
            self.store.remove(layout.checkpoint(self.run, old))

    def steps(self) -> list[int]:
        keys = self.store.list(layout.run_part(self.run, "checkpoints"), ".safetensors")
        return sorted(layout.checkpoint_step(k) for k in keys if self.store.committed(k) is not None)

    def restore(self, state: TrainingState) -> int:
        """Load the newest committed checkpoint into the live `state`; returns its step (0: none)."""
        steps = self.steps()
        if not steps:
            return 0
        key = layout.checkpoint(self.run, steps[-1])
        data = self.store.read_verified(key)  # a damaged checkpoint is refused by name, never trained on
        tensors = load(data)
        meta = json.loads(_header_metadata(data)["meta"])
        with torch.no_grad():
            for name, parameter in state.network.named_parameters():
                if parameter.requires_grad:
                    parameter.copy_(tensors[f"weights/{name}"])
            for name, average in (state.ema or {}).items():
                average.copy_(tensors[f"ema/{name}"])
        entries = [(k.removeprefix("optimizer/"), t) for k, t in tensors.items() if k.startswith("optimizer/")]
        state.optimizer.load_state_dict({"state": _unflatten(entries + list(meta["scalars"].items())),
                                         "param_groups": meta["param_groups"]})
        state.schedule.load_state_dict(meta["schedule"])
        return meta["step"]


def pack_checkpoint(step: int, state: TrainingState) -> bytes:
    tensors = {f"weights/{name}": t.contiguous().cpu() for name, t in trainable_state(state.network).items()}
    tensors.update({f"ema/{name}": t.contiguous().cpu() for name, t in (state.ema or {}).items()})
    optimizer = state.optimizer.state_dict()
    scalars = {}
    for path, value in _flatten(optimizer["state"]):  # nested: 8-bit optimizers keep a dict of quantisation state
        if torch.is_tensor(value):  # cloned: 8-bit optimizers share their small quantisation maps
            tensors[f"optimizer/{path}"] = value.detach().cpu().clone()
        else:
            scalars[path] = value
    meta = {"step": step, "param_groups": optimizer["param_groups"], "scalars": scalars,
            "schedule": state.schedule.state_dict()}
    return save(tensors, metadata={"meta": json.dumps(meta)})


def _flatten(tree: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """(slash-joined path, leaf) of a nested dict."""
    leaves = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        leaves += _flatten(value, f"{path}/") if isinstance(value, dict) else [(path, value)]
    return leaves


def _unflatten(leaves: list[tuple[str, Any]]) -> dict:
    """The inverse of `_flatten`; the top level (parameter index) back to int keys."""
    tree: dict = {}
    for path, value in leaves:
        index, *parts = path.split("/")
        node = tree.setdefault(int(index), {})
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return tree


def _header_metadata(data: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors blob (the header is JSON after an 8-byte length)."""
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + length]).get("__metadata__", {})
