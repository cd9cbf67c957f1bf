"""Tiny but real FLUX.1 [dev], FLUX.1 [schnell], SD3.5 and Chroma folders in the hub layout.

`write_tiny_family(folder, family)` writes a folder that `DiffusionPipeline.from_pretrained` and the
family's own pipeline (FluxPipeline, StableDiffusion3Pipeline, ChromaPipeline) load as they load the
published repositories (black-forest-labs/FLUX.1-dev and FLUX.1-schnell,
stabilityai/stable-diffusion-3.5-medium, lodestones/Chroma1-HD: Chroma's diffusers folder): the same
component names, classes and `model_index.json`, with no part over about 700k parameters (3 MB a
folder), so that a training step on a CPU takes milliseconds.

- Text: T5 (`build_tokenizer`'s tokenizer, saved as the PixArt writer saves it) with the PixArt
  writer's two position heads, so word order reaches the transformer; CLIP text models with a
  byte-level BPE tokenizer learnt here from the demo's words (`vocab.json`, `merges.txt`, as the
  published tokenizers are stored), so each demo word is one token and any text tokenizes. CLIP-L
  pads with its end token and SD3's CLIP-G with "!" (token 0), as SD3's reference code
  (`SDXLClipGTokenizer(pad_with_end=False)`) and the published tokenizer folders do. The widths keep
  the published proportions that the pipelines depend on: SD3 pads the concatenated CLIP-L and
  CLIP-G states to T5's width, so T5's is the larger, and its pooled vector is both projections.
  The CLIP tokenizers pad to 77 as published (their `model_max_length`, which the pipelines read),
  but SD3's to 16: its transformer reads every CLIP position.
- VAE: 16 latent channels and 8x downsampling, set by hand as the PixArt writer sets its 4-channel
  one (`block_vae`: each 8 x 8 block's mean colour) because a random decoder turns any latents into
  noise. Its `shift_factor` and `scaling_factor` are fitted, so that `(z - shift) * scale` has mean
  0 and std 1 on demo pictures, as the published factors do for real ones; random (`random_vae`,
  for tests of shapes and loading) it carries the published factors. It keeps `quant_conv`, which
  the published Flux and SD3 VAEs drop, as the PixArt one has it.
- Transformers: random (the demo trains them), one or two blocks of six 16-wide heads (wider than a
  token's 64 latent values, as the published ones are), with the
  published layout of inputs: Flux and Chroma take 2x2-packed latents (64 channels) and 3-axis RoPE,
  Flux-dev embeds its guidance, SD3.5 has patch size 2, RMS qk-norm and a dual-attention block.
- Schedulers: FlowMatchEulerDiscreteScheduler as each published `scheduler_config.json` has it:
  FLUX.1-dev shifts with the image's size (mu from 0.5 at 256 tokens to 1.15 at 4096), FLUX.1-schnell
  and Chroma1-HD do not shift (shift 1.0, as diffusers#12112 reads Chroma's config), SD3.5 shifts by 3.0.
"""

from __future__ import annotations

import functools
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

import torch

from tasks.demo.models import CONSTANT, OFFSET, WORDS, block_vae, build_tokenizer, perturb_last_bits, position_heads

BOS, EOS = "<|startoftext|>", "<|endoftext|>"
# published: T5 v1.1 XXL d_model 4096; CLIP-L 768 (quick_gelu); CLIP-G 1280 (gelu); each CLIP 77 tokens
T5_SHAPE = dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)
CLIP_SHAPES = {
    "clip-l": dict(hidden_size=16, intermediate_size=64, projection_dim=16, num_hidden_layers=2,
                   num_attention_heads=2, hidden_act="quick_gelu"),
    "clip-g": dict(hidden_size=32, intermediate_size=128, projection_dim=32, num_hidden_layers=2,
                   num_attention_heads=4, hidden_act="gelu"),
}
CLIP_PADS = {"clip-l": EOS, "clip-g": "!"}

# head width 16 split over RoPE's (text/index, row, column) axes, as the published 128 is (16, 56, 56);
# 6 heads, so the width (96) exceeds a token's 64 latent values, as the published 3072 does: through
# a narrower width the network could not carry a token's noise to its output, and would not denoise
_FLUX_BLOCKS = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
                    num_attention_heads=6, joint_attention_dim=T5_SHAPE["d_model"], axes_dims_rope=(4, 6, 6))
_FLUX = dict(_FLUX_BLOCKS, pooled_projection_dim=CLIP_SHAPES["clip-l"]["hidden_size"])
# the published Flux-dev scheduler; the Flux pipelines read the same keys for mu
_DYNAMIC_SHIFT = dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                      base_image_seq_len=256, max_image_seq_len=4096)
_NO_SHIFT = dict(shift=1.0, use_dynamic_shifting=False)


# published Qwen3-4B (Z-Image's encoder): 2560 wide, 36 layers, 32 query and 8 key-value heads of
# 128; the tiny one keeps grouped queries and three layers, so the one before the last is a middle one
QWEN3_SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, max_position_embeddings=2048, tie_word_embeddings=True)


# published Qwen2.5-VL-7B (Qwen-Image's encoder): text 3584 wide, 28 layers, 28 query and 4 key-value
# heads, its rotary embedding split over (time, height, width) (`mrope_section`, half a head); a
# vision tower the cache never runs
QWEN2_5_VL_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=2048, rope_theta=1e6,
                       rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]})
QWEN2_5_VL_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=14,
                         spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0])


# Qwen2.5-VL-7B-Instruct's published preprocessor_config.json, which the edit pipelines' processor
# folders hold: pictures resized to multiples of 28 between 56² and 3,584² pixels, CLIP's statistics
QWEN2_5_VL_IMAGES = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                     "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                     "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "Qwen2VLImageProcessor",
                     "processor_class": "Qwen2_5_VLProcessor"}


# published Mistral Small 3.1 24B: text 5120 wide, 40 layers, 32 query and 8 key-value heads of 128,
# rope_theta 1e9; the tiny one keeps the 40 layers (FLUX.2 [dev] reads the 10th, 20th and 30th),
# heads of 16 (two of their frequency pairs turn enough at that theta to find the previous word:
# `previous_word_heads`) and a Pixtral vision tower of one layer that the cache never runs
MISTRAL3_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=40, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, rope_theta=1e9, max_position_embeddings=2048)
MISTRAL3_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
                       patch_size=14, image_size=56)


class TinyFamily(NamedTuple):
    pipeline: str  # model_index.json's _class_name
    encoders: tuple[tuple[str, str, str], ...]  # per text encoder: its folders' suffix, its shape, its class
    transformer: str
    transformer_shape: dict
    scheduler: dict  # the scheduler's settings, as the published scheduler_config.json's
    vae_factors: tuple[float, float]  # the published VAE's (shift_factor, scaling_factor)
    scheduler_class: str = "FlowMatchEulerDiscreteScheduler"
    vae: str = "AutoencoderKL"
    vae_shape: dict | None = None  # AutoencoderKLWan's settings, where not Wan 2.1's (`wan_vae`)
    settings: dict | None = None  # the pipeline's own, in model_index.json
    # the CLIP tokenizers' model_max_length, the length the pipelines pad CLIP's captions to (the
    # published 77; the models keep 77 positions either way)
    clip_tokens: int = 77


# Wan 2.1 T2V: umT5 (T5's shape, its own class), the causal 3-D VAE (4x in time, 8x in space,
# normalised per channel by the published latents_mean / latents_std), 1x2x2 patches, RoPE over
# (frame, row, column), and UniPC sampling on flow sigmas shifted by 3.0, as published
# FLUX.2 [klein] 4B: Qwen3 of 36 layers (its 9th, 18th and 27th read; each position's state its word
# and the one before it: `previous_word_heads`), the 32-channel VAE with 2x2
# patches and batch-norm statistics, double and single blocks over one token a patch (128 channels)
# with 4-axis RoPE, no guidance input, distilled (no classifier-free guidance); the scheduler as
# FLUX.2 [dev]'s is published (shift 3.0, dynamic)
_KLEIN = TinyFamily("Flux2KleinPipeline", (("", "qwen3-36", "Qwen3ForCausalLM"),), "Flux2Transformer2DModel",
                    dict(patch_size=1, in_channels=128, num_layers=1, num_single_layers=1, attention_head_dim=16,
                         num_attention_heads=6, joint_attention_dim=3 * QWEN3_SHAPE["hidden_size"],
                         timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False),
                    dict(_DYNAMIC_SHIFT, time_shift_type="exponential"), (0.0, 1.0), vae="AutoencoderKLFlux2",
                    vae_shape=dict(block_out_channels=(8, 16, 32, 32), norm_num_groups=8, layers_per_block=1),
                    settings=dict(is_distilled=True))
_WAN = TinyFamily("WanPipeline", (("", "umt5", "UMT5EncoderModel"),), "WanTransformer3DModel",
                  dict(patch_size=(1, 2, 2), num_attention_heads=6, attention_head_dim=16, in_channels=16,
                       out_channels=16, text_dim=T5_SHAPE["d_model"], freq_dim=32, ffn_dim=128, num_layers=2,
                       rope_max_seq_len=1024),
                  dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0), (0.0, 1.0),
                  "UniPCMultistepScheduler", "AutoencoderKLWan")
_FLUX_TEXT = (("", "clip-l", "CLIPTextModel"), ("_2", "t5", "T5EncoderModel"))
_QWEN_IMAGE = TinyFamily("QwenImagePipeline", (("", "qwen2.5-vl", "Qwen2_5_VLForConditionalGeneration"),),
                         "QwenImageTransformer2DModel",
                         dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
                              num_attention_heads=6, joint_attention_dim=QWEN2_5_VL_TEXT["hidden_size"],
                              axes_dims_rope=(4, 6, 6)),
                         dict(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                              base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                              time_shift_type="exponential"),
                         (0.0, 1.0), vae="AutoencoderKLQwenImage")

FAMILIES = {
    "flux": TinyFamily("FluxPipeline", _FLUX_TEXT, "FluxTransformer2DModel", dict(_FLUX, guidance_embeds=True),
                       _DYNAMIC_SHIFT, (0.1159, 0.3611)),  # FLUX.1 [dev]
    # FLUX.1 Kontext [dev]: FLUX.1 [dev]'s components under the pipeline that edits a reference
    "flux-kontext": TinyFamily("FluxKontextPipeline", _FLUX_TEXT, "FluxTransformer2DModel",
                               dict(_FLUX, guidance_embeds=True), _DYNAMIC_SHIFT, (0.1159, 0.3611)),
    "flux-schnell": TinyFamily("FluxPipeline", _FLUX_TEXT, "FluxTransformer2DModel",
                               dict(_FLUX, guidance_embeds=False), _NO_SHIFT, (0.1159, 0.3611)),
    "sd3": TinyFamily(
        "StableDiffusion3Pipeline",
        (("", "clip-l", "CLIPTextModelWithProjection"), ("_2", "clip-g", "CLIPTextModelWithProjection"),
         ("_3", "t5", "T5EncoderModel")),
        "SD3Transformer2DModel",
        dict(sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
             num_attention_heads=6, caption_projection_dim=96, joint_attention_dim=T5_SHAPE["d_model"],
             pooled_projection_dim=sum(shape["projection_dim"] for shape in CLIP_SHAPES.values()),
             pos_embed_max_size=64, dual_attention_layers=(0,), qk_norm="rms_norm"),
        dict(shift=3.0), (0.0609, 1.5305),
        # its transformer reads both CLIP sequences whole before T5's: 77 positions would be most of
        # a demo step's 173 tokens (64 image, 32 T5) and make it 1.6 times as long; 16 hold the 11
        # words that name a caption's first shape and its background, as T5's 32 do
        clip_tokens=16),
    # Chroma is Flux-schnell's blocks without their modulation, which a small network (the
    # approximator) computes from the timestep instead; it reads T5 alone, masked
    "chroma": TinyFamily("ChromaPipeline", (("", "t5", "T5EncoderModel"),), "ChromaTransformer2DModel",
                         dict(_FLUX_BLOCKS, approximator_num_channels=16, approximator_hidden_dim=32,
                              approximator_layers=2),
                         _NO_SHIFT, (0.1159, 0.3611)),
    # Z-Image Turbo: Qwen3 (its chat template), FLUX.1's VAE, the single-stream transformer with
    # its noise and caption refiners, 2x2 patches and 3-axis RoPE, and a fixed shift of 3.0, as published
    "zimage": TinyFamily("ZImagePipeline", (("", "qwen3", "Qwen3Model"),), "ZImageTransformer2DModel",
                         dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=96, n_layers=2,
                              n_refiner_layers=1, n_heads=6, n_kv_heads=6, cap_feat_dim=QWEN3_SHAPE["hidden_size"],
                              axes_dims=[4, 6, 6], axes_lens=[1024, 64, 64]),
                         dict(shift=3.0, use_dynamic_shifting=False), (0.1159, 0.3611)),
    # Qwen-Image: Qwen2.5-VL (the whole model, its vision tower too, as published), Wan's kind of
    # 3-D VAE under Qwen-Image's class, the dual-stream transformer over 2x2-packed latents (64
    # channels) with 3-axis RoPE, and the published scheduler: an exponential dynamic shift
    # (mu from 0.5 at 256 tokens to 0.9 at 8,192), stretched to end at 0.02
    "qwen-image": _QWEN_IMAGE,
    # Qwen-Image-Edit and Edit-Plus: Qwen-Image's parts under the edit pipelines, the encoder's
    # processor (its image processor and tokenizer) beside it, as published
    "qwen-image-edit": _QWEN_IMAGE._replace(pipeline="QwenImageEditPipeline",
                                            encoders=(("", "qwen2.5-vl-edit", "Qwen2_5_VLForConditionalGeneration"),)),
    "qwen-image-edit-plus": _QWEN_IMAGE._replace(pipeline="QwenImageEditPlusPipeline",
                                                 encoders=(("", "qwen2.5-vl-edit", "Qwen2_5_VLForConditionalGeneration"),)),
    "flux2-klein": _KLEIN,
    # FLUX.2 [dev]: klein's transformer and VAE under Mistral Small 3.1's three layers, with the
    # guidance input (guidance distilled)
    "flux2-dev": _KLEIN._replace(pipeline="Flux2Pipeline",
                                 encoders=(("", "mistral3", "Mistral3ForConditionalGeneration"),),
                                 transformer_shape=dict(_KLEIN.transformer_shape, guidance_embeds=True,
                                                        joint_attention_dim=3 * MISTRAL3_TEXT["hidden_size"]),
                                 settings=None),
    "wan": _WAN,
    # the wan demo's: Wan 2.1's layout and VAE (set by hand to show the demo's colours) under Wan
    # 2.2 TI2V's conditioning (`expand_timesteps`: a timestep a token, so a first frame can be given
    # at timestep 0), so that it samples from text or from text and a first frame
    "wan-ti2v": _WAN._replace(settings=dict(expand_timesteps=True, boundary_ratio=None, transformer_2=[None, None])),
    # Wan 2.2 TI2V-5B: the Wan 2.2 VAE (48 channels; 2 x 2 pixel patches in, 16x in space; residual
    # blocks), 48-channel transformer, one timestep per token (`expand_timesteps`), flow shift 5.0
    "wan2.2-ti2v": TinyFamily("WanPipeline", (("", "umt5", "UMT5EncoderModel"),), "WanTransformer3DModel",
                              dict(patch_size=(1, 2, 2), num_attention_heads=6, attention_head_dim=16, in_channels=48,
                                   out_channels=48, text_dim=T5_SHAPE["d_model"], freq_dim=32, ffn_dim=128,
                                   num_layers=2, rope_max_seq_len=1024),
                              dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0), (0.0, 1.0),
                              "UniPCMultistepScheduler", "AutoencoderKLWan",
                              vae_shape=dict(z_dim=48, is_residual=True, in_channels=12, out_channels=12, patch_size=2,
                                             scale_factor_spatial=16, latents_mean=[0.0] * 48, latents_std=[1.0] * 48),
                              settings=dict(expand_timesteps=True, boundary_ratio=None, transformer_2=[None, None])),
    # Wan 2.2 A14B (text to video): Wan 2.1's layout twice, a high-noise expert (transformer/, the
    # timesteps at or above boundary_ratio × 1000) and a low-noise one (transformer_2/), flow shift
    # 12.0 as the reference code samples T2V A14B
    "wan2.2-a14b": TinyFamily("WanPipeline", (("", "umt5", "UMT5EncoderModel"),), "WanTransformer3DModel",
                              dict(patch_size=(1, 2, 2), num_attention_heads=6, attention_head_dim=16, in_channels=16,
                                   out_channels=16, text_dim=T5_SHAPE["d_model"], freq_dim=32, ffn_dim=128,
                                   num_layers=2, rope_max_seq_len=1024),
                              dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=12.0),
                              (0.0, 1.0), "UniPCMultistepScheduler", "AutoencoderKLWan",
                              settings=dict(expand_timesteps=False, boundary_ratio=0.875)),
}


def write_tiny_family(folder: str | Path, family: str, seed: int = 0, random_vae: bool = False,
                      perturb: int | None = None) -> Path:
    """Write the tiny model folder of `family` (one of FAMILIES) to `folder` (idempotent: returns
    early if complete). Its VAE is set by hand as `write_tiny_models` sets it, or random
    (`random_vae`, for tests of shapes and loading). `perturb` (a seed) moves every initial weight
    by one representable value, as `write_tiny_models` does."""
    import diffusers

    if family not in FAMILIES:
        raise ValueError(f"no tiny model family {family!r}: choose one of {', '.join(FAMILIES)}")
    spec = FAMILIES[family]
    folder = Path(folder)
    marker = folder / "model_index.json"
    if marker.exists():
        return folder
    torch.manual_seed(seed)
    components = _write_text_encoders(folder, spec.encoders, spec.clip_tokens, perturb)
    if spec.vae in ("AutoencoderKLWan", "AutoencoderKLQwenImage"):  # by hand (`set_clip_block_average`), or random
        if not random_vae and spec.vae_shape:
            raise ValueError(f"the tiny {family} VAE is written random only (random_vae): its family has no demo")
        with torch.random.fork_rng():
            wan_vae(seed, perturb, block_average=not random_vae, vae=spec.vae,
                    **(spec.vae_shape or {})).save_pretrained(folder / "vae")
    elif spec.vae == "AutoencoderKLFlux2":  # by hand (`flux2_block_vae`), or random
        with torch.random.fork_rng():
            vae = flux2_vae(seed, perturb, **spec.vae_shape) if random_vae else flux2_block_vae(seed, perturb)
            vae.save_pretrained(folder / "vae")
    else:
        with torch.random.fork_rng():  # the transformer's draws do not depend on the VAE
            block_vae(seed, 16, spec.vae_factors, random_vae, perturb).save_pretrained(folder / "vae")
    experts = ("transformer", "transformer_2") if (spec.settings or {}).get("boundary_ratio") else ("transformer",)
    for name in experts:  # a two-expert model's second: another draw of the same layout
        transformer = getattr(diffusers, spec.transformer)(**spec.transformer_shape)
        if perturb is not None:
            perturb_last_bits(transformer, perturb + 2)
        transformer.save_pretrained(folder / name)
    getattr(diffusers, spec.scheduler_class)(num_train_timesteps=1000, **spec.scheduler).save_pretrained(
        folder / "scheduler")
    components.update(vae=["diffusers", spec.vae], scheduler=["diffusers", spec.scheduler_class],
                      **{name: ["diffusers", spec.transformer] for name in experts})
    index = {"_class_name": spec.pipeline, "_diffusers_version": diffusers.__version__, **components,
             **(spec.settings or {})}
    marker.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")  # last: its presence means complete
    return folder


def _write_text_encoders(folder: Path, encoders, clip_tokens: int, perturb: int | None) -> dict[str, list[str]]:
    """Each text encoder and its tokenizer under their pipeline names; their model_index.json entries."""
    components = {}
    for suffix, encoder, model_class in encoders:
        if encoder in ("t5", "umt5"):
            _write_t5(folder / f"tokenizer{suffix}", folder / f"text_encoder{suffix}", model_class, perturb)
            tokenizer_class = "T5TokenizerFast"  # what the published folders name, the class T5 loads as
        elif encoder.startswith("qwen3"):  # "qwen3-36": 36 layers, as published (FLUX.2 reads three)
            layers = int(encoder.partition("-")[2] or QWEN3_SHAPE["num_hidden_layers"])
            write_qwen3(folder / f"tokenizer{suffix}", folder / f"text_encoder{suffix}", perturb, layers,
                        word_order=layers > QWEN3_SHAPE["num_hidden_layers"])
            tokenizer_class = "Qwen2Tokenizer"
        elif encoder == "mistral3":
            write_mistral3(folder / f"tokenizer{suffix}", folder / f"text_encoder{suffix}", perturb)
            tokenizer_class = "PreTrainedTokenizerFast"  # the published PixtralProcessor's tokenizer (`write_mistral3`)
        elif encoder.startswith("qwen2.5-vl"):  # "qwen2.5-vl-edit": the edit pipelines' processor too
            edit = encoder.endswith("-edit")
            write_qwen2_5_vl(folder / f"tokenizer{suffix}", folder / f"text_encoder{suffix}", perturb,
                             folder / "processor" if edit else None)
            tokenizer_class = "Qwen2Tokenizer"
            if edit:
                components["processor"] = ["transformers", "Qwen2VLProcessor"]
        else:
            _write_clip(folder / f"tokenizer{suffix}", folder / f"text_encoder{suffix}", encoder, model_class,
                        clip_tokens, perturb)
            tokenizer_class = "CLIPTokenizer"
        components[f"tokenizer{suffix}"] = ["transformers", tokenizer_class]
        components[f"text_encoder{suffix}"] = ["transformers", model_class]
    return components


def _write_t5(tokenizer_folder: Path, encoder_folder: Path, model_class: str, perturb: int | None) -> None:
    """T5 v1.1 (`T5EncoderModel`) or umT5 (`UMT5EncoderModel`: a position bias in every layer)."""
    import transformers

    from tasks.demo.videos import VIDEO_WORDS

    # umT5 is the video family's: its demo's words too (added after the others, whose ids stay)
    tokenizer = build_tokenizer(WORDS + VIDEO_WORDS if model_class == "UMT5EncoderModel" else WORDS)
    tokenizer.save_pretrained(tokenizer_folder)
    config_class = transformers.UMT5Config if model_class == "UMT5EncoderModel" else transformers.T5Config
    config = config_class(vocab_size=len(tokenizer), feed_forward_proj="gated-gelu", relative_attention_num_buckets=8,
                          dropout_rate=0.0, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                          decoder_start_token_id=0, **T5_SHAPE)
    encoder = getattr(transformers, model_class)(config)
    if perturb is not None:
        perturb_last_bits(encoder, perturb)
    position_heads(encoder)  # so word order reaches the transformer
    encoder.save_pretrained(encoder_folder)


def _write_clip(tokenizer_folder: Path, encoder_folder: Path, encoder: str, model_class: str, tokens: int,
                perturb: int | None) -> None:
    """A CLIP text model and its BPE tokenizer, stored as the published ones are: vocab.json,
    merges.txt and tokenizer_config.json (transformers builds the fast tokenizer from the first two)."""
    import transformers
    from transformers import CLIPTextConfig

    vocab, merges = _clip_bpe()
    pad = CLIP_PADS[encoder]
    tokenizer_folder.mkdir(parents=True, exist_ok=True)
    (tokenizer_folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (tokenizer_folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
                                                 encoding="utf-8")
    settings = {"tokenizer_class": "CLIPTokenizer", "model_max_length": tokens, "bos_token": BOS, "eos_token": EOS,
                "unk_token": EOS, "pad_token": pad, "do_lower_case": True}
    (tokenizer_folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    # the pooled output is read at the first end token: eos_token_id must be the tokenizer's
    config = CLIPTextConfig(vocab_size=len(vocab), max_position_embeddings=77, bos_token_id=vocab[BOS],
                            eos_token_id=vocab[EOS], pad_token_id=vocab[pad], **CLIP_SHAPES[encoder])
    model = getattr(transformers, model_class)(config)
    if perturb is not None:
        perturb_last_bits(model, perturb)
    model.save_pretrained(encoder_folder)


@functools.cache  # SD3 writes two CLIP tokenizers from one vocabulary
def _clip_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE learnt from WORDS until each is one token: the vocabulary in CLIP's order
    (the 256 byte characters, the same ending a word, the merges' tokens, the start and end tokens),
    so every character has a token, and the merges in the order learnt."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    merges = _learn_merges([[*word[:-1], word[-1] + "</w>"] for word in dict.fromkeys(WORDS)])
    alphabet = list(bytes_to_unicode().values())
    tokens = alphabet + [char + "</w>" for char in alphabet] + [a + b for a, b in merges] + [BOS, EOS]
    return {token: i for i, token in enumerate(tokens)}, merges


def _learn_merges(words: list[list[str]]) -> list[tuple[str, str]]:
    """The merges that make each word (a list of symbols) one token, the most frequent pair merged
    first, ties by the pair's order, so the same merges every time."""
    merges: list[tuple[str, str]] = []
    while pairs := Counter(pair for symbols in words for pair in zip(symbols, symbols[1:])):
        merges.append(min(pairs, key=lambda pair: (-pairs[pair], pair)))
        words = [_merge(symbols, merges[-1]) for symbols in words]
    return merges


# What Qwen3's published chat template renders of system and user messages: each message in its
# role's block, the assistant's opening, and the empty thinking block it adds when enable_thinking
# is false (the published template's other branches, tools and earlier assistant turns, are for
# conversations, which no pipeline gives its encoder)
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# the vision tokens every Qwen tokenizer has, which Qwen2.5-VL's config names
QWEN_VISION = {"vision_start": "<|vision_start|>", "vision_end": "<|vision_end|>", "image": "<|image_pad|>",
               "video": "<|video_pad|>"}
# What Qwen2.5's published chat template renders of system and user messages: a default system
# message where none is given
QWEN2_5_CHAT_TEMPLATE = (
    "{%- if messages[0].role != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
QWEN_ADDED = ("<think>", "</think>")  # added tokens, not special: the published tokenizer decodes them
QWEN_TOKENS = (*QWEN_SPECIALS, *QWEN_ADDED, *QWEN_VISION.values())
def write_qwen_tokenizer(folder: Path, template: str, words: tuple[str, ...] = tuple(WORDS)) -> Any:
    """A Qwen2Tokenizer (the class every Qwen tokenizer folder names) as the published ones are: a
    byte-level BPE (`qwen_bpe`), the specials (end of text, a message's start and end) and the
    thinking tags, the chat `template`, padding with end of text on the right."""
    from transformers import AddedToken, Qwen2Tokenizer

    vocab, merges = qwen_bpe(words)
    tokenizer = Qwen2Tokenizer(vocab=dict(vocab), merges=list(merges), eos_token="<|im_end|>",
                               pad_token="<|endoftext|>", model_max_length=131072, chat_template=template,
                               additional_special_tokens=list(QWEN_SPECIALS[1:]))
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in QWEN_ADDED])
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in QWEN_VISION.values()])
    tokenizer.save_pretrained(folder)
    return tokenizer


@functools.cache  # the same vocabulary for every tiny Qwen tokenizer of a session
def qwen_bpe(words: tuple[str, ...]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE learnt from `words` (and the templates' role names and blank line), each
    alone and after a space (Qwen's pre-tokenizer keeps a word's space), until each is one token:
    the 256 byte characters first, so any text tokenizes, then the merges' tokens and the specials."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()
    words = (*words, "system", "user", "assistant")
    forms = [[alphabet[b] for b in form.encode()] for word in dict.fromkeys(words) for form in (word, " " + word)]
    merges = _learn_merges([*forms, [alphabet[b] for b in b"\n\n"]])
    vocab = {token: i for i, token in enumerate(dict.fromkeys([*alphabet.values(), *(a + b for a, b in merges)]))}
    for token in QWEN_TOKENS:
        vocab[token] = len(vocab)
    return vocab, merges


def write_qwen2_5_vl(tokenizer_folder: Path, encoder_folder: Path, perturb: int | None = None,
                     processor_folder: Path | None = None) -> None:
    """A whole Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`: its vision tower and vocabulary
    head, as the published one is saved) and its tokenizer, whose BPE knows Qwen-Image's template's
    words too (so its prefix is the 34 tokens the pipeline drops, as in the published tokenizer),
    with Qwen2.5's chat template (a default system message). With `processor_folder`, the edit
    pipelines' processor there: the tokenizer, knowing the edit template's words and the pieces the
    published BPE holds whole (" (", "'s", "),"), so its prefix is the 64 tokens they drop, and
    Qwen2.5-VL's published image processor settings."""
    import re

    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from tasks.families.qwenimage import EDIT_TEMPLATE, TEMPLATE

    words = (*WORDS, *dict.fromkeys(re.findall(r"[A-Za-z]+", TEMPLATE)))
    if processor_folder is not None:
        words = (*words, *dict.fromkeys(re.findall(r"[A-Za-z]+", EDIT_TEMPLATE)), "(", "'s", "),")
    tokenizer = write_qwen_tokenizer(tokenizer_folder, QWEN2_5_CHAT_TEMPLATE, words)
    if processor_folder is not None:
        tokenizer.save_pretrained(processor_folder)
        (processor_folder / "preprocessor_config.json").write_text(json.dumps(QWEN2_5_VL_IMAGES, indent=2) + "\n")
    vision = {f"{name}_token_id": tokenizer.convert_tokens_to_ids(token) for name, token in QWEN_VISION.items()}
    ends = dict(bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"), eos_token_id=tokenizer.eos_token_id)
    config = Qwen2_5_VLConfig(text_config=dict(QWEN2_5_VL_TEXT, vocab_size=len(tokenizer), **ends),
                              vision_config=QWEN2_5_VL_VISION, **vision, **ends)
    model = Qwen2_5_VLForConditionalGeneration(config)
    if perturb is not None:
        perturb_last_bits(model, perturb)
    model.save_pretrained(encoder_folder)


# Mistral Small 3.1's published chat template (Mistral-Small-3.1-24B-Instruct-2503's processor, as
# transformers' tests/models/mistral3/test_processing_mistral3.py holds it), FLUX.2 [dev]'s encoder's:
# the begin token, the system message (read from its first text block; a dated assistant persona
# where none is given), each user turn in [INST] (its text blocks, [IMG] for an image block), each
# assistant turn closed by the end token
MISTRAL3_CHAT_TEMPLATE = (
    '{%- set today = strftime_now("%Y-%m-%d") %}\n'
    '{%- set default_system_message = "You are Mistral Small 3, a Large Language Model (LLM) created by Mistral AI, a French startup headquartered in Paris.\\nYour knowledge base was last updated on 2023-10-01. The current date is " + today + ".\\n\\nWhen you\'re not sure about some information, you say that you don\'t have the information and don\'t make up anything.\\nIf the user\'s question is not clear, ambiguous, or does not provide enough context for you to accurately answer the question, you do not try to answer it right away and you rather ask the user to clarify their request (e.g. \\"What are some good restaurants around me?\\" => \\"Where are you?\\" or \\"When is the next flight to Tokyo\\" => \\"Where do you travel from?\\")" %}\n'
    "\n"
    "{{- bos_token }}\n"
    "\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- if messages[0] is string %}\n"
    "        {%- set system_message = messages[0]['content'] %}\n"
    "        {%- set loop_messages = messages[1:] %}\n"
    "    {%- else %} \n"
    "        {%- set system_message = messages[0]['content'][0]['text'] %}\n"
    "        {%- set loop_messages = messages[1:] %}\n"
    "    {%- endif %}\n"
    "{%- else %}\n"
    "    {%- set system_message = default_system_message %}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n"
    "{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}\n"
    "\n"
    "{%- for message in loop_messages %}\n"
    "    {%- if message['role'] == 'user' %}\n"
    "            {%- if message['content'] is string %}\n"
    "            {{- '[INST]' + message['content'] + '[/INST]' }}\n"
    "            {%- else %}\n"
    "                    {{- '[INST]' }}\n"
    "                    {%- for block in message['content'] %}\n"
    "                            {%- if block['type'] == 'text' %}\n"
    "                                    {{- block['text'] }}\n"
    "                            {%- elif block['type'] == 'image' or block['type'] == 'image_url' %}\n"
    "                                    {{- '[IMG]' }}\n"
    "                                {%- else %}\n"
    "                                    {{- raise_exception('Only text and image blocks are supported in message content!') }}\n"
    "                                {%- endif %}\n"
    "                        {%- endfor %}\n"
    "                    {{- '[/INST]' }}\n"
    "                {%- endif %}\n"
    "    {%- elif message['role'] == 'system' %}\n"
    "        {{- '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' }}\n"
    "    {%- elif message['role'] == 'assistant' %}\n"
    "        {%- if message['content'] is string %}\n"
    "            {{- message['content'] + eos_token }}\n"
    "        {%- else %}\n"
    "            {{- message['content'][0]['text'] + eos_token }}\n"
    "        {%- endif %}\n"
    "    {%- else %}\n"
    "        {{- raise_exception('Only user, system and assistant roles are supported!') }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}")
# Mistral's control tokens, first in its vocabulary as published (the image token is 10, the padding 11)
MISTRAL_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]",
                    "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")
def write_mistral3(tokenizer_folder: Path, encoder_folder: Path, perturb: int | None = None) -> None:
    """A whole Mistral Small 3.1 (`Mistral3ForConditionalGeneration`: its vision tower and
    vocabulary head, as FLUX.2 [dev]'s text encoder is saved) and its tokenizer: a byte-level BPE
    whose control tokens come first, which begins each text with <s>, pads with <pad> on the
    right (transformers' default), and carries Mistral Small 3.1's chat template. The published folder is a
    `PixtralProcessor` (that tokenizer and Pixtral's image processor, which needs torchvision,
    which precast does not install); of a text-only conversation the processor renders the same
    template and tokenizes it as the tokenizer does (no second <s>: transformers' rule for both).
    Its vocabulary has the words of FLUX.2 [dev]'s system message too (its template 33 tokens, not
    106 of bytes), and each position's state is its word and the one before it (`previous_word_heads`,
    through the first two frequency pairs: at the published rope_theta of 1e9 the others hardly
    turn), each later layer adding a hundredth of its own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PreTrainedTokenizerFast

    from tasks.families.flux2 import SYSTEM_MESSAGE

    vocab, merges = qwen_bpe((*WORDS, *re.findall(r"[A-Za-z]+", SYSTEM_MESSAGE)))
    vocab = {token: i for i, token in enumerate(dict.fromkeys([*MISTRAL_SPECIALS, *(t for t in vocab
                                                                                  if t not in QWEN_TOKENS)]))}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    bpe.add_special_tokens(list(MISTRAL_SPECIALS))
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>", model_max_length=131072,
                            chat_template=MISTRAL3_CHAT_TEMPLATE).save_pretrained(tokenizer_folder)
    config = Mistral3Config(text_config=dict(MISTRAL3_TEXT, vocab_size=len(vocab)), vision_config=MISTRAL3_VISION,
                            image_token_index=MISTRAL_SPECIALS.index("[IMG]"), spatial_merge_size=2,
                            multimodal_projector_bias=False)
    model = Mistral3ForConditionalGeneration(config)
    if perturb is not None:
        perturb_last_bits(model, perturb)
    previous_word_heads(model.model.language_model, config.text_config, vocab["<pad>"], pairs=2, later=0.01)
    model.save_pretrained(encoder_folder)


def write_qwen3(tokenizer_folder: Path, encoder_folder: Path, perturb: int | None = None,
                layers: int = QWEN3_SHAPE["num_hidden_layers"], word_order: bool = False) -> None:
    """A Qwen3 decoder of `layers` layers (saved with its vocabulary head, as the published
    checkpoints are) and its tokenizer with Qwen3's chat template; with `word_order`, each
    position's state is its word and the word before it (`previous_word_heads`)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = write_qwen_tokenizer(tokenizer_folder, QWEN3_CHAT_TEMPLATE)
    config = Qwen3Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, **dict(QWEN3_SHAPE, num_hidden_layers=layers))
    model = Qwen3ForCausalLM(config)
    if perturb is not None:
        perturb_last_bits(model, perturb)
    if word_order:
        previous_word_heads(model.model, config, tokenizer.pad_token_id)
    model.save_pretrained(encoder_folder)


def previous_word_heads(text, config, pad: int, gain: float = 10.0, pairs: int | None = None,
                        later: float = 0.0) -> None:
    """`text` (a Qwen3 or Mistral decoder, `config` its settings, `pad` its padding token) set so
    that each position's state is its word and the word before it, as `tasks.demo.models.position_heads`
    sets T5 to carry word order: a random causal LM blurs each token into an average of the words
    before it, more with every layer, and at the 9th, 18th and 27th layers that FLUX.2 [klein] reads,
    "a red circle on a blue background" read as the same bag of words as "a blue circle on a red
    background": its demo drew one background colour for every prompt (1 of 12 right; FLUX.1's demo
    with its T5's position heads taken out, 0 to 2).

    The embeddings hold a word in channels 1 to 15, one value for every token in channel 0, and 0
    in channels 16 to 31. The first layer's heads attend to the previous position: their queries and
    keys read only channel 0, so they are the same vectors at every position (after each head's RMS
    norm, Qwen3's; Mistral has none, so every word's embedding is given the same RMS and the first
    layer's input norm divides each by the same number) and the score depends on the distance alone,
    through the rotary embedding (the key is the query turned by one position's angle in each of the
    first `pairs` frequency pairs, all where None, so every pair peaks at the previous position;
    `gain` sets how sharply: at 10, 0.9999 of the weight). The padding token's channel 0 is 0, so a
    padded position (encoded under the mask, and cached: FLUX.2 attends to it) averages the words
    instead: a query peaked one position back would find its nearest words far away, where the
    rotary angles come close to peaking again, and bf16's rounding chose another of them than fp32
    (a padded state 0.81 cosine from fp32's at 512 positions). Their values copy channels 1 to 15
    and the output writes them, at the embeddings' scale, into channels 16 to 31; the MLPs and every
    later layer's attention add their outputs scaled by `later` (0: they pass their input on; a
    little: each layer's states differ, so a cache that reads the wrong layers differs from the
    pipeline's). What is random is the words' embeddings."""
    size, half, width = config.head_dim, config.head_dim // 2, config.hidden_size // 2
    used = half if pairs is None else pairs
    angles = config.rope_parameters["rope_theta"] ** (-torch.arange(half, dtype=torch.float64) * 2 / size)
    kept = (torch.arange(half) < used).double()
    query = torch.cat([torch.ones(used), torch.zeros(size - used)])
    key = torch.cat([angles.cos() * kept, angles.sin() * kept]).float()  # rotate_half's pairs: (i, i + half)
    attention = text.layers[0].self_attn
    normed = hasattr(attention, "q_norm")
    with torch.no_grad():
        embeddings = text.embed_tokens.weight
        embeddings[:, 0] = 0.05
        embeddings[pad, 0] = 0.0
        embeddings[:, width:] = 0.0
        scale = embeddings.pow(2).mean(1).sqrt().mean()  # what the first layer's RMS norm divides by
        if not normed:  # every word at that RMS, so channel 0 reaches the queries and keys as one value
            words = embeddings[:, 1:width]
            words *= ((scale ** 2 * embeddings.shape[1] - 0.05 ** 2) / words.pow(2).sum(1, keepdim=True)).sqrt()
            embeddings[pad, 1:width] = 0.0
        # without a norm, a query's channels are as large as the normed ones at `gain`
        amplitude = 1.0 if normed else gain * (size / used) ** 0.5 * float(scale) / 0.05
        for projection, vector, heads in ((attention.q_proj, query, config.num_attention_heads),
                                          (attention.k_proj, key, config.num_key_value_heads)):
            projection.weight.zero_()
            projection.weight[:, 0] = vector.repeat(heads) * amplitude
        if normed:
            attention.q_norm.weight.fill_(gain)
            attention.k_norm.weight.fill_(gain)
        attention.v_proj.weight.zero_()
        attention.o_proj.weight.zero_()
        group = config.num_attention_heads // config.num_key_value_heads  # query heads a value head serves
        for channel in range(1, width):  # channel c of the previous word into channel width + c - 1
            head, place = divmod(channel - 1, size)
            attention.v_proj.weight[head * size + place, channel] = 1.0
            attention.o_proj.weight[width + channel - 1, head * group * size + place] = scale
        for weight in [layer.mlp.down_proj.weight for layer in text.layers] + [
                layer.self_attn.o_proj.weight for layer in text.layers[1:]]:
            if later:
                weight.mul_(later)
            else:  # +0.0 everywhere (mul_(0) would store -0.0 and change the saved bytes)
                weight.zero_()


def _merge(symbols: list[str], pair: tuple[str, str]) -> list[str]:
    """`symbols` with each occurrence of `pair`, left to right, made one symbol (as BPE encodes)."""
    merged, i = [], 0
    while i < len(symbols):
        if tuple(symbols[i : i + 2]) == pair:
            merged.append(pair[0] + pair[1])
            i += 2
        else:
            merged.append(symbols[i])
            i += 1
    return merged


def wan_vae(seed: int, perturb: int | None = None, block_average: bool = False, vae: str = "AutoencoderKLWan",
            **shape):
    """An `AutoencoderKLWan` of the published Wan 2.1 layout (z_dim 16; 4x in time, 8x in space;
    `shape` changes it, to Wan 2.2's say), or Qwen-Image's copy of it (`vae`:
    `AutoencoderKLQwenImage`), 8 channels wide at the top: random, with the published
    `latents_mean` / `latents_std`, or (for the demo) `block_average`: set by hand to encode each
    8 x 8 block's mean colour and each 4 frames' (`set_clip_block_average`), normalised by the means
    and stds of what it encodes."""
    import diffusers

    torch.manual_seed(seed)
    model = getattr(diffusers, vae)(**{"base_dim": 8, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 1,
                                      "attn_scales": [], "temperal_downsample": [False, True, True], **shape})
    if block_average:
        set_clip_block_average(model)
        model.register_to_config(**_block_factors(model, seed))
    if perturb is not None:
        perturb_last_bits(model, perturb + 1)
    return model


def flux2_vae(seed: int, perturb: int | None = None, **shape):
    """A random `AutoencoderKLFlux2` (32 channels, 2x2 patches) whose batch norm holds statistics
    of a trained one's kind (a mean and a variance per patch channel, not 0 and 1), so that their
    normalisation shows in what is checked of it."""
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(**shape)
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.randn_like(vae.bn.running_mean) * 0.5)
        vae.bn.running_var.copy_(torch.rand_like(vae.bn.running_var) * 2 + 0.25)
    if perturb is not None:
        perturb_last_bits(vae, perturb + 1)
    return vae


def flux2_block_vae(seed: int, perturb: int | None = None):
    """The demo's `AutoencoderKLFlux2`: `block_vae`'s layout and hand-set weights
    (`set_block_average`: each 8 x 8 block's mean colour in latent channels 0 to 2) at 32 latent
    channels, its batch norm holding one mean and variance of demo pictures' 2x2 patches, as
    `latent_factors` fits FLUX.1's shift and scale: the published statistics are per patch channel,
    and the channels the hand-set VAE leaves at 0 would divide by a variance of 0."""
    from diffusers import AutoencoderKLFlux2

    from tasks.demo.models import demo_latents, set_block_average
    from tasks.families.flux2 import patchify

    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(latent_channels=32, layers_per_block=0, norm_num_groups=1, block_out_channels=(8,) * 4,
                             mid_block_add_attention=False, sample_size=256)
    set_block_average(vae)
    if perturb is not None:
        perturb_last_bits(vae, perturb + 1)
    patches = patchify(demo_latents(vae, seed))
    with torch.no_grad():
        vae.bn.running_mean.fill_(patches.mean().item())
        vae.bn.running_var.fill_(patches.var().item())
    return vae


def set_clip_block_average(vae) -> None:
    """Weights for `vae` (a Wan 2.1 `AutoencoderKLWan`, or Qwen-Image's copy of its modules) that
    make it encode each 8 x 8 block's mean
    colour, the first frame alone and then each 4 frames' mean (as its causal chunks take them),
    into latent channels 0 to 2, and decode them back as blocks: a VAE of the published layout
    that gives back every colour and where things are, with no training. Its 3-D VAE does not
    train in minutes on a CPU (300 steps, 2 minutes on 2 cores, still decode every colour as the
    mean grey); the demo's world is flat colours and moving shapes, which blocks show.

    Every residual and attention branch is zeroed, so each block passes its input on; each
    convolution on the path copies channels 0 to 3 (the colours and the constant) from its
    centre tap (the current frame); the spatial downsampling averages 2 x 2 pixels, the temporal
    the last two of its three frames (so two of them take a chunk's four); the temporal
    upsampling repeats a frame. Colours carry OFFSET and a constant channel CONSTANT, as in the
    2-D VAE (`tasks.demo.models.set_block_average`): Wan's norm divides each position's channels
    by their length, which CONSTANT sets to within 1e-6, and its gain multiplies back."""
    def kind(module) -> str:  # Wan's module classes, or the same ones under Qwen-Image's names
        return type(module).__name__.removeprefix("Wan").removeprefix("QwenImage")

    def copy(conv, taps, weights=(1.0,), repeat: int = 1) -> None:
        """`conv` (its weights zeroed first) adds up channels 0 to 3 (those it has) at each of
        `taps` (indices into its kernel) times `weights`, into the same channels of each of its
        `repeat` groups of outputs."""
        conv.weight.zero_()
        conv.bias.zero_()
        group = conv.out_channels // repeat
        for channel in range(min(4, group, conv.in_channels)):
            for r in range(repeat):
                for tap, weight in zip(taps, weights):
                    conv.weight[(r * group + channel, channel, *tap)] = weight

    with torch.no_grad():
        for module in vae.modules():
            if kind(module) == "ResidualBlock":
                module.conv2.weight.zero_()
                module.conv2.bias.zero_()
                if not isinstance(module.conv_shortcut, torch.nn.Identity):
                    copy(module.conv_shortcut, [(0, 0, 0)])
            elif kind(module) == "AttentionBlock":
                module.proj.weight.zero_()
                module.proj.bias.zero_()
            elif kind(module) == "Resample" and module.mode.startswith("down"):
                # 3 x 3 at stride 2 after a zero row and column at the far edges: the top-left 2 x 2
                copy(module.resample[1], [(0, 0), (0, 1), (1, 0), (1, 1)], [0.25] * 4)
                if module.mode == "downsample3d":  # 3 frames at stride 2: the last two
                    copy(module.time_conv, [(1, 0, 0), (2, 0, 0)], [0.5, 0.5])
            elif kind(module) == "Resample" and module.mode.startswith("up"):
                copy(module.resample[1], [(1, 1)])
                if module.mode == "upsample3d":  # two frames of the current one
                    copy(module.time_conv, [(2, 0, 0)], repeat=2)
        for coder in (vae.encoder, vae.decoder):
            copy(coder.conv_in, [(2, 1, 1)])
            coder.conv_in.bias[:3] = OFFSET
            coder.conv_in.bias[3] = CONSTANT
            coder.norm_out.gamma.fill_(CONSTANT / coder.norm_out.scale)
            copy(coder.conv_out, [(2, 1, 1)])
            coder.conv_out.weight[:, 3:] = 0  # the constant stays inside
            coder.conv_out.bias[:3] = -OFFSET
        vae.encoder.conv_out.bias[vae.config.z_dim:] = -20.0  # log-variances: a posterior std of 5e-5
        for conv in (vae.quant_conv, vae.post_quant_conv):
            conv.weight.zero_()
            conv.bias.zero_()
            conv.weight[:, :, 0, 0, 0] = torch.eye(conv.out_channels)


def _block_factors(vae, seed: int) -> dict[str, list[float]]:
    """latents_mean and latents_std that give the colour channels of 64 demo clips' latents
    (drawn from `seed`) mean 0 and std 1, as the published ones do for real videos; the other
    channels are zero, and stay so."""
    import random

    import numpy as np

    from tasks.demo.videos import DEMO_VIDEO, draw_clip

    rng = random.Random(seed)
    clips = torch.stack([torch.from_numpy(np.stack(draw_clip(rng, DEMO_VIDEO["fps"])[0][: DEMO_VIDEO["frames"]]))
                         for _ in range(64)]).permute(0, 4, 1, 2, 3).float() / 127.5 - 1
    with torch.no_grad():
        colours = vae.encode(clips).latent_dist.mean[:, :3].transpose(0, 1).flatten(1)
    channels = vae.config.z_dim - 3
    return {"latents_mean": colours.mean(1).tolist() + [0.0] * channels,
            "latents_std": colours.std(1).tolist() + [1.0] * channels}
