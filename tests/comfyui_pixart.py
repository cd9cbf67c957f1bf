"""ComfyUI's PixArt LoRA loading, restated for tests (ComfyUI is not a pip package).

From ComfyUI at commit a125cd84 (2025-10-12): `comfy/utils.py::pixart_to_diffusers` (diffusers
key -> ComfyUI model key, with q/k/v fused into `attn.qkv` and k/v into `cross_attn.kv_linear`,
addressed as (key, (dim, start, length)) slices), the PixArt branch of
`comfy/lora.py::model_lora_keys_unet` (prefixes `transformer.`, `base_model.model.`,
`unet.base_model.model.`), `LoRAAdapter.load`'s key pairs and `calculate_weight`'s rule
`weight += strength * (alpha / rank) * up @ down` (alpha / rank = 1 without an alpha key); after a
module's LoRA pairs, `load_lora` tries LyCORIS' (comfy/weight_adapter/, read at 17adbb5c and
179c2d35): LoHa's `hada_w1_a/b`, `hada_w2_a/b`, `(w1_a @ w1_b) * (w2_a @ w2_b)` scaled by alpha /
w1_b's rank, and LoKr's `lokr_w1` (or `lokr_w1_a/b`) and `lokr_w2` (or `lokr_w2_a/b`),
`kron(w1, w2)` scaled by alpha / the rank of the last decomposed factor, 1.0 when both are whole.
Only the transformer blocks' linear layers are restated: what a LoRA on them needs.
"""

from __future__ import annotations

import torch

BLOCK = {  # ComfyUI name -> diffusers name, inside `blocks.N` / `transformer_blocks.N`
    "attn.proj": "attn1.to_out.0", "mlp.fc1": "ff.net.0.proj", "mlp.fc2": "ff.net.2",
    "cross_attn.proj": "attn2.to_out.0",
}
PAIRS = [(".lora_up.weight", ".lora_down.weight"), ("_lora.up.weight", "_lora.down.weight"),
         (".lora_B.weight", ".lora_A.weight"), (".lora.up.weight", ".lora.down.weight"),
         (".lora_B", ".lora_A"), (".lora_linear_layer.up.weight", ".lora_linear_layer.down.weight"),
         (".lora_B.default.weight", ".lora_A.default.weight")]


def pixart_to_diffusers(depth: int, hidden: int) -> dict[str, str | tuple[str, tuple[int, int, int]]]:
    """diffusers weight key -> ComfyUI key, or (key, (dim, start, length)) for a slice of a fused one."""
    keys: dict = {}
    for i in range(depth):
        src, dst = f"transformer_blocks.{i}", f"diffusion_model.blocks.{i}"
        qkv, kv = f"{dst}.attn.qkv.weight", f"{dst}.cross_attn.kv_linear.weight"
        keys[f"{src}.attn1.to_q.weight"] = (qkv, (0, 0, hidden))
        keys[f"{src}.attn1.to_k.weight"] = (qkv, (0, hidden, hidden))
        keys[f"{src}.attn1.to_v.weight"] = (qkv, (0, 2 * hidden, hidden))
        keys[f"{src}.attn2.to_q.weight"] = f"{dst}.cross_attn.q_linear.weight"
        keys[f"{src}.attn2.to_k.weight"] = (kv, (0, 0, hidden))
        keys[f"{src}.attn2.to_v.weight"] = (kv, (0, hidden, hidden))
        for comfy, diffusers in BLOCK.items():
            keys[f"{src}.{diffusers}.weight"] = f"{dst}.{comfy}.weight"
    return keys


def lora_key_map(depth: int, hidden: int) -> dict:
    """LoRA module name -> target, as model_lora_keys_unet builds it for a PixArt model."""
    key_map = {}
    for key, target in pixart_to_diffusers(depth, hidden).items():
        base = key.removesuffix(".weight")
        for prefix in ("transformer.", "base_model.model.", "unet.base_model.model."):
            key_map[prefix + base] = target
    return key_map


def comfy_weights(diffusers_state: dict[str, torch.Tensor], depth: int, hidden: int) -> dict[str, torch.Tensor]:
    """The transformer blocks' weights in ComfyUI's layout (fused where ComfyUI fuses)."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for key, target in pixart_to_diffusers(depth, hidden).items():
        if isinstance(target, tuple):
            parts.setdefault(target[0], []).append((target[1][1], diffusers_state[key]))
        else:
            out[target] = diffusers_state[key].clone()
    for key, slices in parts.items():
        out[key] = torch.cat([t for _, t in sorted(slices, key=lambda s: s[0])])
    return out


def apply_lora(weights: dict[str, torch.Tensor], lora: dict[str, torch.Tensor], key_map: dict,
               strength: float = 1.0) -> list[str]:
    """Patch `weights` in place as ComfyUI does; returns the LoRA keys it would not apply (logged as
    "lora key not loaded", or, for a module mapped to a weight the model lacks, "NOT LOADED")."""
    loaded = set()
    for name, target in key_map.items():
        key, (dim, start, length) = target if isinstance(target, tuple) else (target, (0, 0, None))
        if key not in weights:
            continue
        alpha = lora.get(f"{name}.alpha")
        if alpha is not None:
            loaded.add(f"{name}.alpha")
        weight = weights[key] if length is None else weights[key].narrow(dim, start, length)
        for up_suffix, down_suffix in PAIRS:
            if name + up_suffix in lora:
                up, down = lora[name + up_suffix], lora[name + down_suffix]
                loaded |= {name + up_suffix, name + down_suffix}
                scale = alpha.item() / down.shape[0] if alpha is not None else 1.0
                weight += strength * scale * (up.float() @ down.float()).reshape(weight.shape)
                break
        else:
            lycoris = {part: lora[f"{name}.{part}"] for part in LYCORIS if f"{name}.{part}" in lora}
            loaded |= {f"{name}.{part}" for part in lycoris}
            if "hada_w1_a" in lycoris:
                scale = alpha.item() / lycoris["hada_w1_b"].shape[0] if alpha is not None else 1.0
                diff = (lycoris["hada_w1_a"].float() @ lycoris["hada_w1_b"].float()) * \
                    (lycoris["hada_w2_a"].float() @ lycoris["hada_w2_b"].float())
                weight += strength * scale * diff.reshape(weight.shape)
            elif lycoris:
                rank = None
                factors = []
                for n in ("1", "2"):
                    if f"lokr_w{n}" in lycoris:
                        factors.append(lycoris[f"lokr_w{n}"].float())
                    else:
                        rank = lycoris[f"lokr_w{n}_b"].shape[0]
                        factors.append(lycoris[f"lokr_w{n}_a"].float() @ lycoris[f"lokr_w{n}_b"].float())
                scale = alpha.item() / rank if alpha is not None and rank is not None else 1.0
                weight += strength * scale * torch.kron(*factors).reshape(weight.shape)
    return sorted(set(lora) - loaded)


LYCORIS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2",
           "lokr_w2_a", "lokr_w2_b")
