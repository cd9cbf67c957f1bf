"""encode-text: cached T5 outputs equal the encoder's own output for the real tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, T5EncoderModel

from storage.shards import RaggedShard, read_image_shard
from storage.store import Store
from tasks.encode_text import encode_prompts, encode_text_shard, text_cache_key
from tasks.ingest import ingest
from tasks.models import text_encoder_fingerprint


@pytest.fixture
def ingested(make_config):
    config = make_config()
    return config, ingest(config.storage, config.dataset)


def _direct(tiny_models, caption, max_length=300):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models, subfolder="tokenizer")
    encoder = T5EncoderModel.from_pretrained(tiny_models, subfolder="text_encoder").eval()
    ids = tokenizer(caption, truncation=True, max_length=max_length, return_tensors="pt").input_ids
    with torch.no_grad():
        return encoder(input_ids=ids).last_hidden_state[0]


def test_cached_embeddings_equal_a_direct_t5_call(ingested, tiny_models):
    config, dataset = ingested
    store = Store(config.storage)
    fingerprint = text_encoder_fingerprint(config.model, config.text_encoding)
    shard = dataset["shards"][0]["id"]
    record = encode_text_shard(config.storage, config.model, config.text_encoding, fingerprint,
                               store.url(f"shards/images/{shard}.parquet"))
    cache = RaggedShard(store.local_path(text_cache_key(fingerprint, shard)))
    rows = read_image_shard(store.read_bytes(f"shards/images/{shard}.parquet")).to_pylist()
    lengths = []
    for row in rows:
        cached = cache[f"{row['sample_id']}/0"]
        direct = _direct(tiny_models, row["captions"][0])
        assert cached.shape == direct.shape  # only the real tokens are stored
        torch.testing.assert_close(cached, direct, rtol=1e-4, atol=1e-5)
        lengths.append(len(cached))
    assert record["tokens"] == sum(lengths) and len(set(lengths)) > 1  # varied lengths, no padding


def test_results_do_not_depend_on_batching_and_truncation_is_counted(ingested, tiny_models):
    config, dataset = ingested
    store = Store(config.storage)
    shard_url = store.url(f"shards/images/{dataset['shards'][0]['id']}.parquet")
    short = config.text_encoding.model_copy(update={"max_length": 8, "batch_tokens": 1})
    fp_short = text_encoder_fingerprint(config.model, short)
    assert fp_short != text_encoder_fingerprint(config.model, config.text_encoding)
    record = encode_text_shard(config.storage, config.model, short, fp_short, shard_url)
    assert record["truncated"] > 0
    cache = RaggedShard(store.local_path(text_cache_key(fp_short, dataset["shards"][0]["id"])))
    for key in list(cache.rows)[:4]:
        assert len(cache[key]) <= 8
    caption = read_image_shard(store.read_bytes(store.key(shard_url))).to_pylist()[0]
    direct = _direct(tiny_models, caption["captions"][0], max_length=8)
    torch.testing.assert_close(cache[f"{caption['sample_id']}/0"], direct, rtol=1e-4, atol=1e-5)


def test_fingerprint_covers_dtype_and_weights_not_device(make_config, tmp_path, tiny_models):
    import shutil

    config = make_config()
    base = text_encoder_fingerprint(config.model, config.text_encoding)
    assert text_encoder_fingerprint(config.model, config.text_encoding.model_copy(update={"dtype": "bf16"})) != base
    assert text_encoder_fingerprint(config.model, config.text_encoding.model_copy(
        update={"device": "cpu", "batch_tokens": 7})) == base
    copy = tmp_path / "models"
    shutil.copytree(tiny_models, copy)
    weights = copy / "text_encoder" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\x00\x00\x80\x3f")
    assert text_encoder_fingerprint(config.model.model_copy(update={"path": str(copy)}), config.text_encoding) != base


def test_bf16_cache_stays_close_to_fp32(ingested):
    config, _ = ingested
    bf16 = config.text_encoding.model_copy(update={"dtype": "bf16"})
    prompts = ["a red circle on a blue background", "a long caption " * 10]
    fp32 = encode_prompts(config.storage, config.model, config.text_encoding,
                          text_encoder_fingerprint(config.model, config.text_encoding), prompts)
    half = encode_prompts(config.storage, config.model, bf16, text_encoder_fingerprint(config.model, bf16), prompts)
    store = Store(config.storage)
    a, b = RaggedShard(store.local_path(store.key(fp32["url"]))), RaggedShard(store.local_path(store.key(half["url"])))
    assert b[prompts[0]].dtype == torch.bfloat16
    for prompt in ["", *prompts]:
        cosine = torch.nn.functional.cosine_similarity(a[prompt].float(), b[prompt].float(), dim=-1)
        assert cosine.min() > 0.99
