"""Real architectures on a GPU, bf16: T5 v1.1 XXL encoder, the SDXL VAE, PixArt-Sigma XL/2 at 1024 px.

Randomly initialised models with the published shapes (the `config.json` of google/t5-v1_1-xxl,
stabilityai/sdxl-vae and PixArt-alpha/PixArt-Sigma-XL-2-1024-MS), saved and loaded through
`from_pretrained` like the real ones, then run through precast's own code:
- text: `encode_captions` (length-sorted, token-budget batches, real tokens only): captions/s;
- latents: the VAE encoder on 1024x1024 images, batch `--vae-batch`: images/s;
- training: LoRA (rank 32, alpha 16) on the transformer from cached features (`trainable_network`,
  `kept_activations`, `diffusion_loss`, fused AdamW) in each memory mode of `MODES` (no
  checkpointing, recompute, offload to host, a bf16 or int8 frozen base), and the recompute step
  with T5 and the VAE encoding the batch online, each at the largest batch that fits (doubling
  until out of memory): samples/s.
Each reports peak GPU memory and model FLOP utilisation: FLOPs counted by
`torch.utils.flop_counter` on one call, against the device's dense bf16 peak. Without CUDA it is
skipped with a message. `--tiny` runs the same code on small shapes (a check of the code on a CPU).
Usage: python -m benchmarks.gpu [--tiny]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from configs.schema import ModelConfig, TextEncodingConfig, TrainingConfig
from tasks.demo.models import WORDS, build_tokenizer

# dense bf16 tensor-core peaks (no sparsity), TFLOP/s; the sources are in docs/benchmarks.md
PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0}

REAL = {
    "t5": dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64),
    "vae": dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, sample_size=1024),
    "transformer": dict(num_attention_heads=16, attention_head_dim=72, num_layers=28, caption_channels=4096,
                        cross_attention_dim=1152, sample_size=128),
    "resolution": 1024,
}
TINY = {
    "t5": dict(d_model=128, d_kv=32, d_ff=320, num_layers=2, num_heads=4),
    "vae": dict(block_out_channels=(32, 32, 64, 64), layers_per_block=1, sample_size=128),
    "transformer": dict(num_attention_heads=2, attention_head_dim=32, num_layers=2, caption_channels=128,
                        cross_attention_dim=64, sample_size=16),
    "resolution": 128,
}


def make_models(folder: Path, shapes: dict[str, Any], device: torch.device) -> ModelConfig:
    from diffusers import AutoencoderKL, DPMSolverMultistepScheduler, PixArtTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(folder / "tokenizer")
    with torch.device(device):  # random initialisation of 4.7B parameters is far faster on the GPU
        T5EncoderModel(T5Config(vocab_size=32128, feed_forward_proj="gated-gelu", dropout_rate=0.0, **shapes["t5"])) \
            .to(torch.bfloat16).save_pretrained(folder / "text_encoder")
        AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=32,
                      down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                      scaling_factor=0.13025, **shapes["vae"]).to(torch.bfloat16).save_pretrained(folder / "vae")
        PixArtTransformer2DModel(in_channels=4, out_channels=8, norm_num_groups=32, use_additional_conditions=False,
                                 **shapes["transformer"]).to(torch.bfloat16).save_pretrained(folder / "transformer")
    DPMSolverMultistepScheduler(beta_schedule="linear", beta_start=0.0001, beta_end=0.02).save_pretrained(
        folder / "scheduler")
    return ModelConfig(path=str(folder))


def counted_flops(work: Callable[[], Any]) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        work()
    return counter.get_total_flops()


def measure(work: Callable[[], Any], items: int, repeat: int, device: torch.device) -> dict[str, float]:
    """Items/s over `repeat` calls after one warm-up, peak memory, and achieved TFLOP/s."""
    work()
    flops = counted_flops(work)
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    for _ in range(repeat):
        work()
    synchronize(device)
    seconds = (time.perf_counter() - started) / repeat
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"per_s": items / seconds, "peak_gib": peak, "tflops": flops / seconds / 1e12}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def largest_batch(try_batch: Callable[[int], dict[str, float]], limit: int) -> tuple[int, dict[str, float]]:
    """The figures at the largest power-of-two batch that fits in memory (up to `limit`)."""
    best: tuple[int, dict[str, float]] | None = None
    batch = 1
    while batch <= limit:
        try:
            best = (batch, try_batch(batch))
        except torch.OutOfMemoryError:
            break
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        batch *= 2
    if best is None:
        raise RuntimeError("not even batch 1 fits")
    return best


# training memory modes: the settings each changes (bf16 autocast in all)
MODES = {
    "none": {"gradient_checkpointing": "none"},
    "recompute": {"gradient_checkpointing": "recompute"},
    "offload": {"gradient_checkpointing": "offload"},
    "recompute, bf16 base": {"gradient_checkpointing": "recompute", "base_precision": "bf16"},
    "offload, int8 base": {"gradient_checkpointing": "offload", "base_precision": "int8"},
}


def run(tiny: bool = False, captions: int = 256, vae_batch: int = 4, repeat: int = 5, max_batch: int = 64) -> dict:
    from tasks.encode.text import encode_captions, run_encoder, tokenize
    from storage.shards import pad_sequences
    from tasks.encode.models import load_noise_scheduler, load_text_encoder, load_vae
    from tasks.train.loss import diffusion_loss
    from tasks.train import kept_activations, trainable_network

    if not torch.cuda.is_available() and not tiny:
        return {"skipped": "no CUDA device: the real-architecture benchmarks need a GPU"}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    shapes = TINY if tiny else REAL
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(max(3, min(300, int(rng.lognormvariate(4.1, 0.55))))))
             for _ in range(captions)]
    with tempfile.TemporaryDirectory() as tmp:
        model = make_models(Path(tmp), shapes, device)
        text = TextEncodingConfig(dtype="bf16", device=device.type, numerics_samples=0, batch_tokens=65536)
        encoder = load_text_encoder(model, "bf16", device.type, "none")
        results: dict[str, Any] = {"device": name, "peak_bf16_tflops": peak, "shapes": "tiny" if tiny else "real"}
        results["text"] = measure(lambda: encode_captions(texts, model, text), captions, repeat, device)

        resolution = shapes["resolution"]
        vae = load_vae(model, "bf16", device.type)
        images = torch.rand(vae_batch, 3, resolution, resolution, device=device, dtype=torch.bfloat16) * 2 - 1
        with torch.inference_mode():
            results["latents"] = measure(lambda: vae.encode(images).latent_dist.mean, vae_batch, repeat, device)

        noise_scheduler = load_noise_scheduler(model)
        generator = torch.Generator(device).manual_seed(0)
        lengths = [len(ids) for ids in tokenize(texts, encoder.tokenizer, text)[0]]
        latent_side = resolution // 8

        def trainer(mode: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
            """One optimizer step of LoRA training in `mode`, as the trainer takes it."""
            training = TrainingConfig(rank=32, alpha=16, mixed_precision="bf16", device=device.type, **MODES[mode])
            network = trainable_network(model, training).to(device)
            optimizer = torch.optim.AdamW([p for p in network.parameters() if p.requires_grad], lr=1e-4,
                                          fused=device.type == "cuda" or None)

            def step(latents: torch.Tensor, embeddings: torch.Tensor, mask: torch.Tensor) -> None:
                with kept_activations(training.gradient_checkpointing, device):
                    loss = diffusion_loss(network, noise_scheduler, latents, embeddings, mask, generator,
                                          torch.bfloat16)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            return step

        def cached(step, batch: int) -> dict[str, float]:
            # what the cache hands the trainer: posterior latents and real-length embeddings
            latents = torch.randn(batch, 4, latent_side, latent_side, device=device)
            sequences = [torch.randn(lengths[i % len(lengths)], shapes["t5"]["d_model"]) for i in range(batch)]
            embeddings, mask = pad_sequences(sequences)
            embeddings, mask = embeddings.to(device), mask.to(device)
            return measure(lambda: step(latents, embeddings, mask), batch, repeat, device)

        results["training_modes"] = {}
        for mode in MODES:
            step = trainer(mode)
            batch, figures = largest_batch(lambda size: cached(step, size), max_batch)
            results["training_modes"][mode] = {**figures, "batch": batch}
            del step
        step = trainer("recompute")

        def online(batch: int) -> dict[str, float]:
            pixels = torch.rand(batch, 3, resolution, resolution, device=device, dtype=torch.bfloat16) * 2 - 1
            batch_texts = [texts[i % len(texts)] for i in range(batch)]

            def encode_and_step() -> None:
                with torch.no_grad():
                    ids, _ = tokenize(batch_texts, encoder.tokenizer, text)
                    embeddings, mask = pad_sequences(run_encoder(ids, encoder, text.batch_tokens))
                    latents = vae.encode(pixels).latent_dist.sample(generator).float() * vae.config.scaling_factor
                step(latents, embeddings.to(device).float(), mask.to(device))

            return measure(encode_and_step, batch, repeat, device)

        batch, figures = largest_batch(online, max_batch)
        results["training_online"] = {**figures, "batch": batch}
    results["training_cached"] = results["training_modes"]["recompute"]

    def rounded(figures: dict[str, Any]) -> dict[str, Any]:
        figures = {**figures, "mfu": figures["tflops"] / peak if peak else None}
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in figures.items()}

    for key in ["text", "latents", "training_cached", "training_online"]:
        results[key] = rounded(results[key])
    results["training_modes"] = {mode: rounded(figures) for mode, figures in results["training_modes"].items()}
    return results


def rows(result: dict) -> list[tuple[str, str, str, str]]:
    if "skipped" in result:
        return [("real architectures on GPU", "skipped", result["skipped"], "")]

    def mfu(figures: dict) -> str:
        return f", MFU {figures['mfu']:.1%}" if figures.get("mfu") is not None else ""

    text, latents = result["text"], result["latents"]
    cached, online = result["training_cached"], result["training_online"]
    where = f"{result['device']}, bf16"
    return [
        ("T5 v1.1 XXL encoding", f"{text['per_s']:,.1f} captions/s", f"{where}, peak {text['peak_gib']:.1f} GiB{mfu(text)}", ""),
        ("SDXL VAE encoding, 1024 px", f"{latents['per_s']:,.2f} img/s",
         f"{where}, peak {latents['peak_gib']:.1f} GiB{mfu(latents)}", ""),
        ("PixArt-Sigma XL/2 LoRA, 1024 px, cached", f"{cached['per_s']:,.2f} samples/s",
         f"batch {cached['batch']}, peak {cached['peak_gib']:.1f} GiB{mfu(cached)}", ""),
        ("PixArt-Sigma XL/2 LoRA, 1024 px, online", f"{online['per_s']:,.2f} samples/s",
         f"batch {online['batch']}, peak {online['peak_gib']:.1f} GiB{mfu(online)}; cached is "
         f"{cached['per_s'] / online['per_s']:.1f}x", ""),
    ] + [(f"PixArt-Sigma XL/2 LoRA, 1024 px, {mode}", f"{figures['per_s']:,.2f} samples/s",
          f"largest batch {figures['batch']}, peak {figures['peak_gib']:.1f} GiB{mfu(figures)}", "")
         for mode, figures in result["training_modes"].items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true", help="small shapes: check the code on any device")
    args = parser.parse_args()
    print(json.dumps(run(tiny=args.tiny)))


if __name__ == "__main__":
    main()
