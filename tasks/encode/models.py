"""Loading the frozen encoders (the family's text encoders and the VAE) by the real
`from_pretrained` path.

The same calls load a hub id or a local folder in the hub layout. Loaders are cached per process
so a worker that encodes many shards loads each of its encoders once.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any

import torch

from configs.schema import ModelConfig, TextEncodingConfig
from tasks.families import Family
from tasks.families.spec import TextEncoderSpec
from tasks.loading import DTYPES, library, resolve_device, serialised

# activation (and stored embedding) dtype of each text_encoding.dtype; int8 quantises weights only
TEXT_ACTIVATIONS = {**DTYPES, "int8": torch.bfloat16}


@dataclass
class TextEncoder:
    """A tokenizer and a text encoder placed for encoding; `device` is where inputs go."""

    tokenizer: Any
    model: Any
    device: torch.device
    family: Family  # what text the encoder reads of a caption
    spec: TextEncoderSpec  # which of the family's encoders, and what of its output is kept
    model_config: ModelConfig  # the model it was loaded from
    offload_hook: Any = None
    images: Any = None  # an encoder that sees pictures: the image processor of its `processor` folder

    def max_length(self, text: TextEncodingConfig) -> int:
        return self.family.text.length(self.model_config, self.spec, text)

    def release(self) -> None:
        """Give the device memory back between shards (offload "model")."""
        if self.offload_hook is not None:
            self.offload_hook.offload()


@serialised
def build_text_encoder(model: ModelConfig, family: Family, spec: TextEncoderSpec, dtype: str, device: str,
                       offload: str) -> TextEncoder:
    """Load one of `family`'s text encoders by the real `from_pretrained` path in `dtype` and
    place it for `offload`.

    fp16 goes through `from_pretrained(dtype=float16)`, which keeps T5's `wo` projections in fp32
    (T5 v1.1 overflows in plain fp16; a later `.to(float16)` would undo that).
    """
    tokenizer = library("transformers", "AutoTokenizer").from_pretrained(model.path, subfolder=spec.tokenizer,
                                                                        revision=model.revision)
    encoder = library("transformers", spec.model_class).from_pretrained(
        model.path, subfolder=spec.folder, revision=model.revision, dtype=TEXT_ACTIVATIONS[dtype],
        **spec.load_options()).eval().requires_grad_(False)
    if dtype == "int8":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(encoder, Int8WeightOnlyConfig())
    images = spec.image_processor(model) if spec.processor else None
    target = resolve_device(device)
    if offload == "sequential":
        from accelerate import cpu_offload

        cpu_offload(encoder, execution_device=target)
        return TextEncoder(tokenizer, encoder, target, family, spec, model, images=images)
    if offload == "model":
        from accelerate import cpu_offload_with_hook

        encoder, hook = cpu_offload_with_hook(encoder, execution_device=target)
        return TextEncoder(tokenizer, encoder, target, family, spec, model, hook, images)
    return TextEncoder(tokenizer, encoder.to(target), target, family, spec, model, images=images)


# each of a family's encoders once per worker process (by encoder name: a setting that changes
# replaces it): every shard that worker encodes reuses them
TEXT_LOADERS: dict[str, Any] = {}


@serialised  # outside the caches: concurrent first calls load once
def load_text_encoder(model: ModelConfig, family: Family, spec: TextEncoderSpec, dtype: str, device: str,
                      offload: str) -> TextEncoder:
    loader = TEXT_LOADERS.setdefault(spec.name, functools.lru_cache(maxsize=1)(build_text_encoder))
    return loader(model, family, spec, dtype, device, offload)


def reference_placement(device: str) -> tuple[str, str]:
    """(device, offload) for an fp32 reference model beside an encoder on `device`: on the CPU as
    it is; beside an accelerator, streamed to it layer by layer from host memory (sequential
    offload), so the reference never needs the accelerator memory the encoder was sized to fit."""
    target = resolve_device(device)
    return ("cpu", "none") if target.type == "cpu" else (str(target), "sequential")


@serialised
def build_vae(model: ModelConfig, family: Family, dtype: str, device: str):
    vae = library("diffusers", family.codec.vae).from_pretrained(
        model.path, subfolder="vae", revision=model.revision, torch_dtype=DTYPES[dtype])
    return vae.to(resolve_device(device)).eval().requires_grad_(False)


# one VAE per worker process, reused by every shard it encodes, by one call at a time (`VAE_IN_USE`):
# Wan's 3-D VAE keeps its causal convolutions' cache on itself, so two shards' calls at once mixed
# their frames (clips of 5 frames got 5 latent frames, not 2, or the call failed)
load_vae = serialised(functools.lru_cache(maxsize=1)(build_vae))
VAE_IN_USE = threading.Lock()


def model_loads() -> dict[str, int]:
    """Encoder models this process has loaded so far (its loader caches' misses), by stage."""
    return {"encode-text": sum(loader.cache_info().misses for loader in TEXT_LOADERS.values()),
            "encode-latents": load_vae.__wrapped__.cache_info().misses}


def encoding_work(records: list[dict[str, Any]], since: float, workers: int, loads: int) -> dict[str, Any]:
    """What an encoding stage cost: its workers, the models they loaded, its shards encoded now
    (committed since `since`) or found already cached, the samples those encoded (and of them the
    latents copied from shards holding the same images), and the store failures the shards encoded
    now retried (a cached shard's record, Prefect's included, holds its first run's); for
    the latent encoder, the share of its encoding the VAE waited for decoded pixels (`feed_wait`)."""
    now = [record for record in records if record["committed_at"] >= since]
    # by image shard: a text stage has a record a shard for each of its encoders
    samples = {r["shard"]: (r["samples"], r.get("copied", 0)) for r in now if "shard" in r}
    copied = sum(copied for _, copied in samples.values())
    work = {"workers": workers, "model_loads": loads, "shards_encoded": len(now),
            "shards_cached": len(records) - len(now), "samples_encoded": sum(n for n, _ in samples.values()) - copied,
            "samples_copied": copied, "io_retries": sum(r.get("io_retries", 0) for r in now)}
    if seconds := sum(record.get("seconds", 0) for record in now):  # the latent encoder's feed
        work["feed_wait"] = round(sum(record["feed_wait_seconds"] for record in now) / seconds, 4)
    return work

