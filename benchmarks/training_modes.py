"""Training's memory and speed modes side by side, in one run on the same cached features.

Each mode is precast's `train` with one setting changed from the plain run (no checkpointing, an
fp32 base, fp32 compute, batches counted in samples), in its own process so its peak memory
(VmHWM) is its own: samples/s, peak memory and how much training added to it. Two figures that do not depend on where the model runs
are measured on one micro-batch through the same code (`trainable_network`, `kept_activations`,
`diffusion_loss`): the bytes of activations backward keeps on the device per sample (what offload
moves to host memory; on a CPU host and device are one memory, so max RSS cannot show it), and the
bytes of the frozen base's weights. The transformer is the demo family's, small; its latents are
64x64 (1,024 image tokens per sample). Usage: python -m benchmarks.training_modes [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.training import config_for, peak_rss_mib, prepare

# mode: the training settings it changes
MODES = {
    "plain": {},
    "recompute": {"gradient_checkpointing": "recompute"},
    "offload": {"gradient_checkpointing": "offload"},
    "bf16 autocast": {"mixed_precision": "bf16"},
    "bf16 base": {"mixed_precision": "bf16", "base_precision": "bf16"},
    "int8 base": {"base_precision": "int8"},
    "token budget": {"batch_tokens": None},  # set to `batch` images of the largest bucket
}


def mode_config(workdir: Path, steps: int, batch: int, mode: str, budget: int):
    config = config_for(workdir, steps, batch)
    changes = {**MODES[mode], **({"batch_tokens": budget} if mode == "token budget" else {})}
    training = config.training.updated({"lora.rank": 32, "lora.alpha": 16, "validation.samples": 0, "log_every": steps,
                                        **changes})
    return config.updated({"training": training.model_dump(), "latent_encoding.resolution": 512})


def held_bytes(config, manifest_url: str) -> dict[str, float]:
    """Activations kept for backward on the device per sample, and the frozen base's weight bytes,
    from one micro-batch of the manifest's largest bucket."""
    from storage.store import Store
    from tasks.families import family_of
    from tasks.train.data import CachedFeatures
    from tasks.train.loss import Objective, diffusion_loss
    from tasks.train.network import kept_activations, trainable_network

    store = Store(config.storage)
    features = CachedFeatures(store, store.read_json(store.key(manifest_url)), family_of(config.model))
    ids = max(features.buckets.values(), key=len)[:2]
    latents, text, _ = features.batch(ids, torch.Generator().manual_seed(0), 0.0)
    network = trainable_network(config.model, family_of(config.model), config.training)
    kept: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:  # sees what checkpointing and offloading did not take
        kept.append(tensor.numel() * tensor.element_size())
        return tensor

    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.training.mixed_precision)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), \
            kept_activations(config.training.gradient_checkpointing, torch.device("cpu")):
        loss = diffusion_loss(network, Objective.of(config.model, config.training), latents, text,
                              torch.Generator().manual_seed(1), half)
    loss.backward()
    frozen = sum(stored_bytes(p) for p in network.parameters() if not p.requires_grad)
    return {"activations_mib_per_sample": round(sum(kept) / len(ids) / 2**20, 2),
            "frozen_weights_mib": round(frozen / 2**20, 2)}


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds, a quantised one's inner tensors (int8 data and scales) included."""
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(stored_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def measure(workdir: Path, manifest_url: str, steps: int, batch: int, mode: str, budget: int, attempt: int) -> dict:
    """Train `mode` on its own copy of the store (modes that keep the math share a run id)."""
    import shutil

    from storage.store import Store
    from tasks.runs.folder import read_metrics
    from tasks.train import train

    config = mode_config(workdir, steps, batch, mode, budget)
    key = Store(config.storage).key(manifest_url)
    root = workdir / "modes" / f"{mode.replace(' ', '-')}-{attempt}"
    shutil.copytree(config.storage.root, root)
    config = type(config).model_validate({**config.model_dump(), "storage": {"root": str(root)}})
    store = Store(config.storage)
    manifest_url = store.url(key)
    before = peak_rss_mib()
    record = train(config.storage, config.model, config.training, manifest_url)
    peak = peak_rss_mib()
    metrics = read_metrics(store, store.key(record["run"]))
    samples = sum(m["batch"] for m in metrics)
    return {"samples_per_s": round(samples / record["seconds"], 2), "final_loss": round(record["final_loss"], 4),
            "samples_per_step": round(samples / len(metrics), 2), "peak_rss_mib": peak,
            "training_rss_mib": round(peak - before, 1), **held_bytes(config, manifest_url)}



def token_spread(workdir: Path, manifest_url: str) -> dict:
    """Image tokens per sample of the smallest and largest bucket of the manifest."""
    from storage.store import Store
    from tasks.families import family_of
    from tasks.train.data import CachedFeatures

    config = config_for(workdir, 1, 1)
    store = Store(config.storage)
    family = family_of(config.model)
    features = CachedFeatures(store, store.read_json(store.key(manifest_url)), family)
    transformer = family.denoiser.transformer_class().load_config(config.model.path, subfolder="transformer")
    tokens = {name: family.denoiser.image_tokens(transformer, *(int(side) for side in name.split("x")))
              for name in features.buckets}
    return {"buckets": len(tokens), "min_tokens": min(tokens.values()), "max_tokens": max(tokens.values())}


def run(steps: int = 30, batch: int = 4, count: int = 64, repeat: int = 2) -> dict:
    """Every mode `repeat` times, the modes taking turns (a machine's slow minute does not land on
    one mode alone); each mode's fastest run is its figure."""
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        base = mode_config(workdir, steps, batch, "plain", 0)
        manifest = prepare(workdir, base, count)
        spread = token_spread(workdir, manifest)
        budget = batch * spread["max_tokens"]
        runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for attempt in range(repeat):
            for mode in MODES:
                done = subprocess.run([sys.executable, "-m", "benchmarks.training_modes", "--worker", mode, "--dir",
                                       tmp, "--manifest", manifest, "--steps", str(steps), "--batch", str(batch),
                                       "--budget", str(budget), "--attempt", str(attempt)],
                                      capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1])
                runs[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
    modes = {mode: {**max(figures, key=lambda f: f["samples_per_s"]),
                    "samples_per_s_runs": [f["samples_per_s"] for f in figures]} for mode, figures in runs.items()}
    return {"steps": steps, "batch": batch, "repeat": repeat, "tokens": spread, "modes": modes}


def rows(result: dict) -> list[tuple[str, str, str, str]]:
    plain = result["modes"]["plain"]
    out = []
    for mode, figures in result["modes"].items():
        out.append((f"training mode: {mode}", f"{figures['samples_per_s']:,.2f} samples/s (best of {result['repeat']})",
                    f"{figures['samples_per_s'] / plain['samples_per_s']:.2f}x plain; peak RSS {figures['peak_rss_mib']:,.0f} "
                    f"MiB (+{figures['training_rss_mib']:,.0f} in training); activations on the device {figures['activations_mib_per_sample']:.1f} MiB/sample; "
                    f"frozen weights {figures['frozen_weights_mib']:.1f} MiB; {figures['samples_per_step']} samples/step; "
                    f"final loss {figures['final_loss']}", ""))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--worker", choices=list(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--manifest", help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--attempt", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    if args.worker:  # one mode in its own process: its figures and peak memory
        print(json.dumps(measure(Path(args.dir), args.manifest, args.steps, args.batch, args.worker, args.budget,
                                 args.attempt)))
        return
    print(json.dumps(run(args.steps, args.batch, args.count, args.repeat)))


if __name__ == "__main__":
    main()
