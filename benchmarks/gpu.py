"""Real architectures on a GPU, bf16: T5 v1.1 XXL encoder, the SDXL VAE and the demo family's XL
transformer at 1024 px (`tasks.demo.models.REAL_SHAPES`).

Randomly initialised models with the published shapes (the `config.json` of each), saved and loaded through
`from_pretrained` like the real ones, then run through precast's own code:
- text: `encode_captions` (length-sorted, token-budget batches, real tokens only): captions/s;
- latents: the VAE encoder on 1024x1024 images, batch `--vae-batch`: images/s;
- training: LoRA (rank 32, alpha 16) on the transformer from cached features (`trainable_network`,
  `kept_activations`, `diffusion_loss`, fused AdamW) in each memory mode of `MODES` (no
  checkpointing, recompute, offload to host, a bf16 or int8 frozen base), and the recompute step
  with T5 and the VAE encoding the batch online, each at the largest batch that fits (doubling
  until out of memory): samples/s;
- Wan 2.1 (`wan`): its VAE encoder (`AutoencoderKLWan`, published shape) on one 81-frame clip at
  480×832 and 720×1280, whole and tiled (`latent_encoding.tiling`), and two clips at once with and
  without slicing: seconds and peak memory a clip; LoRA on Wan 2.1 T2V 1.3B at 480×832 with
  recompute, batch 1, at 21, 41, 61 and 81 frames (81: 21 × 60 × 104 latents, 32,760 tokens), and
  at 81 with attention held to each of SDPA's fused kernels (flash, memory-efficient, cuDNN) alone. umT5-XXL's encoder is
  T5-XXL's shape (d_model 4096, d_ff 10240, 24 layers): the T5 figure is its cost a token.
Each reports peak GPU memory and model FLOP utilisation: FLOPs counted by
`torch.utils.flop_counter` on one call, against the device's dense bf16 peak; beside it, of the
positions computed (tokens padded to a batch's longest caption, umT5's zeros to 512) those that are
real, and the MFU on them (`positions`): padding is no work done. Without CUDA it is
skipped with a message. `--tiny` runs the same code on small shapes (a check of the code on a CPU).
Usage: python -m benchmarks.gpu [--tiny]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

from configs.schema import ModelConfig, TextEncodingConfig, TrainingConfig
from tasks.demo.models import REAL_SHAPES, TINY_SHAPES, WORDS, write_model_set

# dense bf16 tensor-core peaks (no sparsity), TFLOP/s; the sources are in docs/benchmarks.md
PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0}



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


def allocated(device: torch.device) -> float | None:
    """GiB the allocator holds for tensors now (None without CUDA)."""
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def largest_batch(try_batch: Callable[[int], dict[str, float]], limit: int) -> tuple[int, dict[str, float]]:
    """The figures at the largest power-of-two batch that fits in memory (up to `limit`)."""
    best: tuple[int, dict[str, float]] | None = None
    batch, refused = 1, ""
    while batch <= limit:
        try:
            best = (batch, try_batch(batch))
        except torch.OutOfMemoryError as error:
            refused = str(error).splitlines()[0]
            break
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        batch *= 2
    if best is None:
        raise torch.OutOfMemoryError(f"not even batch 1 fits: {refused}")
    return best


# training memory modes: the settings each changes (bf16 autocast in all)
MODES = {
    "none": {"gradient_checkpointing": "none"},
    "recompute": {"gradient_checkpointing": "recompute"},
    "offload": {"gradient_checkpointing": "offload"},
    "recompute, bf16 base": {"gradient_checkpointing": "recompute", "base_precision": "bf16"},
    "offload, int8 base": {"gradient_checkpointing": "offload", "base_precision": "int8"},
    # 20 of PixArt-Σ XL's 28 blocks streamed from pinned host memory (tasks/train/streaming.py)
    "recompute, bf16 base, 20 blocks streamed": {"gradient_checkpointing": "recompute", "base_precision": "bf16",
                                                 "blocks_to_swap": 20},
}


def lora_step(model: ModelConfig, mode: str, device: torch.device,
              generator: torch.Generator) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """One optimizer step of LoRA training in `mode`, as the trainer takes it (`attention`: the
    context that picks SDPA's kernels; the trainer's order by default)."""
    from tasks.train.loss import Objective, diffusion_loss
    from tasks.train.network import attention_kernels, kept_activations, sampling_module, trainable_network
    from tasks.train.streaming import BlockStreamer

    training = TrainingConfig(lora={"rank": 32, "alpha": 16}, mixed_precision="bf16", device=device.type, **MODES[mode])
    objective = Objective.of(model, training)
    network = trainable_network(model, objective.family, training)
    if training.blocks_to_swap:  # as the trainer streams them: taken out before the network moves (--tiny: all 2)
        blocks = objective.family.denoiser.blocks(sampling_module(network, training))
        BlockStreamer(blocks, min(training.blocks_to_swap, len(blocks)), device)
    network = network.to(device)
    optimizer = torch.optim.AdamW([p for p in network.parameters() if p.requires_grad], lr=1e-4,
                                  fused=device.type == "cuda" or None)

    def step(latents: torch.Tensor, text: dict[str, torch.Tensor], attention: Callable = attention_kernels) -> None:
        with kept_activations(training.gradient_checkpointing, device), attention():
            loss = diffusion_loss(network, objective, latents, text, generator, torch.bfloat16)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


CAPTION_TOKENS = 40  # a Wan caption's real umT5 tokens


def wan_caption(model: ModelConfig, width: int) -> torch.Tensor:
    """A caption of CAPTION_TOKENS as the training reader hands it to Wan's transformer: umT5's
    states zero-padded to its 512 positions (`TextEncoderSpec.rebuilt`)."""
    from tasks.families import family_of

    family = family_of(model)
    (umt5,) = family.text.encoders
    return umt5.rebuilt(torch.randn(CAPTION_TOKENS, width), family.text.length(model, umt5, TextEncodingConfig()))


def positions(real: int, computed: int, items: int) -> dict[str, float]:
    """What of the positions a figure's FLOPs were spent on are real tokens, not padding (or masked
    positions): per item, and their share (`useful`), which scales its MFU to `useful_mfu`."""
    return {"real_positions": real / items, "computed_positions": computed / items, "useful": real / computed}


def rounded(figures: dict[str, Any], peak: float | None) -> dict[str, Any]:
    mfu = figures["tflops"] / peak if peak else None
    figures = {**figures, "mfu": mfu, "useful_mfu": mfu * figures["useful"] if mfu and "useful" in figures else None}
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in figures.items()}


def wan(tiny: bool, device: torch.device, repeat: int, peak: float | None, vae_clips: bool = True) -> dict[str, Any]:
    """Wan 2.1's VAE encoder on clips (whole, tiled, two at once sliced or not) and its 1.3B
    transformer's LoRA step at 21 to 81 frames of 480×832, through precast's loading and training
    code."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from benchmarks.family_costs import WAN_1_3B, WAN_VAE
    from tasks.demo.flow_models import write_tiny_family
    from tasks.encode.latents import encode_pixels
    from tasks.encode.models import load_vae
    from tasks.families import family_of
    from tasks.train.network import attention_kernels
    from storage.shards import collate

    clips = {"480x832": (81, 480, 832), "720x1280": (81, 720, 1280)} if not tiny else \
        {"480x832": (9, 48, 80), "720x1280": (9, 64, 96)}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_tiny_family(Path(tmp) / "wan", "wan", random_vae=True)  # a tiny umT5: see the docstring
        if not tiny:
            with torch.device(device):
                AutoencoderKLWan(**WAN_VAE).to(torch.bfloat16).save_pretrained(folder / "vae")
                WanTransformer3DModel(**WAN_1_3B).to(torch.bfloat16).save_pretrained(folder / "transformer")
        model = ModelConfig(path=str(folder))
        family = family_of(model)
        vae = load_vae(model, family, "bf16", device.type)
        for name, (frames, height, width) in clips.items() if vae_clips else ():
            for setting, batch, tiling, slicing in (("whole", 1, False, False), ("tiled", 1, True, False),
                                                    ("two, sliced", 2, False, True), ("two", 2, False, False)):
                vae.enable_tiling() if tiling else vae.disable_tiling()
                vae.enable_slicing() if slicing else vae.disable_slicing()
                pixels = torch.rand(batch, 3, frames, height, width, dtype=torch.bfloat16) * 2 - 1
                try:
                    with torch.inference_mode():  # `vae` bound now: it is deleted before the LoRA steps
                        figures = measure(lambda vae=vae: encode_pixels(vae, family.codec.vae_pixels(pixels)),
                                          batch, repeat, device)
                    results[f"vae {name} {setting}"] = rounded(figures, peak)
                except torch.OutOfMemoryError:
                    results[f"vae {name} {setting}"] = {"out_of_memory": True}
                finally:
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                print(json.dumps({f"wan vae {name} {setting}": results[f"vae {name} {setting}"]}), flush=True)
        del vae
        transformer = json.loads((folder / "transformer" / "config.json").read_text())
        caption = wan_caption(model, transformer["text_dim"])
        generator = torch.Generator(device).manual_seed(0)
        before = allocated(device)
        step = lora_step(model, "recompute", device, generator)
        # batch 1 at each length, then at 81 frames with SDPA held to each fused kernel alone: on an
        # H100 41 frames peaked at 10.8 GiB and 81 ran out of 80, far past the tokens' ratio; a
        # kernel that cannot serve refuses, naming why
        kernels = {"flash": [SDPBackend.FLASH_ATTENTION], "memory-efficient": [SDPBackend.EFFICIENT_ATTENTION],
                   "cuDNN": [SDPBackend.CUDNN_ATTENTION],
                   # PyTorch's own order on Hopper with a recent cuDNN, which the trainer no longer takes
                   "cuDNN first (PyTorch's order)": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                                     SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]}
        for frames, kernel in [(f, None) for f in (21, 41, 61, 81)] + [(81, name) for name in kernels]:
            _, height, width = clips["480x832"]
            latent = (16, (frames - 1) // 4 + 1, height // 8, width // 8)
            latents = torch.randn(1, *latent, device=device)
            features = {k: v.to(device) for k, v in collate([{"umt5_hidden": caption}]).items()}
            key = f"lora 1.3B {frames}x480x832 recompute" + (f", {kernel} attention only" if kernel else "")
            tokens, where = family.denoiser.image_tokens(transformer, *latent[1:]), "a plain step"
            try:
                attention = partial(sdpa_kernel, kernels[kernel], set_priority=True) if kernel else attention_kernels
                if device.type == "cuda":  # a plain step first: the trainer's own peak, before any counting
                    torch.cuda.reset_peak_memory_stats(device)
                step(latents, features, attention)
                first = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
                where = "counting FLOPs or timing"
                figures = measure(lambda: step(latents, features, attention), 1, repeat, device)
                figures = {**figures, **positions(tokens + CAPTION_TOKENS, tokens + len(caption), 1)}  # cross-attended zeros too
                results[key] = {**rounded(figures, peak), "tokens": tokens, "plain_step_peak_gib": first,
                                "allocated_before_gib": before}
            except (torch.OutOfMemoryError, RuntimeError) as error:
                results[key] = {"refused": f"{where}: {type(error).__name__}: {str(error).splitlines()[0]}",
                                "tokens": tokens}
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            print(json.dumps({key: results[key]}), flush=True)
    return results


def vae_variants(vae, images: torch.Tensor, repeat: int, device: torch.device) -> dict[str, dict[str, float]]:
    """The VAE encoder as `latents` measures it, then with what might lift it above its 15% of
    peak (each on top of the one before): cuDNN's autotuner, channels-last convolutions, the
    encoder compiled. Leaves the VAE as it found it."""
    variants: dict[str, dict[str, float]] = {}
    encoder, autotune = vae.encoder, torch.backends.cudnn.benchmark
    try:
        with torch.inference_mode():
            torch.backends.cudnn.benchmark = True
            variants["cudnn autotuner"] = measure(lambda: vae.encode(images).latent_dist.mean, len(images), repeat,
                                                  device)
            vae.to(memory_format=torch.channels_last)
            pixels = images.contiguous(memory_format=torch.channels_last)
            variants["+ channels last"] = measure(lambda: vae.encode(pixels).latent_dist.mean, len(images), repeat,
                                                  device)
            vae.encoder = torch.compile(encoder)
            variants["+ compiled"] = measure(lambda: vae.encode(pixels).latent_dist.mean, len(images), repeat, device)
    finally:
        torch.backends.cudnn.benchmark, vae.encoder = autotune, encoder
        vae.to(memory_format=torch.contiguous_format)
    for name, figures in variants.items():
        print(json.dumps({f"latents, {name}": figures}), flush=True)
    return variants


def run(tiny: bool = False, captions: int = 256, vae_batch: int = 4, repeat: int = 5, max_batch: int = 64,
        parts: tuple[str, ...] = ("wan", "pixart")) -> dict:
    from tasks.encode.text import encode_captions, length_batches, run_encoder, tokenize
    from storage.shards import collate
    from tasks.encode.models import load_text_encoder, load_vae
    from tasks.families import family_of
    if not torch.cuda.is_available() and not tiny:
        return {"skipped": "no CUDA device: the real-architecture benchmarks need a GPU"}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    shapes = TINY_SHAPES if tiny else REAL_SHAPES
    results: dict[str, Any] = {"device": name, "peak_bf16_tflops": peak, "shapes": "tiny" if tiny else "real"}
    if "wan" in parts:  # first: the newest family's figures
        results["wan"] = wan(tiny, device, min(repeat, 2), peak)
    if "pixart" not in parts:
        return results
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(max(3, min(300, int(rng.lognormvariate(4.1, 0.55))))))
             for _ in range(captions)]
    with tempfile.TemporaryDirectory() as tmp:
        model = ModelConfig(path=str(write_model_set(Path(tmp), shapes["t5"], shapes["vae"], shapes["transformer"],
                                                     torch.bfloat16, device)))
        text = TextEncodingConfig(dtype="bf16", device=device.type, numerics_samples=0, batch_tokens=65536)
        family = family_of(model)
        t5 = family.text.encoders[0]
        encoder = load_text_encoder(model, family, t5, "bf16", device.type, "none")
        ids = tokenize(texts, encoder, text)[0]
        lengths = [len(x) for x in ids]
        # the encoder's calls pad each length-sorted batch to its longest caption
        padded = sum(len(batch) * longest for batch, longest in length_batches(ids, encoder, text))
        results["text"] = {**measure(lambda: encode_captions(texts, model, family, text, t5), captions, repeat, device),
                           **positions(sum(lengths), padded, captions)}
        print(json.dumps({"text": results["text"]}), flush=True)  # as it goes: a run cut short keeps these

        resolution = shapes["resolution"]
        vae = load_vae(model, family, "bf16", device.type)
        images = torch.rand(vae_batch, 3, resolution, resolution, device=device, dtype=torch.bfloat16) * 2 - 1
        with torch.inference_mode():
            results["latents"] = measure(lambda: vae.encode(images).latent_dist.mean, vae_batch, repeat, device)
        print(json.dumps({"latents": results["latents"]}), flush=True)
        results["latents_variants"] = vae_variants(vae, images, repeat, device)

        generator = torch.Generator(device).manual_seed(0)
        latent_side = resolution // 8
        image_tokens = family.denoiser.image_tokens(
            family.denoiser.transformer_class().load_config(model.path, subfolder="transformer"), latent_side, latent_side)

        def cached(step, batch: int) -> dict[str, float]:
            # what the cache hands the trainer: posterior latents and real-length embeddings
            latents = torch.randn(batch, 4, latent_side, latent_side, device=device)
            sequences = [torch.randn(lengths[i % len(lengths)], shapes["t5"]["d_model"]) for i in range(batch)]
            features = {name: value.to(device) for name, value in collate([{"t5_hidden": s} for s in sequences]).items()}
            # each sample's image tokens, and its caption padded to the batch's longest (masked)
            real = sum(image_tokens + len(s) for s in sequences)
            computed = batch * (image_tokens + max(len(s) for s in sequences))
            return {**measure(lambda: step(latents, features), batch, repeat, device), **positions(real, computed, batch)}

        results["training_modes"] = {}
        for mode in MODES:
            # what else is allocated (T5 and the VAE, and anything a mode before left): the plan
            # (tasks/train/plan.py) counts a step's own bytes, the peak less this
            before = allocated(device)
            step = lora_step(model, mode, device, generator)
            batch, figures = largest_batch(lambda size: cached(step, size), max_batch)
            results["training_modes"][mode] = {**figures, "batch": batch, "allocated_before_gib": before}
            print(json.dumps({mode: results["training_modes"][mode]}), flush=True)
            del step
        step = lora_step(model, "recompute", device, generator)

        def online(batch: int) -> dict[str, float]:
            pixels = torch.rand(batch, 3, resolution, resolution, device=device, dtype=torch.bfloat16) * 2 - 1
            batch_texts = [texts[i % len(texts)] for i in range(batch)]

            def encode_and_step() -> None:
                with torch.no_grad():
                    ids = tokenize(batch_texts, encoder, text)[0]
                    hidden = run_encoder(ids, encoder, text)["hidden"]
                    features = collate([{"t5_hidden": h} for h in hidden])
                    latents = vae.encode(pixels).latent_dist.sample(generator).float() * vae.config.scaling_factor
                step(latents, {name: value.to(device) for name, value in features.items()})

            return measure(encode_and_step, batch, repeat, device)

        batch, figures = largest_batch(online, max_batch)
        results["training_online"] = {**figures, "batch": batch}
    results["training_cached"] = results["training_modes"]["recompute"]
    for key in ["text", "latents", "training_cached", "training_online"]:
        results[key] = rounded(results[key], peak)
    results["training_modes"] = {mode: rounded(figures, peak) for mode, figures in results["training_modes"].items()}
    results["latents_variants"] = {name: rounded(figures, peak) for name, figures in results["latents_variants"].items()}
    return results


def rows(result: dict) -> list[tuple[str, str, str, str]]:
    if "skipped" in result:
        return [("real architectures on GPU", "skipped", result["skipped"], "")]

    def mfu(figures: dict) -> str:
        """MFU, and the real positions of those computed: an MFU on padding is no work done."""
        real = (f"; real positions {figures['real_positions']:,.0f} of {figures['computed_positions']:,.0f} an item "
                f"({figures['useful']:.0%})" if "useful" in figures else "")
        useful = f", {figures['useful_mfu']:.1%} on real positions" if figures.get("useful_mfu") is not None else ""
        return (f", MFU {figures['mfu']:.1%}{useful}" if figures.get("mfu") is not None else "") + real

    wan_rows = []
    for figure, figures in result.get("wan", {}).items():
        if "refused" in figures or figures.get("out_of_memory"):
            wan_rows.append((f"Wan 2.1 {figure}", "refused", figures.get("refused", "out of memory"), ""))
        elif figure.startswith("vae"):
            wan_rows.append((f"Wan 2.1 {figure} (81 frames)", f"{1 / figures['per_s']:.2f} s a clip",
                             f"peak {figures['peak_gib']:.1f} GiB{mfu(figures)}", ""))
        else:
            wan_rows.append((f"Wan 2.1 {figure}", f"{figures['per_s']:.3f} samples/s",
                             f"batch 1, {figures['tokens']:,} tokens, peak {figures['peak_gib']:.1f} GiB (a plain "
                             f"step's {figures['plain_step_peak_gib']:.1f}){mfu(figures)}", ""))
    if "text" not in result:
        return wan_rows
    text, latents = result["text"], result["latents"]
    cached, online = result["training_cached"], result["training_online"]
    where = f"{result['device']}, bf16"
    return [
        ("T5 v1.1 XXL encoding", f"{text['per_s']:,.1f} captions/s", f"{where}, peak {text['peak_gib']:.1f} GiB{mfu(text)}", ""),
        ("SDXL VAE encoding, 1024 px", f"{latents['per_s']:,.2f} img/s",
         f"{where}, peak {latents['peak_gib']:.1f} GiB{mfu(latents)}", ""),
        *[(f"SDXL VAE encoding, 1024 px, {name}", f"{figures['per_s']:,.2f} img/s",
           f"{figures['per_s'] / latents['per_s']:.2f}x, peak {figures['peak_gib']:.1f} GiB{mfu(figures)}", "")
          for name, figures in result.get("latents_variants", {}).items()],
        (f"{REAL_SHAPES['name']} LoRA, 1024 px, cached", f"{cached['per_s']:,.2f} samples/s",
         f"batch {cached['batch']}, peak {cached['peak_gib']:.1f} GiB{mfu(cached)}", ""),
        (f"{REAL_SHAPES['name']} LoRA, 1024 px, online", f"{online['per_s']:,.2f} samples/s",
         f"batch {online['batch']}, peak {online['peak_gib']:.1f} GiB{mfu(online)}; cached is "
         f"{cached['per_s'] / online['per_s']:.1f}x", ""),
    ] + [(f"{REAL_SHAPES['name']} LoRA, 1024 px, {mode}", f"{figures['per_s']:,.2f} samples/s",
          f"largest batch {figures['batch']}, peak {figures['peak_gib']:.1f} GiB{mfu(figures)}", "")
         for mode, figures in result["training_modes"].items()] + wan_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true", help="small shapes: check the code on any device")
    parser.add_argument("--parts", default="wan,pixart", help="which: wan, pixart or both (comma-separated)")
    args = parser.parse_args()
    print(json.dumps(run(tiny=args.tiny, parts=tuple(args.parts.split(",")))))


if __name__ == "__main__":
    main()
