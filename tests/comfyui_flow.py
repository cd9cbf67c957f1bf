"""ComfyUI's FLUX.1, FLUX.2, Chroma, SD3/SD3.5, Z-Image, Qwen-Image and Wan LoRA loading, restated for tests
(ComfyUI is not a pip package).

From ComfyUI at commit a125cd84 (2025-10-12), as tests/comfyui_pixart.py restates PixArt's:
`comfy/utils.py::flux_to_diffusers` and `mmdit_to_diffusers` (diffusers key -> ComfyUI model key;
Flux fuses q/k/v into `img_attn.qkv` / `txt_attn.qkv` and, in a single block, q/k/v and `proj_mlp`
into `linear1`; SD3 fuses q/k/v into `x_block.attn.qkv`, `context_block.attn.qkv` and
`x_block.attn2.qkv`; slices are (key, (dim, start, length))), the Flux and SD3 branches of
`comfy/lora.py::model_lora_keys_unet` (`comfy.model_base.Chroma` subclasses `Flux`, so Chroma takes
Flux's branch), `load_lora`'s `<name>.alpha` and `LoRAAdapter.load`'s key pairs, and
`calculate_weight`'s rule `weight += strength * (alpha / rank) * up @ down` on the slice.
Only the transformer blocks' linear layers are restated: what a LoRA on them needs. ComfyUI's other
names (`diffusion_model.<its key>`, `lora_unet_<its key>`, Flux's `...linear1_qkv`) use its own
layout, not diffusers', and are left out.

Z-Image is ComfyUI's `Lumina2` model (`comfy/ldm/lumina/model.py::NextDiT`): `z_image_to_diffusers`
(comfy/utils.py) fuses each block's (`layers`, `context_refiner`, `noise_refiner`) `attention.to_q/k/v`
into `attention.qkv` (slices of `dim` rows) and names `attention.to_out.0` `attention.out`, the
feed-forward's `w1`, `w2`, `w3` and `adaLN_modulation.0` alike; its branch of `model_lora_keys_unet`
reads each diffusers name under `transformer.`, `diffusion_model.`, `lycoris_` (with "." -> "_") and
bare (read in ComfyUI's source after 2025-12; restated from it).

FLUX.2 is ComfyUI's `Flux2`, a `Flux` (so it takes Flux's branch of `model_lora_keys_unet`:
`transformer.<diffusers name>`, `lycoris_` and `lora_transformer_` with "." -> "_", and the bare
name), whose `flux_to_diffusers` maps FLUX.2's diffusers names onto its
BFL layout: a double block's `attn.to_q/k/v` into `img_attn.qkv` (slices of the width),
`attn.to_out.0` to `img_attn.proj`, the text stream's alike, `ff.linear_in/out` to `img_mlp.0/2`; a
single block's fused `attn.to_qkv_mlp_proj` to `linear1` and `attn.to_out` to `linear2` (restated
from ComfyUI's source after FLUX.2: comfy/utils.py at b3be02d6, comfy/lora.py at ec93dcac).

Qwen-Image's ComfyUI model (`comfy/ldm/qwen_image/model.py`) names its modules as diffusers does:
its branch of `model_lora_keys_unet` reads each of its `diffusion_model.<key>` weights as `<key>`,
`transformer.<key>` and `lycoris_<key with . as _>` (read in ComfyUI's source after 2025-08;
restated from it).

Wan has no branch in `model_lora_keys_unet` and no diffusers conversion in ComfyUI: only the generic
names of its own model's keys (`diffusion_model.<key>` and `lora_unet_<key with . as _>`, lora.py's
first loop), its model being `comfy/ldm/wan/model.py::WanModel` (blocks' `self_attn.q/k/v/o`,
`cross_attn.q/k/v/o`, `ffn.0`, `ffn.2`), whose names diffusers' `scripts/convert_wan_to_diffusers.py`
(`TRANSFORMER_KEYS_RENAME_DICT`) renames to its own.
"""

from __future__ import annotations

import torch

from tests.comfyui_pixart import apply_lora  # noqa: F401  (calculate_weight is the same for every model)

Target = str | tuple[str, tuple[int, int, int]]

FLUX_DOUBLE = {  # diffusers name -> ComfyUI name, inside `transformer_blocks.N` / `double_blocks.N`
    "attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj",
    "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
}
MMDIT_BLOCK = {  # diffusers name -> ComfyUI name, inside `transformer_blocks.N` / `joint_blocks.N`
    "attn.to_out.0": "x_block.attn.proj", "attn.to_add_out": "context_block.attn.proj",
    "attn2.to_out.0": "x_block.attn2.proj",
    "ff.net.0.proj": "x_block.mlp.fc1", "ff.net.2": "x_block.mlp.fc2",
    "ff_context.net.0.proj": "context_block.mlp.fc1", "ff_context.net.2": "context_block.mlp.fc2",
}
# Wan's own block names -> diffusers', as TRANSFORMER_KEYS_RENAME_DICT renames them
WAN_RENAMES = {"self_attn.q": "attn1.to_q", "self_attn.k": "attn1.to_k", "self_attn.v": "attn1.to_v",
               "self_attn.o": "attn1.to_out.0", "cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k",
               "cross_attn.v": "attn2.to_v", "cross_attn.o": "attn2.to_out.0", "ffn.0": "ffn.net.0.proj",
               "ffn.2": "ffn.net.2"}
FLUX_PREFIXES = ("transformer.", "lycoris_", "lora_transformer_")  # the last two with "." -> "_"
# the same branch in ComfyUI after FLUX.2 (comfy/lora.py at ec93dcac) also reads the bare name ("DiffSynth lora format")
FLUX2_PREFIXES = (*FLUX_PREFIXES, "")
MMDIT_PREFIXES = ("transformer.", "base_model.model.", "lora_transformer_", "lycoris_")
ZIMAGE_PREFIXES = ("transformer.", "diffusion_model.", "lycoris_", "")
QWEN_IMAGE_PREFIXES = ("transformer.", "lycoris_", "")
ZIMAGE_BLOCK = {"attention.to_out.0": "attention.out", "feed_forward.w1": "feed_forward.w1",
                "feed_forward.w2": "feed_forward.w2", "feed_forward.w3": "feed_forward.w3",
                "adaLN_modulation.0": "adaLN_modulation.0"}


def _qkv(out: dict, src: str, names: tuple[str, str, str], key: str, width: int) -> None:
    for n, name in enumerate(names):
        out[f"{src}.{name}.weight"] = (key, (0, n * width, width))


def flux_to_diffusers(depth: int, single_depth: int, hidden: int) -> dict[str, Target]:
    """diffusers weight key -> ComfyUI key or slice, for FLUX.1 and Chroma (their blocks are alike).
    A single block's `proj_mlp` is ComfyUI's slice (3 * hidden, 4 * hidden) of `linear1`: mlp_ratio 4."""
    keys: dict[str, Target] = {}
    for i in range(depth):
        src, dst = f"transformer_blocks.{i}", f"diffusion_model.double_blocks.{i}"
        _qkv(keys, src, ("attn.to_q", "attn.to_k", "attn.to_v"), f"{dst}.img_attn.qkv.weight", hidden)
        _qkv(keys, src, ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), f"{dst}.txt_attn.qkv.weight", hidden)
        for diffusers, comfy in FLUX_DOUBLE.items():
            keys[f"{src}.{diffusers}.weight"] = f"{dst}.{comfy}.weight"
    for i in range(single_depth):
        src, dst = f"single_transformer_blocks.{i}", f"diffusion_model.single_blocks.{i}"
        _qkv(keys, src, ("attn.to_q", "attn.to_k", "attn.to_v"), f"{dst}.linear1.weight", hidden)
        keys[f"{src}.proj_mlp.weight"] = (f"{dst}.linear1.weight", (0, 3 * hidden, 4 * hidden))
        keys[f"{src}.proj_out.weight"] = f"{dst}.linear2.weight"
    return keys


FLUX2_DOUBLE = {"attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj", "ff.linear_in": "img_mlp.0",
                "ff.linear_out": "img_mlp.2", "ff_context.linear_in": "txt_mlp.0", "ff_context.linear_out": "txt_mlp.2"}


def flux2_to_diffusers(depth: int, single_depth: int, hidden: int) -> dict[str, Target]:
    """diffusers weight key -> ComfyUI key or slice, for FLUX.2's blocks."""
    keys: dict[str, Target] = {}
    for i in range(depth):
        src, dst = f"transformer_blocks.{i}", f"diffusion_model.double_blocks.{i}"
        _qkv(keys, src, ("attn.to_q", "attn.to_k", "attn.to_v"), f"{dst}.img_attn.qkv.weight", hidden)
        _qkv(keys, src, ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), f"{dst}.txt_attn.qkv.weight",
             hidden)
        for diffusers, comfy in FLUX2_DOUBLE.items():
            keys[f"{src}.{diffusers}.weight"] = f"{dst}.{comfy}.weight"
    for i in range(single_depth):
        src, dst = f"single_transformer_blocks.{i}", f"diffusion_model.single_blocks.{i}"
        keys[f"{src}.attn.to_qkv_mlp_proj.weight"] = f"{dst}.linear1.weight"
        keys[f"{src}.attn.to_out.weight"] = f"{dst}.linear2.weight"
    return keys


def mmdit_to_diffusers(depth: int, hidden: int) -> dict[str, Target]:
    """diffusers weight key -> ComfyUI key or slice, for SD3/SD3.5. ComfyUI's slice width is
    `64 * (x_embedder width // 64)`, the width itself for every published SD3 (width = 64 * depth);
    `hidden` stands for it (a tiny test model's width need not be a multiple of 64). `attn2` (SD3.5's
    dual attention) and the last block's context output layers are mapped for every block, as
    ComfyUI maps them; a model lacks those it does not have."""
    keys: dict[str, Target] = {}
    for i in range(depth):
        src, dst = f"transformer_blocks.{i}", f"diffusion_model.joint_blocks.{i}"
        _qkv(keys, src, ("attn.to_q", "attn.to_k", "attn.to_v"), f"{dst}.x_block.attn.qkv.weight", hidden)
        _qkv(keys, src, ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
             f"{dst}.context_block.attn.qkv.weight", hidden)
        _qkv(keys, src, ("attn2.to_q", "attn2.to_k", "attn2.to_v"), f"{dst}.x_block.attn2.qkv.weight", hidden)
        for diffusers, comfy in MMDIT_BLOCK.items():
            keys[f"{src}.{diffusers}.weight"] = f"{dst}.{comfy}.weight"
    return keys


def zimage_to_diffusers(depth: int, refiners: int, hidden: int) -> dict[str, Target]:
    """diffusers weight key -> ComfyUI key or slice, for Z-Image's blocks (the caption refiner's have
    no adaLN_modulation: a model lacks what it does not have)."""
    keys: dict[str, Target] = {}
    blocks = [f"layers.{i}" for i in range(depth)]
    blocks += [f"{kind}.{i}" for kind in ("context_refiner", "noise_refiner") for i in range(refiners)]
    for block in blocks:
        _qkv(keys, block, ("attention.to_q", "attention.to_k", "attention.to_v"),
             f"diffusion_model.{block}.attention.qkv.weight", hidden)
        for diffusers, comfy in ZIMAGE_BLOCK.items():
            keys[f"{block}.{diffusers}.weight"] = f"diffusion_model.{block}.{comfy}.weight"
    return keys


def _lora_key_map(diffusers_keys: dict[str, Target], prefixes: tuple[str, ...]) -> dict[str, Target]:
    key_map = {}
    for key, target in diffusers_keys.items():
        base = key.removesuffix(".weight")
        for prefix in prefixes:
            key_map[prefix + (base if prefix.endswith(".") or not prefix else base.replace(".", "_"))] = target
    return key_map


def flux_lora_key_map(depth: int, single_depth: int, hidden: int, mlp_hidden: int | None = None) -> dict[str, Target]:
    """LoRA module name -> target, as model_lora_keys_unet builds it for FLUX.1 or Chroma."""
    if mlp_hidden is not None and mlp_hidden != 4 * hidden:
        raise ValueError(f"ComfyUI slices proj_mlp as 4 * hidden = {4 * hidden} rows, not {mlp_hidden}")
    return _lora_key_map(flux_to_diffusers(depth, single_depth, hidden), FLUX_PREFIXES)


def mmdit_lora_key_map(depth: int, hidden: int) -> dict[str, Target]:
    """LoRA module name -> target, as model_lora_keys_unet builds it for SD3/SD3.5."""
    return _lora_key_map(mmdit_to_diffusers(depth, hidden), MMDIT_PREFIXES)


def wan_to_diffusers(depth: int) -> dict[str, Target]:
    """diffusers weight key -> ComfyUI key, for Wan's blocks."""
    return {f"blocks.{i}.{diffusers}.weight": f"diffusion_model.blocks.{i}.{wan}.weight"
            for i in range(depth) for wan, diffusers in WAN_RENAMES.items()}


def generic_lora_key_map(model_keys: dict[str, Target]) -> dict[str, Target]:
    """LoRA module name -> target by lora.py's generic loop over the model's own `.weight` keys."""
    key_map = {}
    for key in model_keys.values():
        base = key[len("diffusion_model."):-len(".weight")]
        key_map[f"lora_unet_{base.replace('.', '_')}"] = key_map[f"diffusion_model.{base}"] = key
    return key_map


def maps_for(transformer) -> tuple[dict[str, Target], dict[str, Target]]:
    """(diffusers key -> target, LoRA module name -> target) for a diffusers Flux, Chroma, SD3 or
    Wan transformer, or its saved config (a dict with `_class_name`)."""
    config = dict(getattr(transformer, "config", transformer))
    config.setdefault("_class_name", type(transformer).__name__)
    hidden = config.get("num_attention_heads", 0) * config.get("attention_head_dim", 0)
    if config["_class_name"] in ("FluxTransformer2DModel", "ChromaTransformer2DModel"):
        args = (config["num_layers"], config["num_single_layers"], hidden)
        return flux_to_diffusers(*args), flux_lora_key_map(*args)
    if config["_class_name"] == "SD3Transformer2DModel":
        return mmdit_to_diffusers(config["num_layers"], hidden), mmdit_lora_key_map(config["num_layers"], hidden)
    if config["_class_name"] == "Flux2Transformer2DModel":
        keys = flux2_to_diffusers(config["num_layers"], config["num_single_layers"], hidden)
        return keys, _lora_key_map(keys, FLUX2_PREFIXES)
    if config["_class_name"] == "QwenImageTransformer2DModel":  # its blocks' linear layers, by their own names
        keys = {key: f"diffusion_model.{key}" for key in transformer.state_dict()
                if key.startswith("transformer_blocks.") and key.endswith(".weight") and "norm" not in key}
        return keys, _lora_key_map(keys, QWEN_IMAGE_PREFIXES)
    if config["_class_name"] == "ZImageTransformer2DModel":
        keys = zimage_to_diffusers(config["n_layers"], config["n_refiner_layers"], config["dim"])
        return keys, _lora_key_map(keys, ZIMAGE_PREFIXES)
    if config["_class_name"] == "WanTransformer3DModel":
        keys = wan_to_diffusers(config["num_layers"])
        return keys, generic_lora_key_map(keys)
    raise ValueError(f"no ComfyUI map restated for {config['_class_name']}")


def comfy_weights(diffusers_state: dict[str, torch.Tensor],
                  diffusers_keys: dict[str, Target]) -> dict[str, torch.Tensor]:
    """The mapped linear weights in ComfyUI's layout (fused where ComfyUI fuses); keys the model
    lacks (SD3's attn2 outside dual-attention blocks, its last block's context outputs) are skipped."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for key, target in diffusers_keys.items():
        if key not in diffusers_state:
            continue
        if isinstance(target, tuple):
            parts.setdefault(target[0], []).append((target[1][1], diffusers_state[key]))
        else:
            out[target] = diffusers_state[key].clone()
    for key, slices in parts.items():
        slices.sort(key=lambda s: s[0])
        ends = [0] + [start + len(t) for start, t in slices]
        if [start for start, _ in slices] != ends[:-1]:
            raise ValueError(f"{key}: the slices ComfyUI fuses are not all in the model")
        out[key] = torch.cat([t for _, t in slices])
    return out


def diffusers_weights(weights: dict[str, torch.Tensor],
                      diffusers_keys: dict[str, Target]) -> dict[str, torch.Tensor]:
    """comfy_weights' inverse: each diffusers key whose ComfyUI weight (or slice of it) is in `weights`."""
    out = {}
    for key, target in diffusers_keys.items():
        name, (dim, start, length) = target if isinstance(target, tuple) else (target, (0, 0, None))
        if name in weights:
            out[key] = weights[name] if length is None else weights[name].narrow(dim, start, length)
    return out
