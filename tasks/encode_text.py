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
from tasks.models import (
    TEXT_ACTIVATIONS, TEXT_FORMAT, TextEncoder, build_text_encoder, device_slot, load_text_encoder,
)

log = logging.getLogger(__name__)


def text_cache_key(fingerprint: str, shard_id: str) -> str:
    return f"cache/text/{fingerprint}/{shard_id}.safetensors"


def prompts_cache_key(fingerprint: str, prompts: list[str]) -> str:
    return f"cache/text/{fingerprint}/prompts/{hash_json(prompt_rows(prompts))}.safetensors"


def prompt_rows(prompts: list[str]) -> list[str]:
    """The texts of a prompts shard: the empty caption first, then each distinct prompt."""
    return list(dict.fromkeys(["", *prompts]))


def tokenize(texts: list[str], tokenizer, max_length: int) -> tuple[list[list[int]], int]:
    """Token ids of each caption (with </s>) cut at max_length, and how many were cut."""
    full = tokenizer(texts, add_special_tokens=True).input_ids
    truncated = sum(len(x) > max_length for x in full)
    # the same cut as the tokenizer's own truncation: keep max_length-1 tokens, then </s>
    return [x if len(x) <= max_length else x[: max_length - 1] + [tokenizer.eos_token_id] for x in full], truncated


@torch.inference_mode()
def run_encoder(ids: list[list[int]], encoder: TextEncoder, batch_tokens: int) -> list[torch.Tensor]:
    """Embeddings [len_i, dim] of each token sequence, on the CPU in the encoder's output dtype.

    Sequences are sorted by length and batched under a token budget, so a batch pads only to its
    own longest caption and short captions never pay for long ones.
    """
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]), reverse=True)
    outputs: list[torch.Tensor | None] = [None] * len(ids)
    pad = encoder.tokenizer.pad_token_id
    start = 0
    while start < len(order):
        longest = len(ids[order[start]])
        batch = order[start : start + max(1, batch_tokens // longest)]
        start += len(batch)
        input_ids = torch.full((len(batch), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, index in enumerate(batch):
            input_ids[row, : len(ids[index])] = torch.tensor(ids[index])
            mask[row, : len(ids[index])] = 1
        hidden = encoder.model(input_ids=input_ids.to(encoder.device), attention_mask=mask.to(encoder.device))
        hidden = hidden.last_hidden_state.cpu()
        for row, index in enumerate(batch):
            outputs[index] = hidden[row, : len(ids[index])].clone()
    encoder.release()
    return outputs


def encode_captions(texts: list[str], model: ModelConfig, config: TextEncodingConfig) -> tuple[list[torch.Tensor], int]:
    """T5 embeddings of `texts` (real tokens only, in the stored dtype) and the truncation count.
    Non-finite output fails with the caption named instead of being cached."""
    encoder = load_text_encoder(model, config.dtype, config.device, config.offload)
    ids, truncated = tokenize(texts, encoder.tokenizer, config.max_length)
    embeddings = [e.to(TEXT_ACTIVATIONS[config.dtype]) for e in run_encoder(ids, encoder, config.batch_tokens)]
    for text, embedding in zip(texts, embeddings):
        if not torch.isfinite(embedding).all():
            raise FloatingPointError(
                f"T5 produced non-finite values in {config.dtype} for caption {text[:80]!r}; use bf16 or fp32"
            )
    return embeddings, truncated


def numerics_check(
    texts: list[str], embeddings: list[torch.Tensor], model: ModelConfig, config: TextEncodingConfig
) -> dict[str, Any]:
    """Error of the configured precision against fp32 on a spread sample of captions: per-token
    cosine similarity (min, mean) and max abs error. fp32 itself is the reference."""
    if config.dtype == "fp32" or config.numerics_samples == 0:
        return {"dtype": config.dtype, "samples": 0, "reference": "fp32"}
    step = max(1, len(texts) // config.numerics_samples)
    picked = list(range(0, len(texts), step))[: config.numerics_samples]
    # the reference is loaded for this check only (same placement), then freed
    reference = build_text_encoder(model, "fp32", config.device, config.offload)
    ids, _ = tokenize([texts[i] for i in picked], reference.tokenizer, config.max_length)
    expected = run_encoder(ids, reference, config.batch_tokens)
    del reference
    got = torch.cat([embeddings[i].float() for i in picked])
    want = torch.cat(expected).float()
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    return {
        "dtype": config.dtype, "samples": len(picked), "reference": "fp32",
        "cosine_min": round(cosine.min().item(), 6), "cosine_mean": round(cosine.mean().item(), 6),
        "max_abs_error": round((got - want).abs().max().item(), 6),
        "max_abs_reference": round(want.abs().max().item(), 6),
    }


def encode_text_shard(
    storage: StorageConfig, model: ModelConfig, text: TextEncodingConfig, fingerprint: str, shard_url: str
) -> dict[str, Any]:
    """Encode every caption variant of one image shard; returns the cache shard's commit record."""
    store = Store(storage)
    shard_id = shard_id_of(shard_url)
    key = text_cache_key(fingerprint, shard_id)
    if (record := store.committed(key)) is not None:
        return record
    table = read_image_shard(store.read_verified(store.key(shard_url)), columns=["sample_id", "captions"])
    texts: dict[str, int] = {}
    rows: dict[str, int] = {}
    for sample in table.to_pylist():
        for variant, caption in enumerate(sample["captions"]):
            rows[f"{sample['sample_id']}/{variant}"] = texts.setdefault(caption, len(texts))
    embeddings, truncated = encode_captions(list(texts), model, text)
    numerics = fingerprint_numerics(store, fingerprint, list(texts), embeddings, model, text)
    meta = {"format": TEXT_FORMAT, "fingerprint": fingerprint, "shard": shard_id, "truncated": truncated,
            "numerics": numerics}
    record = store.commit(
        key, pack_ragged(rows, embeddings, meta), shard=shard_id, rows=len(rows), captions=len(texts),
        tokens=sum(len(e) for e in embeddings), truncated=truncated, numerics=numerics,
    )
    log.info("encoded %d captions of shard %s (%d tokens, %d truncated)", len(texts), shard_id,
             record["tokens"], truncated)
    return record


def fingerprint_numerics(
    store: Store, fingerprint: str, texts: list[str], embeddings: list[torch.Tensor], model: ModelConfig,
    text: TextEncodingConfig,
) -> dict[str, Any]:
    """The precision check of this fingerprint: measured once, on the first shard encoded with it."""
    key = f"cache/text/{fingerprint}/numerics.json"
    if store.exists(key):
        return store.read_json(key)
    numerics = numerics_check(texts, embeddings, model, text)
    store.write_json(key, numerics)
    return numerics


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


def encoding_report(records: list[dict[str, Any]]) -> str:
    """Markdown summary of an encode-text stage: per shard counts and the precision check."""
    numerics = next((r["numerics"] for r in records if r.get("numerics")), {})
    lines = ["# Text encoding", ""]
    if numerics.get("samples"):
        lines += [f"Precision check ({numerics['dtype']} vs fp32, {numerics['samples']} captions): per-token cosine "
                  f"min {numerics['cosine_min']:.6f}, mean {numerics['cosine_mean']:.6f}; max abs error "
                  f"{numerics['max_abs_error']:.4g} (largest fp32 value {numerics['max_abs_reference']:.4g}).", ""]
    elif numerics:
        lines += [f"Precision: {numerics['dtype']} (no check needed or requested).", ""]
    lines += ["| shard | captions | tokens | truncated |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['shard']} | {r['captions']} | {r['tokens']} | {r['truncated']} |" for r in records]
    total = sum(r["truncated"] for r in records)
    lines += ["", f"{sum(r['captions'] for r in records)} captions, {sum(r['tokens'] for r in records)} tokens stored, "
              f"{total} truncated at max_length."]
    return "\n".join(lines)


@task(name="encode-text", cache_policy=INPUTS, persist_result=True, result_serializer="json")
def encode_text_task(
    storage: StorageConfig, model: ModelConfig, text: TextEncodingConfig, fingerprint: str, shard_url: str
) -> dict[str, Any]:
    with device_slot(text.device):
        return encode_text_shard(storage, model, text, fingerprint, shard_url)


@task(name="encode-prompts", cache_policy=INPUTS, persist_result=True, result_serializer="json")
def encode_prompts_task(
    storage: StorageConfig, model: ModelConfig, text: TextEncodingConfig, fingerprint: str, prompts: list[str]
) -> dict[str, Any]:
    with device_slot(text.device):
        return encode_prompts(storage, model, text, fingerprint, prompts)
