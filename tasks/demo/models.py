"""Tiny but real PixArt-Sigma components, saved in the hub layout: a world the demo can learn.

The folder this writes loads with the same `from_pretrained` calls as the real
PixArt-alpha/PixArt-Sigma-XL-2-*-MS repository, so tests and the demo exercise the production
loading path: `text_encoder/` (T5EncoderModel), `tokenizer/` (a T5 Unigram fast tokenizer built
here from a word list), `vae/` (AutoencoderKL, 8x downsampling), `transformer/`
(PixArtTransformer2DModel with learned sigma) and `scheduler/` (DPM-Solver++, PixArt's betas).

The transformer is random: the demo trains all of it. The VAE is trained here, on pictures like
the demo data's, because a random decoder turns any latents into noise and nothing the demo
learns would show in its samples. The text encoder is random but for two position heads, and the
scheduler predicts v rather than PixArt's epsilon; the comments below say why each is needed.
"""

from __future__ import annotations

import logging
import math
import random
import string
import time
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

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


VAE_STEPS = 2000  # what `precast demo` trains: every seed measured reproduces the palette (docs/design.md)
VAE_ATTEMPTS = 3  # fresh seeds tried before the palette check fails


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


def train_vae(vae, seed: int, steps: int) -> float:
    """Fit `vae` to demo pictures (reconstruction plus a small KL term) and return the scaling factor
    that gives whole pictures' posterior means unit std, as PixArt's latents have.

    A flat palette colour in a quarter of the crops, because a tiny VAE with one norm group learns
    flat colours slowly from scenes alone; 64 px crops (cheap), then 128 px crops for the last 30%,
    so that the statistics of its norms hold at the demo's 256 px and not only at the crop's size;
    a cosine learning-rate decay to settle."""
    from tasks.demo.data import draw_scene

    log.info("training the tiny VAE (%d steps, under a minute on 2 CPU cores)", steps)
    start = time.perf_counter()
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    pool = torch.stack([_pixels(draw_scene(rng, 256, 256)[0]) for _ in range(256)])
    palette = _palette()
    with torch.no_grad():  # a small posterior std from the start, so the decoder learns from clean latents
        vae.quant_conv.bias[vae.config.latent_channels:] = -6.0
    optimizer = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / steps)))
    for step in range(steps):
        crop, batch = (128, 2) if step >= 0.7 * steps else (64, 8)
        x, y = torch.randint(0, pool.shape[-1] - crop + 1, (2,), generator=generator).tolist()
        images = pool[torch.randint(len(pool), (batch,), generator=generator), :, y : y + crop, x : x + crop]
        flat = torch.rand(batch, generator=generator) < 0.25
        colours = palette[torch.randint(len(palette), (batch,), generator=generator)]
        images = torch.where(flat[:, None, None, None], colours[:, :, None, None].expand_as(images), images)
        posterior = vae.encode(images).latent_dist
        loss = F.mse_loss(vae.decode(posterior.sample(generator)).sample, images)
        loss = loss + 1e-4 * posterior.kl().mean() / images[0].numel()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    log.info("tiny VAE trained in %.0f s: last batch loss %.4f (pixel MSE + KL)",
             time.perf_counter() - start, loss.item())
    with torch.no_grad():
        return 1.0 / vae.encode(pool[:64]).latent_dist.mean.std().item()


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


def write_tiny_models(folder: str | Path, seed: int = 0, vae_steps: int = VAE_STEPS, perturb: int | None = None) -> Path:
    """Write the tiny PixArt-Sigma model set to `folder` (idempotent: returns early if complete).
    `vae_steps=0` leaves the VAE untrained: for tests that need only its shapes and loading path.
    A trained VAE must give back every palette colour (`palette_confusions`); it is trained again
    from the next seed when it does not, and after VAE_ATTEMPTS the write fails naming the colours.
    `perturb` (a seed) moves every initial weight by one representable value (`perturb_last_bits`)."""
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

    with torch.random.fork_rng():
        vae = trained_vae(seed, vae_steps, perturb)
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


def trained_vae(seed: int, steps: int, perturb: int | None = None, channels: int = 4,
                factors: tuple[float | None, float] = (None, 0.13025)):
    """The demo's VAE with `channels` latent channels, trained until it gives back every palette
    colour (random, with the published `factors` (shift_factor, scaling_factor), when `steps` is 0).
    A trained one's factors are fitted to demo pictures: the scale alone where the published VAE
    has no shift (PixArt's SDXL VAE), both where it has (Flux's and SD3's, `latent_factors`)."""
    from diffusers import AutoencoderKL

    for attempt in range(VAE_ATTEMPTS if steps else 1):
        attempt_seed = seed + 1000 * attempt
        torch.manual_seed(attempt_seed)  # the caller forked the generator: the transformer's draws stay put
        # No resnets in the encoder's blocks and no mid-block attention, so it trains here in under a
        # minute; one norm group, because a group per channel would normalise a flat colour, the
        # demo's background, away.
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=channels, layers_per_block=0, norm_num_groups=1,
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(8, 8, 8, 8), mid_block_add_attention=False, sample_size=256,
        )
        if perturb is not None:
            perturb_last_bits(vae, perturb + 1)
        if not steps:
            vae.register_to_config(shift_factor=factors[0], scaling_factor=factors[1])
            return vae
        scale = train_vae(vae, attempt_seed, steps)
        if not (confused := palette_confusions(vae)):
            shift, scale = (None, scale) if factors[0] is None else latent_factors(vae, attempt_seed)
            vae.register_to_config(shift_factor=shift, scaling_factor=scale)
            return vae
        log.warning("the tiny VAE (seed %d) confuses palette colours: %s", attempt_seed, "; ".join(confused))
    raise RuntimeError(f"the tiny VAE gives back the wrong palette colours after {VAE_ATTEMPTS} seeds of "
                       f"{steps} steps: {'; '.join(confused)}. Train it longer (--vae-steps).")


def latent_factors(vae, seed: int) -> tuple[float, float]:
    """The shift and scale that give the posterior means of 64 demo pictures (drawn from `seed`)
    mean 0 and std 1: what Flux and SD3 latents are, `(z - shift_factor) * scaling_factor`."""
    from tasks.demo.data import draw_scene

    rng = random.Random(seed)
    pictures = torch.stack([_pixels(draw_scene(rng, 256, 256)[0]) for _ in range(64)])
    with torch.no_grad():
        latents = vae.encode(pictures).latent_dist.mean
    return latents.mean().item(), 1.0 / latents.std().item()
