"""The calls a diffusers pipeline makes to its transformer, recorded: what a family's `predict`
must reproduce."""

from __future__ import annotations

import inspect
from typing import Any

import torch


def transformer_calls(pipeline: Any, component: str = "transformer") -> list[tuple[dict[str, Any], torch.Tensor]]:
    """A list that fills, as the pipeline runs, with each call of its `component` (a transformer):
    its arguments by name (those passed by position, as PixArt's and Z-Image's pipelines pass the
    latents, by the names of `forward`'s parameters) and output."""
    calls: list[tuple[dict[str, Any], torch.Tensor]] = []
    module = getattr(pipeline, component)
    names = list(inspect.signature(module.forward).parameters)
    module.register_forward_hook(
        lambda module, args, kwargs, output: calls.append(({**dict(zip(names, args)), **kwargs}, output[0])),
        with_kwargs=True)
    return calls
