"""The memory plan (`precast plan`, tasks/train/plan.py) for every family at its published shapes,
and beside the steps an H100 measured.

Each family's model folder holds only configs: the tiny family's folder (its schedulers, tokenizers
and model_index.json) with the published config.json of the transformer, the VAE and each text
encoder written over the tiny ones (`benchmarks.family_costs`' configs), so the plan builds the real
shapes on the meta device and runs the trainer's step on fake tensors, as `precast plan` does for a
user's folder. For each family: LoRA r=32, alpha 16, bf16 autocast, batch 1, at 1024² (a Wan clip: 81
frames at 480×832), the captions as long as the text cache holds; each checkpointing mode at a
bf16 and an int8 base (fp8's bytes are int8's within a byte a row); and which setting the plan
chooses on a 24, 48 and 80 GB card at each base: every block resident if it can, else the fewest
blocks streamed from host memory, and what their copies cost a step over PCIe 4.0. And each encode
stage alone: the text encoders at bf16, int8 and bf16 with sequential offload (a batch of 16,384
tokens of the longest captions), the VAE at the defaults (fp32, batch 8).

The H100 check: the rows of docs/benchmarks.md's "GPU: real architectures" (2026-11-26), planned
with their settings: PixArt-Σ XL/2 at 1024², batch 8 (T5 v1.1 XXL and the SDXL VAE were resident
on the card during those steps: their bf16 weights are added), and Wan 2.1 1.3B at 41 frames of
480×832, batch 1, recompute, an fp32 base (the benchmark's "recompute" loads the base as
`from_pretrained` does).
Usage: python -m benchmarks.memory_plan [--families NAME,...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

CARDS = {"24 GB": 24 * 10**9, "48 GB": 48 * 10**9, "80 GB": 80 * 10**9}
# the text encoders' settings planned: as loaded, quantised, streamed a layer at a time (batch_tokens 16,384)
TEXT_SETTINGS = (("bf16", "none"), ("int8", "none"), ("bf16", "sequential"))
MODES = ("none", "recompute", "offload")


def published_folders() -> dict[str, tuple[str, dict[str, Any], dict[str, Any], dict[str, dict], dict[str, Any]]]:
    """name: (tiny family, transformer config, VAE config, text configs by encoder name, the run's
    dataset and latent settings)."""
    from benchmarks import family_costs as c

    image, clip = {"latent_encoding": {"resolution": 1024}}, {"latent_encoding": {"resolution": 624},
                                                             "dataset": {"video": {"frames": 81}}}
    texts = c.TEXT_CONFIGS
    seeing = {**texts, "qwen2_5_vl": c.QWEN2_5_VL_7B_SEEING}  # the vision tower too
    edit = {"path": "unused", "references": "files", "reference_path": "references"}
    return {
        "PixArt-Σ XL/2": ("pixart-sigma", c.PIXART_SIGMA_XL2_1024, c.VAE4, texts, image),
        "FLUX.1-dev": ("flux", c.FLUX_DEV, c.VAE16, texts, image),
        "SD3.5 Large": ("sd3", c.SD35_LARGE, c.VAE16, texts, image),
        "SD3.5 Medium": ("sd3", c.SD35_MEDIUM, c.VAE16, texts, image),
        "Chroma1-HD": ("chroma", c.CHROMA_HD, c.VAE16, texts, image),
        "Z-Image Turbo": ("zimage", c.Z_IMAGE_TURBO, c.VAE16, texts, image),
        "Qwen-Image": ("qwen-image", c.QWEN_IMAGE_20B, c.QWEN_IMAGE_VAE, texts, image),
        "Qwen-Image-Edit (a 1024² reference)": ("qwen-image-edit", c.QWEN_IMAGE_20B, c.QWEN_IMAGE_VAE, seeing,
                                                {**image, "dataset": {"sources": [edit]}}),
        "Qwen-Image-Edit-Plus (two references)": ("qwen-image-edit-plus", c.QWEN_IMAGE_20B, c.QWEN_IMAGE_VAE, seeing,
                                                  {**image, "dataset": {"sources": [{**edit, "reference_path": ["a", "b"]}]}}),
        "FLUX.2 [klein] 4B": ("flux2-klein", c.KLEIN_4B, c.VAE_FLUX2, texts, image),
        "FLUX.2 [klein] 9B": ("flux2-klein", c.KLEIN_9B, c.VAE_FLUX2, {**texts, "qwen3": c.QWEN3_8B}, image),
        "FLUX.2 [dev]": ("flux2-dev", c.FLUX2_DEV, c.VAE_FLUX2, texts, image),
        "Wan 2.1 T2V 1.3B (81 × 480×832)": ("wan", c.WAN_1_3B, c.WAN_VAE, texts, clip),
        "Wan 2.1 T2V 14B (81 × 480×832)": ("wan", c.WAN_14B, c.WAN_VAE, texts, clip),
    }


def write_published(folder: Path, tiny: str, transformer: dict, vae: dict, texts: dict[str, dict]) -> Path:
    """The tiny family's folder with the published configs written over its own."""
    from tasks.demo.flow_models import write_tiny_family
    from tasks.demo.models import write_tiny_models
    from tasks.families import family_of
    from configs.schema import ModelConfig

    folder = write_tiny_models(folder, random_vae=True) if tiny == "pixart-sigma" else \
        write_tiny_family(folder, tiny, random_vae=True)
    family = family_of(ModelConfig(path=str(folder)))
    over(folder / "transformer" / "config.json", transformer, whole=True)
    over(folder / "vae" / "config.json", vae, whole=True)
    for spec in family.text.encoders:
        over(folder / spec.folder / "config.json", texts[spec.name])
        if spec.tokenizer_length:  # CLIP's published length
            over(folder / spec.tokenizer / "tokenizer_config.json", {"model_max_length": 77})
    return folder


def over(path: Path, published: dict, whole: bool = False) -> None:
    """`path`'s JSON with `published` written over it (and over its language model's, a multimodal
    one's); `whole`: only its class left of it (a diffusers model's config: the rest at the class's defaults)."""
    config = json.loads(path.read_text())
    if whole:
        config = {key: value for key, value in config.items() if key.startswith("_")}
    plain = {key: list(value) if isinstance(value, tuple) else value for key, value in published.items()}
    for part in (config, config.get("text_config")):
        if isinstance(part, dict):
            part.update(plain if part is config else {k: v for k, v in plain.items() if k != "vision_config"})
            if "num_hidden_layers" in plain:  # the tiny model's list of its layers' kinds: the class's default
                part.pop("layer_types", None)
    path.write_text(json.dumps(config))


def plan_family(folder: Path, settings: dict[str, Any], training: dict[str, Any], bases=("bf16", "int8"),
                modes=MODES) -> dict[str, Any]:
    from configs.schema import PipelineConfig
    from tasks.families import family_of
    from tasks.train.plan import LINKS, choose, config_shapes, footprint

    dataset = {"sources": [{"path": "unused"}], **settings.get("dataset", {})}
    config = PipelineConfig(**{**settings, "dataset": dataset, "model": {"path": str(folder)},
                               "training": {"batch_size": 1, "mixed_precision": "bf16", "base_precision": "bf16",
                                            "lora": {"rank": 32, "alpha": 16}, **training}})
    family = family_of(config.model)
    shapes, steps = config_shapes(config, family), {}
    rows = [footprint(config.model, config.training, family, shapes, base, mode, steps) for base in bases
            for mode in modes]
    chosen = {}
    for card, size in CARDS.items():
        for base in bases:
            own = [f for f in rows if f.base_precision == base]
            candidates = own + [s for f in own if not f.fits(size) and (s := f.streaming(size)) is not None]
            pick = choose(candidates, config.training.model_copy(update={"base_precision": base}), size)
            chosen[f"{card} {base}"] = None if pick is None else {
                "checkpointing": pick.checkpointing, "blocks_to_swap": pick.blocks_to_swap,
                "of_blocks": len(pick.blocks), "total_gb": pick.total / 1e9,
                "streamed_gb_a_step": 2 * pick.streamed / 1e9,
                "pcie4_seconds": pick.seconds_streaming(LINKS["PCIe 4.0 x16"])}
    return {"latent": list(shapes.latent), "lengths": shapes.lengths, "tokens": rows[0].tokens,
            "rows": {f"{f.base_precision} {f.checkpointing}": figures(f) for f in rows}, "choice": chosen,
            "encoders": encoder_rows(config, family, shapes)}


def encoder_rows(config, family, shapes) -> dict[str, dict[str, dict[str, Any]]]:
    """Each encode stage's plan: the text encoders at each of TEXT_SETTINGS, the VAE at the config's."""
    from tasks.train.plan import encoder_footprints

    encoders: dict[str, dict[str, dict[str, Any]]] = {}
    for dtype, offload in TEXT_SETTINGS:
        text = config.text_encoding.model_copy(update={"dtype": dtype, "offload": offload})
        for e in encoder_footprints(config.model_copy(update={"text_encoding": text}), family, shapes):
            if e.name != "vae" or not encoders.get("vae"):
                encoders.setdefault(e.name, {})[e.setting] = {
                    "weights_gb": e.weights / 1e9, "call_gb": e.call / 1e9, "total_gb": e.total / 1e9,
                    "batch": e.batch, "length": e.length,
                    "fits": [card for card, size in CARDS.items() if e.fits(size)]}
    return encoders


def figures(f) -> dict[str, Any]:
    return {"weights_gb": f.weights / 1e9, "trained_gb": f.trainable / 1e9, "step_gb": f.step / 1e9,
            "total_gb": f.total / 1e9, "total_gib": f.total / 2**30, "host_gb": f.host / 1e9,
            "largest_mib": f.largest / 2**20, "batch": f.batch,
            "at_peak": [[op, module, round(nbytes / 2**20, 1)] for op, module, nbytes in f.ledger[:5]]}


def h100_check(tmp: Path) -> dict[str, Any]:
    """The plan at the H100 rows' settings, and those rows (GiB, max_memory_allocated)."""
    import torch

    from benchmarks import family_costs as c
    from tasks.demo.models import REAL_SHAPES

    measured = {"none": 63.9, "recompute": 18.7, "offload": 15.1, "recompute, bf16 base": 15.8,
                "offload, int8 base": 13.6}
    settings = {"none": ("fp32", "none"), "recompute": ("fp32", "recompute"), "offload": ("fp32", "offload"),
                "recompute, bf16 base": ("bf16", "recompute"), "offload, int8 base": ("int8", "offload")}
    # resident during those steps: T5 v1.1 XXL's encoder and the SDXL VAE, bf16 (gpu.py loads them first)
    with torch.device("meta"):
        from diffusers import AutoencoderKL
        from transformers import T5Config, T5EncoderModel

        t5 = T5EncoderModel(T5Config(**REAL_SHAPES["t5"]))
        vae = AutoencoderKL(**{**c.VAE4})
    resident = 2 * (sum(p.numel() for p in t5.parameters()) + sum(p.numel() for p in vae.parameters()))
    folder = write_published(tmp / "pixart-h100", "pixart-sigma", c.PIXART_SIGMA_XL2_1024, c.VAE4, c.TEXT_CONFIGS)
    out = {"resident_encoders_gib": resident / 2**30, "pixart": {}}
    steps: dict = {}
    from configs.schema import PipelineConfig
    from tasks.families import family_of
    from tasks.train.plan import config_shapes, footprint

    config = PipelineConfig(dataset={"sources": [{"path": "unused"}]}, model={"path": str(folder)},
                            latent_encoding={"resolution": 1024},
                            training={"batch_size": 8, "mixed_precision": "bf16", "lora": {"rank": 32, "alpha": 16}})
    family = family_of(config.model)
    shapes = config_shapes(config, family)
    for name, (base, mode) in settings.items():
        f = footprint(config.model, config.training, family, shapes, base, mode, steps)
        planned = (f.total + resident) / 2**30
        out["pixart"][name] = {"planned_gib": planned, "measured_gib": measured[name],
                               "difference": planned / measured[name] - 1}
    wan = write_published(tmp / "wan-h100", "wan", c.WAN_1_3B, c.WAN_VAE, c.TEXT_CONFIGS)
    for frames, measured_gib in ((41, 10.8), (81, None)):
        result = plan_family(wan, {"latent_encoding": {"resolution": 624}, "dataset": {"video": {"frames": frames}}},
                             {"base_precision": "fp32"}, bases=("fp32",), modes=("recompute",))
        planned = result["rows"]["fp32 recompute"]["total_gib"]
        out[f"wan 1.3B {frames} frames"] = {"tokens": result["tokens"], "planned_gib": planned,
                                            "measured_gib": measured_gib,
                                            "difference": planned / measured_gib - 1 if measured_gib else None,
                                            "at_peak": result["rows"]["fp32 recompute"]["at_peak"],
                                            "largest_mib": result["rows"]["fp32 recompute"]["largest_mib"]}
    return out


def run(families: tuple[str, ...] | None = None, check: bool = True) -> dict[str, Any]:
    results: dict[str, Any] = {"families": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (tiny, transformer, vae, texts, settings)) in enumerate(published_folders().items()):
            if families and name not in families:
                continue
            began = time.perf_counter()
            folder = write_published(Path(tmp) / str(i), tiny, transformer, vae, texts)
            results["families"][name] = {**plan_family(folder, settings, {}),
                                         "seconds": round(time.perf_counter() - began, 1)}
            print(json.dumps({name: results["families"][name]["choice"]}), flush=True)
        if check:
            results["h100"] = h100_check(Path(tmp))
    return results


def rows(result: dict) -> list[tuple[str, str, str, str]]:
    out = []
    for name, family in result["families"].items():
        r = family["rows"]
        out.append((f"memory plan: {name}",
                    f"{r['bf16 recompute']['total_gb']:.1f} GB bf16 base, {r['int8 recompute']['total_gb']:.1f} GB "
                    f"int8 (recompute)",
                    "; ".join(f"{card}: {describe(pick)}" for card, pick in family["choice"].items()), ""))
        for encoder, settings in family.get("encoders", {}).items():
            out.append((f"memory plan: {name}, encoding with {encoder}",
                        "; ".join(f"{setting}: {e['total_gb']:.1f} GB" for setting, e in settings.items()),
                        "; ".join(f"{setting}: {', '.join(e['fits']) or 'no card'}" for setting, e in settings.items()),
                        ""))
    for name, row in result.get("h100", {}).get("pixart", {}).items():
        out.append((f"memory plan vs H100: PixArt-Σ XL/2 batch 8, {name}",
                    f"{row['planned_gib']:.1f} GiB planned", f"{row['measured_gib']} GiB measured "
                    f"({row['difference']:+.1%})", "within 10%"))
    for key in ("wan 1.3B 41 frames", "wan 1.3B 81 frames"):
        if row := result.get("h100", {}).get(key):
            measured = f"{row['measured_gib']} GiB measured ({row['difference']:+.1%})" if row["measured_gib"] else \
                "out of 80 GB on the H100 (cuDNN's attention first)"
            out.append((f"memory plan vs H100: {key}", f"{row['planned_gib']:.1f} GiB planned", measured, ""))
    return out


def describe(pick: dict | None) -> str:
    if pick is None:
        return "none fits"
    streamed = f", {pick['blocks_to_swap']}/{pick['of_blocks']} blocks streamed" if pick["blocks_to_swap"] else ""
    return f"{pick['checkpointing']}{streamed}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--families", help="comma-separated names (default: all)")
    args = parser.parse_args()
    print(json.dumps(run(tuple(args.families.split(",")) if args.families else None)))


if __name__ == "__main__":
    main()
