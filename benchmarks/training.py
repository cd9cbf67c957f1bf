"""Training on cached features vs encoding text and images online every step.

One invocation, the same data, model and loop (`trainable_network`, `diffusion_loss`):
- cached: precast's `train` on the manifest (T5 and the VAE encoder never loaded);
- online: each step tokenizes and T5-encodes the batch's captions and VAE-encodes its images,
  as a trainer without a feature cache does;
- loader: `CachedFeatures.batch` alone, to compare with the cached step time.
Each training variant runs in its own process so its peak memory (max RSS) is its own. The model
set is random but in a real model set's proportions: the text encoder has about 8x the
transformer's parameters. Usage: python -m benchmarks.training [--steps 30] [--batch 4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from configs.schema import ModelConfig, PipelineConfig
from tasks.demo.data import write_demo_data
from tasks.demo.models import write_model_set


def make_models(folder: Path) -> Path:
    """The model set: random, with a text encoder about 8x the transformer, as at full scale."""
    return write_model_set(
        folder, dict(d_model=256, d_kv=32, d_ff=640, num_layers=14, num_heads=8),
        dict(layers_per_block=1, block_out_channels=(32, 64, 128, 128)),
        dict(num_attention_heads=4, attention_head_dim=32, num_layers=4, cross_attention_dim=128, caption_channels=256,
             sample_size=32))


def config_for(workdir: Path, steps: int, batch: int) -> PipelineConfig:
    return PipelineConfig.model_validate({
        "storage": {"root": str(workdir / "store")},
        "dataset": {"sources": [{"path": str(workdir / "data")}], "shard_size": 64},
        "model": {"path": str(workdir / "models")},
        "text_encoding": {"dtype": "fp32", "device": "cpu", "numerics_samples": 0},
        "latent_encoding": {"resolution": 256, "batch_size": 1, "device": "cpu"},
        "training": {"steps": steps, "batch_size": batch, "lora": {"rank": 16, "alpha": 16},
                     "samples": {"prompts": []},
                     "caption_dropout": 0.0, "checkpoint_every": 0, "device": "cpu"},
    })


def prepare(workdir: Path, config: PipelineConfig, count: int) -> str:
    """Ingest and cache everything; returns the manifest URL."""
    from tasks.runner import run_direct

    make_models(workdir / "models")
    write_demo_data(workdir / "data", count=count)
    return run_direct(config, until="manifest")["manifest"]["url"]


def run_cached(config: PipelineConfig, manifest_url: str) -> dict:
    from storage.store import Store
    from tasks.families import family_of
    from tasks.train.data import CachedFeatures, bucket_batches
    from tasks.train import train

    record = train(config.storage, config.model, config.training, manifest_url)
    store = Store(config.storage)
    features = CachedFeatures(store, store.read_json(store.key(manifest_url)), family_of(config.model))
    batches = bucket_batches(features.buckets, config.training.batch_size, 0)
    generator = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    for _ in range(config.training.steps):
        features.batch(next(batches), generator, 0.0)
    loader = (time.perf_counter() - started) / config.training.steps
    return {"step_s": record["seconds"] / config.training.steps, "loader_s": loader}


def run_online(config: PipelineConfig, manifest_url: str) -> dict:
    """The same loop, but text and latents computed from the raw data every step."""
    from storage import layout
    from storage.shards import read_image_shard, read_parquet_bytes
    from storage.store import Store
    from tasks.encode.latents import crop_box, preprocess
    from tasks.encode.text import run_encoder, tokenize
    from storage.shards import collate
    from tasks.train.data import bucket_batches
    from tasks.encode.models import load_text_encoder, load_vae
    from tasks.families import family_of
    from tasks.train.loss import Objective, diffusion_loss
    from tasks.train.network import trainable_network

    training = config.training
    store = Store(config.storage)
    manifest = store.read_json(store.key(manifest_url))
    rows = read_parquet_bytes(store.read_bytes(manifest["table"])).to_pylist()
    buckets: dict[str, list[str]] = {}
    for row in rows:
        buckets.setdefault(row["bucket"], []).append(row["sample_id"])
    samples = {}
    for key in store.list(layout.IMAGE_SHARDS, ".parquet"):
        for sample in read_image_shard(store.read_bytes(key)).to_pylist():
            samples[sample["sample_id"]] = sample
    family = family_of(config.model)
    t5 = family.text.encoders[0]
    encoder = load_text_encoder(config.model, family, t5, "fp32", "cpu", "none")
    vae = load_vae(config.model, family, "fp32", "cpu")
    network = trainable_network(config.model, family, training)
    objective = Objective.of(config.model, training)
    table = family.codec.bucket_table(256)
    optimizer = torch.optim.AdamW([p for p in network.parameters() if p.requires_grad],
                                  lr=training.optimizer.learning_rate)
    batches = bucket_batches(buckets, training.batch_size, training.seed)
    generator = torch.Generator().manual_seed(training.seed)
    started = time.perf_counter()
    for _ in range(training.steps):
        batch = [samples[i] for i in next(batches)]
        with torch.no_grad():
            ids = tokenize([s["captions"][0] for s in batch], encoder, config.text_encoding)[0]
            hidden = run_encoder(ids, encoder, config.text_encoding)["hidden"]
            text = collate([{"t5_hidden": h} for h in hidden])
            pixels = torch.stack([preprocess(s["image"], crop_box(table, s["width"], s["height"], "center", 0, ""))[0]
                                  for s in batch])
            latents = vae.encode(pixels).latent_dist.sample(generator) * vae.config.scaling_factor
        loss = diffusion_loss(network, objective, latents, text, generator, None)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {"step_s": (time.perf_counter() - started) / training.steps}


def parameters(folder: Path) -> dict:
    from transformers import T5EncoderModel

    from tasks.families import family_of

    model = ModelConfig(path=str(folder))
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    return {"text_encoder": count(T5EncoderModel.from_pretrained(folder, subfolder="text_encoder")),
            "transformer": count(family_of(model).denoiser.load(model))}


def run(steps: int = 30, batch: int = 4, count: int = 64) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        config = config_for(workdir, steps, batch)
        manifest = prepare(workdir, config, count)
        results = {}
        for worker in ["cached", "online"]:
            done = subprocess.run([sys.executable, "-m", "benchmarks.training", "--worker", worker, "--dir", tmp,
                                   "--manifest", manifest, "--steps", str(steps), "--batch", str(batch)],
                                  capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1])
            results[worker] = json.loads(done.stdout.strip().splitlines()[-1])
        sizes = parameters(workdir / "models")
    cached, online = results["cached"], results["online"]
    return {
        "steps": steps, "batch": batch, "parameters": sizes,
        "text_encoder_vs_transformer": round(sizes["text_encoder"] / sizes["transformer"], 1),
        "samples_per_s": {"cached": round(batch / cached["step_s"], 2), "online": round(batch / online["step_s"], 2)},
        "cached_vs_online": round(online["step_s"] / cached["step_s"], 2),
        "peak_rss_mib": {"cached": cached["peak_rss_mib"], "online": online["peak_rss_mib"]},
        "loader_s_per_batch": round(cached["loader_s"], 5), "cached_step_s": round(cached["step_s"], 4),
        "loader_share_of_step": round(cached["loader_s"] / cached["step_s"], 3),
    }


def rows(result: dict) -> list[tuple[str, str, str, str]]:
    speed, memory = result["samples_per_s"], result["peak_rss_mib"]
    return [
        ("training on cached features", f"{speed['cached']:,.1f} samples/s",
         f"{result['cached_vs_online']}x encoding online every step ({speed['online']:,.1f} samples/s)", ""),
        ("training peak memory", f"{memory['cached']:,.0f} MiB", f"online {memory['online']:,.0f} MiB (max RSS)", ""),
        ("loader share of a step", f"{result['loader_share_of_step']:.1%}",
         f"{result['loader_s_per_batch'] * 1000:.2f} ms per batch", ""),
    ]


def peak_rss_mib() -> float:
    """This process's peak resident memory since it started its program."""
    from tasks.train.metrics import peak_memory_gib

    return round(peak_memory_gib(torch.device("cpu")) * 1024, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--worker", choices=["cached", "online"], help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--manifest", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # one variant in its own process: print its timings and peak memory
        config = config_for(Path(args.dir), args.steps, args.batch)
        result = (run_cached if args.worker == "cached" else run_online)(config, args.manifest)
        result["peak_rss_mib"] = peak_rss_mib()
        print(json.dumps(result))
        return
    print(json.dumps(run(args.steps, args.batch, args.count)))


if __name__ == "__main__":
    main()
