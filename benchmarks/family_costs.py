"""Cost model per family at the published shapes: parameters, LoRA r=32 parameters and cache bytes
per sample, for PixArt-Σ XL/2, FLUX.1-dev and -schnell, SD3.5 Large and Medium, Chroma1-HD, Z-Image
Turbo, Qwen-Image, FLUX.2 [dev] and [klein] and Wan 2.1 T2V 1.3B and 14B (on 81-frame clips at 480p
and 720p).

Why: what a family's caches cost per million samples decides a run's storage, and cannot be
measured without the weights. So every model is built from its published config on the meta device
(no weights, no hub: seconds on 2 CPU cores), which counts every parameter exactly, and the
family's own `denoiser.lora_targets`, `text.encoders` and T5 length decide the rest. What a training
step needs on the device is the memory plan's (`precast plan`, `benchmarks/memory_plan.py`, which
takes its published configs from here). docs/benchmarks.md ("Cost model per family") states these
figures and how they add up.

For one 1024×1024 image (a Wan clip: 81 frames at 480×832 or 720×1280) and one caption of 40 T5
tokens (Chroma also at its 512-token cap):
- parameters of each transformer, text encoder and VAE; LoRA parameters on the family's targets
  (PEFT's own matching, on meta);
- text cache bytes per caption: each encoder's cached outputs in bf16, as its `TextEncoderSpec`
  says (a masked encoder keeps the real tokens and its kept pads, an unmasked one all of T5's
  length); latent cache bytes per image; the frozen base's bytes in bf16, int8 and fp8.
"""

from __future__ import annotations

import importlib
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from configs.schema import ModelConfig, TextEncodingConfig
from tasks.families.chroma import CHROMA
from tasks.families.flux import FLUX
from tasks.families.flux2 import DEV, KLEIN
from tasks.families.pixart import SIGMA
from tasks.families.qwenimage import QWEN_IMAGE
from tasks.families.sd3 import SD3
from tasks.families.spec import Conditioning, Family, TextEncoderSpec
from tasks.families.wan import WAN, latent_frames
from tasks.families.zimage import ZIMAGE

# --- published configs: each model's config.json, checked against diffusers' conversion scripts
# black-forest-labs/FLUX.1-dev transformer (convert_flux_to_diffusers.py: 19 double + 38 single blocks)
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                guidance_embeds=True, axes_dims_rope=(16, 56, 56))
# black-forest-labs/FLUX.1-schnell transformer: dev's without the guidance embedding
FLUX_SCHNELL = dict(FLUX_DEV, guidance_embeds=False)
# lodestones/Chroma1-HD transformer (ChromaTransformer2DModel's defaults)
CHROMA_HD = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                 num_attention_heads=24, joint_attention_dim=4096, axes_dims_rope=(16, 56, 56),
                 approximator_num_channels=64, approximator_hidden_dim=5120, approximator_layers=5)
# stabilityai/stable-diffusion-3.5-large transformer (convert_sd3_to_diffusers.py: heads = layers,
# pos_embed_max_size 192)
SD35_LARGE = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
                  num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                  pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192,
                  dual_attention_layers=(), qk_norm="rms_norm")
# stabilityai/stable-diffusion-3.5-medium transformer (pos_embed_max_size 384, attn2 in blocks 0–12)
SD35_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                   num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                   pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                   dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")
# Tongyi-MAI/Z-Image-Turbo transformer (ZImageTransformer2DModel's defaults: 30 layers of 3840, 2 noise
# and 2 caption refiners, Qwen3-4B's 2560-wide states in)
Z_IMAGE_TURBO = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
                     n_refiner_layers=2, n_heads=30, n_kv_heads=30, cap_feat_dim=2560)
# black-forest-labs/FLUX.2-klein-4B and -9B transformers (diffusers' convert_flux2_to_diffusers.py: 5 + 20
# and 8 + 24 blocks, 24 and 32 heads of 128, three Qwen3 layers' states in)
KLEIN_4B = dict(patch_size=1, in_channels=128, num_layers=5, num_single_layers=20, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=7680, timestep_guidance_channels=256, mlp_ratio=3.0,
                axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, guidance_embeds=False)
KLEIN_9B = dict(KLEIN_4B, num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288)
# black-forest-labs/FLUX.2-dev transformer (Flux2Transformer2DModel's defaults: 8 double + 48 single
# blocks, 48 heads of 128, three Mistral layers' states in, the guidance embedder)
FLUX2_DEV = dict(KLEIN_4B, num_layers=8, num_single_layers=48, num_attention_heads=48, joint_attention_dim=15360,
                 guidance_embeds=True)
# their vae: AutoencoderKLFlux2's defaults (32 channels, 8x, 2x2 patches batch-normalised)
VAE_FLUX2 = dict(latent_channels=32, block_out_channels=(128, 256, 512, 512))
# Qwen/Qwen-Image transformer (QwenImageTransformer2DModel's defaults: 60 dual-stream blocks of 24 × 128,
# Qwen2.5-VL-7B's 3584-wide states in, 2×2-packed latents of 16 channels)
QWEN_IMAGE_20B = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                      num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56))
# its vae: AutoencoderKLQwenImage's defaults (Wan 2.1's layout: z_dim 16, 8x in space)
QWEN_IMAGE_VAE = dict(WAN_VAE_SHAPE := dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                              attn_scales=[], temperal_downsample=[False, True, True]))
# PixArt-alpha/PixArt-Sigma-XL-2-1024-MS transformer
PIXART_SIGMA_XL2_1024 = dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8,
                             num_layers=28, cross_attention_dim=1152, attention_bias=True, sample_size=128,
                             patch_size=2, activation_fn="gelu-approximate", num_embeds_ada_norm=1000,
                             norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
                             caption_channels=4096, interpolation_scale=2, use_additional_conditions=False)
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers and -14B-Diffusers transformers (convert_wan_to_diffusers.py;
# the 14B's are WanTransformer3DModel's defaults)
WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
WAN_14B = dict(WAN_1_3B, num_attention_heads=40, ffn_dim=13824, num_layers=40)
# their vae: AutoencoderKLWan's defaults (z_dim 16; 8x in space, 4x in time), Qwen-Image's layout
WAN_VAE = dict(WAN_VAE_SHAPE)
# google/umt5-xxl's encoder: Wan's text_encoder
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                feed_forward_proj="gated-gelu", relative_attention_num_buckets=32)
# google/t5-v1_1-xxl's encoder: every family's T5 (FLUX.1's text_encoder_2, SD3.5's text_encoder_3)
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              feed_forward_proj="gated-gelu", relative_attention_num_buckets=32)
# Qwen/Qwen2.5-VL-7B-Instruct's language model: Qwen-Image's text_encoder, without its vision tower and head
QWEN2_5_VL_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, rope_scaling={"type": "mrope",
                                                                                  "mrope_section": [16, 24, 24]})
# Qwen/Qwen2.5-VL-7B-Instruct whole: Qwen-Image-Edit's text_encoder, which reads the references through its vision tower
QWEN2_5_VL_7B_SEEING = dict(QWEN2_5_VL_7B, image_token_id=151655, vision_config=dict(
    depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584, patch_size=14,
    spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
    in_channels=3, hidden_act="silu", tokens_per_second=2))
# mistralai/Mistral-Small-3.1-24B-Instruct-2503's language model: FLUX.2 [dev]'s text_encoder,
# without its Pixtral vision tower, projector and vocabulary head
MISTRAL_SMALL_3_1 = dict(vocab_size=131072, hidden_size=5120, intermediate_size=32768, num_hidden_layers=40,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e9)
# Qwen/Qwen3-8B: FLUX.2 [klein] 9B's text_encoder
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
# Qwen/Qwen3-4B: Z-Image's and FLUX.2 [klein] 4B's text_encoder (the bare decoder: the cache reads no vocabulary head)
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
# openai/clip-vit-large-patch14: FLUX.1's and SD3.5's text_encoder
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
              num_attention_heads=12, max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu")
# laion/CLIP-ViT-bigG-14 (OpenCLIP bigG): SD3.5's text_encoder_2
CLIP_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
              num_attention_heads=20, max_position_embeddings=77, projection_dim=1280, hidden_act="gelu")
# FLUX.1's vae (SD3.5's and Chroma's have the same shape)
VAE16 = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
             down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
             layers_per_block=2, use_quant_conv=False, use_post_quant_conv=False)
VAE4 = dict(VAE16, latent_channels=4, use_quant_conv=True, use_post_quant_conv=True)  # SDXL's: PixArt-Σ's vae

# the text encoders (their classes as `TextEncoderSpec.model_class` names them) and the VAEs: name: (library,
# class, config)
ENCODERS = {
    "T5 v1.1 XXL encoder": ("transformers", "T5EncoderModel", T5_XXL),
    "umT5-XXL encoder (Wan)": ("transformers", "UMT5EncoderModel", UMT5_XXL),
    "Qwen3-4B decoder (Z-Image, FLUX.2 [klein] 4B)": ("transformers", "Qwen3Model", QWEN3_4B),
    "Qwen3-8B decoder (FLUX.2 [klein] 9B)": ("transformers", "Qwen3Model", QWEN3_8B),
    "Mistral Small 3.1 24B language model (FLUX.2 [dev])": ("transformers", "MistralModel", MISTRAL_SMALL_3_1),
    "Qwen2.5-VL-7B language model (Qwen-Image)": ("transformers", "Qwen2_5_VLTextModel", QWEN2_5_VL_7B),
    "CLIP-L (CLIPTextModel, FLUX)": ("transformers", "CLIPTextModel", CLIP_L),
    "CLIP-L (WithProjection, SD3)": ("transformers", "CLIPTextModelWithProjection", CLIP_L),
    "CLIP-G (WithProjection, SD3)": ("transformers", "CLIPTextModelWithProjection", CLIP_G),
    "VAE 16-ch (FLUX/SD3.5/Chroma)": ("diffusers", "AutoencoderKL", VAE16),
    "VAE 4-ch (SDXL, PixArt-Σ)": ("diffusers", "AutoencoderKL", VAE4),
    "VAE 3-D (Wan 2.1)": ("diffusers", "AutoencoderKLWan", WAN_VAE),
    "VAE 3-D (Qwen-Image)": ("diffusers", "AutoencoderKLQwenImage", QWEN_IMAGE_VAE),
    "VAE 32-ch (FLUX.2)": ("diffusers", "AutoencoderKLFlux2", VAE_FLUX2),
}
TEXT_CONFIGS = {"t5": T5_XXL, "clip_l": CLIP_L, "clip_g": CLIP_G, "umt5": UMT5_XXL, "qwen3": QWEN3_4B,
                "qwen2_5_vl": QWEN2_5_VL_7B, "mistral3": MISTRAL_SMALL_3_1}  # by `TextEncoderSpec.name`
TEXT_OVERRIDES = {"FLUX.2 [klein] 9B": {"qwen3": QWEN3_8B}}  # a row whose encoder of that name is another size

IMAGE = (1, 1024, 1024)  # frames, height, width of a picture
CLIP_480P, CLIP_720P = (81, 480, 832), (81, 720, 1280)  # Wan's clips: 5 s at 16 fps
CAPTION_TOKENS = 40  # real T5 tokens of a typical caption, </s> included
# Z-Image's chat template around a caption: "<|im_start|>user\n" before it, "<|im_end|>\n<|im_start|>assistant\n"
# after it, 8 Qwen tokens, all of them in the cache
ZIMAGE_TEMPLATE_TOKENS = 8
# Qwen-Image's: the 34 tokens before the caption are dropped, the 5 after it kept
# ("<|im_end|>\n<|im_start|>assistant\n")
QWEN_IMAGE_TEMPLATE_TOKENS = 5
RANK = 32
BF16 = torch.bfloat16
GIB24 = 24 * 2**30  # a "24 GB" card
# name: (family, transformer config, VAE config, the caption's real T5 tokens (None: as many as
# T5's limit), the sample's frames, height and width)
FAMILIES = {
    "PixArt-Σ XL/2": (SIGMA, PIXART_SIGMA_XL2_1024, VAE4, CAPTION_TOKENS, IMAGE),
    "FLUX.1-dev": (FLUX, FLUX_DEV, VAE16, CAPTION_TOKENS, IMAGE),
    "FLUX.1-schnell": (FLUX, FLUX_SCHNELL, VAE16, CAPTION_TOKENS, IMAGE),
    "SD3.5 Large": (SD3, SD35_LARGE, VAE16, CAPTION_TOKENS, IMAGE),
    "SD3.5 Medium": (SD3, SD35_MEDIUM, VAE16, CAPTION_TOKENS, IMAGE),
    "Chroma1-HD (40-token caption)": (CHROMA, CHROMA_HD, VAE16, CAPTION_TOKENS, IMAGE),
    "Chroma1-HD (512 cap)": (CHROMA, CHROMA_HD, VAE16, None, IMAGE),
    "Z-Image Turbo": (ZIMAGE, Z_IMAGE_TURBO, VAE16, CAPTION_TOKENS + ZIMAGE_TEMPLATE_TOKENS, IMAGE),
    # FLUX.2 caches every one of its 512 positions (three layers' states side by side), whatever the caption
    "FLUX.2 [dev]": (DEV, FLUX2_DEV, VAE_FLUX2, CAPTION_TOKENS, IMAGE),
    "FLUX.2 [klein] 4B": (KLEIN, KLEIN_4B, VAE_FLUX2, CAPTION_TOKENS, IMAGE),
    "FLUX.2 [klein] 9B": (KLEIN, KLEIN_9B, VAE_FLUX2, CAPTION_TOKENS, IMAGE),
    "Qwen-Image": (QWEN_IMAGE, QWEN_IMAGE_20B, QWEN_IMAGE_VAE, CAPTION_TOKENS + QWEN_IMAGE_TEMPLATE_TOKENS, IMAGE),
    "Wan 2.1 T2V 1.3B (81 × 480×832)": (WAN, WAN_1_3B, WAN_VAE, CAPTION_TOKENS, CLIP_480P),
    "Wan 2.1 T2V 14B (81 × 480×832)": (WAN, WAN_14B, WAN_VAE, CAPTION_TOKENS, CLIP_480P),
    "Wan 2.1 T2V 14B (81 × 720×1280)": (WAN, WAN_14B, WAN_VAE, CAPTION_TOKENS, CLIP_720P),
}


# --- sizes -------------------------------------------------------------------------------
def count(model: torch.nn.Module) -> dict[str, int]:
    """Parameters, buffers (SD3's persistent pos_embed table is on the GPU too), and what of the
    parameters is `nn.Linear` weights and their output rows (what a weight-only quantization takes)."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    total = sum(p.numel() for p in model.parameters())
    linear_weight = sum(m.weight.numel() for m in linears)
    return dict(params=total, buffers=sum(b.numel() for b in model.buffers()), linear_weight=linear_weight,
                linear_rows=sum(m.out_features for m in linears), other=total - linear_weight)


def base_bytes(c: dict[str, int]) -> dict[str, int]:
    """Frozen base: bf16; int8 and fp8 weight-only as torchao holds them (a byte a nn.Linear
    weight and what a row keeps besides, `tasks.train.plan.ROW_BYTES`; everything else bf16)."""
    from tasks.train.plan import ROW_BYTES

    rest = (c["other"] + c["buffers"]) * 2
    return dict(bf16=(c["params"] + c["buffers"]) * 2,
                **{base: c["linear_weight"] + c["linear_rows"] * row + rest for base, row in ROW_BYTES.items()})


def encoder_params() -> dict[str, int]:
    params = {}
    for name, (library, cls, config) in ENCODERS.items():
        model_class = getattr(importlib.import_module(library), cls)
        with torch.device("meta"):  # a transformers model takes its config object, a diffusers one keywords
            if library == "transformers":
                model = model_class(model_class.config_class(**config))
            else:
                model = model_class(**config)
        params[name] = count(model)["params"]
    return params


# --- caches ------------------------------------------------------------------------------
def model_folder(family: Family, config: dict[str, Any], folder: Path) -> ModelConfig:
    """A model folder holding only what the family's text lengths read: the transformer's
    config.json (FLUX.1's default T5 length: 512 with a guidance embedding, 256 without) and each
    CLIP tokenizer's settings, with the published length (77)."""
    (folder / "transformer").mkdir(parents=True)
    (folder / "transformer" / "config.json").write_text(json.dumps(config))
    for spec in family.text.encoders:
        if spec.tokenizer_length:
            (folder / spec.tokenizer).mkdir()
            (folder / spec.tokenizer / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 77}))
    return ModelConfig(path=str(folder))


def width(spec: TextEncoderSpec, output: str, texts: dict[str, dict]) -> int:
    """The width of one of an encoder's outputs (`texts`: its config by name): a projection model's
    pooled vector is projected; an LLM's states of several layers are side by side."""
    config = texts[spec.name]
    if output == "pooled" and spec.model_class.endswith("WithProjection"):
        return config["projection_dim"]
    return (config.get("d_model") or config["hidden_size"]) * len(getattr(spec, "layers", (-1,)))  # T5's name, CLIP's


def conditioning(family: Family, model: ModelConfig, caption_tokens: int | None, read: bool = False,
                 texts: dict[str, dict] = TEXT_CONFIGS) -> Conditioning:
    """One caption's cached text features, on meta, as the text cache holds them under the default
    `text_encoding` (T5 at the family's own length), or as the training reader gives them (`read`:
    a zero-padded encoder's at its whole length)."""
    text = {}
    for spec in family.text.encoders:
        length = family.text.length(model, spec, TextEncodingConfig())
        ragged = spec.masked and not (read and spec.zero_padded) and not getattr(spec, "padded", False)
        if ragged:  # the real tokens and the pads attended to
            length = min(length, (caption_tokens or length) + spec.pads_kept)
        for output, key in zip(spec.outputs, spec.keys()):
            if output == "pooled":
                text[key] = torch.empty(1, width(spec, output, texts), dtype=BF16, device="meta")
            else:
                text[key] = torch.empty(1, length, width(spec, output, texts), dtype=BF16, device="meta")
                text[f"{key}_mask"] = torch.ones(1, length, dtype=torch.bool, device="meta")
    return text


def text_cache(text: Conditioning) -> dict[str, Any]:
    parts = {key: t.numel() * t.element_size() for key, t in text.items() if not key.endswith("_mask")}
    return dict(parts=parts, total=sum(parts.values()))


def latent_cache(vae: dict[str, Any], sample: tuple[int, int, int]) -> dict[str, int]:
    """precast stores the posterior's mean and std (or the mean only), C × (F) × (H/8) × (W/8) each."""
    values = torch.Size(latent_shape(vae, sample)).numel()
    return {"mean+std fp16/bf16": 2 * values * 2, "mean+std fp32": 2 * values * 4, "mean only fp16/bf16": values * 2}


def latent_shape(vae: dict[str, Any], sample: tuple[int, int, int]) -> tuple[int, ...]:
    """The latents of a sample (frames, height, width): C, h, w for a picture's VAE (each down block
    but the last halves a side); C, F, h, w for Wan's (8x in space; the first frame alone, then 4
    frames a latent frame)."""
    frames, height, width = sample
    if "z_dim" in vae:
        down = 2 ** len(vae["temperal_downsample"])
        return vae["z_dim"], latent_frames(frames, 2 ** sum(vae["temperal_downsample"])), height // down, width // down
    down = 2 ** (len(vae["block_out_channels"]) - 1)
    return vae["latent_channels"], height // down, width // down


# --- LoRA, on meta -------------------------------------------------------------------------
def lora_params(model: torch.nn.Module, targets: list[str]) -> tuple[int, dict[str, dict[str, int]]]:
    """LoRA r=32 on `targets`, as PEFT matches them: its parameters and the modules matched, by block kind."""
    from peft import LoraConfig, inject_adapter_in_model

    with torch.device("meta"):
        inject_adapter_in_model(LoraConfig(r=RANK, lora_alpha=RANK, target_modules=targets), model)
    matched = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and isinstance(getattr(module, "base_layer", None), torch.nn.Linear):
            top = name.split(".")[0]
            leaf = ".".join(name.split(".")[2:]) if top.endswith("blocks") else name
            matched.setdefault(top, {}).setdefault(leaf, 0)
            matched[top][leaf] += 1
    return sum(p.numel() for name, p in model.named_parameters() if "lora_" in name), matched


def family_costs(family: Family, config: dict[str, Any], vae: dict[str, Any], caption_tokens: int | None,
                 sample: tuple[int, int, int], folder: Path, texts: dict[str, dict] = TEXT_CONFIGS) -> dict[str, Any]:
    model_config = model_folder(family, config, folder)
    text, latents = conditioning(family, model_config, caption_tokens, texts=texts), latent_shape(vae, sample)
    with torch.device("meta"):
        model = family.denoiser.transformer_class()(**config)
    sizes = count(model)
    lora, matched = lora_params(model.to(BF16), list(family.denoiser.lora_targets))
    text_tokens = max(t.shape[1] for key, t in text.items() if t.ndim == 3)  # the longest cached sequence
    return dict(cls=family.denoiser.transformer, text_tokens=text_tokens,
                image_tokens=family.denoiser.image_tokens(config, *latents[1:]), sample=sample, latents=latents,
                **sizes, base=base_bytes(sizes), lora_params=lora, matched=matched, text_cache=text_cache(text),
                latent_cache=latent_cache(vae, sample))


def run() -> dict[str, Any]:
    import diffusers
    import peft
    import transformers

    result = {"versions": dict(torch=torch.__version__, diffusers=diffusers.__version__,
                               transformers=transformers.__version__, peft=peft.__version__),
              "encoders": encoder_params(), "families": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (family, config, vae, caption_tokens, sample)) in enumerate(FAMILIES.items()):
            result["families"][name] = family_costs(family, config, vae, caption_tokens, sample, Path(tmp) / str(i),
                                                    {**TEXT_CONFIGS, **TEXT_OVERRIDES.get(name, {})})
    return result


def rows(result: dict) -> list[tuple[str, str, str, str]]:
    out = [("family costs: encoders' parameters", "; ".join(f"{name} {n:,}" for name, n in result["encoders"].items()),
            "", "")]
    for name, row in result["families"].items():
        out.append((f"family costs: {name}", f"{row['params']:,} params; LoRA r={RANK}: {row['lora_params']:,}",
                    f"text cache {row['text_cache']['total']:,} B/caption ({row['text_tokens']} tokens), latents "
                    f"{row['latent_cache']['mean+std fp16/bf16']:,} B/sample (fp16 mean+std, "
                    f"{'×'.join(str(side) for side in row['sample'] if side > 1)}; {row['image_tokens']:,} tokens)", ""))
    return out
