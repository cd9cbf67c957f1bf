"""A run's adapter in the layout another program loads.

`diffusers`: the file the family's pipeline writes with `save_lora_weights` and reads with
`load_lora_weights` (rank and alpha in its metadata), written by that function itself.

`comfyui`: one safetensors file that ComfyUI's LoRA loader maps onto the family's model: each
module by the name ComfyUI's key map gives it (`Family.export.comfyui_key`: diffusers' names under
`transformer.` where ComfyUI converts them, the model's own names where it does not), its weights
by the names ComfyUI reads (a LoRA's `lora_A`/`lora_B`, LyCORIS' `hada_*` for a LoHa and `lokr_*`
for a LoKr, which are PEFT's own) and, for every module, `alpha`. ComfyUI reads no
adapter_config.json and scales an update by alpha / rank (1.0 without an alpha, and for a LoKr
whose two factors are both whole), while PEFT scales by alpha / r: without the alphas an r=32,
alpha=16 adapter would act twice as strongly there, and a whole-factor LoKr carries PEFT's scale in
its second factor.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load, save

from tasks.families import Family
from tasks.runs.folder import FinishedRun

FORMATS = ("comfyui", "diffusers")
# the weights of a module each adapter kind (PEFT's peft_type) saves, by the names ComfyUI's loader reads
COMFYUI_WEIGHTS = {"LORA": ("lora_A", "lora_B"), "LOHA": ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"),
                   "LOKR": ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")}
KINDS = {"LORA": "LoRA", "LOHA": "LoHa", "LOKR": "LoKr"}  # PEFT's peft_type, as users name them
PEFT_PREFIX = "base_model.model."


def comfyui_lora(tensors: dict[str, torch.Tensor], adapter_config: dict, name: Callable[[str], str]
                 ) -> dict[str, torch.Tensor]:
    """PEFT adapter tensors → ComfyUI's LoRA layout, each transformer module by `name(module)` (the
    family's `comfyui_key`)."""
    if adapter_config.get("use_dora"):
        # its dora_scale of [out, 1] divides by the base weight's row norms, not the adapted weight's,
        # as PEFT's magnitudes do (ComfyUI's weight_decompose): no file gives PEFT's weights there
        raise ValueError("the adapter is a DoRA, whose magnitudes ComfyUI's LoRA loader applies against the base "
                         "weight's norms, not the adapted weight's as PEFT trained them: load it with PEFT, or export "
                         "--format diffusers for the family pipeline's load_lora_weights")
    if adapter_config.get("use_rslora"):
        raise ValueError("the adapter uses use_rslora, which ComfyUI's LoRA loader does not read")
    patterns = {k: v for k, v in adapter_config.items() if k in ("rank_pattern", "alpha_pattern") and v}
    if patterns:
        raise ValueError(f"the adapter has per-module {', '.join(patterns)}; export supports one rank and alpha")
    kind = adapter_config.get("peft_type", "LORA")
    alpha = float(adapter_config["lora_alpha" if kind == "LORA" else "alpha"])
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, weight = key.removeprefix(PEFT_PREFIX).removesuffix(".weight").rpartition(".")
        if not key.startswith(PEFT_PREFIX) or weight not in COMFYUI_WEIGHTS.get(kind, ()):
            raise ValueError(f"adapter key {key!r} is not a PEFT {KINDS.get(kind, kind)} weight of the transformer that "
                             "ComfyUI reads")
        modules.setdefault(module, {})[weight] = tensor
    out = {}
    for module, weights in modules.items():
        if kind == "LOKR" and {"lokr_w1", "lokr_w2"} <= set(weights):  # ComfyUI scales two whole factors by 1
            weights["lokr_w2"] = weights["lokr_w2"] * (alpha / adapter_config["r"])
        out.update({f"{name(module)}.{weight}{'.weight' if kind == 'LORA' else ''}": tensor
                    for weight, tensor in weights.items()})
        out[f"{name(module)}.alpha"] = torch.tensor(alpha)
    return out


def save_diffusers_lora(family: Family, tensors: dict[str, torch.Tensor], adapter_config: dict, folder: str) -> Path:
    """PEFT adapter tensors written to `folder` by the family's pipeline's own `save_lora_weights`
    (what its `load_lora_weights` reads); the file's path."""
    if (kind := adapter_config.get("peft_type", "LORA")) != "LORA":
        raise ValueError(f"the adapter is a {KINDS[kind]}, and {family.sampler.pipeline_name}'s load_lora_weights "
                         "reads LoRA weights alone: export --format comfyui, or load it with PEFT "
                         "(PeftModel.from_pretrained, as the run page shows)")
    pipeline = family.sampler.pipeline_class()
    if not hasattr(pipeline, "save_lora_weights"):
        raise ValueError(f"{family.name}'s pipeline ({family.sampler.pipeline_name}) has no LoRA loader; "
                         f"export --format comfyui, or load the adapter with PEFT")
    layers = {key.removeprefix(PEFT_PREFIX): tensor for key, tensor in tensors.items()}
    pipeline.save_lora_weights(folder, transformer_lora_layers=layers, transformer_lora_adapter_metadata=adapter_config)
    return Path(folder) / "pytorch_lora_weights.safetensors"


def export_adapter(url: str, format: str, options: dict | None = None) -> bytes:
    """The adapter of a finished run (`<root>/runs/<id>` or its adapter URL) in `format`, as file bytes."""
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}: one of {', '.join(FORMATS)}")
    run = FinishedRun.at(url, options)
    config, data = run.adapter()
    if format == "diffusers":
        with tempfile.TemporaryDirectory() as folder:
            return save_diffusers_lora(run.family, load(data), config, folder).read_bytes()
    return save(comfyui_lora(load(data), config, run.family.export.comfyui_key),
                metadata={"format": "pt", "precast.source": url})
