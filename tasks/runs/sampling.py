"""Sample images through diffusers' PixArtSigmaPipeline.

During training the pipeline gets no tokenizer and no text encoder: prompts come from the text
cache, and the VAE is loaded only here, for decoding. `sample_run` is the user-facing path (`precast
sample`): the full pipeline with the trained weights.
"""

from __future__ import annotations

import json

import torch
from PIL import Image

from configs.schema import ModelConfig
from storage import layout
from storage.shards import pad_sequences
from tasks.encode.models import load_vae


def side_by_side(images: list[Image.Image]) -> Image.Image:
    grid = Image.new("RGB", (sum(i.width for i in images), max(i.height for i in images)))
    x = 0
    for image in images:
        grid.paste(image, (x, 0))
        x += image.width
    return grid


def sample_grid(
    model: ModelConfig,
    transformer,
    prompt_embeddings: list[torch.Tensor],
    empty_embedding: torch.Tensor,
    steps: int,
    guidance_scale: float,
    seed: int,
) -> Image.Image:
    """One image per prompt, side by side."""
    from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline

    device = next(transformer.parameters()).device
    vae = load_vae(model, "fp32", str(device))
    scheduler = DPMSolverMultistepScheduler.from_pretrained(model.path, subfolder="scheduler", revision=model.revision)
    pipeline = PixArtSigmaPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer,
                                   scheduler=scheduler)
    pipeline.set_progress_bar_config(disable=True)
    # positive and negative embeddings must share one length for classifier-free guidance
    embeds, mask = pad_sequences(prompt_embeddings + [empty_embedding] * len(prompt_embeddings))
    count = len(prompt_embeddings)
    dtype = next(transformer.parameters()).dtype
    images = pipeline(
        prompt_embeds=embeds[:count].to(device, dtype), prompt_attention_mask=mask[:count].to(device),
        negative_prompt_embeds=embeds[count:].to(device, dtype), negative_prompt_attention_mask=mask[count:].to(device),
        negative_prompt=None, num_inference_steps=steps, guidance_scale=guidance_scale,
        generator=torch.Generator(device="cpu").manual_seed(seed),
    ).images
    return side_by_side(images)


def sample_run(
    url: str, prompts: list[str], model: ModelConfig | None = None, options: dict | None = None,
    steps: int = 20, guidance_scale: float = 4.5, seed: int = 0, device: str = "auto",
) -> Image.Image:
    """Images for `prompts` from a run (`<root>/runs/<id>`) or its `adapter`/`transformer` URL,
    through `PixArtSigmaPipeline.from_pretrained` with the trained weights: a LoRA adapter merged
    into the transformer, or the fully trained transformer. The model comes from the run's lineage
    unless given."""
    import tempfile

    import fsspec
    from diffusers import PixArtSigmaPipeline, PixArtTransformer2DModel
    from peft import PeftModel

    from tasks.encode.models import load_transformer, resolve_device

    fs, path = fsspec.core.url_to_fs(url.rstrip("/"), **(options or {}))
    run = layout.run_of(path)
    lineage = json.loads(fs.cat_file(layout.run_part(run, "lineage"))) if fs.exists(layout.run_part(run, "lineage")) \
        else {}
    if model is None:
        if not lineage:
            raise FileNotFoundError(f"{url} has no lineage.json: say which model with --model")
        model = ModelConfig.model_validate(lineage["model"])
    # the prompt text T5 reads, as it read the run's captions
    text = lineage.get("text", {"caption_preprocessing": "diffusers", "max_length": 300})
    with tempfile.TemporaryDirectory() as local:
        adapter, full = layout.run_part(run, "adapter"), layout.run_part(run, "transformer")
        if fs.exists(f"{adapter}/adapter_config.json"):
            for name in ("adapter_config.json", "adapter_model.safetensors"):
                fs.get_file(f"{adapter}/{name}", f"{local}/{name}")
            transformer = PeftModel.from_pretrained(load_transformer(model), local).merge_and_unload()
        elif fs.exists(f"{full}/config.json"):
            for name in fs.ls(full, detail=False):
                fs.get_file(name, f"{local}/{name.rsplit('/', 1)[-1]}")
            transformer = PixArtTransformer2DModel.from_pretrained(local)
        else:
            raise FileNotFoundError(f"no adapter/ or transformer/ with trained weights at {url}")
    pipeline = PixArtSigmaPipeline.from_pretrained(model.path, revision=model.revision, transformer=transformer)
    pipeline.to(resolve_device(device)).set_progress_bar_config(disable=True)
    if text["caption_preprocessing"] == "none":  # the pipeline lowercases even without clean_caption
        pipeline._text_preprocessing = lambda texts, clean_caption=False: (
            [texts] if isinstance(texts, str) else list(texts))
    images = pipeline(prompts, num_inference_steps=steps,
                      guidance_scale=guidance_scale, clean_caption=True, max_sequence_length=text["max_length"],
                      generator=torch.Generator(device="cpu").manual_seed(seed)).images
    return side_by_side(images)
