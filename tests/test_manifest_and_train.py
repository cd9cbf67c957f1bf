"""manifest and train as plain functions: joins, checksums, LoRA from cached features only."""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import PixArtTransformer2DModel
from peft import PeftModel
from PIL import Image

from storage import layout
from storage.store import Damaged, Store
from tasks.families import family_of
from tasks.manifest import build_manifest
from tasks.runner import run_direct
from tasks.train import train


def _cache_everything(config):
    done = run_direct(config, until="encode-latents")
    return done["ingest"], done["text_fingerprints"], done["vae_fingerprint"]


def kill_training_at(config, manifest_url: str, batch: int) -> None:
    """Run training until it asks for its `batch`-th batch, then kill it there (a simulated SIGINT)."""
    from unittest import mock

    from tasks.train.data import CachedFeatures

    real, calls = CachedFeatures.batch, []

    def killed(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == batch:
            raise KeyboardInterrupt("killed mid-run")
        return real(self, *args, **kwargs)

    with mock.patch.object(CachedFeatures, "batch", killed), pytest.raises(KeyboardInterrupt):
        train(config.storage, config.model, config.training, manifest_url)


def test_manifest_joins_and_records_checksums(make_config):
    config = make_config()
    dataset, text_fps, vae_fp = _cache_everything(config)
    record = build_manifest(config.storage, dataset["id"], text_fps, vae_fp, config.training.samples.prompts)
    manifest = Store(config.storage).read_json(Store(config.storage).key(record["url"]))
    assert manifest["samples"] == 24 and sum(manifest["buckets"].values()) == 24
    assert len(manifest["checksums"]) == 1 + 3 * len(dataset["shards"]) + 1  # prompts, 3 per shard, table


def test_manifest_refuses_a_missing_or_damaged_shard(make_config):
    """The manifest reads a cache shard's header alone (which rows it holds): one that does not
    parse, or a shard that is gone, fails it naming the shard. A damaged tensor is found by training,
    which reads the whole shard (`test_training_refuses_a_shard_tampered_after_the_manifest`)."""
    config = make_config()
    dataset, text_fps, vae_fp = _cache_everything(config)
    store = Store(config.storage)
    damaged = layout.cache_shard("latents", vae_fp, dataset["shards"][1]["id"])
    path = store.path(damaged)
    data = bytearray(open(path, "rb").read())
    data[8] ^= 0xFF  # the header's opening brace
    open(path, "wb").write(bytes(data))
    with pytest.raises(Damaged, match=re.escape(damaged) + " is damaged: its safetensors header does not parse"):
        build_manifest(config.storage, dataset["id"], text_fps, vae_fp, config.training.samples.prompts)
    store.fs.rm(path)
    with pytest.raises(FileNotFoundError, match=dataset["shards"][1]["id"]):
        build_manifest(config.storage, dataset["id"], text_fps, vae_fp, config.training.samples.prompts)


def test_train_needs_no_text_encoder_or_vae_and_saves_a_peft_adapter(make_config, tiny_models, tmp_path):
    config = make_config()
    dataset, text_fps, vae_fp = _cache_everything(config)
    manifest = build_manifest(config.storage, dataset["id"], text_fps, vae_fp, config.training.samples.prompts)
    # after caching, the text encoder, tokenizer and VAE are gone: training must not need them
    stripped = tmp_path / "transformer-only"
    shutil.copytree(tiny_models, stripped, ignore=shutil.ignore_patterns("text_encoder", "tokenizer", "vae"))
    model = config.model.model_copy(update={"path": str(stripped)})
    no_samples = config.training.updated({"samples.prompts": [], "steps": 8})
    record = train(config.storage, model, no_samples, manifest["url"])
    assert record["steps"] == 8 and record["samples"] == []
    store = Store(config.storage)
    run_key = store.key(record["run"])
    losses = [line for line in store.read_bytes(f"{run_key}/metrics.jsonl").splitlines() if line]
    assert len(losses) == 8

    adapter_dir = store.path(store.key(record["adapter"]))
    base = PixArtTransformer2DModel.from_pretrained(tiny_models, subfolder="transformer")
    loaded = PeftModel.from_pretrained(base, adapter_dir)
    lora_b = [p for n, p in loaded.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # trained, not the zero initialisation

    # the same config again is the same run: returned at once, nothing retrained
    assert train(config.storage, model, no_samples, manifest["url"]) == record


def test_train_renders_samples_through_the_pixart_pipeline(make_config):
    config = make_config()
    dataset, text_fps, vae_fp = _cache_everything(config)
    manifest = build_manifest(config.storage, dataset["id"], text_fps, vae_fp, config.training.samples.prompts)
    record = train(config.storage, config.model, config.training, manifest["url"])
    store = Store(config.storage)
    (sample,) = record["samples"]
    image = Image.open(io.BytesIO(store.read_bytes(store.key(sample))))
    assert image.size == (256, 256) and image.format == "PNG"
    assert torch.isfinite(torch.tensor([record["first_loss"], record["final_loss"]])).all()


def test_training_reader_draws_seeded_latents_from_one_bucket(make_config):
    from tasks.train.data import CachedFeatures, bucket_batches

    config = make_config()
    dataset, text_fps, vae_fp = _cache_everything(config)
    record = build_manifest(config.storage, dataset["id"], text_fps, vae_fp, config.training.samples.prompts)
    store = Store(config.storage)
    features = CachedFeatures(store, store.read_json(store.key(record["url"])), family_of(config.model))
    batch = next(bucket_batches(features.buckets, 3, seed=0))
    assert len({features.samples[s]["bucket"] for s in batch}) == 1  # one bucket per batch

    def draw(seed):
        return features.batch(batch, torch.Generator().manual_seed(seed), caption_dropout=0.0)

    first, again, other = draw(1), draw(1), draw(2)
    for a, b in zip(first, again):
        torch.testing.assert_close(a, b)  # same seed, same latents and captions
    assert not torch.equal(first[0], other[0])  # a fresh posterior sample per draw
    shard = features._latents[features.samples[batch[0]]["latent_shard"]]
    mean, _ = shard.get(batch[0])
    scaled_mean = (mean.float() - features.shift) * features.scale
    assert not torch.equal(first[0][0], scaled_mean)  # sampled, not the mean


def test_the_cpu_optimizer_steps_as_torchs_per_tensor_adamw_bit_for_bit():
    """On a CPU `build_optimizer` takes AdamW's foreach path for its speed: every step must give the
    bits of torch's default per-tensor AdamW, so runs trained before and after it are the same run."""
    from configs.schema import TrainingConfig
    from tasks.train.optimizer import build_optimizer

    def trained(make):
        draw = torch.Generator().manual_seed(0)
        weights = [torch.nn.Parameter(torch.randn(shape, generator=draw)) for shape in [(8, 96), (96, 8)] * 8]
        optimizer = make(weights)
        for _ in range(50):
            for weight in weights:
                weight.grad = torch.randn(weight.shape, generator=draw)
            optimizer.step()
        return weights

    training = TrainingConfig(learning_rate=1e-3, weight_decay=0.01)
    ours = trained(lambda weights: build_optimizer(training, weights, torch.device("cpu")))
    reference = trained(lambda weights: torch.optim.AdamW(weights, lr=1e-3, weight_decay=0.01, foreach=False))
    assert all(torch.equal(a, b) for a, b in zip(ours, reference))
    assert not torch.equal(ours[0], trained(lambda weights: torch.optim.AdamW(weights, lr=2e-3))[0])


@pytest.mark.parametrize("optimizer, background_loader", [("adamw", False), ("adamw8bit", False), ("adamw", True)])
def test_interrupted_training_resumes_bit_identically(make_config, tmp_path, monkeypatch, optimizer,
                                                      background_loader):
    from tasks import prefetch
    from tasks.train import data as train_module

    if background_loader:  # the accelerator path: batches read two steps ahead in a thread
        monkeypatch.setattr(train_module, "prefetched",
                            lambda load, items, ahead: prefetch.prefetched(load, items, ahead=2))

    def run(root, crash_at=None):
        config = make_config(root=str(root), training={"steps": 7, "checkpoint_every": 2, "keep_checkpoints": 2,
                                                       "sample_prompts": [], "gradient_accumulation": 2,
                                                       "ema_decay": 0.9, "optimizer": optimizer, "rank": 64})
        dataset, text_fps, vae_fp = _cache_everything(config)
        manifest = build_manifest(config.storage, dataset["id"], text_fps, vae_fp, config.training.samples.prompts)
        if crash_at is not None:
            kill_training_at(config, manifest["url"], crash_at)
        return config, train(config.storage, config.model, config.training, manifest["url"])

    whole_config, whole = run(tmp_path / "whole")
    resumed_config, resumed = run(tmp_path / "resumed", crash_at=12)  # step 6 of 7, after the step-4 checkpoint
    assert whole["resumed_from"] == 0 and resumed["resumed_from"] == 4
    stores = Store(whole_config.storage), Store(resumed_config.storage)
    adapters = [s.read_bytes(s.key(r["adapter"]) + "/adapter_model.safetensors") for s, r in zip(stores, (whole, resumed))]
    assert adapters[0] == adapters[1]  # bit-identical weights
    metrics = [s.read_bytes(s.key(r["run"]) + "/metrics.jsonl") for s, r in zip(stores, (whole, resumed))]
    assert metrics[0] == metrics[1]
    kept = stores[1].list(stores[1].key(resumed["run"]) + "/checkpoints", ".safetensors")
    assert [k.rsplit("/", 1)[1] for k in kept] == ["step-00000004.safetensors", "step-00000006.safetensors"]


def test_a_damaged_checkpoint_is_refused_by_name(make_config):
    config = make_config(training={"steps": 5, "checkpoint_every": 2, "sample_prompts": []})
    dataset, text_fps, vae_fp = _cache_everything(config)
    manifest = build_manifest(config.storage, dataset["id"], text_fps, vae_fp, config.training.samples.prompts)
    kill_training_at(config, manifest["url"], 4)
    store = Store(config.storage)
    (checkpoint,) = [k for k in store.fs.find(store.root_path) if k.endswith("step-00000002.safetensors")]
    data = bytearray(open(checkpoint, "rb").read())
    data[-3] ^= 0x55
    open(checkpoint, "wb").write(bytes(data))
    with pytest.raises(Damaged, match="step-00000002.safetensors is damaged"):
        train(config.storage, config.model, config.training, manifest["url"])


@pytest.mark.parametrize("captions", ["diffusers", "none"])
def test_samples_during_training_loss_curve_and_precast_sample(make_config, tmp_path, captions):
    """`precast sample` gives the pipeline prompt text; it renders what training rendered from the
    cached prompt embeddings, so both read the same tokens (a cased prompt with a URL included)."""
    from flows.cli import main

    prompts = ["A RED Circle, see https://example.com/red.png", "a blue square"]
    config = make_config(text_encoding={"caption_preprocessing": captions},
                         training={"steps": 4, "sample_every": 2, "sample_steps": 2, "sample_prompts": prompts})
    dataset, text_fps, vae_fp = _cache_everything(config)
    manifest = build_manifest(config.storage, dataset["id"], text_fps, vae_fp, config.training.samples.prompts)
    record = train(config.storage, config.model, config.training, manifest["url"])
    assert [url.rsplit("/", 1)[1] for url in record["samples"]] == ["step-000002.png", "step-000004.png"]
    store = Store(config.storage)
    curve = Image.open(io.BytesIO(store.read_bytes(store.key(record["run"]) + "/loss_curve.png")))
    assert curve.size == (800, 500)
    # a plot a reader can read: labelled axes, integer step ticks, train and validation in a legend
    from tasks.runs.plots import training_curves
    from tasks.runs.folder import read_metrics

    loss_axes, rate_axes = training_curves(read_metrics(store, store.key(record["run"]))).axes
    assert (loss_axes.get_ylabel(), rate_axes.get_ylabel(), rate_axes.get_xlabel()) == ("loss", "learning rate", "step")
    legend = [text.get_text() for text in loss_axes.get_legend().get_texts()]
    assert legend == ["training loss", "validation loss (held-out samples)"]
    assert all(float(tick).is_integer() for tick in rate_axes.get_xticks())

    out = tmp_path / "out" / "sample.png"
    assert main(["sample", record["run"], "--prompt", prompts[0], "--prompt", prompts[1], "--out", str(out),
                 "--steps", "2", "--seed", str(config.training.seed)]) == 0
    assert Image.open(out).size == (512, 256)  # two 256 px images side by side
    final = Image.open(io.BytesIO(store.read_bytes(store.key(record["samples"][-1]))))
    difference = np.abs(np.asarray(Image.open(out), dtype=float) - np.asarray(final, dtype=float))
    assert difference.mean() < 1.0, difference.mean()  # the LoRA merged vs applied: rounding only


def _manifest(config):
    dataset, text_fps, vae_fp = _cache_everything(config)
    return build_manifest(config.storage, dataset["id"], text_fps, vae_fp, config.training.samples.prompts)


def test_init_from_continues_from_an_adapter(make_config):
    from safetensors.torch import load

    config = make_config(training={"steps": 4, "sample_prompts": []})
    manifest = _manifest(config)
    first = train(config.storage, config.model, config.training, manifest["url"])
    store = Store(config.storage)
    trained = load(store.read_bytes(store.key(first["adapter"]) + "/adapter_model.safetensors"))

    # a near-zero learning rate: the continued adapter must still be the first one
    frozen = config.training.updated({"init_from": first["run"], "optimizer.learning_rate": 1e-12, "steps": 1})
    second = train(config.storage, config.model, frozen, manifest["url"])
    assert second["run"] != first["run"]
    continued = load(store.read_bytes(store.key(second["adapter"]) + "/adapter_model.safetensors"))
    for name, tensor in trained.items():
        torch.testing.assert_close(continued[name], tensor, rtol=1e-6, atol=1e-8)
    lineage = store.read_json(store.key(second["run"]) + "/lineage.json")
    assert lineage["init_from"]["url"] == first["adapter"]

    nightly = config.training.updated({"init_from": "latest", "steps": 2})
    third = train(config.storage, config.model, nightly, manifest["url"])
    assert store.read_json(store.key(third["run"]) + "/lineage.json")["init_from"]["url"] == second["adapter"]
    assert train(config.storage, config.model, nightly, manifest["url"]) == third  # unchanged data: same run

    wrong_rank = config.training.updated({"init_from": first["run"], "lora.rank": 8})
    with pytest.raises(ValueError, match=f"init_from {first['adapter']} does not fit"):
        train(config.storage, config.model, wrong_rank, manifest["url"])
    # a nightly run that changed its rank: no run of its form yet, so it starts anew; the next continues it
    ranked = [train(config.storage, config.model, nightly.updated({"lora.rank": 8, "steps": steps}), manifest["url"])
              for steps in (2, 3)]
    inits = [store.read_json(store.key(run["run"]) + "/lineage.json")["init_from"] for run in ranked]
    assert inits[0] is None and inits[1]["url"] == ranked[0]["adapter"]


def test_full_fine_tune_saves_diffusers_weights(make_config, tiny_models, tmp_path):
    from flows.cli import main

    config = make_config(training={"method": "full", "steps": 2, "sample_prompts": []})
    record = train(config.storage, config.model, config.training, _manifest(config)["url"])
    assert record["adapter"] is None
    store = Store(config.storage)
    trained = PixArtTransformer2DModel.from_pretrained(store.path(store.key(record["transformer"])))
    base = PixArtTransformer2DModel.from_pretrained(tiny_models, subfolder="transformer")
    changed = [n for (n, a), (_, b) in zip(trained.named_parameters(), base.named_parameters()) if not torch.equal(a, b)]
    assert len(changed) > len(list(base.parameters())) // 2  # every weight is trained, not an adapter
    out = tmp_path / "full.png"
    assert main(["sample", record["transformer"], "--prompt", "a red circle", "--out", str(out), "--steps", "2"]) == 0
    assert Image.open(out).size == (256, 256)


def test_ema_weights_are_the_saved_result(make_config):
    from safetensors.torch import load

    config = make_config(training={"steps": 4, "sample_prompts": []})
    manifest = _manifest(config)
    raw = train(config.storage, config.model, config.training, manifest["url"])
    averaged_config = config.training.updated({"optimizer.ema_decay": 0.5})
    averaged = train(config.storage, config.model, averaged_config, manifest["url"])
    store = Store(config.storage)
    a, b = (load(store.read_bytes(store.key(r["adapter"]) + "/adapter_model.safetensors")) for r in (raw, averaged))
    lora_b = [name for name in a if "lora_B" in name]
    assert lora_b and set(a) == set(b)
    # same seed and data: the averaged B matrices lag the raw ones (they start at zero)
    assert all(b[n].abs().sum() < a[n].abs().sum() for n in lora_b)


def test_two_process_data_parallel_training_on_cpu(make_config, tiny_models):
    """torch DDP over gloo: two processes, each its own batches, rank 0 writes the run; each
    streams a block of its transformer from host memory (`blocks_to_swap`, under recompute: the
    streamed weights leave the network before DDP wraps it)."""
    from tasks.train.checkpointer import Checkpointer, TrainingState

    config = make_config(training={"steps": 3, "processes": 2, "checkpoint_every": 2, "keep_checkpoints": 1,
                                   "sample_prompts": [], "gradient_checkpointing": "recompute", "blocks_to_swap": 1})
    relayed = []  # rank 0 reports progress through the store; the parent relays it
    record = train(config.storage, config.model, config.training, _manifest(config)["url"],
                   progress=lambda *report: relayed.append(report))
    assert relayed and relayed[-1][:2] == (3, 3)
    store = Store(config.storage)
    run = store.key(record["run"])
    import json
    import math

    metrics = [json.loads(line) for line in store.read_bytes(f"{run}/metrics.jsonl").splitlines() if line]
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(math.isfinite(m["loss"]) for m in metrics)
    # rank 0's checkpoint loads into a fresh single-process model
    from peft import LoraConfig, get_peft_model

    from tasks.families import family_of

    targets = family_of(config.model).denoiser.target_modules(config.training)
    network = get_peft_model(PixArtTransformer2DModel.from_pretrained(tiny_models, subfolder="transformer"),
                             LoraConfig(r=4, lora_alpha=4, target_modules=targets))
    optimizer = torch.optim.AdamW([p for p in network.parameters() if p.requires_grad])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    state = TrainingState(network, optimizer, schedule)
    assert Checkpointer(store, run, every=2, keep=1).restore(state) == 2
    base = PixArtTransformer2DModel.from_pretrained(tiny_models, subfolder="transformer")
    PeftModel.from_pretrained(base, store.path(store.key(record["adapter"])))


def test_training_refuses_a_shard_tampered_after_the_manifest(make_config):
    config = make_config(training={"steps": 2, "sample_prompts": []})
    dataset, text_fps, vae_fp = _cache_everything(config)
    manifest = build_manifest(config.storage, dataset["id"], text_fps, vae_fp, config.training.samples.prompts)
    store = Store(config.storage)
    tampered = layout.cache_shard("text", text_fps["t5"], dataset["shards"][2]["id"])
    data = bytearray(store.read_bytes(tampered))
    data[-5] ^= 0x01
    open(store.path(tampered), "wb").write(bytes(data))
    with pytest.raises(Damaged, match=tampered.replace(".", r"\.") + " is damaged"):
        train(config.storage, config.model, config.training, manifest["url"])
    assert [key for key in store.find("runs") if "/lease/" not in key] == []  # nothing trained on damaged data


@pytest.mark.parametrize("processes", [1, 2])
def test_training_on_a_remote_root_reads_the_bytes_it_verified(make_config, s3_endpoint, tmp_path, monkeypatch,
                                                               processes):
    """Local copies of remote shards are checked in the read that is used: an earlier copy that
    differs from the committed object (stale, or damaged on disk) is fetched again, never trained on
    (with several processes: fetched once for the node, then checked by each)."""
    import s3fs

    from storage.fingerprint import sha256_bytes

    s3fs.S3FileSystem(endpoint_url=s3_endpoint).mkdir(f"precast-verified-{processes}")
    config = make_config(root=f"s3://precast-verified-{processes}/store",
                         training={"steps": 2, "sample_prompts": [], "processes": processes})
    config = config.model_copy(update={"storage": config.storage.model_copy(
        update={"options": {"endpoint_url": s3_endpoint}})})
    monkeypatch.setenv("PRECAST_CACHE", str(tmp_path / "cache"))
    dataset, text_fps, vae_fp = _cache_everything(config)
    manifest = build_manifest(config.storage, dataset["id"], text_fps, vae_fp, [])
    store = Store(config.storage)  # local copies of every cache shard, as an earlier reader on this node left them
    copies = [Path(store.local_path(key)) for key in store.find("cache") if key.endswith(".safetensors")]
    assert copies and all(copy.is_relative_to(tmp_path / "cache") for copy in copies)
    for copy in copies:
        data = bytearray(copy.read_bytes())
        data[-5] ^= 0x01
        copy.write_bytes(bytes(data))
    train(config.storage, config.model, config.training, manifest["url"])
    checksums = set(Store(config.storage).read_json(Store(config.storage).key(manifest["url"]))["checksums"].values())
    assert {sha256_bytes(copy.read_bytes()) for copy in copies} <= checksums


def test_a_new_training_format_is_a_new_run(make_config, monkeypatch):
    """A fix to the training loop bumps TRAIN_FORMAT: the same config and data then train a new
    run instead of returning the one the old code made."""
    from tasks import identity

    config = make_config(training={"steps": 1, "sample_prompts": []})
    manifest = _manifest(config)
    first = train(config.storage, config.model, config.training, manifest["url"])
    assert train(config.storage, config.model, config.training, manifest["url"]) == first
    monkeypatch.setattr(identity, "TRAIN_FORMAT", identity.TRAIN_FORMAT + "-fixed")
    second = train(config.storage, config.model, config.training, manifest["url"])
    assert second["run"] != first["run"]


def test_lineage_names_the_code_and_the_data(make_config):
    config = make_config(training={"steps": 1, "sample_prompts": []})
    manifest = _manifest(config)
    record = train(config.storage, config.model, config.training, manifest["url"])
    store = Store(config.storage)
    lineage = store.read_json(store.key(record["run"]) + "/lineage.json")
    assert lineage["manifest"] == store.read_json(store.key(manifest["url"]))["id"]
    assert lineage["code"] and lineage["versions"]["torch"].startswith("2.13")


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction", "sample", "flow_prediction"])
def test_noisy_input_and_target_follow_the_models_scheduler(tiny_models, tmp_path, prediction):
    """The noisy latents and the regression target are the model's own scheduler's for its
    prediction_type (alphas from its DPM-Solver config, as the pipeline samples with); a type DDPM
    cannot train is refused by name."""
    import shutil

    from diffusers import DPMSolverMultistepScheduler

    from configs.schema import ModelConfig, TrainingConfig
    from tasks.train.loss import Objective, diffusion_loss

    folder = tmp_path / "models"
    shutil.copytree(tiny_models, folder)
    config_file = folder / "scheduler" / "scheduler_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "prediction_type": prediction}))
    model = ModelConfig(path=str(folder))
    if prediction == "flow_prediction":
        with pytest.raises(ValueError, match=r"prediction_type 'flow_prediction'\) cannot train"):
            Objective.of(model, TrainingConfig())
        return
    seen = {}

    def network(noisy, encoder_hidden_states, encoder_attention_mask, timestep, added_cond_kwargs):
        seen.update(noisy=noisy, timestep=timestep)
        return SimpleNamespace(sample=torch.zeros(len(noisy), 2 * noisy.shape[1], *noisy.shape[2:]))

    latents = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    text = {"t5_hidden": torch.randn(3, 5, 32), "t5_hidden_mask": torch.ones(3, 5, dtype=torch.long)}
    loss = diffusion_loss(network, Objective.of(model, TrainingConfig()), latents, text,
                          torch.Generator().manual_seed(7), None)
    # the same draws: noise, then uniform timesteps over the training schedule
    generator = torch.Generator().manual_seed(7)
    noise = torch.randn(latents.shape, generator=generator)
    timesteps = torch.randint(0, 1000, (3,), generator=generator)
    reference = DPMSolverMultistepScheduler.from_pretrained(folder, subfolder="scheduler")
    assert reference.config.prediction_type == prediction
    alpha = reference.alphas_cumprod[timesteps].sqrt().view(-1, 1, 1, 1)
    sigma = (1 - reference.alphas_cumprod[timesteps]).sqrt().view(-1, 1, 1, 1)
    assert torch.equal(seen["timestep"], timesteps)
    torch.testing.assert_close(seen["noisy"], alpha * latents + sigma * noise)
    target = {"epsilon": noise, "v_prediction": alpha * noise - sigma * latents, "sample": latents}[prediction]
    torch.testing.assert_close(loss, (target ** 2).mean())  # the prediction was zero


def test_validation_loss_on_held_out_samples_with_fixed_draws(make_config, monkeypatch):
    """A fixed held-out set, never trained on, scored every `validation_every` steps and at the
    end with the same draws: in metrics.jsonl, the lineage and the progress callback."""
    import json
    from unittest import mock

    from tasks.train.data import CachedFeatures
    from tasks.train.validation import Validation

    config = make_config(training={"steps": 6, "validation_samples": 5, "validation_every": 4,
                                   "caption_dropout": 0.2, "sample_prompts": []})
    manifest = _manifest(config)
    seen: dict[float, set[str]] = {}  # caption dropout of the call (0: validation) -> sample ids
    real = CachedFeatures.batch

    def recorded(self, sample_ids, generator, caption_dropout):
        seen.setdefault(caption_dropout, set()).update(sample_ids)
        return real(self, sample_ids, generator, caption_dropout)

    reports = []
    with mock.patch.object(CachedFeatures, "batch", recorded):
        record = train(config.storage, config.model, config.training, manifest["url"],
                       progress=lambda *report: reports.append(report))
    store = Store(config.storage)
    features = CachedFeatures(store, json.loads(store.read_bytes(store.key(manifest["url"]))),
                              family_of(config.model))
    validation = Validation(features, 5, 4, config.training.batch_size, config.training.seed)
    assert len(validation.held) == 5 and seen[0.0] == validation.held
    assert not seen[0.2] & validation.held  # never trained on

    metrics = [json.loads(line) for line in store.read_bytes(store.key(record["run"]) + "/metrics.jsonl").splitlines()]
    scored = [m["step"] for m in metrics if "validation_loss" in m]
    assert scored == [4, 6] and record["validation_loss"] == metrics[-1]["validation_loss"]
    assert [r[3] is not None for r in reports] == [m["step"] in scored for m in metrics]
    # fixed draws: the same weights score the same, a different seed's draws score otherwise
    network = PixArtTransformer2DModel.from_pretrained(config.model.path, subfolder="transformer")
    from tasks.train.loss import Objective

    objective = Objective.of(config.model, config.training)
    first = validation.loss(network, objective, torch.device("cpu"), None)
    assert validation.loss(network, objective, torch.device("cpu"), None) == first

    too_many = config.training.updated({"validation.samples": 24})
    with pytest.raises(ValueError, match="training.validation.samples is 24, which leaves none of the manifest's 24"):
        train(config.storage, config.model, too_many, manifest["url"])
