"""A run's adapter in the layout another program loads.

`comfyui`: one safetensors file that ComfyUI's LoRA loader maps onto its PixArt model: diffusers
module names under the `transformer.` prefix, `lora_A`/`lora_B` weights and, for every module,
`alpha`. ComfyUI reads no adapter_config.json and scales an update by alpha / rank (1.0 without
an alpha), while PEFT scales by lora_alpha / r: without the alphas an r=32, alpha=16 adapter would
act twice as strongly there.
"""

from __future__ import annotations

import json

import fsspec
import torch
from safetensors.torch import load, save

from storage import layout

FORMATS = ("comfyui",)
PEFT_PREFIX = "base_model.model."


def comfyui_lora(tensors: dict[str, torch.Tensor], adapter_config: dict) -> dict[str, torch.Tensor]:
    """PEFT adapter tensors → ComfyUI's PixArt LoRA layout."""
    for option in ("use_dora", "use_rslora"):
        if adapter_config.get(option):
            raise ValueError(f"the adapter uses {option}, which ComfyUI's LoRA loader does not read")
    patterns = {k: v for k, v in adapter_config.items() if k in ("rank_pattern", "alpha_pattern") and v}
    if patterns:
        raise ValueError(f"the adapter has per-module {', '.join(patterns)}; export supports one rank and alpha")
    out = {}
    for key, tensor in tensors.items():
        if not key.startswith(PEFT_PREFIX) or not key.endswith((".lora_A.weight", ".lora_B.weight")):
            raise ValueError(f"adapter key {key!r} is not a PEFT LoRA weight of the transformer")
        module = key[len(PEFT_PREFIX) : -len(".lora_A.weight")]
        out[f"transformer.{module}{key[-len('.lora_A.weight'):]}"] = tensor
        out[f"transformer.{module}.alpha"] = torch.tensor(float(adapter_config["lora_alpha"]))
    return out


def export_adapter(url: str, format: str, options: dict | None = None) -> bytes:
    """The adapter of a run (`<root>/runs/<id>` or its adapter URL) in `format`, as file bytes."""
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}: one of {', '.join(FORMATS)}")
    fs, path = fsspec.core.url_to_fs(url.rstrip("/"), **(options or {}))
    adapter = layout.run_part(layout.run_of(path), "adapter")
    if not fs.exists(f"{adapter}/adapter_config.json"):
        raise FileNotFoundError(f"{url} has no LoRA adapter (a `method: full` run saves a whole transformer, "
                                f"which loads as a model, not as a LoRA)")
    config = json.loads(fs.cat_file(f"{adapter}/adapter_config.json"))
    tensors = load(fs.cat_file(f"{adapter}/adapter_model.safetensors"))
    return save(comfyui_lora(tensors, config), metadata={"format": "pt", "precast.source": url})
