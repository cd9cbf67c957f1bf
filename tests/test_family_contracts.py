"""What every family must equal, each checked against the family's own diffusers pipeline, one test
a kind of check, parametrised over the families (as diffusers' `PipelineTesterMixin` is over its
pipelines); a new family joins by being listed in CONTRACTS with how its pipeline is asked:

- the text cache, encoded by the stage and read back as training reads it, then given to the
  pipeline through the family's `embedding_kwargs`, is what the pipeline's own `encode_prompt`
  gives its transformer (fp32, at the family's default lengths, a caption past every limit cut as
  the pipeline cuts it; where the family masks, the same positions under the same mask);
- the transformer, called by the family's `predict` on the pipeline's own input, gives the
  pipeline's own call's output.

Family-specific facts (Chroma's boolean mask, SD3's CLIP lengths, Wan's zeros and experts) stay in
each family's test module."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from configs.schema import ModelConfig, StorageConfig, TextEncodingConfig, TrainingConfig
from storage.shards import collate
from storage.store import Store
from tasks.encode.text import encode_prompts
from tasks.families import family_of
from tasks.families.flux import unpack
from tasks.identity import text_fingerprints
from tasks.train.data import TextCaches
from tests.pipeline_calls import transformer_calls

PROMPTS = ["a red circle on a blue background", "stripes " * 600, ""]  # a caption, one past every limit, none
CPU = torch.device("cpu")


def packed(hidden: torch.Tensor, height: int, width: int) -> torch.Tensor:
    return unpack(hidden, height, width)  # FLUX.1's and Chroma's 2×2 tokens back to latents


@dataclass(frozen=True)
class Contract:
    """How a family's pipeline is asked: `encode` gives its prompt embeddings by the names of the
    pipeline's call arguments, masks as booleans (its `encode_prompt`, with the pipeline's default
    max_sequence_length); `latents` makes the latents [B, C, (F,) h, w] of what it hands its
    transformer; `timesteps` the schedule's units of the timestep it gives; `guidance` what the
    pipeline and the run are called with (`training.guidance_scale`: FLUX.1-dev's input)."""

    pipeline: str
    encode: Callable[[Any, list[str]], dict[str, torch.Tensor]]
    latents: Callable[[torch.Tensor, int, int], torch.Tensor] = lambda hidden, height, width: hidden
    timesteps: Callable[[torch.Tensor], torch.Tensor] = lambda timestep: timestep
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


CONTRACTS = {
    # a learned-sigma transformer's variance half is dropped by the pipeline before its step
    "pixart-sigma": Contract("PixArtSigmaPipeline", pixart, stepped=lambda output: output.chunk(2, dim=1)[0]),
    "flux": Contract("FluxPipeline", flux, latents=packed, timesteps=lambda t: t * 1000, guidance=3.5),
    "sd3": Contract("StableDiffusion3Pipeline", sd3),
    "chroma": Contract("ChromaPipeline", chroma, latents=packed, timesteps=lambda t: t * 1000),
    "wan": Contract("WanPipeline", wan, settings={"num_frames": 5}),
    # a timestep a latent token, the same for each of them when no frame is given
    "wan2.2-ti2v": Contract("WanPipeline", wan, timesteps=lambda t: t[:, 0], settings={"num_frames": 5}),
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
    if "prompt_attention_mask" in theirs:  # the cache keeps the positions the transformer attends to
        mask, wanted = ours["prompt_attention_mask"].bool(), theirs["prompt_attention_mask"]
        assert torch.equal(mask, wanted[:, : mask.shape[1]]) and not wanted[:, mask.shape[1]:].any()
        torch.testing.assert_close(embeds[mask], want[:, : mask.shape[1]][mask], rtol=1e-4, atol=5e-5)
    else:  # every position the pipeline gives, padding included
        assert embeds.shape == want.shape
        torch.testing.assert_close(embeds, want, rtol=1e-4, atol=5e-5)
    for name in set(theirs) - {"prompt_embeds", "prompt_attention_mask"}:  # pooled vectors
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=5e-5)


def test_the_transformer_is_called_as_the_pipeline_calls_it(case, tmp_path):
    """The pipeline's own call, recorded, given the cached prompt and the empty negative through
    `embedding_kwargs`: `predict` on its input (as latents, in the schedule's units) with the
    run's `call_options` gives its output."""
    model, contract, pipeline = case
    family = family_of(model)
    text = cached(model, tmp_path, ["a green square on a white background", ""])
    calls = transformer_calls(pipeline)
    pipeline(**family.sampler.embedding_kwargs(text, 1), height=96, width=64, num_inference_steps=1,
             **family.sampler.guidance(contract.guidance, 1.0), output_type="latent",
             generator=torch.Generator().manual_seed(0), **contract.settings)
    (seen, output), *_ = calls  # a pipeline that guides calls again for the negative
    height, width = 96 // 8, 64 // 8
    with torch.no_grad():
        ours = family.denoiser.predict(
            pipeline.transformer, contract.latents(seen["hidden_states"], height, width),
            {name: value[:1] for name, value in text.items()}, contract.timesteps(seen["timestep"]),
            **family.denoiser.call_options(TrainingConfig(guidance_scale=contract.guidance)))
    torch.testing.assert_close(ours, contract.latents(contract.stepped(output), height, width))
