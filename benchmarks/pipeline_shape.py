"""The shape of a first run: the data stages' wall time against their longest stage, what each
stage reads per image, and what the ingest coordinator's CPU costs per image as the dataset grows.

- Stages: `--count` demo images with captions, source and store on a moto S3 server behind
  `storage.slow_endpoint.SlowEndpoint` (20 ms a request, counting the bytes of every response), the
  demo's tiny PixArt models, shards of `SHARD_SIZE`. The data stages (ingest, encode-text,
  encode-latents, manifest) run on fresh stores two ways, in one process (`tasks.runner.Direct`):
  one stage after another, each whole before the next begins (how precast ran before the stages
  overlapped), and as `run_stages` runs them now (the latent encoder takes each shard as ingest
  commits it, the text encoders beside it once the dataset is known). Figures: each way's wall
  time; the longest single stage of the first way; each stage's CPU seconds there (this process's
  and the S3 server's: on this machine the store computes on the same cores), and the floor those
  leave: no arrangement finishes before the longest stage, nor before the cores have done the
  work of every stage; and the bytes each stage read per image (object GETs under the source and
  under the image shards; the manifest's: every GET, against the caches' size).
- Coordinator: `--sizes` demo images in a local folder ingested with partitions on two Dask worker
  processes (`examine_partition` on a plain client, as `benchmarks.ingest_workers` does); the
  figure is the ingesting process's own CPU per image at each size, which should not grow with it.
Usage: python -m benchmarks.pipeline_shape [--count 600] [--sizes 1000,20000]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from storage.slow_endpoint import SlowEndpoint
from benchmarks.s3_ingest import moto
from configs.schema import QUICKSTART, DatasetConfig, SourceConfig, StorageConfig, load_config
from storage import layout
from tasks.demo.data import write_demo_data
from tasks.demo.models import write_tiny_models
from tasks.manifest import MANIFEST_CONCURRENCY
from tasks.runner import Direct, Shards, one_after_another, run_stages

SHARD_SIZE = 64
DELAY = 0.020


def bench_config(root: str, models: Path, endpoint: str):
    """The quickstart on `root` with the tiny models, the S3 source and `SHARD_SIZE` shards."""
    config = load_config(QUICKSTART, [f"storage.root={root}", f"model.path={models}",
                                      f"dataset.shard_size={SHARD_SIZE}", "training.samples.prompts=[a red circle]"])
    return config.model_copy(update={
        "storage": config.storage.model_copy(update={"options": {"endpoint_url": endpoint}}),
        "dataset": config.dataset.model_copy(update={"sources": [SourceConfig(path="s3://bench/data")]})})


def stages(count: int) -> dict[str, Any]:
    import s3fs

    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = moto(port)
    result: dict[str, Any] = {"images": count, "shard_size": SHARD_SIZE, "delay_ms": DELAY * 1000}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            models = write_tiny_models(Path(tmp) / "models", random_vae=True)
            data = write_demo_data(Path(tmp) / "data", count=count)
            s3 = s3fs.S3FileSystem(endpoint_url=f"http://127.0.0.1:{port}")
            s3.mkdir("bench")
            s3.put(str(data), "bench/data", recursive=True)
            with SlowEndpoint(f"http://127.0.0.1:{port}", DELAY) as proxy:
                for way in ("one_after_another", "overlapped"):
                    executor = Direct(bench_config(f"s3://bench/{way}", models, proxy.url))
                    began = time.perf_counter()
                    if way == "one_after_another":
                        seconds, cpu = one_after_another(executor, psutil.Process(server.pid))
                        result["stage_cpu_s"] = {name: round(value, 2) for name, value in cpu.items()}
                    else:
                        seconds = run_stages(executor, until="manifest")["seconds"]
                    result[f"{way}_s"] = round(time.perf_counter() - began, 2)
                    result[f"{way}_stage_s"] = {name: round(value, 2) for name, value in seconds.items()}
                result.update(training_start(executor.store))
            alone = result["one_after_another_stage_s"]
            result["longest_stage"] = max(alone, key=alone.get)
            result["longest_stage_s"] = alone[result["longest_stage"]]
            # what each stage reads per image, stage by stage on a fresh store (no delay: only bytes count)
            with SlowEndpoint(f"http://127.0.0.1:{port}", 0) as proxy:
                executor = Direct(bench_config("s3://bench/reads", models, proxy.url))
                dataset = executor.ingest()
                source_bytes = sum(r.bytes for r in proxy.gets("/bench/data/"))
                result["ingest_source_bytes_per_image"] = round(source_bytes / count)
                result["image_shard_bytes_per_image"] = round(sum(
                    executor.store.require(layout.image_shard(shard["id"]))["size"]
                    for shard in dataset["shards"]) / count)
                for name, encode in (("encode_text", executor.encode_text),
                                     ("encode_latents", executor.encode_latents)):
                    proxy.reset()
                    encode(Shards.of(executor.store, dataset))
                    result[f"{name}_shard_bytes_per_image"] = round(sum(
                        r.bytes for r in proxy.gets(f"/bench/reads/{layout.IMAGE_SHARDS}/")
                        if r.path.endswith(".parquet")) / count)
                caches = executor.store.find("cache")
                result["cache_bytes_per_image"] = round(sum(
                    executor.store.require(key)["size"] for key in caches
                    if key.endswith(".safetensors") and "/prompts/" not in key) / count)
                proxy.reset()
                executor.manifest(dataset)
                result["manifest_bytes_per_image"] = round(sum(r.bytes for r in proxy.gets("/bench/reads/")) / count)
    finally:
        server.terminate()
        server.wait(timeout=30)
    result["cpu_s"] = round(sum(result["stage_cpu_s"].values()), 2)
    result["floor_s"] = round(max(result["longest_stage_s"], result["cpu_s"] / (os.cpu_count() or 1)), 2)
    result["overlapped_vs_floor"] = round(result["overlapped_s"] / result["floor_s"], 3)
    result["overlapped_vs_longest"] = round(result["overlapped_s"] / result["longest_stage_s"], 3)
    result["one_after_another_vs_longest"] = round(result["one_after_another_s"] / result["longest_stage_s"], 3)
    return result


def coordinator(sizes: tuple[int, ...], workers: int = 2, partition_size: int = 250) -> dict[str, Any]:
    """The ingesting process's CPU per image with partitions on `workers` Dask workers, at each size."""
    from distributed import Client, LocalCluster

    from tasks.ingest.stage import ingest
    from tasks.ingest.staging import Partitions, examine_partition

    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, \
            LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        for size in sizes:
            data = write_demo_data(Path(tmp) / f"data-{size}", count=size)
            storage = StorageConfig(root=str(Path(tmp) / f"store-{size}"))
            dataset = DatasetConfig(sources=[SourceConfig(path=str(data))], partition_size=partition_size)
            examine = lambda *args: client.submit(examine_partition, storage, dataset, *args,  # noqa: E731
                                                  pure=False).result()
            cpu, thread, began = time.process_time(), time.thread_time(), time.perf_counter()
            done = ingest(storage, dataset, partitions=Partitions(examine, slots=workers, size=partition_size))
            assert done["samples"] == size, done["samples"]
            result[f"coordinator_cpu_ms_per_image_{size}"] = round((time.process_time() - cpu) * 1000 / size, 3)
            # the ingest's own thread (listing, merging in order, cutting shards): the part no thread pool spreads
            result[f"coordinator_thread_ms_per_image_{size}"] = round((time.thread_time() - thread) * 1000 / size, 3)
            result[f"images_per_s_{size}"] = round(size / (time.perf_counter() - began), 1)
    first, last = sizes[0], sizes[-1]
    for figure in ("cpu", "thread"):
        result[f"coordinator_{figure}_growth"] = round(result[f"coordinator_{figure}_ms_per_image_{last}"]
                                                       / result[f"coordinator_{figure}_ms_per_image_{first}"], 3)
    return result


def flops() -> dict[str, float]:
    """Forward FLOPs per item of the encoders a first run spends its GPU time on, counted on the
    meta device (`torch.utils.flop_counter`) with the published configs: the 16-channel VAE's
    encoder on a 1024² picture (the 4-channel SDXL VAE of PixArt-Σ is the same network), T5-XXL on
    120 real tokens (a masked family's long caption) and on FLUX.1-dev's 512 unmasked positions,
    CLIP-L on 77."""
    import torch
    import transformers
    from diffusers import AutoencoderKL
    from torch.utils.flop_counter import FlopCounterMode

    from benchmarks.family_costs import CLIP_L, T5_XXL, VAE16

    def counted(call: Any) -> float:
        with FlopCounterMode(display=False) as counter:
            call()
        return counter.get_total_flops()

    with torch.device("meta"):
        vae = AutoencoderKL(**VAE16).to(torch.bfloat16)
        t5 = transformers.T5EncoderModel(transformers.T5Config(**T5_XXL)).to(torch.bfloat16)
        clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(**CLIP_L)).to(torch.bfloat16)
        return {
            "vae_1024": counted(lambda: vae.encode(torch.empty(1, 3, 1024, 1024, dtype=torch.bfloat16))),
            "vae_512": counted(lambda: vae.encode(torch.empty(1, 3, 512, 512, dtype=torch.bfloat16))),
            "t5_120": counted(lambda: t5(input_ids=torch.zeros(1, 120, dtype=torch.long))),
            "t5_512": counted(lambda: t5(input_ids=torch.zeros(1, 512, dtype=torch.long))),
            "clip_77": counted(lambda: clip(input_ids=torch.zeros(1, 77, dtype=torch.long))),
        }


# The cost model's assumptions, each with its source (docs/benchmarks.md, "A million images to caches")
IMAGE_BYTES = 300e3  # a photo with its caption, 2 GETs ("Ingest from an object store")
GET_SECONDS = 0.020  # an S3 request
DECODE_SECONDS = 0.010  # decode and hash a full-resolution photo on one core ("Ingest on workers")
PACK_SECONDS = 0.0007  # pack (0.5 ms, "Ingest on workers") and hash (300 KB at ~1.5 GB/s) an image into its shard
NODE_CORES = 112  # a DGX H100: 2 × 56-core Xeon 8480C
NODE_GPUS = 8
NODE_BYTES_PER_S = 12.5e9  # 100 Gbit/s to the object store (an assumption: a DGX H100 has 2 × 400 Gb/s storage ports)
READS_IN_FLIGHT = 512  # dataset.read_concurrency on each node
PEAK = 989.4e12  # H100 SXM dense bf16 FLOP/s ("GPU: real architectures")
MFU = 0.35  # the encoders' share of peak (assumed, as for Wan; the GPU benchmark measures it when lent)
LOAD_SECONDS = 30.0  # T5-XXL from local disk onto a GPU ("Encoder workers"); the VAE loads in seconds
SHARD_SIZE_REAL = 256  # dataset.shard_size's default
# read per shard by the manifest: the commit records of the image shard and both caches, and the
# caches' headers (not their tensors: tasks/manifest.py), MANIFEST_CONCURRENCY at once
MANIFEST_REQUESTS = 5


def training_start(store) -> dict[str, Any]:
    """What training does before its first step, on the last way's store: every cache shard (both
    caches and the prompts, as its manifest names them) fetched into an empty local cache and
    checked, one at a time and 16 at once."""
    shards = {key: store.require(key)["sha256"] for key in store.find("cache") if key.endswith(".safetensors")}
    result: dict[str, Any] = {"training_start_shards": len(shards)}
    for concurrency in (1, 16):
        with tempfile.TemporaryDirectory() as cache:
            began = time.perf_counter()
            store.local_paths(shards, concurrency, cache)
            result[f"training_start_s_{concurrency}"] = round(time.perf_counter() - began, 2)
    return result


def first_run(images: float, nodes: int, text_flops: float, vae_flops: float, coordinator_s: float) -> dict[str, float]:
    """Seconds of each stage of a first run and of the pipeline, before (one stage after another,
    one writer thread) and now (parallel writers, overlapped stages), on `nodes` 8-GPU nodes."""
    gpus = NODE_GPUS * nodes
    read = max(images * 2 * GET_SECONDS / (READS_IN_FLIGHT * nodes), images * IMAGE_BYTES / (NODE_BYTES_PER_S * nodes),
               images * DECODE_SECONDS / (NODE_CORES * nodes))
    scan = max(read, images * coordinator_s)  # the coordinator merges outcomes as the workers send them
    # the coordinator's own network carries every new byte in (staged) and out (shards)
    write_before = max(images * IMAGE_BYTES / NODE_BYTES_PER_S, images * PACK_SECONDS)
    write_now = max(images * IMAGE_BYTES / NODE_BYTES_PER_S, images * PACK_SECONDS / 8)
    text = LOAD_SECONDS + images * text_flops / (gpus * PEAK * MFU)
    latents = images * vae_flops / (gpus * PEAK * MFU)
    manifest = images / SHARD_SIZE_REAL * MANIFEST_REQUESTS * GET_SECONDS / MANIFEST_CONCURRENCY
    # now: the VAE from the first committed shard, T5 once the dataset is committed, both on the same
    # GPUs: the end is no sooner than all the GPU work after the scan, nor than T5 after the writes
    now = scan + text + max(latents, write_now) + manifest
    longest = max(scan + write_now, text, latents)
    return {"read": read, "scan": scan, "write_before": write_before, "write_now": write_now, "text": text,
            "latents": latents, "manifest": manifest, "before": scan + write_before + text + latents + manifest,
            "now": now, "floor": scan + max(write_now, text + latents),  # no shard exists before the scan ends
            "longest": longest}


def cost_model(counted: dict[str, float], coordinator_s: float) -> dict[str, Any]:
    """`first_run` in minutes for 1 and 10 million images on one and four nodes, for a masked
    family's T5 (120 tokens: PixArt-Σ, Chroma) and FLUX.1-dev's (512 positions + CLIP-L), with the
    VAE at 1024² and at 512²; and the share of peak at which one node caches a million 1024²
    images in 30 minutes."""
    text = {"masked T5 (120 tokens)": counted["t5_120"],
            "FLUX.1 (T5 at 512 + CLIP-L)": counted["t5_512"] + counted["clip_77"]}
    table = {}
    for family, flops in text.items():
        for size in (1024, 512):
            for images in (1e6, 1e7):
                for nodes in (1, 4):
                    model = first_run(images, nodes, flops, counted[f"vae_{size}"], coordinator_s)
                    case = f"{family}, {size}px, {images / 1e6:.0f}M images, {nodes} node{'s' * (nodes > 1)}"
                    table[case] = {**{name: round(seconds / 60, 1) for name, seconds in model.items()},
                                   "now_vs_longest": round(model["now"] / model["longest"], 2),
                                   "now_vs_floor": round(model["now"] / model["floor"], 2)}

    def mfu_for_30_minutes(flops: float) -> float:
        left = 30 * 60 - first_run(1e6, 1, flops, counted["vae_1024"], coordinator_s)["scan"] - LOAD_SECONDS
        return round(1e6 * (flops + counted["vae_1024"]) / (NODE_GPUS * PEAK * left), 2)
    return {"first_run": table, "mfu_for_30_min": {family: mfu_for_30_minutes(flops) for family, flops in text.items()}}


def run(count: int = 600, sizes: tuple[int, ...] = (1000, 20000)) -> dict[str, Any]:
    result = {**stages(count), "sizes": list(sizes), **coordinator(sizes), "flops": flops()}
    serial = result[f"coordinator_thread_ms_per_image_{sizes[-1]}"] / 1000
    return {**result, **cost_model(result["flops"], serial)}


def rows(result: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    first, last = result["sizes"][0], result["sizes"][-1]
    return [
        ("data stages overlapped vs their longest stage", f"{result['overlapped_vs_longest']:.2f}×",
         f"{result['overlapped_s']:.1f} s vs {result['longest_stage']} {result['longest_stage_s']:.1f} s; one "
         f"after another {result['one_after_another_s']:.1f} s ({result['one_after_another_vs_longest']:.2f}×); "
         f"{result['images']} images, S3 at {result['delay_ms']:.0f} ms a request", "≤ 1.3×"),
        ("data stages overlapped vs this machine's floor", f"{result['overlapped_vs_floor']:.2f}×",
         f"floor {result['floor_s']:.1f} s: the stages' {result['cpu_s']:.1f} CPU s (S3 server's included: "
         + ", ".join(f"{name} {value:.1f}" for name, value in result["stage_cpu_s"].items())
         + f") on {os.cpu_count()} cores, or the longest stage", "≤ 1.3×"),
        ("bytes read per image", f"encode-text {result['encode_text_shard_bytes_per_image']:,} B",
         f"encode-latents {result['encode_latents_shard_bytes_per_image']:,} B of "
         f"{result['image_shard_bytes_per_image']:,} B of image shard; ingest "
         f"{result['ingest_source_bytes_per_image']:,} B of source; manifest "
         f"{result['manifest_bytes_per_image']:,} B (caches {result['cache_bytes_per_image']:,} B)", "each byte once"),
        ("training start: cache shards fetched and checked", f"{result['training_start_s_16']:.2f} s",
         f"{result['training_start_shards']} shards 16 at once; one at a time {result['training_start_s_1']:.2f} s",
         "round trips overlap"),
        ("ingest coordinator CPU per image", f"{result[f'coordinator_cpu_ms_per_image_{last}']} ms at {last:,}",
         f"{result[f'coordinator_cpu_ms_per_image_{first}']} ms at {first:,} "
         f"({result['coordinator_cpu_growth']:.2f}×; partitions on 2 workers); its own thread "
         f"{result[f'coordinator_thread_ms_per_image_{first}']} → "
         f"{result[f'coordinator_thread_ms_per_image_{last}']} ms", "flat"),
        *[(f"first run: {case}", f"{model['now']} min", f"before {model['before']} min; longest stage "
           f"{model['longest']} min ({model['now_vs_longest']}×); the floor {model['floor']} min", "< 30 min")
          for case, model in result["first_run"].items() if "1M images, 1 node" in case],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=600)
    parser.add_argument("--sizes", default="1000,20000")
    args = parser.parse_args()
    print(json.dumps(run(args.count, tuple(int(size) for size in args.sizes.split(",")))))


if __name__ == "__main__":
    main()
