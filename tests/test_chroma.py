"""Chroma through the family seam, against `ChromaPipeline`'s own functions: the cache holds T5's
states at the positions its transformer attends to, and the transformer is called as the pipeline
calls it, with a boolean mask (what Chroma was trained with; diffusers 0.42's own float mask does
not mask, diffusers#12116)."""

from __future__ import annotations

import pytest
import torch
from diffusers import ChromaPipeline

from configs.schema import ModelConfig, TextEncodingConfig, TrainingConfig
from storage.shards import collate
from tasks.encode.text import encode_captions
from tasks.families import family_of
from tasks.families.flux import unpack
from tests.pipeline_calls import transformer_calls


@pytest.fixture(scope="module")
def chroma(tiny_family) -> ModelConfig:
    return ModelConfig(path=str(tiny_family("chroma")))


def cached(model: ModelConfig, prompts: list[str]) -> list[torch.Tensor]:
    family = family_of(model)
    (spec,) = family.text.encoders
    config = TextEncodingConfig(dtype="fp32", device="cpu", numerics_samples=0)
    return encode_captions(prompts, model, family, config, spec)[0]["hidden"]


def test_the_transformer_is_called_as_the_pipeline_calls_it_with_a_boolean_mask(chroma):
    """Given the cached features through `embedding_kwargs`, the pipeline calls its transformer
    with a boolean mask; `predict` gives its prediction, and the ragged cache gives what the
    pipeline's own 512 positions give under the same mask."""
    family = family_of(chroma)
    pipeline = ChromaPipeline.from_pretrained(chroma.path)
    calls = transformer_calls(pipeline)
    prompts = ["a green square on a white background", ""]  # the prompt, the negative
    both = collate([{"t5_hidden": e} for e in cached(chroma, prompts)])
    generate = dict(height=96, width=64, num_inference_steps=1, guidance_scale=2.0, output_type="latent")
    pipeline(**family.sampler.embedding_kwargs(both, 1), generator=torch.Generator().manual_seed(0), **generate)
    (seen, output), (seen_negative, _) = calls
    assert seen["attention_mask"].dtype == torch.bool and seen["attention_mask"].shape == (1, 7 + 1 + 1 + 6 * 4)  # 7 words, </s>, a pad; 12 × 8 latents in 2 × 2 tokens
    noisy = unpack(seen["hidden_states"], 12, 8)
    with torch.no_grad():
        ours = family.denoiser.predict(pipeline.transformer, noisy, {k: v[:1] for k, v in both.items()},
                              seen["timestep"] * 1000, **family.denoiser.call_options(TrainingConfig()))
    torch.testing.assert_close(ours, unpack(output, 12, 8))

    calls.clear()
    embeds, mask = pipeline._get_t5_prompt_embeds(prompts, max_sequence_length=512)
    pipeline(prompt_embeds=embeds[:1], prompt_attention_mask=mask[:1].bool(), negative_prompt_embeds=embeds[1:],
             negative_prompt_attention_mask=mask[1:].bool(), generator=torch.Generator().manual_seed(0), **generate)
    torch.testing.assert_close(calls[0][1], output, rtol=1e-4, atol=1e-5)
