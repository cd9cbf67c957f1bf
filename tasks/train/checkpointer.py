"""Training checkpoints: everything needed to resume bit-exactly, in one safetensors object.

A checkpoint holds the state of every stateful part of the trainer, each by its own
`state_dict`/`load_state_dict`: the trainable weights (`weights/…`), the optimiser (`optimizer/…`),
the LR schedule, and when kept the moving average (`ema/…`) and the fp16 loss scaler. Their tensors
are the file's tensors, named `<part>/<path in its state>`; the rest (the optimiser's
hyper-parameters and scalars, the schedule, the step) is JSON metadata. The step is all the data
needs: batches are a pure function of seed, epoch and index, and every random draw of a
micro-batch comes from generators seeded by its index (`tasks.train.data.draws`), so no generator
state is saved and a run resumes on any number of processes and nodes. It is committed like every
other artifact, so a run killed mid-write resumes from the previous one. No pickle is involved.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from safetensors.torch import load, save

from configs.schema import TrainingConfig
from storage import layout
from storage.lease import Lease
from storage.store import Store
from tasks.train.ema import Ema
from tasks.train.network import Weights
from tasks.train.optimizer import OptimizerState
from tasks.runs.folder import read_metrics, write_metrics


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


@dataclass
class TrainingState:
    """What a checkpoint saves and restores besides the step: the trainable weights, the optimiser
    and the LR schedule, and when kept their moving average and the loss scaler."""

    network: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: Any
    ema: Ema | None = None
    scaler: torch.amp.GradScaler | None = None

    def parts(self) -> dict[str, Stateful]:
        """Each stateful part by its name in the checkpoint."""
        parts = {"weights": Weights(self.network), "optimizer": OptimizerState(self.optimizer), "schedule": self.schedule,
                 "ema": self.ema, "scaler": self.scaler}
        return {name: part for name, part in parts.items() if part is not None}


@dataclass
class Checkpointer:
    """A run's checkpoint policy: every `every` steps before the `last` (its weights are the run's
    output; 0: never), keeping the newest `keep`, of the parts of `state`; writes stop with
    LeaseLost once `lease` was taken over."""

    store: Store
    run: str
    every: int
    keep: int
    lease: Lease | None = None
    state: TrainingState | None = None
    last: int = 0

    @classmethod
    def from_config(cls, training: TrainingConfig, store: Store, run: str, lease: Lease | None,
                    state: TrainingState) -> Checkpointer:
        """Reads `checkpoint_every`, `keep_checkpoints` and `steps`."""
        return cls(store, run, training.checkpoint_every, training.keep_checkpoints, lease, state, training.steps)

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0 and step < self.last

    def maybe_save(self, step: int, metrics: list[dict[str, Any]]) -> bool:
        """When due, commit the checkpoint of `step` after the metrics so far (resuming reads them
        back), then drop all but the newest `keep`; whether it saved."""
        if not self.due(step):
            return False
        if self.lease is not None:
            self.lease.check()
        write_metrics(self.store, self.run, metrics)
        self.store.commit(layout.checkpoint(self.run, step), pack_checkpoint(step, self.state), step=step)
        for old in self.steps()[: -self.keep]:
            self.store.remove(layout.checkpoint(self.run, old) + ".done")  # uncommit first: never a record without data
            self.store.remove(layout.checkpoint(self.run, old))
        return True

    def steps(self) -> list[int]:
        keys = self.store.list(layout.run_part(self.run, "checkpoints"), ".safetensors")
        return sorted(layout.checkpoint_step(k) for k in keys if self.store.committed(k) is not None)

    def restore(self, state: TrainingState | None = None) -> int:
        """Load the newest committed checkpoint into the live `state` (by default the one this
        checkpointer saves); returns its step (0: none)."""
        steps = self.steps()
        if not steps:
            return 0
        key = layout.checkpoint(self.run, steps[-1])
        data = self.store.read_verified(key)  # a damaged checkpoint is refused by name, never trained on
        tensors, meta = load(data), _current(json.loads(_header_metadata(data)["meta"]))
        for name, part in (state or self.state).parts().items():
            leaves = [(k.removeprefix(f"{name}/"), t) for k, t in tensors.items() if k.startswith(f"{name}/")]
            leaves += meta.get(name, {}).items()
            if leaves:  # a disabled loss scaler has no state, and none is saved
                part.load_state_dict(_unflatten(leaves))
        return meta["step"]

    def saved_metrics(self, step: int) -> list[dict[str, Any]]:
        """The metrics of the steps up to `step`, as saved with its checkpoint."""
        return read_metrics(self.store, self.run)[:step]


def pack_checkpoint(step: int, state: TrainingState) -> bytes:
    tensors, meta, stored = {}, {"step": step}, set()
    for name, part in state.parts().items():
        for path, value in _flatten(part.state_dict()):
            if not torch.is_tensor(value):
                meta.setdefault(name, {})[path] = value
                continue
            tensor = value.detach().contiguous().cpu()
            if tensor.untyped_storage().data_ptr() in stored:  # 8-bit optimizers share their small
                tensor = tensor.clone()  # quantisation maps; safetensors holds each storage once
            stored.add(tensor.untyped_storage().data_ptr())
            tensors[f"{name}/{path}"] = tensor
    return save(tensors, metadata={"meta": json.dumps(meta)})


def _current(meta: dict[str, Any]) -> dict[str, Any]:
    """Checkpoint metadata as parts save it; checkpoints written before (the same tensors) kept the
    optimiser's param groups and scalars apart."""
    if "scalars" not in meta:
        return meta
    return {"step": meta["step"], "schedule": meta["schedule"],
            "optimizer": {**meta["scalars"], "param_groups": meta["param_groups"]}}


def _flatten(tree: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """(slash-joined path, leaf) of a nested dict."""
    leaves = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        leaves += _flatten(value, f"{path}/") if isinstance(value, dict) else [(path, value)]
    return leaves


def _unflatten(leaves: list[tuple[str, Any]]) -> dict:
    """The inverse of `_flatten` (every key a string)."""
    tree: dict = {}
    for path, value in leaves:
        *parents, leaf = path.split("/")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def _header_metadata(data: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors blob (the header is JSON after an 8-byte length)."""
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + length]).get("__metadata__", {})
