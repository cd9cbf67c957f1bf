"""The model-family seam: the family comes from the model folder's model_index.json, a folder no
family reads is refused by name, each family calls its transformer as its own diffusers pipeline
does, and a finished run knows its family from its lineage alone."""

import json
import shutil

import pytest
import torch

from configs.schema import ModelConfig, StorageConfig
from storage import layout
from storage.store import Store
from tasks.families import family_of
from tasks.families.pixart import ALPHA, SIGMA
from tasks.runs.folder import FinishedRun


def _with_pipeline(tiny_models, folder, pipeline):
    shutil.copytree(tiny_models, folder)
    index = folder / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "_class_name": pipeline}))
    return ModelConfig(path=str(folder))


def test_the_family_is_the_pipeline_model_index_names(tiny_models, tmp_path):
    assert family_of(ModelConfig(path=tiny_models)) is SIGMA
    assert family_of(_with_pipeline(tiny_models, tmp_path / "alpha", "PixArtAlphaPipeline")) is ALPHA
    unknown = _with_pipeline(tiny_models, tmp_path / "unknown", "StableCascadeCombinedPipeline")
    with pytest.raises(ValueError, match=r"unknown: its model_index.json names StableCascadeCombinedPipeline, which "
                                         r"precast does not train; it trains PixArtAlphaPipeline \(PixArt-α\)"):
        family_of(unknown)
    (tmp_path / "bare").mkdir()
    with pytest.raises(FileNotFoundError, match="bare: has no model_index.json"):
        family_of(ModelConfig(path=str(tmp_path / "bare")))


def test_every_family_is_a_record_of_parts_none_a_subclass():
    """A family declares its parts; none inherits another family's methods to undo them."""
    from tasks.families import FAMILIES, Family

    assert FAMILIES and all(type(family) is Family for family in FAMILIES)
    assert len({family.name for family in FAMILIES}) == len(FAMILIES)
    for family in FAMILIES:  # each part knows whose it is, for its errors
        assert {family.text.family, family.codec.family, family.denoiser.family, family.sampler.family} == {family.name}


def test_pixart_alpha_gets_the_micro_conditions_its_pipeline_gives(tiny_models):
    """PixArtAlphaPipeline's 1024 px model (sample_size 128: additional conditions) is called with
    each image's pixel size and aspect ratio: the pipeline's own call is captured and compared."""
    from diffusers import DPMSolverMultistepScheduler, PixArtAlphaPipeline, PixArtTransformer2DModel

    torch.manual_seed(0)
    # the size embeddings take a third of the width each: 2 heads of 12
    transformer = PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=8,
                                           num_layers=1, cross_attention_dim=24, caption_channels=32, sample_size=128)
    seen = []
    forward = transformer.forward
    transformer.forward = lambda *args, **kwargs: seen.append(kwargs["added_cond_kwargs"]) or forward(*args, **kwargs)
    pipeline = PixArtAlphaPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=transformer,
                                   scheduler=DPMSolverMultistepScheduler())
    pipeline.vae_scale_factor = 8  # as with the family's VAE
    embeds, mask = torch.randn(1, 5, 32), torch.ones(1, 5)
    pipeline(prompt_embeds=embeds, prompt_attention_mask=mask, negative_prompt=None, negative_prompt_embeds=embeds,
             negative_prompt_attention_mask=mask, height=768, width=1024, num_inference_steps=2, output_type="latent",
             guidance_scale=1.0, use_resolution_binning=False)
    theirs = seen[0]
    noisy = torch.zeros(1, 4, 96, 128)
    ours = ALPHA.denoiser.micro_conditions(noisy, embeds)
    assert torch.equal(ours["resolution"], theirs["resolution"]) and torch.equal(ours["aspect_ratio"],
                                                                                  theirs["aspect_ratio"])
    assert SIGMA.denoiser.micro_conditions(noisy, embeds) == {"resolution": None, "aspect_ratio": None}


def test_a_finished_run_knows_its_family_from_its_lineage_alone(tmp_path):
    """No model folder needed: the lineage names the pipeline (runs published before it did were
    PixArt-Σ's); a full fine-tune's run has no LoRA adapter to export."""
    store = Store(StorageConfig(root=str(tmp_path / "store")))
    run = layout.run("abc")
    model = {"path": str(tmp_path / "gone"), "revision": None}
    store.commit_json(layout.run_part(run, "lineage"), {"model": model}, model=model, adapter=None,
                      transformer=store.url(layout.run_part(run, "transformer")))
    finished = FinishedRun.at(store.url(run))
    assert finished.family is SIGMA and finished.weights == "transformer"
    with pytest.raises(FileNotFoundError, match="has no LoRA adapter"):
        finished.adapter()
    store.commit_json(layout.run_part(run, "lineage"), {"model": model, "pipeline": "PixArtAlphaPipeline"},
                      model=model, adapter=None, transformer=None, weights="transformer")
    assert FinishedRun.at(store.url(run) + "/transformer").family is ALPHA


def test_a_resolution_the_family_has_no_buckets_for_is_refused_before_any_stage(make_config, tmp_path):
    from tasks.runner import run_direct

    config = make_config(latent_encoding={"resolution": 768})  # area buckets would take it; PixArt's tables do not
    with pytest.raises(ValueError, match=r"latent_encoding.resolution 768: PixArt-Σ has aspect-ratio buckets for "
                                         r"256, 512, 1024, 2048 only"):
        run_direct(config)
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("*.json"))  # nothing ingested
