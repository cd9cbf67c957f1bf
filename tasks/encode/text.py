"""Stage 2 — encode-text: T5 per image shard → ragged safetensors holding only the real tokens.

Output: `cache/text/<encoder_fp>/<shard_id>.safetensors`, rows keyed `<sample_id>/<variant>`.
The sample prompts and the empty caption (caption dropout, the negative prompt of guidance) are
encoded here too, into `cache/text/<encoder_fp>/prompts/<hash>.safetensors`, so training never
needs T5. A shard whose output is committed returns at once without loading T5.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from configs.schema import ModelConfig, StorageConfig, TextEncodingConfig
from storage import layout
from storage.shards import pack_ragged, read_image_shard, shard_id_of
from storage.store import Store, json_bytes
from tasks.identity import TEXT_FORMAT, prompt_rows, prompts_cache_key
from tasks.records import CacheRecord
from tasks.encode.models import (
    TEXT_ACTIVATIONS, TextEncoder, build_text_encoder, load_text_encoder,
    reference_placement,
)

log = logging.getLogger(__name__)


def tokenize(texts: list[str], encoder: TextEncoder, config: TextEncodingConfig) -> tuple[list[list[int]], int]:
    """Token ids of each caption (preprocessed as configured, with </s>) cut at max_length, and how
    many were cut."""
    max_length = config.max_length
    full = encoder.tokenizer(encoder.family.preprocess_captions(texts, config.caption_preprocessing),
                             add_special_tokens=True).input_ids
    truncated = sum(len(x) > max_length for x in full)
    # the same cut as the tokenizer's own truncation: keep max_length-1 tokens, then </s>
    return [x if len(x) <= max_length else x[: max_length - 1] + [encoder.tokenizer.eos_token_id] for x in full], truncated


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
    ids, truncated = tokenize(texts, encoder, config)
    embeddings = [e.to(TEXT_ACTIVATIONS[config.dtype]) for e in run_encoder(ids, encoder, config.batch_tokens)]
    for text, embedding in zip(texts, embeddings):
        if not torch.isfinite(embedding).all():
            raise FloatingPointError(
                f"T5 produced non-finite values in {config.dtype} for caption {text[:80]!r}; use bf16 or fp32"
            )
    return embeddings, truncated


def measure_numerics(
    storage: StorageConfig, model: ModelConfig, text: TextEncodingConfig, fingerprint: str, shard_url: str | None
) -> dict[str, Any]:
    """The precision check of a fingerprint, measured once and committed before any shard is
    encoded, so every shard of the fingerprint embeds this one record: error of the configured
    precision against fp32 on a spread sample of the captions of `shard_url` (the dataset's first
    shard; None: the empty dataset, nothing to measure) as per-token cosine (min, mean) and max abs
    error. fp32 itself is the reference."""
    store = Store(storage)
    key = layout.text_numerics(fingerprint)
    if store.committed(key) is not None:
        return json.loads(store.read_verified(key))
    numerics: dict[str, Any] = {"dtype": text.dtype, "samples": 0, "reference": "fp32"}
    if text.dtype != "fp32" and text.numerics_samples > 0 and shard_url is not None:
        texts = shard_captions(store, shard_url)[0]
        step = max(1, len(texts) // text.numerics_samples)
        picked = texts[::step][: text.numerics_samples]
        got = torch.cat([e.float() for e in encode_captions(picked, model, text)[0]])
        # the fp32 reference never shares the accelerator with the encoder (T5-XXL: ~19 GB)
        reference = build_text_encoder(model, "fp32", *reference_placement(text.device))
        ids, _ = tokenize(picked, reference, text)
        want = torch.cat(run_encoder(ids, reference, text.batch_tokens)).float()
        del reference
        cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
        numerics.update(
            samples=len(picked), cosine_min=round(cosine.min().item(), 6), cosine_mean=round(cosine.mean().item(), 6),
            max_abs_error=round((got - want).abs().max().item(), 6),
            max_abs_reference=round(want.abs().max().item(), 6),
        )
    # pipelines measuring at once all keep the first record
    return json.loads(store.commit_first(key, json_bytes(numerics)))


def shard_captions(store: Store, shard_url: str) -> tuple[list[str], dict[str, int]]:
    """The distinct captions of an image shard, and each `<sample_id>/<variant>` row's index into them."""
    table = read_image_shard(store.read_verified(store.key(shard_url)), columns=["sample_id", "captions"])
    texts: dict[str, int] = {}
    rows: dict[str, int] = {}
    for sample in table.to_pylist():
        for variant, caption in enumerate(sample["captions"]):
            rows[f"{sample['sample_id']}/{variant}"] = texts.setdefault(caption, len(texts))
    return list(texts), rows


def encode_text_shard(
    storage: StorageConfig, model: ModelConfig, text: TextEncodingConfig, fingerprint: str, shard_url: str
) -> dict[str, Any]:
    """Encode every caption variant of one image shard; returns the cache shard's commit record.
    The fingerprint's precision check (`measure_numerics`) must be committed first."""
    store = Store(storage)
    shard_id = shard_id_of(shard_url)
    key = layout.cache_shard("text", fingerprint, shard_id)
    if (record := store.committed(key)) is not None:
        return record
    texts, rows = shard_captions(store, shard_url)
    numerics = json.loads(store.read_verified(layout.text_numerics(fingerprint)))
    embeddings, truncated = encode_captions(texts, model, text)
    meta = {"format": TEXT_FORMAT, "fingerprint": fingerprint, "shard": shard_id, "truncated": truncated,
            "numerics": numerics}
    record = store.commit(
        key, pack_ragged(rows, embeddings, meta), shard=shard_id, rows=len(rows), captions=len(texts),
        samples=len({row.rsplit("/", 1)[0] for row in rows}),
        tokens=sum(len(e) for e in embeddings), truncated=truncated, numerics=numerics,
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
    # what `precast sample` must do to a prompt to match: kept with the run's lineage
    meta = {"format": TEXT_FORMAT, "fingerprint": fingerprint, "truncated": truncated,
            "caption_preprocessing": text.caption_preprocessing, "max_length": text.max_length}
    rows = {t: i for i, t in enumerate(texts)}
    return store.commit(key, pack_ragged(rows, embeddings, meta), rows=len(rows), captions=len(rows))


def text_cache_record(store: Store, fingerprint: str, prompts: dict[str, Any], shards: list[dict[str, Any]]) -> CacheRecord:
    """What the encode-text stage returns, wherever its shards ran: the cache's URL, the commit
    records of the prompts and of each shard, `amount` and `committed_at` (the newest)."""
    records = [prompts, *shards]
    return {"url": store.url(layout.cache("text", fingerprint)), "prompts": prompts, "shards": shards,
            "amount": f"{sum(r['captions'] for r in records)} captions",
            "committed_at": max(r["committed_at"] for r in records)}


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
