"""Tiny but real PixArt-Sigma components, saved in the hub layout: a world the demo can learn.

The folder this writes loads with the same `from_pretrained` calls as the real
PixArt-alpha/PixArt-Sigma-XL-2-*-MS repository, so tests and the demo exercise the production
loading path: `text_encoder/` (T5EncoderModel), `tokenizer/` (a T5 Unigram fast tokenizer built
here from a word list), `vae/` (AutoencoderKL, 8x downsampling), `transformer/`
(PixArtTransformer2DModel with learned sigma) and `scheduler/` (DPM-Solver++, PixArt's betas).

The transformer is random: the demo trains all of it. The VAE is set by hand (`block_vae`) to
encode each 8 x 8 block's mean colour, because a random decoder turns any latents into noise and
nothing the demo learns would show in its samples; the demo's world is flat colours and shapes,
which blocks show, and a trained one took a minute of every demo. The text encoder is random but for two position heads, and the
scheduler predicts v rather than PixArt's epsilon; the comments below say why each is needed.
"""

from __future__ import annotations

import math
import random
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


def build_tokenizer(words: list[str] = WORDS):
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + word, -5.0 - i * 1e-3) for i, word in enumerate(dict.fromkeys(words))]
    chars = string.ascii_letters + string.digits + string.punctuation
    pieces += [(c, -10.0) for c in chars] + [("\u2581" + c, -9.0) for c in chars]
    vocab: dict[str, float] = {}
    for piece, score in pieces:
        vocab.setdefault(piece, score)  # one entry per piece, the first score wins
    return T5Tokenizer(vocab=list(vocab.items()), extra_ids=0, model_max_length=512)


# Carried through a hand-set VAE (`block_vae`, Wan's `set_clip_block_average`): each colour plus
# OFFSET, so that the SiLU after each output norm is linear to 1e-3 of a colour, and a constant
# channel of CONSTANT, which sets the norm's statistics
OFFSET, CONSTANT = 10.0, 1e4


def _pixels(image) -> torch.Tensor:
    import numpy as np

    return torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1).float() / 127.5 - 1


def _palette() -> torch.Tensor:
    from tasks.demo.data import COLORS

    return torch.tensor(list(COLORS.values()), dtype=torch.float32) / 127.5 - 1


def palette_round_trip(vae, side: int = 256, frames: int | None = None) -> dict[str, tuple[float, str, float]]:
    """Each palette colour as a flat `side`-pixel picture (a clip of `frames` frames for a video
    VAE), encoded (posterior mean) and decoded: for each colour's name, the decoded mean colour's
    distance to that colour, the name of the nearest other palette colour and the distance to it
    (0-255 RGB units). The colour comes back when the first distance is the smaller."""
    from tasks.demo.data import COLORS

    names, palette = list(COLORS), _palette()
    flat = palette[:, :, None, None].expand(-1, -1, side, side)
    flat = (flat if frames is None else flat[:, :, None].expand(-1, -1, frames, -1, -1)).contiguous()
    with torch.no_grad():
        decoded = vae.decode(vae.encode(flat).latent_dist.mean).sample.clamp(-1, 1).flatten(2).mean(-1)
    distances = torch.cdist(decoded, palette) * 127.5
    distances[range(len(names)), range(len(names))], own = math.inf, distances.diagonal().clone()
    return {name: (float(own[i]), names[int(distances[i].argmin())], float(distances[i].min()))
            for i, name in enumerate(names)}


def palette_confusions(vae, frames: int | None = None, sides: tuple[int, ...] = (64, 256)) -> list[str]:
    """The palette colours the VAE does not give back clearly at each of `sides` (a crop's size and
    the demo's 256 px by default; clips of `frames` frames for a video VAE): each must decode at
    most half as far from itself as from any other palette colour, so that another machine's
    rounding cannot tip it. Empty when every colour passes."""
    return [f"{name} decodes {own:.0f} from {name} and {other:.0f} from {nearest} at {side} px"
            for side in sides for name, (own, nearest, other) in palette_round_trip(vae, side, frames).items()
            if own > other / 2]


def position_heads(encoder) -> None:
    """Two heads of a T5 encoder's first layer set to look at the next and the previous word. A
    trained T5 attends by position; random position biases are near zero, so each token would come
    out as an average of its caption's words, and "a red circle on a blue background" would read
    like "a blue circle on a red background"."""
    config = encoder.config
    attention = encoder.encoder.block[0].layer[0].SelfAttention
    if type(attention).__name__ == "UMT5Attention":  # a position bias in every layer, its own bucket method
        buckets = attention._relative_position_bucket(torch.tensor([1, -1]))
    else:
        buckets = attention._relative_position_bucket(torch.tensor([1, -1]), num_buckets=config.relative_attention_num_buckets,
                                                      max_distance=config.relative_attention_max_distance)
    with torch.no_grad():
        attention.relative_attention_bias.weight[buckets, torch.arange(2)] = 8.0


def perturb_last_bits(module: torch.nn.Module, seed: int) -> None:
    """Move every floating-point weight of `module` one representable value up or down, at random:
    what another CPU's rounding does to a computation, the robustness benchmark's stand-in for
    another machine."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in module.state_dict().values():
            if tensor.is_floating_point():
                up = torch.rand(tensor.shape, generator=generator) < 0.5
                tensor.copy_(torch.nextafter(tensor, torch.where(up, math.inf, -math.inf).to(tensor.dtype)))


def write_tiny_models(folder: str | Path, seed: int = 0, random_vae: bool = False, perturb: int | None = None) -> Path:
    """Write the tiny PixArt-Sigma model set to `folder` (idempotent: returns early if complete).
    `random_vae` leaves the VAE random (`block_vae`): for tests that need only its shapes and
    loading path. `perturb` (a seed) moves every initial weight by one representable value
    (`perturb_last_bits`)."""
    from diffusers import DPMSolverMultistepScheduler, PixArtTransformer2DModel
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
    text_encoder = T5EncoderModel(text_config)
    if perturb is not None:
        perturb_last_bits(text_encoder, perturb)
    position_heads(text_encoder)
    text_encoder.save_pretrained(folder / "text_encoder")

    with torch.random.fork_rng():  # the transformer's draws stay put
        vae = block_vae(seed, random_weights=random_vae, perturb=perturb)
    vae.save_pretrained(folder / "vae")

    transformer = PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2,
        cross_attention_dim=32, caption_channels=text_config.d_model, sample_size=32, patch_size=2,
        norm_num_groups=8, use_additional_conditions=False,
    )
    if perturb is not None:
        perturb_last_bits(transformer, perturb + 2)
    transformer.save_pretrained(folder / "transformer")

    # v-prediction, not PixArt's epsilon: a background's colour is settled at the noisiest steps,
    # where x_t is nearly all noise, so an epsilon loss hardly depends on the text there and a
    # few minutes of training would not learn it (precast trains both, as each model's config says)
    DPMSolverMultistepScheduler(
        beta_schedule="linear", beta_start=0.0001, beta_end=0.02, num_train_timesteps=1000,
        prediction_type="v_prediction", algorithm_type="dpmsolver++", solver_order=2,
    ).save_pretrained(folder / "scheduler")

    write_model_index(folder)  # last: its presence means the folder is complete
    return folder


# the published shapes (each model's config.json) of T5 v1.1 XXL, the SDXL VAE and PixArt-Sigma XL/2
# at 1024 px, and small ones that check the same code on any device: what write_model_set builds
# for the GPU benchmark
REAL_SHAPES = {
    "name": "PixArt-Sigma XL/2",
    "t5": dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64),
    "vae": dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, sample_size=1024),
    "transformer": dict(num_attention_heads=16, attention_head_dim=72, num_layers=28, caption_channels=4096,
                        cross_attention_dim=1152, sample_size=128),
    "resolution": 1024,
}
TINY_SHAPES = {
    "name": "tiny",
    "t5": dict(vocab_size=32128, d_model=128, d_kv=32, d_ff=320, num_layers=2, num_heads=4),
    "vae": dict(block_out_channels=(32, 32, 64, 64), layers_per_block=1, sample_size=128),
    "transformer": dict(num_attention_heads=2, attention_head_dim=32, num_layers=2, caption_channels=128,
                        cross_attention_dim=64, sample_size=16),
    "resolution": 128,
}


def write_model_set(folder: Path, text_encoder: dict, vae: dict, transformer: dict,
                    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Path:
    """A random model set in the PixArt-Sigma hub layout with the given shapes (keyword arguments of
    T5Config, AutoencoderKL and PixArtTransformer2DModel), for benchmarks that measure real or
    scaled-down architectures through the production loading path."""
    from diffusers import AutoencoderKL, DPMSolverMultistepScheduler, PixArtTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(folder / "tokenizer")
    with torch.device(device):  # random initialisation of billions of parameters is far faster on a GPU
        T5EncoderModel(T5Config(**{"vocab_size": len(tokenizer), "feed_forward_proj": "gated-gelu", "dropout_rate": 0.0,
                                   **text_encoder})) \
            .to(dtype).save_pretrained(folder / "text_encoder")
        AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=32,
                      down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                      scaling_factor=0.13025, **vae).to(dtype).save_pretrained(folder / "vae")
        PixArtTransformer2DModel(in_channels=4, out_channels=8, norm_num_groups=32, use_additional_conditions=False,
                                 **transformer).to(dtype).save_pretrained(folder / "transformer")
    DPMSolverMultistepScheduler(beta_schedule="linear", beta_start=0.0001, beta_end=0.02).save_pretrained(
        folder / "scheduler")
    write_model_index(folder)
    return folder


def write_model_index(folder: Path) -> None:
    """The model_index.json of a PixArt-Sigma folder: what names its pipeline, and so its family."""
    (folder / "model_index.json").write_text(
        '{"_class_name": "PixArtSigmaPipeline", "_diffusers_version": "0.42.1",\n'
        ' "scheduler": ["diffusers", "DPMSolverMultistepScheduler"],\n'
        ' "text_encoder": ["transformers", "T5EncoderModel"],\n'
        ' "tokenizer": ["transformers", "T5Tokenizer"],\n'
        ' "transformer": ["diffusers", "PixArtTransformer2DModel"],\n'
        ' "vae": ["diffusers", "AutoencoderKL"]}\n'
    )


def block_vae(seed: int, channels: int = 4, factors: tuple[float | None, float] = (None, 0.13025),
              random_weights: bool = False, perturb: int | None = None):
    """The demo's `AutoencoderKL` (8x downsampling, `channels` latent channels), set by hand
    (`set_block_average`) with factors fitted to demo pictures (`latent_factors`): the scale alone
    where the published VAE has no shift (PixArt's SDXL VAE), both where it has (Flux's and SD3's);
    or `random_weights` with the published `factors`, for checks of shapes and loading. `perturb`
    moves every weight by one representable value (`perturb_last_bits`)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    # no resnets in the encoder's blocks and no mid-block attention (what a trained one needed to
    # train in a minute); one norm group, as a group per channel would normalise a flat colour away
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=channels, layers_per_block=0, norm_num_groups=1,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8), mid_block_add_attention=False, sample_size=256,
    )
    if not random_weights:
        set_block_average(vae)
    if perturb is not None:
        perturb_last_bits(vae, perturb + 1)
    if not random_weights:
        shift, scale = latent_factors(vae, seed)
        factors = (None if factors[0] is None else shift, scale)
    vae.register_to_config(shift_factor=factors[0], scaling_factor=factors[1])
    return vae


def set_block_average(vae) -> None:
    """Weights for `vae` (`block_vae`'s `AutoencoderKL`) that make it encode each 8 x 8 block's mean
    colour into latent channels 0 to 2 (the others 0) and decode them back as blocks.

    Every residual branch is zeroed, so each block passes its input on; the input convolutions
    spread the colours (plus OFFSET) into channels 0 to 2, their negatives (plus OFFSET) into 4 to 6
    and CONSTANT into 3, so that a position's channels add up to the same whatever its colour and
    the one-group output norms (over channels and positions) see the same mean and std in every
    picture, which their weight and bias then put back; each downsampling averages 2 x 2 pixels
    (the top-left taps of its 3 x 3 kernel at stride 2), each upsampling repeats one (its centre
    tap after the nearest-neighbour resize); the output convolutions take channels 0 to 2 back,
    less OFFSET."""
    from diffusers.models.downsampling import Downsample2D
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.upsampling import Upsample2D

    signs, bias = [1.0, 1.0, 1.0, 0.0, -1.0, -1.0, -1.0], torch.tensor([OFFSET] * 3 + [CONSTANT] + [OFFSET] * 3 + [0.0])

    def carry(conv, taps, weight: float) -> None:  # channels 0 to 6, each to itself
        conv.weight.zero_()
        conv.bias.zero_()
        for channel in range(len(signs)):
            for tap in taps:
                conv.weight[(channel, channel, *tap)] = weight

    with torch.no_grad():
        for module in vae.modules():
            if isinstance(module, ResnetBlock2D):
                module.conv2.weight.zero_()
                module.conv2.bias.zero_()
            elif isinstance(module, Downsample2D):
                carry(module.conv, [(0, 0), (0, 1), (1, 0), (1, 1)], 0.25)
            elif isinstance(module, Upsample2D):
                carry(module.conv, [(1, 1)], 1.0)
        for coder in (vae.encoder, vae.decoder):
            coder.conv_in.weight.zero_()
            coder.conv_in.bias.copy_(bias)
            for channel, sign in enumerate(signs):
                if sign:
                    coder.conv_in.weight[channel, channel % 4, 1, 1] = sign
            norm = coder.conv_norm_out
            norm.weight.fill_(float((bias.var(unbiased=False) + norm.eps).sqrt()))
            norm.bias.fill_(float(bias.mean()))
            coder.conv_out.weight.zero_()
            coder.conv_out.bias.zero_()
            for channel in range(3):
                coder.conv_out.weight[channel, channel, 1, 1] = 1.0
            coder.conv_out.bias[:3] = -OFFSET
        vae.encoder.conv_out.bias[vae.config.latent_channels:] = -20.0  # log-variances: a posterior std of 5e-5
        for conv in (vae.quant_conv, vae.post_quant_conv):
            conv.weight.zero_()
            conv.bias.zero_()
            conv.weight[:, :, 0, 0] = torch.eye(conv.out_channels)


def latent_factors(vae, seed: int) -> tuple[float, float]:
    """The shift and scale that give the posterior means of 64 demo pictures (drawn from `seed`)
    mean 0 and std 1: what Flux and SD3 latents are, `(z - shift_factor) * scaling_factor`."""
    latents = demo_latents(vae, seed)
    return latents.mean().item(), 1.0 / latents.std().item()


def demo_latents(vae, seed: int) -> torch.Tensor:
    """`vae`'s posterior means of 64 demo pictures of 256 px drawn from `seed`: what a hand-set
    VAE's normalisation is fitted on."""
    from tasks.demo.data import draw_scene

    rng = random.Random(seed)
    pictures = torch.stack([_pixels(draw_scene(rng, 256, 256)[0]) for _ in range(64)])
    with torch.no_grad():
        return vae.encode(pictures).latent_dist.mean
