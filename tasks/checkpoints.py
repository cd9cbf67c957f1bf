"""Training checkpoints: everything needed to resume bit-exactly, in one safetensors object.

A checkpoint holds the trainable weights (and their EMA), the optimizer's tensors, the RNG states
(the run's data and noise generators, one each per process, and torch's global generator) as
tensors, and as JSON metadata the optimizer's hyper-parameters and scalars, the LR schedule state and the step (which fixes the data-order
position: batches are a pure function of seed, epoch and index). It is committed like every other
artifact, so a run killed mid-write resumes from the previous one. No pickle is involved.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from safetensors.torch import load, save

from storage import layout
from storage.store import Store


def trainable_state(network: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in network.named_parameters() if p.requires_grad}


def pack_checkpoint(
    step: int, network, optimizer, schedule, rng_states: dict[str, list[torch.Tensor]],
    ema: dict[str, torch.Tensor] | None,
) -> bytes:
    tensors = {f"weights/{name}": t.contiguous().cpu() for name, t in trainable_state(network).items()}
    tensors.update({f"ema/{name}": t.contiguous().cpu() for name, t in (ema or {}).items()})
    state = optimizer.state_dict()
    scalars = {}
    for path, value in _flatten(state["state"]):  # nested: 8-bit optimizers keep a dict of quantisation state
        if torch.is_tensor(value):  # cloned: 8-bit optimizers share their small quantisation maps
            tensors[f"optimizer/{path}"] = value.detach().cpu().clone()
        else:
            scalars[path] = value
    for name, states in rng_states.items():
        tensors.update({f"rng/{name}/{rank}": state for rank, state in enumerate(states)})
    tensors["rng/torch"] = torch.get_rng_state()
    meta = {"step": step, "param_groups": state["param_groups"], "scalars": scalars,
            "schedule": schedule.state_dict()}
    return save(tensors, metadata={"meta": json.dumps(meta)})


def save_checkpoint(
    store: Store, run: str, step: int, network, optimizer, schedule, rng_states, ema, keep: int
) -> None:
    """Commit the checkpoint of `step` (`rng_states`: per generator name, one state per process in
    rank order), then drop all but the newest `keep`."""
    data = pack_checkpoint(step, network, optimizer, schedule, rng_states, ema)
    store.commit(layout.checkpoint(run, step), data, step=step)
    for old in committed_steps(store, run)[:-keep]:
        store.remove(layout.checkpoint(run, old) + ".done")  # uncommit first: never a record without data
        store.remove(layout.checkpoint(run, old))


def committed_steps(store: Store, run: str) -> list[int]:
    keys = store.list(layout.run_part(run, "checkpoints"), ".safetensors")
    return sorted(layout.checkpoint_step(k) for k in keys if store.committed(k) is not None)


def restore_latest(
    store: Store, run: str, network, optimizer, schedule, generators: dict[str, torch.Generator], ema, rank: int = 0
) -> int:
    """Load the newest committed checkpoint of `run` into the live objects (the EMA weights too,
    when kept, and process `rank`'s generator states); returns its step (0: none)."""
    steps = committed_steps(store, run)
    if not steps:
        return 0
    key = layout.checkpoint(run, steps[-1])
    data = store.read_verified(key)  # a damaged checkpoint is refused by name, never trained on
    tensors = load(data)
    meta = json.loads(_header_metadata(data)["meta"])
    with torch.no_grad():
        for name, parameter in network.named_parameters():
            if parameter.requires_grad:
                parameter.copy_(tensors[f"weights/{name}"])
        for name, average in (ema or {}).items():
            average.copy_(tensors[f"ema/{name}"])
    entries = [(k.removeprefix("optimizer/"), t) for k, t in tensors.items() if k.startswith("optimizer/")]
    optimizer.load_state_dict({"state": _unflatten(entries + list(meta["scalars"].items())),
                               "param_groups": meta["param_groups"]})
    schedule.load_state_dict(meta["schedule"])
    for name, generator in generators.items():
        if f"rng/{name}/{rank}" not in tensors:
            raise ValueError(f"{store.url(key)} was written by fewer processes than this run has")
        generator.set_state(tensors[f"rng/{name}/{rank}"])
    torch.set_rng_state(tensors["rng/torch"])
    return meta["step"]


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
