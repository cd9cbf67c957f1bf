"""Loading the PixArt components by the real `from_pretrained` path, and their fingerprints.

The same calls load a hub id (PixArt-alpha/PixArt-Sigma-XL-2-1024-MS) or a local folder in that
layout. Loaders are cached per process so a worker that encodes many shards loads T5 once.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any

import torch

from configs.schema import LatentEncodingConfig, ModelConfig, TextEncodingConfig
from storage.fingerprint import component_fingerprint, hash_json

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# activation (and stored embedding) dtype of each text_encoding.dtype; int8 quantises weights only
TEXT_ACTIVATIONS = {**DTYPES, "int8": torch.bfloat16}
TEXT_FORMAT = "precast.text/3"  # bump when the stored text layout or numerics change
LATENT_FORMAT = "precast.latents/2"
# from_pretrained patches torch.nn.Module globally while it builds empty weights; two threads
# loading at once can leave the patch in place ("Cannot copy out of meta tensor"), so every load
# (cached or not) holds this lock; re-entrant, because a cached loader locks around its builder.
LOAD_LOCK = threading.RLock()


def serialised(load):
    @functools.wraps(load)
    def locked(*args, **kwargs):
        with LOAD_LOCK:
            return load(*args, **kwargs)

    return locked


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class TextEncoder:
    """A tokenizer and a T5 encoder placed for encoding; `device` is where inputs go."""

    tokenizer: Any
    model: Any
    device: torch.device
    offload_hook: Any = None

    def release(self) -> None:
        """Give the device memory back between shards (offload "model")."""
        if self.offload_hook is not None:
            self.offload_hook.offload()


@serialised
def build_text_encoder(model: ModelConfig, dtype: str, device: str, offload: str) -> TextEncoder:
    """Load T5 by the real `from_pretrained` path in `dtype` and place it for `offload`.

    fp16 goes through `from_pretrained(dtype=float16)`, which keeps T5's `wo` projections in fp32
    (T5 v1.1 overflows in plain fp16; a later `.to(float16)` would undo that).
    """
    from transformers import AutoTokenizer, T5EncoderModel

    tokenizer = AutoTokenizer.from_pretrained(model.path, subfolder="tokenizer", revision=model.revision)
    encoder = T5EncoderModel.from_pretrained(
        model.path, subfolder="text_encoder", revision=model.revision, dtype=TEXT_ACTIVATIONS[dtype]
    ).eval().requires_grad_(False)
    if dtype == "int8":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(encoder, Int8WeightOnlyConfig())
    target = resolve_device(device)
    if offload == "sequential":
        from accelerate import cpu_offload

        cpu_offload(encoder, execution_device=target)
        return TextEncoder(tokenizer, encoder, target)
    if offload == "model":
        from accelerate import cpu_offload_with_hook

        encoder, hook = cpu_offload_with_hook(encoder, execution_device=target)
        return TextEncoder(tokenizer, encoder, target, hook)
    return TextEncoder(tokenizer, encoder.to(target), target)


# one encoder per worker process: every shard that worker encodes reuses it; the lock outside
# the cache makes concurrent first calls load once
load_text_encoder = serialised(functools.lru_cache(maxsize=1)(build_text_encoder))


def reference_placement(device: str) -> tuple[str, str]:
    """(device, offload) for an fp32 reference model beside an encoder on `device`: on the CPU as
    it is; beside an accelerator, streamed to it layer by layer from host memory (sequential
    offload), so the reference never needs the accelerator memory the encoder was sized to fit."""
    target = resolve_device(device)
    return ("cpu", "none") if target.type == "cpu" else (str(target), "sequential")


@serialised
def build_vae(model: ModelConfig, dtype: str, device: str):
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(model.path, subfolder="vae", revision=model.revision, torch_dtype=DTYPES[dtype])
    return vae.to(resolve_device(device)).eval().requires_grad_(False)


# one VAE per worker process, reused by every shard it encodes
load_vae = serialised(functools.lru_cache(maxsize=1)(build_vae))


def model_loads() -> dict[str, int]:
    """Encoder models this process has loaded so far (its loader caches' misses), by stage."""
    return {"encode-text": load_text_encoder.__wrapped__.cache_info().misses,
            "encode-latents": load_vae.__wrapped__.cache_info().misses}


def encoding_work(records: list[dict[str, Any]], since: float, workers: int, loads: int) -> dict[str, Any]:
    """What an encoding stage cost: its workers, the models they loaded, and its shards encoded
    now (committed since `since`) or found already cached."""
    encoded = sum(1 for record in records if record["committed_at"] >= since)
    return {"workers": workers, "model_loads": loads, "shards_encoded": encoded,
            "shards_cached": len(records) - encoded}


@serialised
def load_transformer(model: ModelConfig, dtype: torch.dtype | None = None):
    """The model's PixArt transformer, its weights in `dtype` (None: as stored, fp32 when loaded)."""
    from diffusers import PixArtTransformer2DModel

    return PixArtTransformer2DModel.from_pretrained(model.path, subfolder="transformer", revision=model.revision,
                                                    torch_dtype=dtype)


TRAINABLE_PREDICTIONS = ("epsilon", "v_prediction", "sample")


def load_noise_scheduler(model: ModelConfig):
    """The training scheduler: DDPM with the betas, timesteps and `prediction_type` of the model's
    own scheduler config (what its samplers assume). A flow-matching model, or a prediction type
    DDPM cannot train, is refused by name."""
    from diffusers import DDPMScheduler

    config = DDPMScheduler.load_config(model.path, subfolder="scheduler", revision=model.revision)
    kind, prediction = config.get("_class_name", "unknown"), config.get("prediction_type", "epsilon")
    if kind.startswith("FlowMatch") or prediction not in TRAINABLE_PREDICTIONS:
        raise ValueError(f"{model.path}: its scheduler ({kind}, prediction_type {prediction!r}) cannot be trained "
                         f"by precast, which trains DDPM noise schedules with prediction_type "
                         f"{', '.join(TRAINABLE_PREDICTIONS)}")
    return DDPMScheduler.from_config(config)


def text_encoder_fingerprint(model: ModelConfig, text: TextEncodingConfig) -> str:
    """Covers weights, tokenizer files, max_length, dtype (quantisation included), caption
    preprocessing and format; not device, offload or batch size, which change nothing beyond
    float noise."""
    files = component_fingerprint(model.path, ["text_encoder", "tokenizer"], model.revision)
    return hash_json({"files": files, "max_length": text.max_length, "dtype": text.dtype, "format": TEXT_FORMAT,
                      "captions": caption_rule(text.caption_preprocessing)})


def caption_rule(mode: str) -> str:
    """What decides the text of `mode`: for diffusers, the source of the pipeline's cleaning code,
    so a diffusers release that cleans otherwise re-encodes (and one that does not, does not)."""
    if mode == "none":
        return mode
    import inspect

    from diffusers import PixArtSigmaPipeline

    code = [inspect.getsource(PixArtSigmaPipeline._text_preprocessing),
            inspect.getsource(PixArtSigmaPipeline._clean_caption), PixArtSigmaPipeline.bad_punct_regex.pattern]
    return hash_json(code)


def preprocess_captions(texts: list[str], mode: str) -> list[str]:
    """The text T5 reads: as written (`none`), or what PixArtSigmaPipeline's `encode_prompt` feeds
    its tokenizer by default (`diffusers`: the pipeline's own `_text_preprocessing` with
    `clean_caption=True`)."""
    if mode == "none":
        return list(texts)
    from diffusers import PixArtSigmaPipeline
    from diffusers.utils import is_bs4_available, is_ftfy_available

    if not (is_bs4_available() and is_ftfy_available()):  # the pipeline would fall back to lowercasing only
        raise ImportError("text_encoding.caption_preprocessing 'diffusers' needs beautifulsoup4 and ftfy, as the "
                          "pipeline's clean_caption does: pip install beautifulsoup4 ftfy")
    cleaner = object.__new__(PixArtSigmaPipeline)  # the method uses no model: nothing is loaded
    return cleaner._text_preprocessing(list(texts), clean_caption=True)


def vae_fingerprint(model: ModelConfig, latents: LatentEncodingConfig) -> str:
    """Covers VAE weights, bucket table, crop, posterior layout, flip, tiling, both dtypes and
    format; not device, batch size or slicing."""
    files = component_fingerprint(model.path, ["vae"], model.revision)
    # tiling blends overlapping tiles, so it changes the latents; slicing does not
    settings: dict[str, Any] = latents.model_dump(exclude={"device", "batch_size", "slicing"})
    if latents.crop == "center":
        settings.pop("crop_seed")  # unused: changing it must not re-encode
    return hash_json({"files": files, **settings, "format": LATENT_FORMAT})


def transformer_fingerprint(model: ModelConfig) -> str:
    return hash_json(component_fingerprint(model.path, ["transformer", "scheduler"], model.revision))
