"""Stage 2 — encode-text: T5 per image shard → ragged safetensors holding only the real tokens.

Output: `cache/text/<encoder_fp>/<shard_id>.safetensors`, rows keyed `<sample_id>/<variant>`.
The sample prompts and the empty caption (caption dropout, the negative prompt of guidance) are
encoded here too, into `cache/text/<encoder_fp>/prompts/<hash>.safetensors`, so training never
needs T5. A shard whose output is committed returns at once without loading T5.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from prefect import task
from prefect.cache_policies import INPUTS

from configs.schema import ModelConfig, StorageConfig, TextEncodingConfig
from storage.fingerprint import hash_json
from storage.shards import pack_ragged, read_image_shard, shard_id_of
from storage.store import Store
from tasks.models import DTYPES, TEXT_FORMAT, load_text_encoder

log = logging.getLogger(__name__)


def text_cache_key(fingerprint: str, shard_id: str) -> str:
    return f"cache/text/{fingerprint}/{shard_id}.safetensors"


def prompts_cache_key(fingerprint: str, prompts: list[str]) -> str:
    return f"cache/text/{fingerprint}/prompts/{hash_json(prompt_rows(prompts))}.safetensors"


def prompt_rows(prompts: list[str]) -> list[str]:
    """The texts of a prompts shard: the empty caption first, then each distinct prompt."""
    return list(dict.fromkeys(["", *prompts]))


@torch.inference_mode()
def encode_captions(texts: list[str], model: ModelConfig, config: TextEncodingConfig) -> tuple[list[torch.Tensor], int]:
    """T5 embeddings of `texts`, each [real_tokens, dim] in the configured dtype, and how many
    captions were truncated at max_length.

    Captions are sorted by token count and batched under a token budget, so a batch pads only to
    its own longest caption and short captions never pay for long ones.
    """
    tokenizer, encoder = load_text_encoder(model, config.dtype, config.device)
    limit = config.max_length
    full = tokenizer(texts, add_special_tokens=True).input_ids
    truncated = sum(len(x) > limit for x in full)
    # the same cut as the tokenizer's own truncation: keep limit-1 tokens, then </s>
    ids = [x if len(x) <= limit else x[: limit - 1] + [tokenizer.eos_token_id] for x in full]
    order = sorted(range(len(texts)), key=lambda i: len(ids[i]), reverse=True)
    outputs: list[torch.Tensor | None] = [None] * len(texts)
    device = encoder.device
    start = 0
    while start < len(order):
        longest = len(ids[order[start]])
        size = max(1, config.batch_tokens // longest)
        batch = order[start : start + size]
        start += size
        input_ids = torch.full((len(batch), longest), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, index in enumerate(batch):
            input_ids[row, : len(ids[index])] = torch.tensor(ids[index])
            mask[row, : len(ids[index])] = 1
        hidden = encoder(input_ids=input_ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        hidden = hidden.to(DTYPES[config.dtype]).cpu()
        for row, index in enumerate(batch):
            embedding = hidden[row, : len(ids[index])].clone()
            if not torch.isfinite(embedding).all():
                raise FloatingPointError(
                    f"T5 produced non-finite values for caption {texts[index][:80]!r} in {config.dtype}; "
                    "use dtype bf16 or fp32"
                )
            outputs[index] = embedding
    return outputs, truncated


def encode_text_shard(
    storage: StorageConfig, model: ModelConfig, text: TextEncodingConfig, fingerprint: str, shard_url: str
) -> dict[str, Any]:
    """Encode every caption variant of one image shard; returns the cache shard's commit record."""
    store = Store(storage)
    shard_id = shard_id_of(shard_url)
    key = text_cache_key(fingerprint, shard_id)
    if (record := store.committed(key)) is not None:
        return record
    table = read_image_shard(store.read_bytes(store.key(shard_url)), columns=["sample_id", "captions"])
    texts: dict[str, int] = {}
    rows: dict[str, int] = {}
    for sample in table.to_pylist():
        for variant, caption in enumerate(sample["captions"]):
            rows[f"{sample['sample_id']}/{variant}"] = texts.setdefault(caption, len(texts))
    embeddings, truncated = encode_captions(list(texts), model, text)
    meta = {"format": TEXT_FORMAT, "fingerprint": fingerprint, "shard": shard_id, "truncated": truncated}
    record = store.commit(
        key, pack_ragged(rows, embeddings, meta), shard=shard_id, rows=len(rows), captions=len(texts),
        tokens=sum(len(e) for e in embeddings), truncated=truncated,
    )
    log.info("encoded %d captions of shard %s (%d tokens, %d truncated)", len(texts), shard_id,
             record["tokens"], truncated)
    return record


def encode_prompts(
    storage: StorageConfig, model: ModelConfig, text: TextEncodingConfig, fingerprint: str, prompts: list[str]
) -> dict[str, Any]:
    """Encode the empty caption and the sample prompts; rows are keyed by the prompt text."""
    store = Store(storage)
    key = prompts_cache_key(fingerprint, prompts)
    if (record := store.committed(key)) is not None:
        return record
    texts = prompt_rows(prompts)
    embeddings, truncated = encode_captions(texts, model, text)
    meta = {"format": TEXT_FORMAT, "fingerprint": fingerprint, "truncated": truncated}
    rows = {t: i for i, t in enumerate(texts)}
    return store.commit(key, pack_ragged(rows, embeddings, meta), rows=len(rows), captions=len(rows))


@task(name="encode-text", cache_policy=INPUTS, persist_result=True, result_serializer="json")
def encode_text_task(
    storage: StorageConfig, model: ModelConfig, text: TextEncodingConfig, fingerprint: str, shard_url: str
) -> dict[str, Any]:
    return encode_text_shard(storage, model, text, fingerprint, shard_url)


@task(name="encode-prompts", cache_policy=INPUTS, persist_result=True, result_serializer="json")
def encode_prompts_task(
    storage: StorageConfig, model: ModelConfig, text: TextEncodingConfig, fingerprint: str, prompts: list[str]
) -> dict[str, Any]:
    return encode_prompts(storage, model, text, fingerprint, prompts)
