"""A finished run's folder, read through the store: its commit record, its lineage and its trained
weights. Every tool over a finished run (sampling, export, the run page, `init_from`) reads a run
here, so each gets the store's retries and refuses a run whose lineage is not committed."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from configs.schema import ModelConfig, StorageConfig, TrainingConfig, read_flat
from storage import layout
from storage.store import Store
from tasks.families import UNRECORDED_PIPELINE, Family, family_named

# the files PEFT's save_pretrained writes for an adapter (and from_pretrained reads)
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def run_record(store: Store, run: str) -> dict[str, Any] | None:
    """A run's commit record (its lineage's), or None while the run is not finished."""
    return store.committed(layout.run_part(run, "lineage"))


def weights_of(record: dict[str, Any]) -> str:
    """Which weights a finished run's commit record points at: "adapter" (LoRA, PEFT layout) or
    "transformer" (diffusers); for runs published before the record named it, whichever is set."""
    return record.get("weights") or ("adapter" if record["adapter"] else "transformer")


def write_metrics(store: Store, run: str, metrics: list[dict[str, Any]]) -> None:
    store.write_bytes(layout.run_part(run, "metrics"), "".join(json.dumps(m) + "\n" for m in metrics).encode())


def read_metrics(store: Store, run: str) -> list[dict[str, Any]]:
    """A run's metrics.jsonl (empty before its first checkpoint or publish)."""
    if not store.exists(layout.run_part(run, "metrics")):
        return []
    return [json.loads(line) for line in store.read_bytes(layout.run_part(run, "metrics")).splitlines() if line]


@dataclass
class FinishedRun:
    store: Store
    run: str  # the run's key in the store
    record: dict[str, Any]  # the lineage's commit record: steps, losses, samples, weights
    lineage: dict[str, Any]  # what trained it: manifest, model, training config, text, code, versions

    @classmethod
    def at(cls, url: str, options: dict | None = None, like: StorageConfig | None = None) -> FinishedRun:
        """The run at `url` (a run's URL, or its adapter/transformer URL), read with the fsspec
        `options`, or with every setting of the store config `like` (options, credentials, retries)."""
        root, run = layout.parse_run(url)
        config = like.model_copy(update={"root": root}) if like else StorageConfig(root=root, options=options or {})
        return cls.read(Store(config), run)

    @classmethod
    def read(cls, store: Store, run: str) -> FinishedRun:
        record = run_record(store, run)
        if record is None:
            raise FileNotFoundError(f"{store.url(run)} is not a finished run (no committed lineage.json)")
        lineage = json.loads(store.read_verified(layout.run_part(run, "lineage"), record["sha256"]))
        if "training" in lineage:  # grouped as they are written now (runs before the grouping wrote them flat)
            lineage["training"] = read_flat(TrainingConfig, lineage["training"])
        return cls(store, run, record, lineage)

    @property
    def url(self) -> str:
        return self.store.url(self.run)

    @property
    def weights(self) -> str:
        return weights_of(self.record)

    @property
    def family(self) -> Family:
        """The family of the run's model, as its lineage recorded it: no model folder is needed."""
        return family_named(self.lineage.get("pipeline", UNRECORDED_PIPELINE))

    def adapter(self) -> tuple[dict[str, Any], bytes]:
        """The LoRA adapter's PEFT config and its safetensors file's bytes."""
        if self.weights != "adapter":
            raise FileNotFoundError(f"{self.url} has no LoRA adapter (a `method: full` run saves a whole transformer, "
                                    f"which loads as a model, not as a LoRA)")
        folder = layout.run_part(self.run, "adapter")
        config = json.loads(self.store.read_bytes(f"{folder}/{ADAPTER_CONFIG}"))
        return config, self.store.read_bytes(f"{folder}/{ADAPTER_WEIGHTS}")

    def trained_transformer(self, model: ModelConfig, family: Family, local: str) -> torch.nn.Module:
        """The transformer with the trained weights: the adapter merged into `model`'s, or the
        whole trained transformer (`model`'s family's); its files are copied to the folder `local`
        first."""
        from peft import PeftModel

        folder = layout.run_part(self.run, self.weights)
        for key in self.store.list(folder):
            self.store.get_file(key, Path(local) / key.rsplit("/", 1)[-1])
        if self.weights == "adapter":
            return PeftModel.from_pretrained(family.denoiser.load(model), local).merge_and_unload()
        return family.denoiser.transformer_class().from_pretrained(local)
