"""The calls a diffusers pipeline makes to its transformer, recorded: what a family's `predict`
must reproduce."""

from __future__ import annotations

from typing import Any

import torch


def transformer_calls(pipeline: Any, component: str = "transformer") -> list[tuple[dict[str, Any], torch.Tensor]]:
    """A list that fills, as the pipeline runs, with each call of its `component` (a transformer):
    its keyword arguments (the latents by their name, `hidden_states`, where they are passed first,
    as PixArt's pipelines pass them) and output."""
    calls: list[tuple[dict[str, Any], torch.Tensor]] = []
    getattr(pipeline, component).register_forward_hook(
        lambda module, args, kwargs, output: calls.append(({**dict(zip(["hidden_states"], args)), **kwargs},
                                                           output[0])), with_kwargs=True)
    return calls
