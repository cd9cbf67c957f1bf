"""Datasets as users build them. Several sources, mixed as users mix them: a subject repeated beside
a larger set, a set drawn at a fixed share whatever its size, a regularisation set trained toward
the base model's prediction at half the loss; each sample keeps its source from ingest to the run
page, and how the sources mix counts in the manifest and the run, never in what ingest and the
encoders made. And pictures whose alpha channel is their loss mask."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from itertools import islice
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from configs.schema import PipelineConfig
from storage import layout
from storage.store import Store
from tasks.demo.data import write_demo_data
from tasks.identity import manifest_id
from tasks.ingest.examine import ALPHA_MASKED, MASK_FILE
from tasks.ingest.report import mix_markdown, report_markdown
from tasks.runner import run_direct
from tasks.runs.page import RunPage
from tasks.train.data import CachedFeatures, mixed_batches
from tasks.train.plan import config_shapes

# a subject of cut-outs (their alpha the loss mask) repeated 3 times, a set drawn at a quarter of the
# batches, a regularisation set trained toward the base model at half the loss
MIX = [{"repeats": 3, "masks": "alpha"}, {"weight": 0.25}, {"regularisation": "base_model", "loss_weight": 0.5}]
SHARES = [0.75 * 15 / 23, 0.25, 0.75 * 8 / 23]  # the pool's 3 × 5 + 8 draws share what the weight leaves


def _config(folder: Path, tiny_models: str, sources: list[str], mix: list[dict],
            storage: dict | None = None, storage_dtype: str = "fp32") -> PipelineConfig:
    return PipelineConfig.model_validate({
        "storage": storage or {"root": str(folder / "store")},
        "dataset": {"sources": [{"path": path, **settings} for path, settings in zip(sources, mix)], "shard_size": 10},
        "model": {"path": tiny_models}, "text_encoding": {"dtype": "fp32", "batch_tokens": 256},
        "latent_encoding": {"resolution": 256, "storage_dtype": storage_dtype, "batch_size": 4},
        "training": {"rank": 4, "alpha": 4, "steps": 4, "batch_size": 2, "sample_prompts": [],
                     "validation_samples": 0}})


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, tiny_models):
    """Three sources trained through every stage as MIX says: the subject's 5 cut-outs (and one
    wholly transparent, quarantined), 8 pictures of styles, 8 of regularisation."""
    folder = tmp_path_factory.mktemp("mixed")
    _masked_pictures(folder / "subject")
    sources = [str(folder / "subject"), *(str(write_demo_data(folder / name, count=8, seed=20 + i))
                                          for i, name in enumerate(("styles", "regularisation")))]
    config = _config(folder, tiny_models, sources, MIX)
    return config, sources, run_direct(config)


def test_three_sources_train_through_every_stage_and_each_sample_keeps_its_source(mixed):
    config, sources, done = mixed
    store = Store(config.storage)
    report = store.read_json(layout.dataset_report(done["ingest"]["id"]))
    assert [(s["path"], s["samples"]) for s in report["sources"]] == [(path, n) for path, n in zip(sources, (5, 8, 8))]
    assert "## By source" in report_markdown(report)  # how training draws is the manifest's: a dataset serves any mix

    manifest = store.read_json(store.key(done["manifest"]["url"]))
    assert [(m["samples"], m["repeats"], m["weight"], m["loss_weight"], m["regularisation"]) for m in manifest["mix"]] \
        == [(5, 3, None, 1.0, "off"), (8, 1, 0.25, 1.0, "off"), (8, 1, None, 0.5, "base_model")]
    assert [round(m["share"], 6) for m in manifest["mix"]] == [round(share, 6) for share in SHARES]
    # the ingest report's artifact shows this config's mix beside the dataset's report (flows/stages.py)
    table = mix_markdown(config.dataset.drawn([s["samples"] for s in report["sources"]]))
    assert "| 48.9% |" in table and "| 25.0% |" in table and "| 26.1% |" in table
    assert config.dataset.drawn([5, 8, 8]) == manifest["mix"]
    features = CachedFeatures(store, manifest, config_family(config))
    for index, path in enumerate(sources):  # a sample's id is its picture's sha256 (the cut-outs' with their mask's word)
        ids = {hashlib.sha256(p.read_bytes() + (ALPHA_MASKED if index == 0 and p.name != "5.png" else b"")).hexdigest()
               for p in Path(path).iterdir() if p.suffix != ".txt" and p.name != "4.png"}
        assert {s for s, row in features.samples.items() if row["source"] == index} == ids

    page = RunPage.read(store, store.key(done["train"]["run"])).markdown()
    assert "×3 repeats, 48.9% of draws" in page and "weight 0.25, 25.0% of draws" in page
    assert "loss weight 0.5, regularisation (base_model), 26.1% of draws" in page
    assert done["train"]["final_loss"] == done["train"]["final_loss"]  # masked, weighted, regularised: no NaN


def config_family(config: PipelineConfig):
    from tasks.families import family_of

    return family_of(config.model)


def test_the_sampler_draws_the_declared_shares_the_same_on_every_process_and_after_a_resume(mixed):
    config, _, done = mixed
    store = Store(config.storage)
    features = CachedFeatures(store, store.read_json(store.key(done["manifest"]["url"])), config_family(config))
    batches = list(islice(mixed_batches(features.buckets, 2, 0, features), 6000))
    # the weighted source: a quarter of the batches, each of its own samples alone
    styles = [batch for batch in batches if features.samples[batch[0]]["source"] == 1]
    assert abs(len(styles) / len(batches) - SHARES[1]) < 0.02, len(styles) / len(batches)
    assert all(features.samples[s]["source"] == 1 for batch in styles for s in batch)
    # the pool's batches, the rest: the subject's 5 samples 3 times each beside the 8 of regularisation
    pooled = Counter(features.samples[s]["source"] for batch in batches if batch not in styles for s in batch)
    assert set(pooled) == {0, 2} and abs(pooled[0] / (pooled[0] + pooled[2]) - 15 / 23) < 0.02, pooled
    # a pure function of the seed: two processes (every other batch each) and a run resumed at batch 1,000
    assert list(islice(mixed_batches(features.buckets, 2, 0, features), 6000)) == batches
    ranks = [list(islice(mixed_batches(features.buckets, 2, 0, features), rank, 6000, 2)) for rank in (0, 1)]
    assert [batch for pair in zip(*ranks) for batch in pair] == batches
    assert list(islice(mixed_batches(features.buckets, 2, 0, features), 1000, 1010)) == batches[1000:1010]
    assert list(islice(mixed_batches(features.buckets, 2, 1, features), 100)) != batches[:100]


def test_a_source_drops_its_captions_and_weighs_its_loss_as_it_says(mixed):
    """Each source's caption dropout and loss weight reach its samples alone; a regularisation
    sample of `base_model` regresses the base model's prediction: an adapter that starts as the
    base (LoRA's B is zero) has nothing to learn from it, a loss of exactly 0."""
    from tasks.train.data import draws
    from tasks.train.loss import Objective, Weighing, diffusion_loss
    from tasks.train.network import trainable_network

    config, _, done = mixed
    store = Store(config.storage)
    manifest = store.read_json(store.key(done["manifest"]["url"]))
    manifest["mix"][0]["caption_dropout"] = 1.0  # the subject's captions always dropped
    family = config_family(config)
    features = CachedFeatures(store, manifest, family)
    by_source = {index: sorted(s for s, row in features.samples.items() if row["source"] == index) for index in range(3)}
    ids = [by_source[0][0], by_source[1][0]]
    assert features.caption_dropouts(ids, 0.1) == [1.0, 0.1]
    empty = features.text.prompt("")
    for sample_id, dropped in zip(ids, (True, False)):  # a batch each: their buckets may differ
        _, text, _ = features.batch([sample_id], torch.Generator().manual_seed(0),
                                 features.caption_dropouts([sample_id], 0.0))
        assert all(torch.equal(text[name][0], value.float()) == dropped for name, value in empty.items())

    network = trainable_network(config.model, family, config.training, None)
    objective = Objective.of(config.model, config.training, family)

    def loss(sample_ids: list[str]) -> torch.Tensor:
        latents, text, _ = features.batch(sample_ids, torch.Generator().manual_seed(1), 0.0)
        return diffusion_loss(network, objective, latents, text, draws(0, 0, "noise"), None,
                              features.weighing(sample_ids), network)

    assert features.weighing(by_source[1][:2]) == Weighing(None, None)
    regularised = by_source[2][:1]
    assert loss(regularised) == 0.0
    plain = diffusion_loss(network, objective, *features.batch(regularised, torch.Generator().manual_seed(1), 0.0)[:2],
                           draws(0, 0, "noise"), None)
    assert plain > 0
    weighing = features.weighing([by_source[0][0], regularised[0]])
    assert weighing.loss_weights.tolist() == [1.0, 0.5] and weighing.base_model.tolist() == [False, True]


def test_changing_how_sources_mix_reads_and_encodes_nothing_again(mixed, tiny_models):
    """Repeats, weights and loss weights are training's: a new mix is a new manifest and run over
    the same dataset and caches; sources that keep every default are one pool, as before sources
    could mix (the same manifest id as a config without these fields)."""
    config, sources, done = mixed
    again = run_direct(_config(Path(config.storage.root).parent, tiny_models, sources,
                               [{"repeats": 2, "masks": "alpha"}, {"weight": 0.5}, {"loss_weight": 2.0}]))
    assert again["ingest"]["id"] == done["ingest"]["id"] and again["ingest"]["work"]["units_read"] == 0
    for stage in ("encode-text", "encode-latents"):
        assert again[stage]["work"]["shards_encoded"] == 0, again[stage]["work"]
    assert again["manifest"]["url"] != done["manifest"]["url"] and again["train"]["run"] != done["train"]["run"]

    plain = _config(Path(config.storage.root).parent, tiny_models, sources, [{"masks": "alpha"}, {}, {}])
    assert plain.dataset.mix is None
    pooled = run_direct(plain, until="manifest")
    assert Store(config.storage).key(pooled["manifest"]["url"]) == layout.manifest(manifest_id(
        pooled["ingest"]["id"], pooled["text_fingerprints"], pooled["vae_fingerprint"], []))


def test_mixes_that_cannot_be_drawn_are_refused_naming_the_sources(tiny_models):
    sources = [{"path": "/a", "weight": 0.6}, {"path": "/b", "weight": 0.5}, {"path": "/c"}]
    with pytest.raises(ValidationError, match=r"weights add up to 1\.1, which leaves no batch for the sources "
                                              r"without one \(/c\)"):
        PipelineConfig.model_validate({"dataset": {"sources": sources}, "model": {"path": tiny_models}})
    with pytest.raises(ValidationError, match=r"dataset.sources /a: repeats has no effect on a source with a weight"):
        PipelineConfig.model_validate({"dataset": {"sources": [{"path": "/a", "weight": 0.5, "repeats": 2}]},
                                       "model": {"path": tiny_models}})
    with pytest.raises(ValidationError, match=r"dataset.sources /r: regularisation base_model .* training.method full"):
        PipelineConfig.model_validate({"dataset": {"sources": [{"path": "/d"}, {"path": "/r", "regularisation":
                                                                                 "base_model"}]},
                                       "model": {"path": tiny_models}, "training": {"method": "full"}})


def _masked_pictures(folder: Path) -> dict[str, bytes]:
    """Pictures with captions: 4 whose right half is transparent, one wholly transparent, one
    without alpha; {name: file bytes}."""
    import io

    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True)
    files = {}
    for i in range(6):
        pixels = np.full((128, 128, 4), 255, dtype=np.uint8)
        pixels[..., :3] = np.random.default_rng(i).integers(0, 255, 3, dtype=np.uint8)
        pixels[:, 64:, 3] = 0 if i < 4 else pixels[:, 64:, 3]
        pixels[..., 3] = 0 if i == 4 else pixels[..., 3]
        image = Image.fromarray(pixels, "RGBA") if i < 5 else Image.fromarray(pixels[..., :3], "RGB")
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        files[f"{i}.png"] = buffer.getvalue()
        (folder / f"{i}.png").write_bytes(buffer.getvalue())
        (folder / f"{i}.txt").write_text(f"a picture number {i}")
    return files


def test_a_pictures_alpha_is_its_loss_mask_cached_on_the_latent_grid(tmp_path, tiny_models):
    """`masks: alpha`: each picture keeps its alpha (its own sample: the same file unmasked is
    another), the latent cache holds it as the share of each latent pixel it covers, and the loss
    of a sample is the mean over what its mask covers: a mask of zeros weighs it out as a loss
    weight of 0 would. A wholly transparent picture is quarantined; one without alpha trains whole.
    Latents and masks are stored at the default precision (fp16), as users store them."""
    from storage.shards import LatentShard, read_image_shard
    from tasks.train.data import draws
    from tasks.train.loss import Objective, Weighing, diffusion_loss
    from tasks.train.network import trainable_network

    files = _masked_pictures(tmp_path / "cut-outs")
    config = _config(tmp_path, tiny_models, [str(tmp_path / "cut-outs")], [{"masks": "alpha"}], storage_dtype="fp16")
    assert config.latent_encoding.storage_dtype == type(config.latent_encoding)().storage_dtype
    done = run_direct(config)
    assert done["ingest"]["quarantined"] == 1
    report = Store(config.storage).read_json(layout.dataset_report(done["ingest"]["id"]))
    assert [(q["reason"], Path(q["source"]).name) for q in report["quarantine"]] == [("empty_mask", "4.png")]
    # a picture without alpha is the same sample as in a source without masks
    ids = {name: hashlib.sha256(data + ALPHA_MASKED * (name != "5.png")).hexdigest()
           for name, data in files.items() if name != "4.png"}
    store = Store(config.storage)
    rows = [row for shard in done["ingest"]["shards"]
            for row in read_image_shard(store.read_bytes(layout.image_shard(shard["id"]))).to_pylist()]
    assert {row["sample_id"] for row in rows} == set(ids.values())

    manifest = store.read_json(store.key(done["manifest"]["url"]))
    features = CachedFeatures(store, manifest, config_family(config))
    for name, sample_id in ids.items():
        row = features.samples[sample_id]
        mask = LatentShard(store.local_paths({row["latent_shard"]: manifest["checksums"][row["latent_shard"]]})
                           [row["latent_shard"]]).mask(sample_id)
        assert mask.dtype == torch.float16
        mask = mask.float()
        width = mask.shape[-1]
        if name == "5.png":  # no alpha: the whole picture
            assert torch.equal(mask, torch.ones_like(mask))
        else:  # the right half transparent
            assert mask[..., : width // 2 - 1].min() == 1 and mask[..., width // 2 + 1 :].max() == 0, mask

    half, whole = ids["0.png"], ids["5.png"]
    assert features.samples[half]["bucket"] == features.samples[whole]["bucket"]  # square: one batch
    latents, text, masks = features.batch([half, whole], torch.Generator().manual_seed(0), 0.0)
    network = trainable_network(config.model, config_family(config), config.training, None)
    objective = Objective.of(config.model, config.training, config_family(config))

    def loss(weighing):
        return diffusion_loss(network, objective, latents, text, draws(0, 0, "noise"), None, weighing)

    zero = torch.stack([torch.zeros_like(masks[0]), masks[1]])
    torch.testing.assert_close(loss(Weighing(None, None, zero)), loss(Weighing(torch.tensor([0.0, 1.0]), None)))
    assert loss(Weighing(None, None, masks)) != loss(None)
    assert done["train"]["final_loss"] == done["train"]["final_loss"]  # trained to the end, no NaN from a mask


def _png(pixels) -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _pictures_with_mask_files(folder: Path) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """A folder of 8 captioned pictures (two in a subfolder; one, 7, transparent on its top rows)
    and a folder of their masks at the same relative paths, learned on the left half: a mask as
    large as its picture, one of 16 × 16 (under min_side: a mask is any size), one a JPEG, one
    white whose right half is transparent; one black everywhere, one missing, one not a picture.
    ({name: picture}, {name: mask})."""
    import io

    import numpy as np
    from PIL import Image

    pictures, masks = {}, {}
    for i in range(8):
        name = f"sub/{i}" if i in (2, 3) else str(i)
        pixels = np.random.default_rng(i).integers(0, 255, (128, 128, 4 if i == 7 else 3), dtype=np.uint8)
        if i == 7:
            pixels[..., 3] = 255
            pixels[:16, :, 3] = 0
        pictures[name] = _png(pixels)
        side = 16 if i == 1 else 128
        grey = np.zeros((side, side), dtype=np.uint8)
        grey[:, : side // 2] = 0 if i == 4 else 255
        if i == 2:
            buffer = io.BytesIO()
            Image.fromarray(grey).convert("RGB").save(buffer, format="JPEG", quality=95)
            masks[name] = buffer.getvalue()
        elif i == 3:  # white everywhere, the right half transparent: not learned
            masks[name] = _png(np.stack([np.full_like(grey, 255), grey], axis=-1))
        elif i != 5:
            masks[name] = b"not a picture" if i == 6 else _png(grey)
    for name, data in pictures.items():
        (folder / "pictures" / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / "pictures" / f"{name}.png").write_bytes(data)
        (folder / "pictures" / f"{name}.txt").write_text(f"a picture number {name}")
    for name, data in masks.items():
        (folder / "masks" / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / "masks" / f"{name}.{'jpg' if name == 'sub/2' else 'png'}").write_bytes(data)
    return pictures, masks


def _masked_source(folder: Path, fmt: str, pictures: dict[str, bytes], masks: dict[str, bytes]) -> tuple[Path, dict]:
    """The pictures as a source of `fmt` that reads their masks (written by `_pictures_with_mask_files`):
    its path and settings."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ext = {name: "jpg" if name == "sub/2" else "png" for name in masks}
    if fmt == "parquet":  # the masks' bytes in a column, a row without one null; two row groups
        pq.write_table(pa.table({"image": list(pictures.values()), "text": [f"a picture number {n}" for n in pictures],
                                 "mask": [masks.get(name) for name in pictures]}), folder / "rows.parquet",
                       row_group_size=4)
        return folder / "rows.parquet", {"masks": "column"}
    if fmt == "jsonl-column":  # each row names its mask file, relative to the metadata file
        rows = [{"file_name": f"pictures/{name}.png", "text": f"a picture number {name}",
                 **({"mask": f"masks/{name}.{ext[name]}"} if name in masks else {})} for name in pictures]
        (folder / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        return folder / "metadata.jsonl", {"masks": "column"}
    if fmt == "jsonl":  # the metadata's names relative to its folder, the masks' to mask_path
        rows = [{"file_name": f"./{name}.png", "text": f"a picture number {name}"} for name in pictures]
        (folder / "pictures" / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder / "pictures", {"masks": "files", "mask_path": str(folder / "masks")}


@pytest.mark.parametrize("fmt", ["folder", "folder on S3", "jsonl", "jsonl-column", "parquet"])
def test_mask_files_weigh_each_picture_and_leave_its_pixels_whole(tmp_path, tiny_models, fmt, request):
    """`masks: files` (each picture's mask at its relative path in `mask_path`, any picture
    extension) and `masks: column` (a row's mask file, or its bytes in a parquet column): any size
    (resized to the picture), cached on the latent grid as alpha's is; the pixels under it are
    encoded as they are (the latents equal the unmasked picture's), and the sample is the picture
    with its mask. A black, missing or broken mask quarantines its picture, naming why; a changed
    mask reads that picture again (a parquet file: the file) and encodes it alone. On S3 (moto) the
    source, its masks and the store are objects."""
    from storage.shards import LatentShard

    pictures, masks = _pictures_with_mask_files(tmp_path)
    source, settings = _masked_source(tmp_path, fmt.removesuffix(" on S3"), pictures, masks)
    storage, upload = None, lambda: None
    if fmt.endswith("on S3"):  # the pictures and masks uploaded, read back through the store's options
        import s3fs

        endpoint = request.getfixturevalue("s3_endpoint")
        s3 = s3fs.S3FileSystem(endpoint_url=endpoint)
        s3.mkdir("precast-masks")
        storage = {"root": "s3://precast-masks/store", "options": {"endpoint_url": endpoint}}

        def upload():  # file by file: a folder put again would land inside the one put before
            for name in ("pictures", "masks"):
                for path in (tmp_path / name).rglob("*.*"):
                    s3.put_file(str(path), f"precast-masks/{name}/{path.relative_to(tmp_path / name)}")

        upload()
        source, settings = "s3://precast-masks/pictures", {**settings, "mask_path": "s3://precast-masks/masks"}
    config = _config(tmp_path, tiny_models, [str(source)], [settings], storage)
    done = run_direct(config, until="manifest")
    report = Store(config.storage).read_json(layout.dataset_report(done["ingest"]["id"]))
    names = list(pictures)

    def named(source: str) -> str:  # the quarantined picture: a file, or a parquet row
        return names[int(source.rsplit("#", 1)[1])] if fmt == "parquet" else Path(source).stem

    assert sorted((named(q["source"]), q["reason"]) for q in report["quarantine"]) == \
        [("4", "empty_mask"), ("5", "missing_mask"), ("6", "bad_mask")], report["quarantine"]
    kept = [name for name in pictures if name in masks and name not in ("4", "6")]
    ids = {name: hashlib.sha256(pictures[name] + MASK_FILE + hashlib.sha256(masks[name]).hexdigest().encode())
           .hexdigest() for name in kept}

    # the same pictures without masks, in the same store: the pixels the VAE saw are the same
    plain = run_direct(_config(tmp_path, tiny_models, [str(source)], [{}], storage), until="manifest")
    store = Store(config.storage)

    def cached(manifest_url: str) -> tuple[CachedFeatures, dict]:
        manifest = store.read_json(store.key(manifest_url))
        return CachedFeatures(store, manifest, config_family(config)), manifest

    (features, manifest), (unmasked, plain_manifest) = cached(done["manifest"]["url"]), cached(plain["manifest"]["url"])
    assert set(features.samples) == set(ids.values())
    for name, sample_id in ids.items():
        row, twin = features.samples[sample_id], unmasked.samples[hashlib.sha256(pictures[name]).hexdigest()]
        shard, twin_shard = (LatentShard(store.local_paths({r["latent_shard"]: m["checksums"][r["latent_shard"]]})
                                         [r["latent_shard"]]) for r, m in ((row, manifest), (twin, plain_manifest)))
        # (within float rounding: the VAE's batches hold other pictures)
        torch.testing.assert_close(shard.get(sample_id)[0], twin_shard.get(twin["sample_id"])[0], rtol=1e-5, atol=1e-5)
        mask = shard.mask(sample_id).float()
        width = mask.shape[-1]
        if name == "7":  # its own transparent top rows (an eighth of its height) are not learned either
            assert mask[..., : mask.shape[-2] // 8 - 1, :].max() == 0, mask
            mask = mask[..., mask.shape[-2] // 8 + 1:, :]
        assert mask[..., : width // 2 - 1].min() > 0.95 and mask[..., width // 2 + 1:].max() < 0.05, (name, mask)

    # a nightly run after one mask was redrawn (the top half): that picture alone is read and encoded
    top = torch.zeros(128, 128, dtype=torch.uint8)
    top[:64] = 255
    masks["0"] = _png(top.numpy())
    (tmp_path / "masks" / "0.png").write_bytes(masks["0"])
    if fmt == "parquet":  # the file written again, read again whole
        _masked_source(tmp_path, fmt, pictures, masks)
    upload()
    again = run_direct(config, until="manifest")
    read = 1 + fmt.startswith("jsonl")  # and the metadata file, read every time
    assert again["ingest"]["work"]["units_read"] == read and again["ingest"]["new_samples"] == 1
    assert again["encode-latents"]["work"]["samples_encoded"] == 1
    features, manifest = cached(again["manifest"]["url"])
    assert ids["0"] not in features.samples and len(features.samples) == len(ids)


def test_a_rows_mask_that_cannot_be_a_mask_quarantines_the_row_alone(tmp_path, tiny_models):
    """A metadata row naming its mask through a file, as a folder or by a name too long for the
    filesystem, and a parquet mask cell that holds a string: each row is quarantined for its reason,
    the others ingested."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pictures, masks = _pictures_with_mask_files(tmp_path)
    named = {"0": "pictures/1.png/x.png", "1": "masks/sub", "7": "m" * 300 + ".png", "sub/3": "masks/sub/3.png"}
    (tmp_path / "metadata.jsonl").write_text("".join(
        json.dumps({"file_name": f"pictures/{name}.png", "text": "a picture", "mask": mask}) + "\n"
        for name, mask in named.items()))
    pq.write_table(pa.table({"image": [pictures["0"], pictures["sub/3"]], "text": ["a", "b"],
                             "mask": pa.array(["masks/0.png", None], pa.string())}), tmp_path / "strings.parquet")
    pq.write_table(pa.table({"image": [pictures["sub/3"]], "text": ["b"], "mask": [masks["sub/3"]]}),
                   tmp_path / "bytes.parquet")
    reasons = []
    for sources in (["metadata.jsonl"], ["strings.parquet", "bytes.parquet"]):
        config = _config(tmp_path, tiny_models, [str(tmp_path / source) for source in sources],
                         [{"masks": "column"}] * len(sources), {"root": str(tmp_path / f"store-{sources[0]}")})
        done = run_direct(config, until="ingest")
        report = Store(config.storage).read_json(layout.dataset_report(done["ingest"]["id"]))
        reasons.append(sorted(q["reason"] for q in report["quarantine"]))
    # (a folder is no regular file: special_file, as for a row's picture)
    assert reasons == [["missing_mask", "missing_mask", "special_file"], ["bad_mask", "missing_mask"]], reasons


def test_mask_files_that_cannot_be_read_as_a_sources_masks_are_refused_naming_the_source(tmp_path, tiny_models):
    with pytest.raises(ValidationError, match="masks: files reads its masks from mask_path"):
        _config(tmp_path, tiny_models, [str(tmp_path)], [{"masks": "files"}])
    with pytest.raises(ValidationError, match="mask_path is read with masks: files only"):
        _config(tmp_path, tiny_models, [str(tmp_path)], [{"mask_path": str(tmp_path)}])
    pictures = write_demo_data(tmp_path / "pictures", count=2)
    inside = _config(tmp_path, tiny_models, [str(pictures)], [{"masks": "files", "mask_path": str(pictures / "m")}])
    (pictures / "m").mkdir()
    with pytest.raises(RuntimeError, match="inside the source folder"):
        run_direct(inside, until="ingest")
    columns = _config(tmp_path, tiny_models, [str(pictures)], [{"masks": "column"}])
    with pytest.raises(RuntimeError, match="masks: column reads masks for jsonl, csv, parquet sources, not folder"):
        run_direct(columns, until="ingest")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"image": [b"x"], "text": ["a"]}), tmp_path / "rows.parquet")
    rows = _config(tmp_path, tiny_models, [str(tmp_path / "rows.parquet")],
                   [{"masks": "files", "mask_path": str(tmp_path / "m")}])
    with pytest.raises(RuntimeError, match="rows.parquet.*masks: files reads masks for folder, jsonl, csv sources, not parquet"):
        run_direct(rows, until="ingest")


def test_a_trigger_word_on_a_source_reads_no_file_again_and_encodes_its_captions_not_its_latents(tmp_path,
                                                                                                 tiny_models):
    """`caption_prefix`: the trigger word takes the place of `[trigger]` in a caption, else starts
    it; setting it on a source already ingested reads none of its files again (what each unit
    gave is recorded without it), encodes every caption and copies every latent."""
    from storage.shards import read_image_shard

    data = write_demo_data(tmp_path / "subject", count=6, seed=3)
    first_caption = sorted(data.glob("*.txt"))[0]
    first_caption.write_text("[trigger] on a plain background\n")
    before = run_direct(_config(tmp_path, tiny_models, [str(data)], [{}]), until="manifest")
    config = _config(tmp_path, tiny_models, [str(data)], [{"caption_prefix": "ohwx person"}])
    after = run_direct(config, until="manifest")
    assert after["ingest"]["work"]["units_read"] == 0 and after["ingest"]["new_samples"] == 6
    assert after["encode-text"]["work"]["samples_encoded"] == 6
    assert (after["encode-latents"]["work"]["samples_encoded"], after["encode-latents"]["work"]["samples_copied"]) \
        == (0, 6)
    store = Store(config.storage)
    captions = [caption for shard in after["ingest"]["shards"]
                for row in read_image_shard(store.read_bytes(layout.image_shard(shard["id"]))).to_pylist()
                for caption in row["captions"]]
    assert "ohwx person on a plain background" in captions
    assert len(captions) == 6 and all(c.startswith("ohwx person") for c in captions)
    assert sum(c.startswith("ohwx person, ") for c in captions) == len(captions) - 1
    assert before["ingest"]["id"] != after["ingest"]["id"]
    # trying one prefix, then the other again: each config keeps its own record, nothing is new
    again = run_direct(_config(tmp_path, tiny_models, [str(data)], [{}]), until="manifest")
    assert again["ingest"]["id"] == before["ingest"]["id"] and again["ingest"]["work"]["units_read"] == 0
    assert again["ingest"]["new_samples"] == 0 and again["encode-text"]["work"]["shards_encoded"] == 0


def test_a_source_at_its_own_resolution_encodes_its_latents_alone_and_trains_beside_the_others(tmp_path,
                                                                                                  tiny_models):
    """`resolution` on a source: its pictures take the family's buckets for it, the others the
    config's, and training draws both (a batch never mixes sizes). Changing it reads no file again
    and encodes that source's latents alone (its captions with them: its samples move to shards of
    their own); where the crop comes out the same (its resolution set to the config's), its latents
    are copied; and going back to a resolution ingested before finds everything cached."""
    folders = [write_demo_data(tmp_path / name, count=4, seed=i) for i, name in enumerate(("wide", "close"))]
    sources = list(map(str, folders))
    ids = [{hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir() if p.suffix != ".txt"}
           for folder in folders]
    config = _config(tmp_path, tiny_models, sources, [{}, {"resolution": 512}])
    first = run_direct(config)
    store = Store(config.storage)
    manifest = store.read_json(store.key(first["manifest"]["url"]))
    rows = CachedFeatures(store, manifest, config_family(config)).samples

    def area(bucket: str) -> int:  # latent pixels (a /8 VAE): 32 × 32 at 256, 64 × 64 at 512
        height, width = map(int, bucket.split("x")[-2:])
        return height * width

    assert all(700 <= area(rows[s]["bucket"]) <= 1300 for s in ids[0]), [rows[s]["bucket"] for s in ids[0]]
    assert all(3000 <= area(rows[s]["bucket"]) <= 5200 for s in ids[1]), [rows[s]["bucket"] for s in ids[1]]
    assert first["train"]["url"]

    def again(settings: dict) -> dict:
        return run_direct(_config(tmp_path, tiny_models, sources, [{}, settings]), until="manifest")

    def counts(done: dict) -> tuple:
        latents = done["encode-latents"]["work"]
        return (done["ingest"]["work"]["units_read"], done["ingest"]["new_samples"],
                done["encode-text"]["work"]["samples_encoded"], latents["samples_encoded"], latents["samples_copied"])

    # units read, new samples, captioned samples encoded, latents encoded, latents copied
    assert counts(again({})) == (0, 4, 4, 4, 0)  # the config's 256: another crop, encoded again
    assert counts(again({"resolution": 256})) == (0, 4, 4, 0, 4)  # the same crop as the config's: copied
    back = again({"resolution": 512})
    assert counts(back) == (0, 0, 0, 0, 0) and back["ingest"]["id"] == first["ingest"]["id"]
    assert back["manifest"]["url"] == first["manifest"]["url"]

    refused = _config(tmp_path / "refused", tiny_models, sources, [{}, {"resolution": 300}])
    named = r"dataset source '.*close': resolution 300: .* has aspect-ratio buckets for 256, 512, 1024, 2048 only"
    with pytest.raises(ValueError, match=named):
        run_direct(refused)
    assert not (tmp_path / "refused").exists()
    with pytest.raises(ValueError, match=named):  # `precast plan` names it too
        config_shapes(refused, config_family(refused))


def test_a_sample_moved_to_another_resolution_takes_its_pixels_from_a_shard_that_crops_it_alike(tmp_path):
    """Where a sample's latents are copied from when it moves to a new shard (`pixels_from`): the
    shard holding its image at the same resolution (its captions changed too), else at the config's
    (a source's resolution written out as the config's crops alike), else the smallest shard id."""
    from tasks.ingest.ledger import Ledger
    from tasks.ingest.shards import HOLDER

    ledger = Ledger(tmp_path)
    # (sample, shard, resolution): every holder of each sample, the one wanted not the smallest id
    held = [("a", "s0", 300), ("a", "s1", 512), ("a", "s2", 0), ("b", "t0", 0), ("b", "t1", 300), ("b", "t2", 512),
            ("c", "u1", 512), ("c", "u0", 300)]
    ledger.run_many("INSERT INTO stored VALUES (?, '[]', 8, 8, ?, ?)", held)
    ledger.run_many("INSERT INTO samples VALUES (?, 0, '[\"x\"]', 8, 8, 'x.png', 'folder', 0, ?, NULL, NULL, NULL)",
                    [("a", 256), ("b", 300), ("c", 0), ("d", 0)])
    assert dict(ledger.all(f"SELECT sample_id, {HOLDER} FROM samples")) == \
        {"a": "s2", "b": "t1", "c": "u0", "d": None}


@pytest.mark.parametrize("root", ["local", "s3"])
def test_a_picture_moved_to_another_source_is_drawn_as_that_sources(tmp_path, tiny_models, root, request):
    """Which source a sample came from is ingest's record, keyed by its content: a picture moved
    from one source's folder to another's, its caption with it, keeps the dataset (the same samples
    and captions) but makes a new manifest, whose row gives the new source; on a local root and on
    an S3 root (moto), where the record is an object the manifest reads back."""
    import shutil

    storage = None
    if root == "s3":
        import s3fs

        endpoint = request.getfixturevalue("s3_endpoint")
        s3fs.S3FileSystem(endpoint_url=endpoint).mkdir("precast-sources")
        storage = {"root": "s3://precast-sources/store", "options": {"endpoint_url": endpoint}}
    folders = [write_demo_data(tmp_path / name, count=4, seed=i) for i, name in enumerate(("a", "b"))]
    config = _config(tmp_path, tiny_models, list(map(str, folders)), [{"repeats": 2}, {}], storage)
    before = run_direct(config, until="manifest")
    moved = sorted(folders[0].glob("*.txt"))[0]
    picture = next(p for p in folders[0].iterdir() if p.stem == moved.stem and p.suffix != ".txt")
    sample_id = hashlib.sha256(picture.read_bytes()).hexdigest()
    for path in (moved, picture):
        shutil.move(path, folders[1] / f"moved-{path.name}")
    after = run_direct(config, until="manifest")
    assert after["ingest"]["id"] == before["ingest"]["id"] and after["ingest"]["members"] != before["ingest"]["members"]
    store = Store(config.storage)
    manifests = [store.read_json(store.key(done["manifest"]["url"])) for done in (before, after)]
    assert manifests[0]["id"] != manifests[1]["id"]
    assert [m["samples"] for m in manifests[1]["mix"]] == [3, 5]
    sources = [CachedFeatures(store, manifest, config_family(config)).samples[sample_id]["source"]
               for manifest in manifests]
    assert sources == [0, 1]


def test_a_file_in_two_sources_that_caption_it_otherwise_keeps_its_first_sources_captions(tmp_path, tiny_models):
    """A duplicate's captions are merged only between sources that prefix and mix alike: the same
    pictures under a trigger word in a second source stay the first source's, uncaptioned by it."""
    import shutil

    from storage.shards import read_image_shard

    plain = write_demo_data(tmp_path / "plain", count=4, seed=5)
    shutil.copytree(plain, tmp_path / "subject")
    config = _config(tmp_path, tiny_models, [str(plain), str(tmp_path / "subject")], [{}, {"caption_prefix": "ohwx"}])
    done = run_direct(config, until="ingest")
    store = Store(config.storage)
    report = store.read_json(layout.dataset_report(done["ingest"]["id"]))
    assert (report["samples"], report["duplicates"], report["duplicates_apart"]) == (4, 4, 4)
    assert "4 of the duplicates came from a source with another caption prefix" in report_markdown(report)
    captions = [c for shard in done["ingest"]["shards"]
                for row in read_image_shard(store.read_bytes(layout.image_shard(shard["id"]))).to_pylist()
                for c in row["captions"]]
    assert len(captions) == 4 and not any("ohwx" in c for c in captions)
    # a source at another resolution keeps its duplicates apart alike: they are trained at the first's
    config = _config(tmp_path, tiny_models, [str(plain), str(tmp_path / "subject")], [{}, {"resolution": 512}])
    done = run_direct(config, until="ingest")
    report = store.read_json(layout.dataset_report(done["ingest"]["id"]))
    assert (report["samples"], report["duplicates"], report["duplicates_apart"]) == (4, 4, 4)
    rows = [row for shard in done["ingest"]["shards"]
            for row in read_image_shard(store.read_bytes(layout.image_shard(shard["id"]))).to_pylist()]
    assert len(rows) == 4 and {row["resolution"] for row in rows} == {None}
