"""Tiny, randomly initialised but real PixArt-Sigma components, saved in the hub layout.

The folder this writes loads with the same `from_pretrained` calls as the real
PixArt-alpha/PixArt-Sigma-XL-2-*-MS repository, so tests and the demo exercise the production
loading path: `text_encoder/` (T5EncoderModel), `tokenizer/` (a T5 Unigram fast tokenizer built
here from a word list), `vae/` (AutoencoderKL, 8x downsampling), `transformer/`
(PixArtTransformer2DModel with learned sigma) and `scheduler/` (DPM-Solver++, PixArt's betas).
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

# A fixed vocabulary: the demo captions' words plus single characters, so any text tokenizes.
WORDS = """a an the of on in with and or at to from by for is are this that image photo picture
red green blue yellow orange purple white black gray pink cyan brown dark light bright pale
circle square triangle stripe stripes dot dots ring rectangle shape shapes line lines grid pattern
background foreground center corner left right top bottom small large big tiny huge wide tall
soft sharp smooth rough gradient texture color colors colour mixed over under near far beside
painting drawing render illustration scene composition detailed simple abstract geometric
sunset sky sea forest city street portrait landscape minimal style studio lighting shadow""".split()


def build_tokenizer():
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + word, -5.0 - i * 1e-3) for i, word in enumerate(dict.fromkeys(WORDS))]
    chars = string.ascii_letters + string.digits + string.punctuation
    pieces += [(c, -10.0) for c in chars] + [("\u2581" + c, -9.0) for c in chars]
    vocab: dict[str, float] = {}
    for piece, score in pieces:
        vocab.setdefault(piece, score)  # one entry per piece, the first score wins
    return T5Tokenizer(vocab=list(vocab.items()), extra_ids=0, model_max_length=512)


def write_tiny_models(folder: str | Path, seed: int = 0) -> Path:
    """Write the tiny PixArt-Sigma model set to `folder` (idempotent: returns early if complete)."""
    from diffusers import AutoencoderKL, DPMSolverMultistepScheduler, PixArtTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    folder = Path(folder)
    marker = folder / "model_index.json"
    if marker.exists():
        return folder
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(folder / "tokenizer")

    text_config = T5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", relative_attention_num_buckets=8, dropout_rate=0.0,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=0,
    )
    T5EncoderModel(text_config).save_pretrained(folder / "text_encoder")

    AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1, norm_num_groups=8,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 16, 16), sample_size=256, scaling_factor=0.13025,
    ).save_pretrained(folder / "vae")

    PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2,
        cross_attention_dim=32, caption_channels=text_config.d_model, sample_size=32, patch_size=2,
        norm_num_groups=8, use_additional_conditions=False,
    ).save_pretrained(folder / "transformer")

    DPMSolverMultistepScheduler(
        beta_schedule="linear", beta_start=0.0001, beta_end=0.02, num_train_timesteps=1000,
        prediction_type="epsilon", algorithm_type="dpmsolver++", solver_order=2,
    ).save_pretrained(folder / "scheduler")

    # model_index.json last: its presence means the folder is complete
    marker.write_text(
        '{"_class_name": "PixArtSigmaPipeline", "_diffusers_version": "0.42.1",\n'
        ' "scheduler": ["diffusers", "DPMSolverMultistepScheduler"],\n'
        ' "text_encoder": ["transformers", "T5EncoderModel"],\n'
        ' "tokenizer": ["transformers", "T5Tokenizer"],\n'
        ' "transformer": ["diffusers", "PixArtTransformer2DModel"],\n'
        ' "vae": ["diffusers", "AutoencoderKL"]}\n'
    )
    return folder
