"""Qwen-Image-Edit and Edit-Plus against their own pipelines: the text cache holds what their
`encode_prompt` makes of a caption *with its references* (Edit's reference at 1024², Edit-Plus's
each at 384² after "Picture N:"), a pair's empty caption too (caption dropout), wherever in the
dataset the reference is stored; the references' latents are sized as the pipelines size them; the
transformer is called as they call it, the references' tokens after the target's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from configs.schema import ModelConfig
from tasks.families import family_of
from tasks.families.flux import unpack
from tests.pipeline_calls import edit_processor, transformer_calls

CPU = torch.device("cpu")
FAMILIES = {"qwen-image-edit": "QwenImageEditPipeline", "qwen-image-edit-plus": "QwenImageEditPlusPipeline"}


@pytest.fixture(scope="module")
def pipelines(tiny_family):
    """Each edit family's model and pipeline, its components loaded as `from_pretrained` loads them."""
    import diffusers
    import transformers

    out = {}
    for name, pipeline in FAMILIES.items():
        folder = tiny_family(name)
        parts = {"vae": diffusers.AutoencoderKLQwenImage.from_pretrained(folder / "vae"),
                 "transformer": diffusers.QwenImageTransformer2DModel.from_pretrained(folder / "transformer"),
                 "scheduler": diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(folder / "scheduler"),
                 "text_encoder": transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(folder / "text_encoder"),
                 "tokenizer": transformers.Qwen2Tokenizer.from_pretrained(folder / "tokenizer"),
                 "processor": edit_processor(folder)}
        out[name] = ModelConfig(path=str(folder)), getattr(diffusers, pipeline)(**parts)
    return out


def pipeline_prompt(name: str, pipeline, caption: str, references: list[Image.Image]) -> torch.Tensor:
    """The pipeline's own `encode_prompt` of `caption` with `references`, each resized first as its
    `__call__` resizes it for the text encoder (`calculate_dimensions` of its module)."""
    import importlib

    module = importlib.import_module(type(pipeline).__module__)
    if name == "qwen-image-edit":
        (reference,) = references
        width, height, _ = module.calculate_dimensions(1024 * 1024, reference.size[0] / reference.size[1])
        shown = pipeline.image_processor.resize(reference, height, width)
    else:
        shown = []
        for reference in references:
            width, height = module.calculate_dimensions(module.CONDITION_IMAGE_SIZE, reference.size[0] / reference.size[1])
            shown.append(pipeline.image_processor.resize(reference, height, width))
    with torch.no_grad():
        return pipeline.encode_prompt(caption, image=shown, device=CPU)[0][0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_family, request):
    """Edit pairs (tasks.demo.data.write_edit_data: every second pair shares the reference before
    it) trained through every stage on each tiny edit family, a pair a shard, so a shared reference
    is stored in its first pair's shard only: Edit through the direct runner on a local root,
    Edit-Plus with two references a pair (the same folder twice) as teams run it, through the
    Prefect flow on an S3 root with three shards encoded at once; Edit's references sized for 128
    px (`latent_encoding.reference_resolution`), its targets for 64."""
    import s3fs

    from configs.schema import PipelineConfig
    from flows.pipeline import pipeline
    from tasks.demo.data import write_edit_data
    from tasks.runner import run_direct

    folder = write_edit_data(tmp_path_factory.mktemp("qwen-edit") / "pairs", count=4)
    out = {}
    for name in FAMILIES:
        plus = name.endswith("plus")
        references = [str(folder / "references")] * (2 if plus else 1)
        storage = {"root": str(folder / f"store-{name}")}
        if plus:
            endpoint = request.getfixturevalue("s3_endpoint")
            s3fs.S3FileSystem(endpoint_url=endpoint).mkdir("precast-edit-plus")
            storage = {"root": "s3://precast-edit-plus/store", "options": {"endpoint_url": endpoint}}
            request.getfixturevalue("prefect_server")
        config = PipelineConfig.model_validate({
            "storage": storage, "model": {"path": str(tiny_family(name))},
            "dataset": {"sources": [{"path": str(folder / "targets"), "references": "files",
                                     "reference_path": references}], "shard_size": 1},
            "text_encoding": {"dtype": "fp32"},
            # Edit's references sized for 128 (its pipeline's rule at another area than the targets')
            "latent_encoding": {"resolution": 64, "storage_dtype": "fp32", "batch_size": 4,
                                **({} if plus else {"reference_resolution": 128})},
            "training": {"rank": 4, "alpha": 4, "steps": 2, "batch_size": 2, "caption_dropout": 0.5,
                         "validation_samples": 0,
                         "samples": {"prompts": ["make the background red"], "steps": 2,
                                     "references": [str(folder / "references" / "00002.png")]}},
            "execution": {"max_parallel_shards": 3 if plus else 1}})
        flowed = pipeline(config=config) if plus else None
        out[name] = config, run_direct(config)  # after the flow: its records, every stage found done
        assert flowed is None or flowed["run"] == out[name][1]["train"]["run"]
    return folder, out


@pytest.mark.parametrize("name", FAMILIES)
def test_each_pairs_caption_is_cached_as_the_pipeline_encodes_it_with_its_references(name, trained, pipelines):
    """Every pair's caption and its empty caption, read back as training reads them, equal the
    pipeline's `encode_prompt` with the pair's references (fp32, batched apart: to 1e-5); a pair whose
    reference is stored in another shard (a shared one) among them."""
    import hashlib
    import json

    from storage.shards import read_image_shard
    from storage.store import Store
    from tasks.ingest.examine import REFERENCE
    from tasks.records import text_shards_of
    from tasks.train.data import CachedFeatures

    folder, runs = trained
    config, done = runs[name]
    _, pipeline = pipelines[name]
    store = Store(config.storage)
    features = CachedFeatures(store, store.read_json(store.key(done["manifest"]["url"])), family_of(config.model))
    pictures = {hashlib.sha256(path.read_bytes() + REFERENCE).hexdigest(): Image.open(path).convert("RGB")
                for path in (folder / "references").iterdir()}
    shard_of, captions = {}, {}
    for key in store.find("shards"):
        if key.endswith(".parquet"):
            for row in read_image_shard(store.read_bytes(key)).to_pylist():
                shard_of[row["sample_id"]], captions[row["sample_id"]] = key, row["captions"]
    assert len(features.samples) == 4
    apart = 0
    for sample_id, row in features.samples.items():
        references = [pictures[reference] for reference in row["references"]]
        assert len(references) == (2 if name.endswith("plus") else 1)
        apart += any(shard_of[reference] != shard_of[sample_id] for reference in row["references"])
        keys = text_shards_of(row)
        got = features.text.caption(keys, sample_id, 0)["qwen2_5_vl_hidden"]
        torch.testing.assert_close(got, pipeline_prompt(name, pipeline, captions[sample_id][0], references),
                                   rtol=1e-5, atol=1e-5)
        empty = features.text.dropped(keys, sample_id)["qwen2_5_vl_hidden"]
        torch.testing.assert_close(empty, pipeline_prompt(name, pipeline, "", references), rtol=1e-5, atol=1e-5)
    assert apart >= 1, "no pair's reference was stored in another shard: the lookup across shards went untested"
    # the states of the template's start and the references, the same for a pair's caption and its
    # empty caption, are stored once a shard: a shard's heads are its pairs' distinct references
    from safetensors import safe_open

    for record in done["encode-text"]["shards"]:
        if not record["rows"]:  # a shard of references alone
            continue
        with safe_open(store.local_path(store.key(record["url"])), framework="pt") as shard:
            rows, head_of = json.loads(shard.metadata()["rows"]), shard.get_tensor("head_of")
            stored = len(shard.get_tensor("embeddings")) + len(shard.get_tensor("heads.embeddings"))
        pictures = {tuple(features.samples[row.rsplit("/", 1)[0]]["references"]) for row in rows}
        assert set(head_of.tolist()) == set(range(len(pictures))) and stored < 0.6 * record["tokens"], record


@pytest.mark.parametrize("name", FAMILIES)
def test_the_transformer_is_called_as_the_pipeline_calls_it_with_references(name, pipelines):
    """The pipeline's own call, recorded (a 96 × 64 target; Edit one reference, Edit-Plus two of
    other ratios, each resized by the pipeline to about 1024² as the family's rule sizes it at 1024):
    `predict` on the target's latents with the references' as `reference_<n>` gives its output for the
    target's tokens."""
    model, pipeline = pipelines[name]
    family = family_of(model)
    pictures = [Image.new("RGB", (80, 48), (30, 200, 30)), Image.new("RGB", (40, 90), (200, 30, 30))]
    pictures = pictures[:1] if name == "qwen-image-edit" else pictures
    embeds = pipeline_prompt(name, pipeline, "make the background red", pictures)[None]
    mask = torch.ones(embeds.shape[:2], dtype=torch.long)
    calls = transformer_calls(pipeline)
    pipeline(image=pictures if len(pictures) > 1 else pictures[0], prompt_embeds=embeds, prompt_embeds_mask=mask,
             height=96, width=64, num_inference_steps=2, output_type="latent",  # (one step's timestep: NaN)
             generator=torch.Generator().manual_seed(0))
    seen, output = calls[0]
    shapes = seen["img_shapes"][0]
    boxes = [family.codec.references.box(*picture.size, 1024) for picture in pictures]
    assert shapes[1:] == [(1, box[1] // 16, box[0] // 16) for box in boxes]  # the rule's sizes, in tokens
    target = (96 // 16) * (64 // 16)
    latents = unpack(seen["hidden_states"][:, :target], 96 // 8, 64 // 8).unsqueeze(2)
    references, start = {}, target
    for n, (_, high, wide) in enumerate(shapes[1:]):
        references[f"reference_{n}"] = unpack(seen["hidden_states"][:, start:start + high * wide], high * 2,
                                              wide * 2).unsqueeze(2)
        start += high * wide
    text = {"qwen2_5_vl_hidden": embeds, "qwen2_5_vl_hidden_mask": mask, **references}
    with torch.no_grad():
        ours = family.denoiser.predict(pipeline.transformer, latents, text, seen["timestep"] * 1000)
    torch.testing.assert_close(ours, unpack(output[:, :target], 96 // 8, 64 // 8).unsqueeze(2))


@pytest.mark.parametrize("size", [(1024, 1024), (1500, 600), (600, 1500), (900, 800), (333, 1000)])
def test_a_reference_is_sized_as_the_pipelines_size_it(size):
    """At 1024 the family's size for a reference's latents is the pipelines' `calculate_dimensions`
    of 1024² at its ratio (the reference resized whole, no crop)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus

    from tasks.families.qwenimage import QWEN_IMAGE_EDIT, QWEN_IMAGE_EDIT_PLUS

    ratio = size[0] / size[1]
    for family, module in ((QWEN_IMAGE_EDIT, pipeline_qwenimage_edit), (QWEN_IMAGE_EDIT_PLUS, pipeline_qwenimage_edit_plus)):
        width, height, *crop = family.codec.references.box(*size, 1024)
        assert (width, height) == tuple(module.calculate_dimensions(1024 * 1024, ratio)[:2])
        assert crop == [0, 0, width, height]


@pytest.mark.parametrize("name", FAMILIES)
def test_sample_prompts_are_cached_with_their_references_and_named_by_their_content(name, trained, pipelines, tmp_path):
    """A sample prompt and its negative (the empty caption) are cached as the pipeline encodes them
    with the prompt's reference, the run's grid is drawn from them, and the manifest names each
    prompt with its reference's digest: another picture at the same path is another cache."""
    import shutil

    from storage.store import Store
    from tasks.identity import entry_negative, sample_prompts
    from tasks.train.data import CachedFeatures

    folder, runs = trained
    config, done = runs[name]
    _, pipeline = pipelines[name]
    store = Store(config.storage)
    manifest = store.read_json(store.key(done["manifest"]["url"]))
    (entry,) = manifest["prompts"]
    features = CachedFeatures(store, manifest, family_of(config.model))
    reference = Image.open(folder / "references" / "00002.png").convert("RGB")
    for row, caption in ((entry, "make the background red"), (entry_negative(entry), "")):
        torch.testing.assert_close(features.text.prompt(row)["qwen2_5_vl_hidden"],
                                   pipeline_prompt(name, pipeline, caption, [reference]), rtol=1e-5, atol=1e-5)
    assert done["train"]["samples"], "no sample grid was drawn"
    moved = tmp_path / "reference.png"
    shutil.copy(folder / "references" / "00000.png", moved)  # another picture, the same path
    other = config.model_copy(update={"training": config.training.model_copy(update={
        "samples": config.training.samples.model_copy(update={"references": [str(moved)]})})})
    changed = sample_prompts(other)
    assert changed != manifest["prompts"] and changed[0].startswith("make the background red")


def test_references_are_sized_for_the_reference_resolution_and_samples_drawn_so(trained, tiny_family):
    """`latent_encoding.reference_resolution`: each reference's latents are its pipeline's size at
    that area (`calculate_dimensions` of the pipeline's module, at 128² here, where the pipeline
    takes 1024²), the targets' at the run's resolution; the run records it, so its samples size
    their references alike; a family that takes no references refuses the setting."""
    import importlib

    from configs.schema import PipelineConfig
    from storage.shards import LatentShard
    from storage.store import Store
    from tasks.encode.latents import check_latent_encoding
    from tasks.runs.folder import FinishedRun

    folder, runs = trained
    config, done = runs["qwen-image-edit"]
    store = Store(config.storage)
    module = importlib.import_module("diffusers.pipelines.qwenimage.pipeline_qwenimage_edit")
    sizes = {}
    for record in done["encode-latents"]["shards"]:
        shard = LatentShard(store.local_path(store.key(record["url"])))
        for reference in shard.meta.get("reference_rows", []):
            sizes[reference] = tuple(shard.get(reference)[0].shape[-2:])
    assert sizes, "no reference latents were found"
    widths = {module.calculate_dimensions(128 * 128, w / h)[:2] for w, h in
              (Image.open(path).size for path in (folder / "references").iterdir())}
    assert {(height * 8, width * 8) for height, width in sizes.values()} == {(h, w) for w, h in widths}
    run = FinishedRun.at(done["train"]["url"], config.storage.options)
    assert run.lineage["reference_resolution"] == 128 and run.lineage["resolution"] == 64
    other = PipelineConfig.model_validate({"model": {"path": str(tiny_family("qwen-image"))},
                                           "dataset": {"sources": [{"path": "t"}]},
                                           "latent_encoding": {"reference_resolution": 1024}})
    with pytest.raises(ValueError, match=r"latent_encoding.reference_resolution: Qwen-Image takes no reference"):
        check_latent_encoding(other.model, other.latent_encoding, other.dataset)


def test_an_edit_family_refuses_flips_and_sample_prompts_without_references(tiny_family):
    """A flipped pair would train against a caption that saw the unflipped reference; a sample
    prompt has no picture to be read with; `precast sample` from text names what its processor needs."""
    from configs.schema import PipelineConfig
    from storage.store import Store
    from tasks.encode.latents import check_latent_encoding
    from tasks.encode.text import seen_prompts
    from tasks.train import check_training

    config = PipelineConfig.model_validate({
        "model": {"path": str(tiny_family("qwen-image-edit"))}, "latent_encoding": {"flip": True},
        "dataset": {"sources": [{"path": "t", "references": "files", "reference_path": "r"}]}})
    with pytest.raises(ValueError, match=r"latent_encoding.flip: Qwen-Image-Edit's text encoder qwen2_5_vl reads each "
                                         r"pair's references"):
        check_latent_encoding(config.model, config.latent_encoding, config.dataset)
    with pytest.raises(ValueError, match=r"training.samples.references: Qwen-Image-Edit reads each sample prompt "
                                         r"with its reference picture"):
        family = family_of(config.model)
        seen_prompts(Store(config.storage), family, family.text.encoders[0], ["a red circle"], None)
    with pytest.raises(ValueError, match=r"training.samples.references: Qwen-Image-Edit reads each sample prompt "
                                         r"with its reference picture"):  # before any stage
        check_training(config.model, config.training)
    from transformers.utils import is_torchvision_available

    from tasks.runs.sampling import check_components

    if not is_torchvision_available():  # `precast sample` loads the processor, which transformers builds only beside it
        with pytest.raises(ImportError, match=r"its processor is a Qwen2VLProcessor, which needs torchvision"):
            check_components(config.model)


def test_one_sample_step_is_refused_where_the_scheduler_makes_it_nan(tiny_family):
    """Qwen-Image's scheduler stretches its sigmas to a terminal one (shift_terminal): for a single
    step its own `set_timesteps` divides by zero, so the pipeline draws NaN; precast refuses the
    setting before any stage (and `precast sample --steps 1` before the pipeline loads), and takes two."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from configs.schema import PipelineConfig
    from tasks.runs.sampling import check_steps
    from tasks.train import check_training

    folder = tiny_family("qwen-image-edit")
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(folder / "scheduler")
    with np.errstate(all="ignore"), torch.no_grad():
        scheduler.set_timesteps(1, mu=1.0)
    assert torch.isnan(scheduler.timesteps).all()

    def config(steps: int) -> PipelineConfig:
        return PipelineConfig.model_validate({"model": {"path": str(folder)}, "dataset": {"sources": [{"path": "t"}]},
                                              "training": {"samples": {
            "prompts": ["make it red"], "references": ["r.png"], "steps": steps}}})

    with pytest.raises(ValueError, match=r"training.samples.steps: 1 step with Qwen-Image-Edit's scheduler \(its "
                                         r"shift_terminal\) gives NaN timesteps"):
        check_training(config(1).model, config(1).training)
    check_training(config(2).model, config(2).training)
    with pytest.raises(ValueError, match=r"--steps: 1 step with Qwen-Image-Edit's scheduler"):
        check_steps(config(1).model, family_of(config(1).model), 1, "--steps")


@pytest.mark.parametrize("name", FAMILIES)
def test_a_picture_without_references_beside_pairs_is_quarantined_by_edit_and_trained_by_edit_plus(
        name, tiny_family, pipelines, tmp_path):
    """A dataset of pairs and plain pictures (two sources): Edit's template holds one picture, so a
    plain picture is quarantined (`references`, naming why) and its caption not encoded; Edit-Plus
    reads a caption without pictures, and its dropout row is the empty caption alone."""
    from PIL import Image as Picture

    from configs.schema import PipelineConfig
    from storage.store import Store
    from tasks.demo.data import write_edit_data
    from tasks.runner import run_direct
    from tasks.train.data import CachedFeatures

    folder = write_edit_data(tmp_path / "pairs", count=2)
    plain = tmp_path / "plain"
    plain.mkdir()
    Picture.new("RGB", (64, 64), (200, 30, 30)).save(plain / "red.png")
    (plain / "red.txt").write_text("a red square")
    config = PipelineConfig.model_validate({
        "storage": {"root": str(tmp_path / "store")}, "model": {"path": str(tiny_family(name))},
        "dataset": {"sources": [{"path": str(folder / "targets"), "references": "files",
                                 "reference_path": str(folder / "references")}, {"path": str(plain)}]},
        # Edit's in bf16, as users encode: the precision check reads its captions with their pictures
        "text_encoding": {"dtype": "bf16" if name == "qwen-image-edit" else "fp32"},
        "latent_encoding": {"resolution": 64, "batch_size": 4},
        "training": {"rank": 4, "alpha": 4, "steps": 1, "batch_size": 1, "caption_dropout": 1.0,
                     "validation_samples": 0, "samples": {"prompts": []}}})
    done = run_direct(config)
    store = Store(config.storage)
    features = CachedFeatures(store, store.read_json(store.key(done["manifest"]["url"])), family_of(config.model))
    unpaired = [sample for sample, row in features.samples.items() if not row["references"]]
    if name == "qwen-image-edit":
        assert len(features.samples) == 2 and not unpaired
        assert [(q["reason"], q["message"]) for shard in done["encode-latents"]["shards"] for q in shard["quarantined"]] == [
            ("references", "0 references: Qwen-Image-Edit takes at least 1")]
        numerics = done["encode-text"]["shards"][0]["numerics"]
        assert numerics["dtype"] == "bf16" and numerics["samples"] > 0 and numerics["cosine_min"] > 0.99
    else:
        from tasks.records import text_shards_of

        (sample,) = unpaired
        keys = text_shards_of(features.samples[sample])
        with torch.no_grad():
            for caption, got in (("a red square", features.text.caption(keys, sample, 0)),
                                 ("", features.text.dropped(keys, sample))):
                want = pipelines[name][1].encode_prompt(caption, image=None, device=CPU)[0][0]
                torch.testing.assert_close(got["qwen2_5_vl_hidden"], want, rtol=1e-5, atol=1e-5)
        assert done["train"]["final_loss"] == done["train"]["final_loss"]  # trained on it: finite


def test_the_plan_counts_the_references_tokens_in_the_captions_states(tiny_family):
    """`precast plan` for Edit on pairs: a caption's positions are its max_length and the tokens of
    its reference, a square at about 1024², as the processor cuts it."""
    from configs.schema import PipelineConfig
    from tasks.train.plan import config_shapes

    folder = tiny_family("qwen-image-edit")
    run = PipelineConfig.model_validate({
        "model": {"path": str(folder)}, "latent_encoding": {"resolution": 64},
        "dataset": {"sources": [{"path": "unused", "references": "files", "reference_path": "refs"}]}})
    family = family_of(run.model)
    shapes = config_shapes(run, family)
    grid = edit_processor(folder).image_processor(images=[Image.new("RGB", (1024, 1024))])["image_grid_thw"][0]
    spec = family.text.encoders[0]
    assert shapes.lengths[spec.name] == family.text.length(run.model, spec, run.text_encoding) + int(grid.prod()) // 4
    assert len(shapes.references) == 1


def test_another_resolution_encodes_the_pairs_latents_again_and_no_caption(trained):
    """A run at another `latent_encoding.resolution`: every target and reference is encoded again at
    it, and no caption: Edit's text encoder reads each reference at its own area (about 1024²),
    whatever the run's resolution, so its text cache (the costly one) is the same."""
    from tasks.runner import run_direct

    _, runs = trained
    config, first = runs["qwen-image-edit"]
    again = run_direct(config.model_copy(update={"latent_encoding": config.latent_encoding.model_copy(
        update={"resolution": 128})}), until="manifest")
    assert again["encode-text"]["work"]["samples_encoded"] == 0
    assert again["encode-text"]["url"] == first["encode-text"]["url"]
    assert again["encode-latents"]["work"]["samples_encoded"] == first["encode-latents"]["work"]["samples_encoded"] > 4
    assert again["encode-latents"]["url"] != first["encode-latents"]["url"]
    assert again["manifest"]["samples"] == 4


def test_a_redrawn_reference_encodes_its_pair_alone_its_captions_with_it(trained):
    """A nightly run after one reference was redrawn (the first of two pairs that shared it): the
    new reference's latents and its target's (its id changed) are encoded, and that target's caption
    and empty caption, both read with the new reference; nothing else (last: it redraws the fixture's picture)."""
    from tasks.runner import run_direct

    folder, runs = trained
    config, _ = runs["qwen-image-edit"]
    redrawn = Image.open(folder / "references" / "00000.png").convert("RGB").transpose(Image.Transpose.ROTATE_180)
    redrawn.save(folder / "references" / "00000.png")
    again = run_direct(config, until="manifest")
    assert again["ingest"]["work"]["units_read"] == 1
    assert again["encode-latents"]["work"]["samples_encoded"] == 2
    assert again["encode-text"]["work"]["samples_encoded"] == 1
    assert sum(shard["captions"] for shard in again["encode-text"]["shards"]
               if shard["committed_at"] > runs["qwen-image-edit"][1]["encode-text"]["committed_at"]) == 2
    assert again["manifest"]["samples"] == 4


def test_a_picture_is_cut_into_patches_once_for_all_the_captions_read_with_it(tiny_family):
    """A pair's caption and its empty caption (and its other variants) are encoded in one call, so
    the image processor cuts its reference once (a tenth to a quarter of a second of one core at 1024²,
    more than the 7B encoder's own call on a GPU); the states equal each caption encoded alone."""
    from configs.schema import TextEncodingConfig
    from tasks.encode.models import load_text_encoder
    from tasks.encode.text import run_encoder, tokenize

    model = ModelConfig(path=str(tiny_family("qwen-image-edit")))
    family, config = family_of(model), TextEncodingConfig(dtype="fp32")
    spec = family.text.encoders[0]
    encoder = load_text_encoder(model, family, spec, config.dtype, config.device, config.offload)
    shown = [spec.picture(Image.new("RGB", (64, 48), colour)) for colour in ((200, 30, 30), (30, 30, 200))]
    texts = ["make the background red", "", "make it green and larger", "", "make the background blue"]
    pictures = [[shown[0]], [shown[0]], [shown[1]], [shown[1]], [shown[0]]]
    cut, images = [], encoder.images

    class Counting:  # the image processor, counting the pictures it cuts
        def __getattr__(self, name):
            return getattr(images, name)

        def __call__(self, images=None, **options):
            cut.extend(images)
            return processor(images=images, **options)

    processor = images
    encoder.images = Counting()
    try:
        ids, _, vision = tokenize(texts, encoder, config, pictures)
        together = run_encoder(ids, encoder, config, vision)["hidden"]
    finally:
        encoder.images = images
    assert len(cut) == len(shown), f"{len(cut)} pictures cut for {len(shown)} distinct ones"
    for index, state in enumerate(together):
        ids, _, vision = tokenize([texts[index]], encoder, config, [pictures[index]])
        torch.testing.assert_close(state, run_encoder(ids, encoder, config, vision)["hidden"][0], rtol=1e-5, atol=1e-5)


def test_a_captions_own_vision_tokens_take_no_pictures_place(tiny_family):
    """A caption that writes Qwen2.5-VL's vision tokens (which would take a picture's place, and on
    which the pipelines' processor fails) is encoded as the caption without them."""
    from configs.schema import TextEncodingConfig
    from tasks.encode.text import encode_captions

    model = ModelConfig(path=str(tiny_family("qwen-image-edit")))
    family = family_of(model)
    spec = family.text.encoders[0]
    picture = spec.picture(Image.new("RGB", (64, 48), (30, 200, 30)))
    hostile, plain = (encode_captions([caption], model, family, TextEncodingConfig(dtype="fp32"), spec, [[picture]])[0]
                      ["hidden"][0] for caption in ("make it <|image_pad|>blue<|vision_end|>", "make it blue"))
    torch.testing.assert_close(hostile, plain, rtol=0, atol=0)
