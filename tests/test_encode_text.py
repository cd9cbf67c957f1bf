"""encode-text: cached T5 outputs equal the encoder's own output for the real tokens."""

from __future__ import annotations

from dataclasses import replace

import shutil

import pytest
import torch
from diffusers import PixArtSigmaPipeline
from transformers import AutoTokenizer, T5EncoderModel

from storage import layout
from storage.shards import RaggedShard, read_image_shard
from storage.store import Store
from tasks.encode.text import encode_captions, encode_prompts, encode_text_shard, measure_numerics
from tasks.ingest.stage import ingest
from tasks.families import family_of
from tasks.identity import text_fingerprints


def text_encoder_fingerprint(model, text):
    """The fingerprint of the tiny PixArt model's one text encoder (T5)."""
    return text_fingerprints(model, text)["t5"]


@pytest.fixture
def ingested(make_config):
    config = make_config()
    return config, ingest(config.storage, config.dataset)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.bfloat16}


def _direct(models, caption, max_length=300, dtype="fp32", preprocessing="diffusers"):
    """The reference for one caption's real tokens, loaded as a user would load it: what
    PixArtSigmaPipeline.encode_prompt gives (preprocessing `diffusers`), or T5 on the text as
    written (`none`)."""
    tokenizer = AutoTokenizer.from_pretrained(models, subfolder="tokenizer")
    encoder = T5EncoderModel.from_pretrained(models, subfolder="text_encoder", dtype=DTYPES[dtype]).eval()
    if dtype == "int8":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(encoder, Int8WeightOnlyConfig())
    if preprocessing == "diffusers":
        pipeline = PixArtSigmaPipeline(tokenizer=tokenizer, text_encoder=encoder, vae=None, transformer=None,
                                       scheduler=None)
        with torch.no_grad():
            embeds, mask, _, _ = pipeline.encode_prompt(caption, do_classifier_free_guidance=False, device="cpu",
                                                        max_sequence_length=max_length, clean_caption=True)
        return embeds[0, : int(mask.sum())]
    ids = tokenizer(caption, truncation=True, max_length=max_length, return_tensors="pt").input_ids
    with torch.no_grad():
        return encoder(input_ids=ids).last_hidden_state[0]


@pytest.mark.parametrize("preprocessing", ["diffusers", "none"])
def test_captions_are_read_as_the_pipeline_reads_them_or_as_written(make_config, tiny_models, tmp_path,
                                                                    preprocessing):
    """A cased caption with a URL, HTML and a hashtag: `diffusers` caches exactly the pipeline's
    encode_prompt tokens (far fewer), `none` the caption as written; the fingerprints differ.
    Captions that differ only in case coincide once the pipeline lowercases them: encoded and
    stored once, and every sample still finds its own."""
    from PIL import Image

    source = tmp_path / "cased"
    source.mkdir()
    captions = ["A RED Circle on a Blue background, see https://example.com/x?id=3 <b>bold</b> #Geometric",
                "The Composition is Simple", "the composition is simple", "THE COMPOSITION IS SIMPLE"]
    for index, caption in enumerate(captions):
        Image.new("RGB", (64, 64), (200, 30 * index, 30)).save(source / f"{index}.png")
        (source / f"{index}.txt").write_text(caption)
    config = make_config(source=str(source), text_encoding={"caption_preprocessing": preprocessing})
    dataset = ingest(config.storage, config.dataset)
    record, cache, rows = _encode_first_shard(config, dataset)
    assert len(rows) == 4 and record["rows"] == 4 and record["captions"] == (2 if preprocessing == "diffusers" else 4)
    other = config.text_encoding.model_copy(
        update={"caption_preprocessing": "none" if preprocessing == "diffusers" else "diffusers"})
    assert text_encoder_fingerprint(config.model, config.text_encoding) != text_encoder_fingerprint(config.model, other)
    tokenizer = AutoTokenizer.from_pretrained(tiny_models, subfolder="tokenizer")
    for row in rows:
        caption = row["captions"][0]
        cached = cache[f"{row['sample_id']}/0"]
        torch.testing.assert_close(cached, _direct(tiny_models, caption, preprocessing=preprocessing),
                                   rtol=1e-4, atol=1e-5)
        as_written = len(tokenizer(caption).input_ids)
        if preprocessing == "none" or caption == captions[0]:  # what the cleaning removed is not encoded
            assert (len(cached) < as_written) if preprocessing == "diffusers" else (len(cached) == as_written)


def _encode_first_shard(config, dataset, **text):
    store = Store(config.storage)
    settings = config.text_encoding.model_copy(update=text)
    fingerprint = text_encoder_fingerprint(config.model, settings)
    shard = dataset["shards"][0]["id"]
    url = store.url(f"shards/images/{shard}.parquet")
    measure_numerics(config.storage, config.model, settings, {"t5": fingerprint}, None, url)
    [record] = encode_text_shard(config.storage, config.model, settings, {"t5": fingerprint}, None, url)
    cache = RaggedShard(store.local_path(layout.cache_shard("text", fingerprint, shard)))
    rows = read_image_shard(store.read_bytes(f"shards/images/{shard}.parquet")).to_pylist()
    return record, cache, rows


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16", "int8"])
def test_cached_embeddings_equal_a_direct_t5_call(ingested, tiny_models, dtype):
    config, dataset = ingested
    record, cache, rows = _encode_first_shard(config, dataset, dtype=dtype)
    lengths = []
    for row in rows:
        cached = cache[f"{row['sample_id']}/0"]
        direct = _direct(tiny_models, row["captions"][0], dtype=dtype)
        assert cached.shape == direct.shape and cached.dtype == DTYPES[dtype]  # only the real tokens
        if dtype == "fp32":
            torch.testing.assert_close(cached, direct, rtol=1e-4, atol=1e-5)
        else:  # batched with other captions: same numerics up to half-precision rounding
            cosine = torch.nn.functional.cosine_similarity(cached.float(), direct.float(), dim=-1)
            assert cosine.min() > 0.999, (dtype, cosine.min())
        lengths.append(len(cached))
    assert record["tokens"] == sum(lengths) and len(set(lengths)) > 1  # varied lengths, no padding
    numerics = record["numerics"]
    assert numerics == cache.meta["numerics"] and numerics["dtype"] == dtype
    if dtype != "fp32":
        assert numerics["samples"] == min(config.text_encoding.numerics_samples, record["captions"])
        assert numerics["cosine_min"] > 0.99 and numerics["max_abs_error"] < 0.1 * numerics["max_abs_reference"]


def test_fp16_keeps_an_overflowing_t5_finite(make_config, tiny_models, tmp_path):
    """T5 v1.1's FFN output overflows fp16; the fp16 path must keep `wo` in fp32."""
    hot = tmp_path / "hot-t5"
    shutil.copytree(tiny_models, hot)
    encoder = T5EncoderModel.from_pretrained(hot, subfolder="text_encoder")
    with torch.no_grad():
        for block in encoder.encoder.block:
            block.layer[1].DenseReluDense.wo.weight.mul_(200_000.0)  # residual stream reaches ~4e5 > 65504
    encoder.save_pretrained(hot / "text_encoder")
    caption = "a red circle on a blue background with stripes"
    naive = T5EncoderModel.from_pretrained(hot, subfolder="text_encoder").to(torch.float16)
    ids = AutoTokenizer.from_pretrained(hot, subfolder="tokenizer")(caption, return_tensors="pt").input_ids
    with torch.no_grad():
        assert not torch.isfinite(naive(input_ids=ids).last_hidden_state).all()  # the trap is real

    config = make_config()
    config = config.model_copy(update={"model": config.model.model_copy(update={"path": str(hot)})})
    dataset = ingest(config.storage, config.dataset)
    record, cache, rows = _encode_first_shard(config, dataset, dtype="fp16")
    for row in rows[:4]:
        cached = cache[f"{row['sample_id']}/0"]
        reference = _direct(str(hot), row["captions"][0], dtype="fp32")
        assert torch.isfinite(cached).all()
        cosine = torch.nn.functional.cosine_similarity(cached.float(), reference, dim=-1)
        assert cosine.min() > 0.999
    assert record["numerics"]["cosine_min"] > 0.999


def test_offload_modes_agree_and_share_the_cache(ingested):
    config, dataset = ingested
    outputs = {}
    for offload in ["none", "model", "sequential"]:
        settings = config.text_encoding.model_copy(update={"offload": offload})
        family = family_of(config.model)
        outputs[offload] = encode_captions(["a red circle", "a long caption " * 12, ""], config.model, family,
                                           settings, family.text.encoders[0])[0]["hidden"]
    for offload in ["model", "sequential"]:
        for a, b in zip(outputs["none"], outputs[offload]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    base = text_encoder_fingerprint(config.model, config.text_encoding)
    assert text_encoder_fingerprint(config.model, config.text_encoding.model_copy(
        update={"offload": "sequential", "batch_tokens": 7, "device": "cpu"})) == base


def test_existing_shard_is_skipped_without_loading_t5(ingested, monkeypatch):
    config, dataset = ingested
    first, _, _ = _encode_first_shard(config, dataset)

    def refuse(*_):
        raise AssertionError("T5 must not load for a shard that is already encoded")

    monkeypatch.setattr("tasks.encode.text.load_text_encoder", refuse)
    again, _, _ = _encode_first_shard(config, dataset, offload="model", batch_tokens=64)
    assert again == first


def test_non_finite_output_fails_the_shard_and_caches_nothing(make_config, tiny_models, tmp_path):
    broken = tmp_path / "nan-t5"
    shutil.copytree(tiny_models, broken)
    encoder = T5EncoderModel.from_pretrained(broken, subfolder="text_encoder")
    with torch.no_grad():
        encoder.encoder.final_layer_norm.weight[0] = float("nan")
    encoder.save_pretrained(broken / "text_encoder")
    config = make_config()
    config = config.model_copy(update={"model": config.model.model_copy(update={"path": str(broken)})})
    dataset = ingest(config.storage, config.dataset)
    with pytest.raises(FloatingPointError, match="non-finite values in fp32 for caption"):
        _encode_first_shard(config, dataset)
    assert [key for key in Store(config.storage).find("cache/text") if key.endswith(".safetensors")] == []


def test_results_do_not_depend_on_batching_and_truncation_is_counted(ingested, tiny_models):
    config, dataset = ingested
    store = Store(config.storage)
    shard_url = store.url(f"shards/images/{dataset['shards'][0]['id']}.parquet")
    short = config.text_encoding.model_copy(update={"max_length": 8, "batch_tokens": 1})
    fp_short = text_encoder_fingerprint(config.model, short)
    assert fp_short != text_encoder_fingerprint(config.model, config.text_encoding)
    measure_numerics(config.storage, config.model, short, {"t5": fp_short}, None, shard_url)
    [record] = encode_text_shard(config.storage, config.model, short, {"t5": fp_short}, None, shard_url)
    assert record["truncated"] > 0
    cache = RaggedShard(store.local_path(layout.cache_shard("text", fp_short, dataset["shards"][0]["id"])))
    for key in list(cache.rows)[:4]:
        assert len(cache[key]) <= 8
    caption = read_image_shard(store.read_bytes(store.key(shard_url))).to_pylist()[0]
    direct = _direct(tiny_models, caption["captions"][0], max_length=8)
    torch.testing.assert_close(cache[f"{caption['sample_id']}/0"], direct, rtol=1e-4, atol=1e-5)


def test_a_batch_pads_no_caption_by_more_than_a_third_of_itself(tiny_models):
    """Captions of the spread real sets have (log-normal token counts, a tail cut at 300): each
    encoded once, every batch within the token budget, and none padded past 4/3 of its own
    tokens, whatever the budget; by the budget alone, most of what the encoder computed of such a
    set was padding."""
    import random

    from configs.schema import ModelConfig, TextEncodingConfig
    from tasks.demo.models import WORDS
    from tasks.encode.models import load_text_encoder
    from tasks.encode.text import length_batches, tokenize

    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(max(3, min(340, int(rng.lognormvariate(4.1, 0.55))))))
             for _ in range(256)]
    model = ModelConfig(path=tiny_models)
    family = family_of(model)
    encoder = load_text_encoder(model, family, family.text.encoders[0], "fp32", "cpu", "none")
    for budget in (600, 16384, 65536):
        text = TextEncodingConfig(batch_tokens=budget)
        ids = tokenize(texts, encoder, text)[0]
        batches = length_batches(ids, encoder, text)
        assert sorted(i for batch, _ in batches for i in batch) == list(range(len(ids)))
        for batch, longest in batches:
            assert longest == max(len(ids[i]) for i in batch) and (len(batch) == 1 or len(batch) * longest <= budget)
            assert all(3 * longest <= 4 * len(ids[i]) for i in batch), (budget, [len(ids[i]) for i in batch])
        assert sum(map(len, ids)) / sum(len(batch) * longest for batch, longest in batches) > 0.75


def test_fingerprint_covers_dtype_and_weights_not_device(make_config, tmp_path, tiny_models):
    config = make_config()
    base = text_encoder_fingerprint(config.model, config.text_encoding)
    assert text_encoder_fingerprint(config.model, config.text_encoding.model_copy(update={"dtype": "bf16"})) != base
    assert text_encoder_fingerprint(config.model, config.text_encoding.model_copy(
        update={"device": "cpu", "batch_tokens": 7})) == base
    copy = tmp_path / "models"
    shutil.copytree(tiny_models, copy)
    weights = copy / "text_encoder" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\x00\x00\x80\x3f")
    changed_weights = text_encoder_fingerprint(config.model.model_copy(update={"path": str(copy)}), config.text_encoding)
    assert changed_weights != base
    tokenizer_file = copy / "tokenizer" / "tokenizer_config.json"
    tokenizer_file.write_text(tokenizer_file.read_text().replace("512", "511"))
    assert text_encoder_fingerprint(config.model.model_copy(update={"path": str(copy)}),
                                    config.text_encoding) not in (base, changed_weights)
    assert text_encoder_fingerprint(config.model, config.text_encoding.model_copy(update={"max_length": 120})) != base


def test_bf16_cache_stays_close_to_fp32(ingested):
    config, _ = ingested
    bf16 = config.text_encoding.model_copy(update={"dtype": "bf16"})
    prompts = ["a red circle on a blue background", "a long caption " * 10]
    fp32 = encode_prompts(config.storage, config.model, config.text_encoding,
                          text_fingerprints(config.model, config.text_encoding), prompts)["t5"]
    half = encode_prompts(config.storage, config.model, bf16, text_fingerprints(config.model, bf16), prompts)["t5"]
    store = Store(config.storage)
    a, b = RaggedShard(store.local_path(store.key(fp32["url"]))), RaggedShard(store.local_path(store.key(half["url"])))
    assert b[prompts[0]].dtype == torch.bfloat16
    for prompt in ["", *prompts]:
        cosine = torch.nn.functional.cosine_similarity(a[prompt].float(), b[prompt].float(), dim=-1)
        assert cosine.min() > 0.99


def test_text_cache_reads_padded_batches_from_local_and_remote_shards(make_config, s3_endpoint, tmp_path):
    """Encoded from a local and from an S3 store, the text shards are byte for byte the same, and
    on S3 the encoder read the image shard's caption columns (counted at the HTTP level), not its
    pictures (photo-sized: noise, 100 KB each)."""
    import numpy as np
    import s3fs
    from PIL import Image

    from storage.slow_endpoint import SlowEndpoint
    from storage.shards import collate
    from tasks.train.data import TextCaches

    source = tmp_path / "photos"
    source.mkdir()
    noise = np.random.default_rng(0)
    for index in range(12):
        Image.fromarray(noise.integers(0, 256, (192, 192, 3), dtype=np.uint8)).save(source / f"{index}.png")
        (source / f"{index}.txt").write_text(f"photo number {index} of a noisy {['red', 'blue'][index % 2]} scene")
    s3fs.S3FileSystem(endpoint_url=s3_endpoint).mkdir("precast-text")
    proxy = SlowEndpoint(s3_endpoint, 0).__enter__()
    local = make_config(source=str(source), dataset={"shard_size": 100})
    remote = local.model_copy(update={"storage": local.storage.model_copy(
        update={"root": "s3://precast-text/store", "options": {"endpoint_url": proxy.url}})})
    batches, shards = [], []
    for config in (local, remote):
        dataset = ingest(config.storage, config.dataset)
        proxy.reset()
        record, cache, rows = _encode_first_shard(config, dataset)
        shards.append(Store(config.storage).read_bytes(Store(config.storage).key(record["url"])))
        key = Store(config.storage).key(record["url"])
        caches = TextCaches(Store(config.storage), family_of(config.model).text.encoders, {key: record["sha256"]})
        batch = collate([caches.caption([key], row["sample_id"], 0) for row in rows])
        embeddings, mask = batch["t5_hidden"], batch["t5_hidden_mask"]
        lengths = [len(cache[f"{row['sample_id']}/0"]) for row in rows]
        assert embeddings.shape[:2] == mask.shape == (len(rows), max(lengths))
        assert mask.sum(1).tolist() == lengths  # the mask is implied by each caption's real length
        for i, row in enumerate(rows):
            torch.testing.assert_close(embeddings[i, : lengths[i]], cache[f"{row['sample_id']}/0"])
            assert embeddings[i, lengths[i]:].abs().sum() == 0
        batches.append(embeddings)
    # the first shard's captions for the precision check and for the shard (its images, once, by
    # _encode_first_shard's own reading of the rows)
    shard_key = layout.image_shard(dataset["shards"][0]["id"])
    size = Store(remote.storage).require(shard_key)["size"]
    encoder_read = sum(r.bytes for r in proxy.gets(f"/precast-text/store/{shard_key}")) - size
    assert 0 < encoder_read < size / 5, (encoder_read, size)
    proxy.__exit__(None, None, None)
    assert shards[0] == shards[1]
    torch.testing.assert_close(batches[0], batches[1])


def test_model_loads_never_overlap_and_the_reference_stays_off_the_accelerator(make_config, monkeypatch):
    """from_pretrained patches torch.nn.Module globally while it builds, so two loads at once can
    leave meta tensors behind ("Cannot copy out of meta tensor"): every load of every component,
    cached or not, the fp32 reference and the fp32 VAE fallback included, waits for the one before."""
    import threading
    import time

    from diffusers import AutoencoderKL

    from tasks.encode import models

    config = make_config()
    active, peak, guard, errors = 0, 0, threading.Lock(), []

    def tracked(original):
        def load(*args, **kwargs):
            nonlocal active, peak
            with guard:
                active += 1
                peak = max(peak, active)
            time.sleep(0.05)  # widen the window two unserialised loads would share
            try:
                return original(*args, **kwargs)
            finally:
                with guard:
                    active -= 1
        return load

    monkeypatch.setattr(T5EncoderModel, "from_pretrained", tracked(T5EncoderModel.from_pretrained))
    monkeypatch.setattr(AutoencoderKL, "from_pretrained", tracked(AutoencoderKL.from_pretrained))
    models.TEXT_LOADERS.clear()
    models.load_vae.__wrapped__.cache_clear()
    family = family_of(config.model)
    t5 = family.text.encoders[0]
    loads = [lambda: models.load_text_encoder(config.model, family, t5, "int8", "cpu", "none"),
             lambda: models.build_text_encoder(config.model, family, t5, "fp32", *models.reference_placement("cpu")),
             lambda: models.load_vae(config.model, family, "bf16", "cpu"),
             lambda: models.build_vae(config.model, family, "fp32", "cpu")] * 2

    def run(load):
        try:
            load()
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(load,)) for load in loads]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and peak == 1
    assert models.reference_placement("cpu") == ("cpu", "none")
    assert models.reference_placement("cuda:1") == ("cuda:1", "sequential")  # streamed, never resident


def declare_encoder(monkeypatch, model, spec) -> None:
    """`model`'s family as a family module declaring `spec` as its one text encoder would be (the
    first family `family_of` finds)."""
    import dataclasses

    import tasks.families

    family = family_of(model)
    declared = dataclasses.replace(family, text=dataclasses.replace(family.text, encoders=(spec,)))
    monkeypatch.setattr(tasks.families, "FAMILIES", (declared, *tasks.families.FAMILIES))


def test_a_decoder_only_llm_plugs_into_the_stage_through_its_prompt_function(make_config, tiny_models, tmp_path,
                                                                            monkeypatch):
    """The text stage runs a decoder-only LLM encoder of the kind Z-Image, Qwen-Image and FLUX.2
    condition on, through its encoder's prompt function alone (`ChatEncoderSpec`: the chat
    template with a system message and enable_thinking, a chosen hidden layer, the template's
    first tokens dropped): the cache holds, caption by caption, what the LLM gives each caption
    called alone, in batches of several lengths; only the bare decoder is loaded; the layers and
    the template are in the fingerprint."""
    from transformers import Qwen3ForCausalLM

    from configs.schema import ModelConfig
    from tasks.demo.flow_models import write_qwen3
    from tasks.encode.models import load_text_encoder
    from tasks.families.spec import ChatEncoderSpec
    from tasks.runner import run_direct

    models = tmp_path / "models"
    shutil.copytree(tiny_models, models)
    for folder in ("text_encoder", "tokenizer"):
        shutil.rmtree(models / folder)
    write_qwen3(models / "tokenizer", models / "text_encoder")
    spec = ChatEncoderSpec("llm", system="Describe the picture.", enable_thinking=False, layers=(-2,), drop=3)
    declare_encoder(monkeypatch, ModelConfig(path=str(models)), spec)
    config = make_config(root=str(tmp_path / "store"), model={"path": str(models)},
                         text_encoding={"caption_preprocessing": "none", "batch_tokens": 60})
    done = run_direct(config, until="encode-text")

    tokenizer = AutoTokenizer.from_pretrained(models, subfolder="tokenizer")
    llm = Qwen3ForCausalLM.from_pretrained(models, subfolder="text_encoder").eval()
    store, fingerprint = Store(config.storage), done["text_fingerprints"]["llm"]
    compared = 0
    for shard in done["ingest"]["shards"]:
        cache = RaggedShard(store.local_path(layout.cache_shard("text", fingerprint, shard["id"])))
        for sample in read_image_shard(store.read_bytes(f"shards/images/{shard['id']}.parquet")).to_pylist():
            for variant, caption in enumerate(sample["captions"]):
                templated = tokenizer.apply_chat_template(
                    [{"role": "system", "content": "Describe the picture."}, {"role": "user", "content": caption}],
                    tokenize=False, add_generation_prompt=True, enable_thinking=False)
                with torch.no_grad():
                    states = llm(**tokenizer(templated, return_tensors="pt"), output_hidden_states=True).hidden_states
                torch.testing.assert_close(cache.get(f"{sample['sample_id']}/{variant}"), states[-2][0, 3:],
                                           rtol=1e-5, atol=1e-5)
                compared += 1
    assert compared >= 24
    loaded = load_text_encoder(config.model, family_of(config.model), spec, "fp32", "cpu", "none")
    assert not hasattr(loaded.model, "lm_head")
    for changed in (ChatEncoderSpec("llm", layers=(-1,), drop=3), replace(spec, removed=("[IMG]",)),
                    replace(spec, generation_prompt=False), replace(spec, padded=True),
                    replace(spec, blocks=True)):
        declare_encoder(monkeypatch, config.model, changed)
        assert text_fingerprints(config.model, config.text_encoding)["llm"] != fingerprint, changed
    declare_encoder(monkeypatch, config.model, spec)
    assert text_fingerprints(config.model, config.text_encoding)["llm"] == fingerprint
    template = next((models / "tokenizer").glob("chat_template.*"))  # one character of the template changed
    template.write_text(template.read_text().replace("assistant", "Assistant"))
    assert text_fingerprints(config.model, config.text_encoding)["llm"] != fingerprint
