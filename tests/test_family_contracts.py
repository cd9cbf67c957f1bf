"""What every family must equal, each checked against the family's own diffusers pipeline, one test
a kind of check, parametrised over the families (as diffusers' `PipelineTesterMixin` is over its
pipelines); a new family joins by being listed in CONTRACTS with how its pipeline is asked:

- the text cache, encoded by the stage and read back as training reads it, then given to the
  pipeline through the family's `embedding_kwargs`, is what the pipeline's own `encode_prompt`
  gives its transformer (fp32, at the family's default lengths, a caption past every limit cut as
  the pipeline cuts it; where the family masks, the same positions under the same mask);
- the transformer, called by the family's `predict` on the pipeline's own input, gives the
  pipeline's own call's output;
- a picture's latents, encoded by the stage, drawn and normalised by the training reader and
  noised by the family's schedule, are what the family's image-to-image (video-to-video) pipeline
  prepares of the same picture with the same draws (PixArt has no such pipeline in diffusers).

Family-specific facts (Chroma's boolean mask, SD3's CLIP lengths, Wan's zeros and experts) stay in
each family's test module."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from configs.schema import ModelConfig, PipelineConfig, StorageConfig, TextEncodingConfig, TrainingConfig
from storage.shards import collate
from storage.store import Store
from tasks.encode.text import encode_prompts
from tasks.families import family_of
from tasks.families.flux import unpack
from tasks.identity import text_fingerprints
from tasks.runner import run_direct
from tasks.train.data import CachedFeatures, TextCaches
from tests.pipeline_calls import transformer_calls

PROMPTS = ["a red circle on a blue background", "stripes " * 600, ""]  # a caption, one past every limit, none
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Contract:
    """How a family's pipeline is asked: `encode` gives its prompt embeddings by the names of the
    pipeline's call arguments, masks as booleans (its `encode_prompt`, with the pipeline's default
    max_sequence_length); `latents` makes the latents [B, C, (F,) h, w] of what it hands its
    transformer; `timesteps` the schedule's units of the timestep it gives; `inputs` the names of
    the call's arguments that hold those two; `guidance` what the pipeline and the run are called
    with (`training.guidance_scale`: FLUX.1-dev's input)."""

    pipeline: str
    encode: Callable[[Any, list[str]], dict[str, Any]]
    latents: Callable[[torch.Tensor, int, int], torch.Tensor] = lambda hidden, height, width: hidden
    timesteps: Callable[[torch.Tensor], torch.Tensor] = lambda timestep: timestep
    inputs: tuple[str, str] = ("hidden_states", "timestep")
    guidance: float = 1.0
    settings: dict[str, Any] = field(default_factory=dict)  # what else the pipeline is called with
    # what of the transformer's output the pipeline steps with
    stepped: Callable[[torch.Tensor], torch.Tensor] = lambda output: output


def pixart(pipeline, prompts):
    embeds, mask, _, _ = pipeline.encode_prompt(prompts, do_classifier_free_guidance=False, device=CPU,
                                                max_sequence_length=300, clean_caption=True)
    return {"prompt_embeds": embeds, "prompt_attention_mask": mask.bool()}


def flux(pipeline, prompts):
    embeds, pooled, _ = pipeline.encode_prompt(prompts, prompt_2=None, device=CPU, max_sequence_length=512)
    return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}


def sd3(pipeline, prompts):
    embeds, _, pooled, _ = pipeline.encode_prompt(prompts, None, None, device=CPU, do_classifier_free_guidance=False)
    return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}


def chroma(pipeline, prompts):
    embeds, _, mask, _, _, _ = pipeline.encode_prompt(prompts, device=CPU, do_classifier_free_guidance=False,
                                                      max_sequence_length=512)
    return {"prompt_embeds": embeds, "prompt_attention_mask": mask.bool()}


def wan(pipeline, prompts):
    embeds, _ = pipeline.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=512, device=CPU)
    return {"prompt_embeds": embeds}


def zimage(pipeline, prompts):  # a list of each caption's real tokens
    embeds, _ = pipeline.encode_prompt(prompts, device=CPU, do_classifier_free_guidance=False, max_sequence_length=512)
    return {"prompt_embeds": embeds}


def qwen_image(pipeline, prompts):  # zero-padded to the longest under its mask
    embeds, mask = pipeline.encode_prompt(prompts, device=CPU, max_sequence_length=512)
    return {"prompt_embeds": embeds, "prompt_embeds_mask": mask.bool()}


def flux2(pipeline, prompts):  # every one of the 512 positions
    embeds, _ = pipeline.encode_prompt(prompts, device=CPU, max_sequence_length=512)
    return {"prompt_embeds": embeds}


def patches(tokens, height, width):  # FLUX.2's tokens, one a 2×2 patch, as [B, 128, h/2, w/2]
    return tokens.transpose(1, 2).reshape(len(tokens), -1, height // 2, width // 2)


CONTRACTS = {
    # a learned-sigma transformer's variance half is dropped by the pipeline before its step
    "pixart-sigma": Contract("PixArtSigmaPipeline", pixart, stepped=lambda output: output.chunk(2, dim=1)[0]),
    # two steps: PixArtAlphaPipeline takes one step as a one-step model's (the scheduler's second output)
    "pixart-alpha": Contract("PixArtAlphaPipeline", pixart, stepped=lambda output: output.chunk(2, dim=1)[0],
                             settings={"num_inference_steps": 2}),
    # not the pipeline's default guidance (3.5): the run's value must reach the transformer
    # FLUX.1's and Chroma's transformers take latents packed 2×2 into tokens
    "flux": Contract("FluxPipeline", flux, latents=unpack, timesteps=lambda t: t * 1000, guidance=2.0),
    "sd3": Contract("StableDiffusion3Pipeline", sd3),
    "chroma": Contract("ChromaPipeline", chroma, latents=unpack, timesteps=lambda t: t * 1000),
    "wan": Contract("WanPipeline", wan, settings={"num_frames": 5}),
    # a timestep a latent token, the same for each of them when no frame is given
    "wan2.2-ti2v": Contract("WanPipeline", wan, timesteps=lambda t: t[:, 0], settings={"num_frames": 5}),
    # a list of one-frame clips in, the time as 1 - σ, the velocity negated out
    # a picture's latents [B, C, 1, h, w] packed 2×2 into tokens; two steps: the scheduler's stretch to
    # its shift_terminal divides by zero at one
    "qwen-image": Contract("QwenImagePipeline", qwen_image, latents=lambda hidden, height, width:
                           unpack(hidden, height, width).unsqueeze(2), timesteps=lambda t: t * 1000,
                           settings={"num_inference_steps": 2}),
    # [dev]: guidance distilled, checked at 2.0 (not its pipeline's default, 4.0), as FLUX.1-dev's
    "flux2-dev": Contract("Flux2Pipeline", flux2, latents=patches, timesteps=lambda t: t * 1000, guidance=2.0),
    "flux2-klein": Contract("Flux2KleinPipeline", flux2, latents=patches, timesteps=lambda t: t * 1000),
    "zimage": Contract("ZImagePipeline", zimage,
                       latents=lambda clips, height, width: torch.stack(list(clips)).squeeze(2),
                       timesteps=lambda t: (1 - t) * 1000, inputs=("x", "t"),
                       stepped=lambda output: [-o for o in output]),
}


def cached(model: ModelConfig, root, prompts: list[str]) -> dict[str, torch.Tensor]:
    """The prompts encoded by the stage's own function into a store under `root` with the text
    settings users run (but fp32), read back as training reads them, one batch."""
    storage, text = StorageConfig(root=str(root)), TextEncodingConfig(dtype="fp32", device="cpu", numerics_samples=0)
    records = encode_prompts(storage, model, text, text_fingerprints(model, text), prompts)
    store = Store(storage)
    keys = {name: store.key(record["url"]) for name, record in records.items()}
    caches = TextCaches(store, family_of(model).text.encoders,
                        {keys[name]: record["sha256"] for name, record in records.items()}, keys)
    return collate([caches.prompt(prompt) for prompt in prompts])


@pytest.fixture(params=list(CONTRACTS))
def case(request, tiny_family) -> tuple[ModelConfig, Contract, Any]:
    """A family's tiny model, its contract and its pipeline, loaded by `from_pretrained`."""
    from diffusers import DiffusionPipeline

    model = ModelConfig(path=str(tiny_family(request.param)))
    contract = CONTRACTS[request.param]
    pipeline = DiffusionPipeline.from_pretrained(model.path)
    assert type(pipeline).__name__ == contract.pipeline == family_of(model).sampler.pipeline_name
    return model, contract, pipeline


def test_the_text_cache_is_what_encode_prompt_gives_the_transformer(case, tmp_path):
    model, contract, pipeline = case
    ours = family_of(model).sampler.embedding_kwargs(cached(model, tmp_path, PROMPTS), len(PROMPTS))
    with torch.no_grad():
        theirs = contract.encode(pipeline, PROMPTS)
    ours = {name: value for name, value in ours.items() if name in theirs}
    assert set(ours) == set(theirs)
    embeds, want = ours["prompt_embeds"], theirs["prompt_embeds"]
    if isinstance(want, list):  # ragged: each caption's positions
        assert [e.shape for e in embeds] == [w.shape for w in want]
        for mine, wanted in zip(embeds, want):
            torch.testing.assert_close(mine, wanted, rtol=1e-4, atol=5e-5)
    elif masked := [name for name in ("prompt_attention_mask", "prompt_embeds_mask") if name in theirs]:
        # the cache keeps the positions the transformer attends to
        mask, wanted = ours[masked[0]].bool(), theirs[masked[0]]
        assert torch.equal(mask, wanted[:, : mask.shape[1]]) and not wanted[:, mask.shape[1]:].any()
        torch.testing.assert_close(embeds[mask], want[:, : mask.shape[1]][mask], rtol=1e-4, atol=5e-5)
    else:  # every position the pipeline gives, padding included
        assert embeds.shape == want.shape
        torch.testing.assert_close(embeds, want, rtol=1e-4, atol=5e-5)
    for name in set(theirs) - {"prompt_embeds", "prompt_attention_mask", "prompt_embeds_mask"}:  # pooled vectors
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=5e-5)


def test_the_transformer_is_called_as_the_pipeline_calls_it(case, tmp_path):
    """The pipeline's own call, recorded, given the cached prompt and the empty negative through
    `embedding_kwargs`: `predict` on its input (as latents, in the schedule's units) with the
    run's `call_options` gives its output."""
    model, contract, pipeline = case
    family = family_of(model)
    text = cached(model, tmp_path, ["a green square on a white background", ""])
    calls = transformer_calls(pipeline)
    pipeline(**family.sampler.embedding_kwargs(text, 1), height=96, width=64,
             **family.sampler.guidance(contract.guidance, 1.0), output_type="latent",
             generator=torch.Generator().manual_seed(0), **{"num_inference_steps": 1, **contract.settings})
    (seen, output), *_ = calls  # a pipeline that guides calls again for the negative
    if seen.get("guidance") is not None:  # a guidance-distilled transformer's input (FLUX.1-dev's)
        assert torch.equal(seen["guidance"], torch.full((1,), contract.guidance))
    height, width = 96 // 8, 64 // 8
    latents, timestep = (seen[name] for name in contract.inputs)
    with torch.no_grad():
        ours = family.denoiser.predict(
            pipeline.transformer, contract.latents(latents, height, width),
            {name: value[:1] for name, value in text.items()}, contract.timesteps(timestep),
            **family.denoiser.call_options(TrainingConfig(guidance_scale=contract.guidance)))
    torch.testing.assert_close(ours, contract.latents(contract.stepped(output), height, width))


@dataclass(frozen=True)
class Preparation:
    """How a family's image-to-image pipeline prepares a picture's latents: `pipeline` is its class,
    `prepare(pipeline, pixels, timestep, generator)` its own `prepare_latents` on pixels [1, 3, H, W]
    in [-1, 1], given back as latents [1, C, (F,) h, w]; `posterior` what of the VAE's posterior it
    takes (`sample`: a draw with the generator, as the reader draws from the cached mean and std;
    `argmax`: its mean, as `latent_encoding.posterior: mean` caches)."""

    pipeline: str
    prepare: Callable[[Any, torch.Tensor, torch.Tensor, torch.Generator], torch.Tensor]
    posterior: str = "sample"


def packed_image(pipeline, pixels, timestep, generator):  # FLUX.1's and Chroma's: packed 2×2 tokens
    side = pixels.shape[-1]
    latents, _ = pipeline.prepare_latents(pixels, timestep, 1, pipeline.vae.config.latent_channels, side, side,
                                          torch.float32, CPU, generator)
    return unpack(latents, side // 8, side // 8)


def sd3_image(pipeline, pixels, timestep, generator):
    return pipeline.prepare_latents(pixels, timestep, 1, 1, torch.float32, CPU, generator)


def zimage_image(pipeline, pixels, timestep, generator):
    side = pixels.shape[-1]
    return pipeline.prepare_latents(pixels, timestep, 1, pipeline.vae.config.latent_channels, side, side,
                                    torch.float32, CPU, generator)


def qwen_image_picture(pipeline, pixels, timestep, generator):  # packed, a one-frame clip
    side = pixels.shape[-1]
    latents = pipeline.prepare_latents(pixels, timestep, 1, pipeline.transformer.config.in_channels // 4, side, side,
                                       torch.float32, CPU, generator)
    return unpack(latents, side // 8, side // 8).unsqueeze(2)


def flux2_picture(pipeline, pixels, timestep, generator):
    """FLUX.2 has no image-to-image pipeline: its own encoding of a reference picture (the VAE's
    argmax, patched, batch-normalised), noised by its scheduler as the image-to-image pipelines do."""
    latents = pipeline._encode_vae_image(pixels, generator)
    return pipeline.scheduler.scale_noise(latents, timestep, torch.randn(latents.shape, generator=generator))


def wan_video(pipeline, pixels, timestep, generator):  # a picture is a one-frame clip
    side = pixels.shape[-1]
    return pipeline.prepare_latents(pixels.unsqueeze(2), 1, pipeline.vae.config.z_dim, side, side, torch.float32, CPU,
                                    generator, timestep=timestep)


PREPARATIONS = {
    "flux": Preparation("FluxImg2ImgPipeline", packed_image),
    "sd3": Preparation("StableDiffusion3Img2ImgPipeline", sd3_image),
    "chroma": Preparation("ChromaImg2ImgPipeline", packed_image),
    "wan": Preparation("WanVideoToVideoPipeline", wan_video, posterior="argmax"),
    "zimage": Preparation("ZImageImg2ImgPipeline", zimage_image),
    "qwen-image": Preparation("QwenImageImg2ImgPipeline", qwen_image_picture),
    "flux2-dev": Preparation("Flux2Pipeline", flux2_picture, posterior="argmax"),
    "flux2-klein": Preparation("Flux2KleinPipeline", flux2_picture, posterior="argmax"),
    # Wan 2.2 TI2V: diffusers 0.42's video-to-video pipeline takes its VAE for an 8× one (its noise
    # is twice the latents' sides); its image-to-video pipeline's preparation of a first frame is
    # checked in tests/test_wan.py
}


@pytest.mark.parametrize("name", list(PREPARATIONS))
def test_latents_are_what_the_image_to_image_pipeline_prepares_of_the_same_picture(name, tiny_family, tmp_path):
    import diffusers
    import numpy as np
    from PIL import Image

    preparation, side = PREPARATIONS[name], 256  # one of every family's buckets: the picture is neither cut nor scaled
    source = tmp_path / "source"
    source.mkdir()
    picture = Image.fromarray(np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8))
    picture.save(source / "picture.png")
    (source / "picture.txt").write_text("a picture")
    posterior = "mean" if preparation.posterior == "argmax" else "mean_std"
    config = PipelineConfig.model_validate({
        "storage": {"root": str(tmp_path / "store")}, "dataset": {"sources": [{"path": str(source)}]},
        "model": {"path": str(tiny_family(name))}, "text_encoding": {"dtype": "fp32"},
        "latent_encoding": {"resolution": side, "dtype": "fp32", "storage_dtype": "fp32", "posterior": posterior}})
    records = run_direct(config, until="manifest")
    store, family = Store(config.storage), family_of(config.model)
    features = CachedFeatures(store, store.read_json(store.key(records["manifest"]["url"])), family)
    (sample,) = features.samples
    ours, *_ = features.batch([sample], torch.Generator().manual_seed(3), 0.0)

    pipeline = getattr(diffusers, preparation.pipeline).from_pretrained(config.model.path)
    shifting = pipeline.scheduler.config.get("use_dynamic_shifting")
    pipeline.scheduler.set_timesteps(4, **({"mu": 1.0} if shifting else {}))
    timestep, sigma = pipeline.scheduler.timesteps[1:2], pipeline.scheduler.sigmas[1:2]
    pixels = pipeline.image_processor.preprocess(picture) if hasattr(pipeline, "image_processor") \
        else pipeline.video_processor.preprocess(picture)
    with torch.no_grad():
        theirs = preparation.prepare(pipeline, pixels, timestep, torch.Generator().manual_seed(3))
    draws = torch.Generator().manual_seed(3)  # the pipeline's: the posterior's draw (when it draws), then the noise
    if preparation.posterior == "sample":
        torch.randn(ours.shape, generator=draws)
    noise = torch.randn(ours.shape, generator=draws)
    torch.testing.assert_close(family.denoiser.schedule(config.model).noised(ours, noise, sigma), theirs,
                               rtol=1e-4, atol=1e-4)
