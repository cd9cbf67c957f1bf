"""The calls a diffusers pipeline makes to its transformer, recorded: what a family's `predict`
must reproduce; and the processor a Qwen-Image-Edit pipeline loads, made here."""

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


def loaded_components(folder) -> dict[str, Any]:
    """What a tiny model folder's pipeline is given beside `from_pretrained(folder)`: a Qwen-Image-Edit
    folder's `processor` (`edit_processor`), which transformers loads only beside torchvision."""
    return {"processor": edit_processor(folder)} if (folder / "processor").is_dir() else {}


def edit_processor(folder) -> Any:
    """The edit pipelines' processor, its own `__call__` over the folder's tokenizer and image
    processor. transformers builds a `Qwen2VLProcessor` only beside torchvision (for its video
    processor, which an edit pipeline never calls), and torch's CPU build here has none: it is made
    around its constructor, with the attributes that constructor sets."""
    from transformers import AutoImageProcessor, Qwen2Tokenizer, Qwen2VLProcessor

    made = Qwen2VLProcessor.__new__(Qwen2VLProcessor)
    made.tokenizer = Qwen2Tokenizer.from_pretrained(folder / "processor")
    made.image_processor = AutoImageProcessor.from_pretrained(folder / "processor")
    made.chat_template = None
    for kind in ("image", "video"):
        setattr(made, f"{kind}_token", f"<|{kind}_pad|>")
        setattr(made, f"{kind}_token_id", made.tokenizer.convert_tokens_to_ids(f"<|{kind}_pad|>"))
    return made
