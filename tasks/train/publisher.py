"""What a training run shows and leaves (rank 0): its records and sample grids to the experiment
trackers and the store while it trains, then the trained weights, final samples, metrics, loss
curve, config and lineage, the lineage committed last as the run's commit record."""

from __future__ import annotations

import io
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from configs.schema import ModelConfig, TrainingConfig
from storage import layout
from storage.shards import bucket_sides
from storage.store import Store, fsspec_options
from tasks.families import Family, pipeline_of
from tasks.identity import check_entry_picture, entry_negative
from tasks.runs.folder import write_metrics
from tasks.runs.plots import loss_curve_png
from tasks.runs.sampling import read_picture_bytes, sample_grid
from tasks.train.data import TextCaches
from tasks.train.network import adapter_form, output_name, sampling_module
from tasks.train.trackers import Trackers


class RunPublisher:
    def __init__(self, store: Store, run: str, model: ModelConfig, family: Family, training: TrainingConfig,
                 manifest: dict[str, Any], init: dict | None, prompts: TextCaches, resolution: int,
                 reference_resolution: int | None = None):
        self.store, self.run, self.model, self.family, self.training = store, run, model, family, training
        self.resolution = resolution  # the latents' (`latent_encoding.resolution`): the samples' side
        # what the references were sized for (`latent_encoding.reference_resolution`): the sample references' too
        self.reference_resolution = reference_resolution or resolution
        # the frames of the longest clips it trains on (1: pictures): the samples'
        latent_frames = max(sides[0] if len(sides) == 3 else 1 for sides in map(bucket_sides, manifest["buckets"]))
        self.frames = family.codec.clip_frames(latent_frames)
        self.manifest, self.init, self.prompts = manifest, init, prompts
        # the pictures the samples are drawn from (first frames, or references), read before the first
        # step: a bad one fails the run at once, not at its end (the family's pipeline: `check_training`)
        self.pictures = None
        if pictures := training.samples.pictures()[1]:
            options = fsspec_options(store.config)
            held = [read_picture_bytes(path, options) for path in pictures]
            for path, entry, (_, data) in zip(pictures, manifest["prompts"], held):
                check_entry_picture(entry, path, data)  # the picture its prompt was encoded with
            self.pictures = [picture for picture, _ in held]
        self.output = output_name(training)
        # the training config as it ran: LoRA's target modules resolved (the family's, when unset)
        settings = training.model_dump()
        self.settings = {**settings,
                         "lora": {**settings["lora"], "target_modules": family.denoiser.target_modules(training)}}
        self.trackers = Trackers(store, run, training, self.lineage())

    def lineage(self) -> dict[str, Any]:
        """What made the run: manifest, model, training config, initial adapter, text settings, code."""
        return {
            "manifest": self.manifest["id"], "model": self.model.model_dump(),
            "pipeline": pipeline_of(self.model.path, self.model.revision), "training": self.settings,
            "init_from": self.init and {"url": self.init["url"], "sha256": self.init["sha256"]},
            # the first encoder's (T5's: the one whose max_length users set)
            "text": {k: self.prompts.prompts[0].meta[k] for k in ("caption_preprocessing", "max_length")},
            "resolution": self.resolution, **({"frames": self.frames} if self.frames > 1 else {}),
            **({"reference_resolution": self.reference_resolution} if self.reference_resolution != self.resolution
               else {}),
            "fingerprints": {k: self.manifest[k] for k in ("text_fingerprint", "vae_fingerprint") if k in self.manifest},
            **({"mix": self.manifest["mix"]} if "mix" in self.manifest else {}),  # how it drew from the sources
            "versions": package_versions(), "code": code_version(), "python": platform.python_version(),
        }

    def record(self, step: int, values: dict[str, float]) -> None:
        """A step's figures to the trackers (they return at once)."""
        self.trackers.scalars(step, values)

    def checkpointed(self) -> None:
        self.trackers.sync()

    def relay(self, step: int, loss: float, validation_loss: float | None) -> None:
        """The progress of a run of several processes, for the process that started them to relay."""
        self.store.write_json(layout.run_part(self.run, "progress"), [step, self.training.steps, loss, validation_loss])

    def maybe_sample(self, network: torch.nn.Module, step: int) -> None:
        """Render the sample prompts every `sample_every` steps (the last step is `publish`'s)."""
        every = self.training.samples.every
        if self.training.samples.prompts and every and step % every == 0 and step < self.training.steps:
            self.sample(network, step)

    def sample(self, network: torch.nn.Module, step: int) -> None:
        """A grid of the sample prompts (pre-encoded) through the family's pipeline, seeded."""
        training = self.training
        network.eval()
        with torch.no_grad():
            # the prompts as the manifest names them (`identity.prompt_entries`)
            entries = self.manifest["prompts"]
            samples = sample_grid(self.model, self.family, sampling_module(network, training),
                                  [self.prompts.prompt(p) for p in entries],
                                  [self.prompts.prompt(entry_negative(p)) for p in entries],
                                  training.samples.steps, training.guidance_scale, training.samples.true_cfg_scale,
                                  training.seed, self.resolution, self.frames, self.pictures,
                                  training.samples.pictures()[0], self.reference_resolution)
        network.train()
        buffer = io.BytesIO()
        samples.grid().save(buffer, format="PNG")
        self.store.write_bytes(layout.sample(self.run, step), buffer.getvalue())
        if samples.frames > 1:  # the videos beside their first frames
            self.store.write_bytes(layout.sample(self.run, step, "webp"), samples.animation(self.training.samples.fps))
        self.trackers.image(step, "samples", buffer.getvalue())

    def publish(self, network: torch.nn.Module, metrics: list[dict[str, Any]], start: int,
                elapsed: float) -> dict[str, Any]:
        """Write every output of the finished run, the lineage last; returns its commit record."""
        store, run, model, training = self.store, self.run, self.model, self.training
        network.eval()
        with tempfile.TemporaryDirectory() as tmp:
            network.save_pretrained(tmp)
            for file in sorted(Path(tmp).iterdir()):
                if file.is_file():
                    store.put_file(file, f"{layout.run_part(run, self.output)}/{file.name}")
        if training.samples.prompts:
            self.sample(network, training.steps)
        samples = [store.url(key) for key in store.list(layout.run_part(run, "samples"), ".png")]
        videos = [store.url(key) for key in store.list(layout.run_part(run, "samples"), ".webp")]
        write_metrics(store, run, metrics)
        store.write_bytes(layout.run_part(run, "loss_curve"), loss_curve_png(metrics))
        config = yaml.safe_dump(self.settings, sort_keys=False).encode()
        store.write_bytes(layout.run_part(run, "config"), config)
        self.trackers.close()  # their files are in the run folder before the run commits
        lineage = self.lineage()
        window = max(1, min(10, len(metrics) // 4))  # mean loss over the first and last few steps
        return store.commit_json(
            layout.run_part(run, "lineage"), lineage, run=store.url(run), samples=samples,
            **({"sample_videos": videos} if videos else {}), model=model.model_dump(),
            weights=self.output, adapter=store.url(layout.run_part(run, "adapter")) if self.output == "adapter" else None,
            transformer=store.url(layout.run_part(run, "transformer")) if self.output == "transformer" else None,
            adapter_form=adapter_form(training, self.family.denoiser.target_modules(training)),
            finished=time.time(), steps=training.steps, resumed_from=start, seconds=round(elapsed, 2),
            first_loss=sum(m["loss"] for m in metrics[:window]) / window,
            final_loss=sum(m["loss"] for m in metrics[-window:]) / window, loss_window=window,
            validation_loss=next((m["validation_loss"] for m in reversed(metrics) if "validation_loss" in m), None),
        )


def code_version() -> str:
    """The git commit of the code that trained (with "+dirty" for uncommitted changes), else the
    installed package version."""
    import subprocess

    here = Path(__file__).parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                                check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return f"precast {package_versions()['precast']}"


def package_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    names = ["precast", "torch", "diffusers", "transformers", "peft", "prefect"]
    versions = {}
    for name in names:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = "not installed"
    return versions
