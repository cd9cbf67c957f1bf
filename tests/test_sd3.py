"""SD3/SD3.5 through the family seam, against `StableDiffusion3Pipeline`'s own functions: each
encoder's cached outputs joined are what `encode_prompt` gives the transformer, and the
transformer is called as the pipeline calls it."""

from __future__ import annotations

import pytest
import torch
from diffusers import StableDiffusion3Pipeline

from configs.schema import ModelConfig, TextEncodingConfig
from storage.shards import collate
from tasks.encode.text import encode_captions
from tasks.families import family_of
from tasks.families.sd3 import SD3, joined


@pytest.fixture(scope="module")
def sd3(tiny_family) -> ModelConfig:
    return ModelConfig(path=str(tiny_family("sd3")))


def features(model: ModelConfig, prompts: list[str], **text) -> list[dict[str, torch.Tensor]]:
    """Each prompt's cached features by `Conditioning` key, as training reads them."""
    family, config = family_of(model), TextEncodingConfig(dtype="fp32", device="cpu", numerics_samples=0, **text)
    cached = {spec.name: encode_captions(prompts, model, family, config, spec)[0] for spec in family.text.encoders}
    return [{f"{name}_{output}": values[i][0] if output == "pooled" else values[i]
             for name, outputs in cached.items() for output, values in outputs.items()} for i in range(len(prompts))]


def clip_length(model: ModelConfig, tokens: int | None, folder) -> ModelConfig:
    """A copy of `model` whose two CLIP tokenizers pad to `tokens` (None: unset)."""
    import json
    import shutil

    copy = shutil.copytree(model.path, folder / "sd3")
    for tokenizer in ("tokenizer", "tokenizer_2"):
        settings = json.loads((copy / tokenizer / "tokenizer_config.json").read_text())
        settings.pop("model_max_length")
        settings.update({} if tokens is None else {"model_max_length": tokens})
        (copy / tokenizer / "tokenizer_config.json").write_text(json.dumps(settings))
    return ModelConfig(path=str(copy))


# the published CLIP length (the tiny world's, 16: tests/test_family_contracts.py)
@pytest.mark.parametrize("tokens", [77])
def test_the_joined_cache_is_what_encode_prompt_gives_the_transformer(sd3, tokens, tmp_path):
    """Every output, fp32: CLIP-L's and CLIP-G's penultimate states (padded to their tokenizer's
    model_max_length, which the pipeline reads) and pooled projections, T5's 256 padded positions;
    joined, the pipeline's prompt_embeds [B, CLIP's + 256, D_T5] and pooled_prompt_embeds; a
    caption past every limit is cut as it cuts it."""
    sd3 = clip_length(sd3, tokens, tmp_path)
    family = family_of(sd3)
    assert family is SD3 and family.text.default_max_length(sd3) == 256
    prompts = ["a red circle on a blue background", "stripes " * 300, ""]
    embeds, pooled = joined(collate(features(sd3, prompts)))
    pipeline = StableDiffusion3Pipeline.from_pretrained(sd3.path)
    want, _, want_pooled, _ = pipeline.encode_prompt(prompts, None, None, do_classifier_free_guidance=False)
    assert pipeline.tokenizer_max_length == tokens
    assert embeds.shape == want.shape == (3, tokens + 256, pipeline.text_encoder_3.config.d_model)
    torch.testing.assert_close(embeds, want, rtol=1e-4, atol=5e-5)
    torch.testing.assert_close(pooled, want_pooled, rtol=1e-4, atol=5e-5)


def test_a_clip_tokenizer_without_its_length_is_refused_naming_its_file(sd3, tmp_path):
    with pytest.raises(ValueError, match="tokenizer/tokenizer_config.json sets no model_max_length"):
        features(clip_length(sd3, None, tmp_path), ["a red circle"])


def test_t5_at_another_length_is_what_the_pipeline_gives_at_that_max_sequence_length(sd3):
    embeds, _ = joined(collate(features(sd3, ["a red circle"], max_length=128)))
    want = StableDiffusion3Pipeline.from_pretrained(sd3.path).encode_prompt(
        ["a red circle"], None, None, do_classifier_free_guidance=False, max_sequence_length=128)[0]
    torch.testing.assert_close(embeds, want, rtol=1e-4, atol=5e-5)


def test_the_schedule_is_the_models_flow_matching_with_its_shift(sd3):
    assert family_of(sd3).denoiser.schedule(sd3).scheduler.config.shift == 3.0
