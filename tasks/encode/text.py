"""Stage 2 — encode-text: each of the family's text encoders per image shard → safetensors holding
what its pipeline feeds the transformer (a masked encoder's real tokens and the padding its
transformer attends to, ragged; an unmasked one's every padded position).

Output, per encoder: `cache/text/<encoder_fp>/<shard_id>.safetensors`, rows keyed
`<sample_id>/<variant>`. The sample prompts and the empty caption (caption dropout, the negative
prompt of guidance) are encoded here too, into `cache/text/<encoder_fp>/prompts/<hash>.safetensors`,
so training never needs a text encoder. A shard whose outputs are committed returns at once
without loading an encoder.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable
from typing import Any

import torch

from configs.schema import ModelConfig, StorageConfig, TextEncodingConfig
from storage import layout
from storage.shards import pack_ragged, shard_id_of
from storage.store import Damaged, Store, fsspec_options, json_bytes
from tasks.families import Family, family_of
from tasks.families.spec import References, TextEncoderSpec
from tasks.identity import (EMPTY, SEEN, TEXT_FORMAT, check_entry_picture, entry_negative, entry_prompt, image_shard_id,
                            prompt_rows, prompts_cache_key)
from tasks.records import CacheRecord
from tasks.encode.models import (
    TEXT_ACTIVATIONS, TextEncoder, build_text_encoder, load_text_encoder,
    reference_placement,
)

log = logging.getLogger(__name__)
Outputs = dict[str, list[torch.Tensor]]  # an encoder's outputs by name, a tensor per caption


def tokenize(texts: list[str], encoder: TextEncoder, config: TextEncodingConfig,
             pictures: list[list[Any]] | None = None) -> tuple[list[list[int]], int, list[list[Any]] | None]:
    """Token ids of each caption, preprocessed as configured, as the encoder's prompt function
    makes them (`TextEncoderSpec.tokenize`), how many were cut at its max_length, and for an
    encoder that sees pictures (`TextEncoderSpec.processor`) each caption's pictures, as given in
    `pictures` (PIL, sized by `SeeingEncoderSpec.picture`), which `run_encoder` hands its calls."""
    texts = encoder.family.text.captions.preprocess(texts, config.caption_preprocessing)
    if encoder.images is None:
        return (*encoder.spec.tokenize(encoder.tokenizer, texts, encoder.max_length(config)), None)
    pictures = pictures or [[] for _ in texts]
    return encoder.spec.tokenize_with(encoder.tokenizer, encoder.images, texts, pictures), 0, pictures


def length_batches(ids: list[list[int]], encoder: TextEncoder, text: TextEncodingConfig,
                   groups: list[Any] | None = None) -> list[tuple[list[int], int]]:
    """The encoder's calls for these token sequences: (the sequences' indices, the positions each
    is padded to). Sorted by the positions a caption's call needs (its tokens, or what the spec
    keeps of an unmasked encoder's padding) and batched under `text.batch_tokens`; a batch takes no
    caption shorter than 3/4 of its longest, so padding is at most a third of what a caption
    computes. (By the budget alone, 256 captions of 68 tokens on average, a few cut at 300, were
    218 padded to 300 and 38 to 34: 26% of the positions computed were real.) With `groups` (a key
    each: the pictures it is read with), the sequences of a group are kept together, widest group
    first, so a batch's pictures are cut into patches once for all its captions that read them."""
    spec, limit = encoder.spec, encoder.max_length(text)
    width = [max(len(x), spec.kept(x, limit)) for x in ids]
    order = sorted(range(len(ids)), key=lambda i: width[i], reverse=True)
    if groups is not None:
        widest: dict[Any, int] = {}
        for index in order:
            widest.setdefault(groups[index], width[index])
        rank = {group: n for n, group in enumerate(widest)}
        order = sorted(order, key=lambda i: rank[groups[i]])  # stable: each group's widest first
    batches, start = [], 0
    while start < len(order):
        longest = shortest = width[order[start]]
        end = start + 1
        while end < len(order):
            wider, narrower = max(longest, width[order[end]]), min(shortest, width[order[end]])
            if (end - start + 1) * wider > max(text.batch_tokens, wider) or 4 * narrower < 3 * wider:
                break
            longest, shortest, end = wider, narrower, end + 1
        batches.append((order[start:end], longest))
        start = end
    return batches


@torch.inference_mode()
def run_encoder(ids: list[list[int]], encoder: TextEncoder, text: TextEncodingConfig,
                vision: list[list[Any]] | None = None) -> Outputs:
    """Each of the encoder's outputs (its spec's) for each token sequence (and its pictures,
    `vision`), on the CPU in the encoder's output dtype: sequences [kept_i, D]
    (`TextEncoderSpec.kept`), a pooled vector as [1, D], called in `length_batches`."""
    spec, limit = encoder.spec, encoder.max_length(text)
    kept = [spec.kept(x, limit) for x in ids]
    outputs: dict[str, list[Any]] = {output: [None] * len(ids) for output in spec.outputs}
    pad, left = encoder.tokenizer.pad_token_id, spec.pads_left(encoder.tokenizer)
    # (pictures by identity: `vision` holds them for the whole call)
    groups = None if vision is None else [tuple(map(id, pictures)) for pictures in vision]
    for batch, longest in length_batches(ids, encoder, text, groups):
        input_ids = torch.full((len(batch), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, index in enumerate(batch):
            place = slice(longest - len(ids[index]), None) if left else slice(len(ids[index]))
            input_ids[row, place] = torch.tensor(ids[index])
            mask[row, place] = 1
        shown = {} if vision is None else {"vision": [vision[index] for index in batch], "images": encoder.images}
        for output, values in spec.encode(encoder.model, input_ids.to(encoder.device), mask.to(encoder.device),
                                          **shown).items():
            values = values.cpu()
            for row, index in enumerate(batch):
                outputs[output][index] = (values[row, : kept[index]] if values.ndim == 3 else values[row][None]).clone()
    encoder.release()
    return outputs


def encode_captions(texts: list[str], model: ModelConfig, family: Family, config: TextEncodingConfig,
                    spec: TextEncoderSpec, pictures: list[list[Any]] | None = None) -> tuple[Outputs, int, list[int]]:
    """One of `family`'s encoders' outputs for `texts` (with each one's `pictures`, for an encoder
    that sees them) in the stored dtype, the truncation count, and how many of each text's first
    positions its pictures alone decide (`TextEncoderSpec.head`). Non-finite output fails with the
    encoder and the caption named instead of being cached."""
    encoder = load_text_encoder(model, family, spec, config.dtype, config.device, config.offload)
    ids, truncated, vision = tokenize(texts, encoder, config, pictures)
    heads = [spec.head(encoder.tokenizer, x) for x in ids]
    outputs = {name: [e.to(TEXT_ACTIVATIONS[config.dtype]) for e in values]
               for name, values in run_encoder(ids, encoder, config, vision).items()}
    for values in outputs.values():
        for text, embedding in zip(texts, values):
            if not torch.isfinite(embedding).all():
                raise FloatingPointError(f"text encoder {spec.name} produced non-finite values in {config.dtype} "
                                         f"for caption {text[:80]!r}; use bf16 or fp32")
    return outputs, truncated, heads


def packed(rows: dict[str, int], outputs: Outputs, spec: TextEncoderSpec, meta: dict[str, Any],
           heads: list[tuple[Any, int]] | None = None) -> bytes:
    """A cache shard of one encoder: its first output as the main tensor, the others by name.
    `heads`: each text's pictures (any key) and how many of its first positions they alone decide
    (`encode_captions`), stored once for the texts read with the same pictures (an edit pair's
    1,024² reference is about 1,370 of Qwen-Image-Edit's positions, its caption a few dozen)."""
    first, *more = spec.outputs
    sequences, shared = outputs[first], None
    if heads and any(length for _, length in heads):
        owners: dict[Any, int] = {}
        kept, head_of, tails = [], [], []
        for sequence, (pictures, length) in zip(sequences, heads):
            if length and pictures not in owners:
                owners[pictures] = len(kept)
                kept.append(sequence[:length])
            head_of.append(owners[pictures] if length else -1)
            tails.append(sequence[length:])
        sequences, shared = tails, (kept, head_of)
    return pack_ragged(rows, sequences, meta, {name: outputs[name] for name in more}, shared)


def measure_numerics(
    storage: StorageConfig, model: ModelConfig, text: TextEncodingConfig, fingerprints: dict[str, str],
    dataset: str | None, shard_url: str | None,
) -> dict[str, dict[str, Any]]:
    """Each encoder's precision check, by name (`measure_encoder`); `dataset`: the id of the
    dataset of `shard_url`, whose other shards hold the references it does not (an encoder that
    sees pictures)."""
    family = family_of(model)
    return {spec.name: measure_encoder(storage, model, family, text, spec, fingerprints[spec.name], dataset, shard_url)
            for spec in family.text.encoders}


def measure_encoder(
    storage: StorageConfig, model: ModelConfig, family: Family, text: TextEncodingConfig, spec: TextEncoderSpec,
    fingerprint: str, dataset: str | None, shard_url: str | None,
) -> dict[str, Any]:
    """The precision check of an encoder's fingerprint, measured once and committed before any
    shard is encoded, so every shard of the fingerprint embeds this one record: error of the
    configured precision against fp32 on a spread sample of the captions of `shard_url` (the
    dataset's first shard; None: the empty dataset, nothing to measure) as per-token cosine (min,
    mean) and max abs error of its first output. fp32 itself is the reference."""
    store = Store(storage)
    key = layout.text_numerics(fingerprint)
    if store.committed(key) is not None:
        return json.loads(store.read_verified(key))
    numerics: dict[str, Any] = {"dtype": text.dtype, "samples": 0, "reference": "fp32"}
    seeing = family.codec.references if spec.processor is not None else None
    # (a shard of references alone has no captions: nothing to measure)
    if (text.dtype != "fp32" and text.numerics_samples > 0 and shard_url is not None
            and (texts := shard_captions(store, shard_url, seeing)[0])):
        step = max(1, len(texts) // text.numerics_samples)
        units = texts[::step][: text.numerics_samples]
        picked, shown = [caption for caption, _ in units], None
        if spec.processor is not None:  # with their pictures
            held = shard_pictures(store, shard_url, {picture for _, ids in units for picture in ids}, dataset,
                                  spec.picture)
            shown = [[held[picture] for picture in ids] for _, ids in units]
        first = spec.outputs[0]
        got = torch.cat([e.float() for e in encode_captions(picked, model, family, text, spec, shown)[0][first]])
        # the fp32 reference never shares the accelerator with the encoder (T5-XXL: ~19 GB)
        reference = build_text_encoder(model, family, spec, "fp32", *reference_placement(text.device))
        ids, _, vision = tokenize(picked, reference, text, shown)
        want = torch.cat(run_encoder(ids, reference, text, vision)[first]).float()
        del reference
        cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
        numerics.update(
            samples=len(picked), cosine_min=round(cosine.min().item(), 6), cosine_mean=round(cosine.mean().item(), 6),
            max_abs_error=round((got - want).abs().max().item(), 6),
            max_abs_reference=round(want.abs().max().item(), 6),
        )
    # pipelines measuring at once all keep the first record
    return json.loads(store.commit_first(key, json_bytes(numerics)))


Unit = tuple[str, tuple[str, ...]]  # a caption, and the ids of the pictures its encoder reads with it


def shard_captions(store: Store, shard_url: str, seeing: References | None = None) -> tuple[list[Unit], dict[str, int]]:
    """The distinct captions of an image shard, and each `<sample_id>/<variant>` row's index into
    them. For an encoder that sees pictures (`seeing`: the family's references rule), each caption
    with its pair's references' ids (the same caption with other pictures is another), each
    sample's `<sample_id>/empty` row too, and no rows for a target its pipeline cannot take (the
    latent stage quarantines it, naming why). Only the shard's sample id, caption and reference
    columns are read, not its images, and they are checked against the shard's id, which is their
    hash (a sample's id hashes its references')."""
    key = store.key(shard_url)
    samples = store.read_columns(key, ["sample_id", "captions", "resolution", *(["references"] if seeing else [])]
                                 ).to_pylist()
    if (found := image_shard_id([(s["sample_id"], s["captions"], s.get("resolution")) for s in samples])
            ) != shard_id_of(shard_url):
        raise Damaged(f"{shard_url} is damaged: its sample ids, captions and resolutions hash to {found}, not to its id")
    texts: dict[Unit, int] = {}
    rows: dict[str, int] = {}
    for sample in samples:
        pictures = tuple(sample.get("references") or ()) if seeing else ()
        if seeing and sample["captions"] and seeing.count_problem(len(pictures)):
            continue
        for variant, caption in enumerate(sample["captions"]):
            rows[f"{sample['sample_id']}/{variant}"] = texts.setdefault((caption, pictures), len(texts))
        if seeing and sample["captions"]:
            rows[f"{sample['sample_id']}/{EMPTY}"] = texts.setdefault(("", pictures), len(texts))
    return list(texts), rows


def shard_pictures(store: Store, shard_url: str, ids: set[str], dataset: str | None,
                   sized: Callable[[Any], Any]) -> dict[str, Any]:
    """The pictures `ids` (pairs' references, RGB, each as `sized` makes it) from the image shard
    `shard_url`, or else from the other shards of the dataset whose id is `dataset` (ingest puts a
    reference beside its first new target, so this is for a pair a shard's end parted from it, or
    a reference a nightly run's new pair shares with an older one); each shard that holds one read
    whole and checked against its checksum."""
    from PIL import Image

    from storage.shards import read_image_shard
    from tasks.ingest.untrusted import to_rgb

    found: dict[str, Any] = {}

    def take(url: str) -> None:
        for row in read_image_shard(store.read_verified(store.key(url))).to_pylist():
            if row["sample_id"] in ids:
                with Image.open(io.BytesIO(row["image"])) as opened:
                    found[row["sample_id"]] = sized(to_rgb(opened))

    if ids:
        take(shard_url)
    for shard in store.read_json(layout.dataset(dataset))["shards"] if ids - found.keys() and dataset else ():
        url = store.url(layout.image_shard(shard["id"]))
        # a shard's ids first (a ranged read of one column); the whole shard only where it holds one
        if url != shard_url and not (ids - found.keys()).isdisjoint(
                store.read_columns(store.key(url), ["sample_id"]).column("sample_id").to_pylist()):
            take(url)
        if not ids - found.keys():
            break
    if missing := sorted(ids - found.keys()):
        raise ValueError(f"{shard_url}: its pairs name the references {', '.join(missing)}, which no shard of the "
                         f"dataset holds")
    return found


def encode_text_shard(
    storage: StorageConfig, model: ModelConfig, text: TextEncodingConfig, fingerprints: dict[str, str],
    dataset: str | None, shard_url: str,
) -> list[dict[str, Any]]:
    """Encode every caption variant of one image shard with each of the family's encoders (one
    that sees pictures, each with its pair's references, which the other shards of the dataset
    whose id is `dataset` hold where this one does not); returns each encoder's cache shard commit record (with
    `encoder`, its name). The fingerprints' precision checks (`measure_numerics`) must be committed
    first."""
    store = Store(storage)
    shard_id = shard_id_of(shard_url)
    records, captions, family = [], {}, family_of(model)
    for spec in family.text.encoders:
        fingerprint = fingerprints[spec.name]
        key = layout.cache_shard("text", fingerprint, shard_id)
        retried = len(store.retried)
        if (record := store.committed(key)) is None:
            seeing = family.codec.references if spec.processor is not None else None
            if seeing not in captions:
                captions[seeing] = shard_captions(store, shard_url, seeing)
            record = encode_shard(store, model, family, text, spec, fingerprint, key, shard_id, *captions[seeing],
                                  lambda ids, sized: shard_pictures(store, shard_url, ids, dataset, sized))
        records.append({**record, "encoder": spec.name, "io_retries": len(store.retried) - retried})
    return records


def coinciding(texts: list[Unit], rows: dict[str, int], model: ModelConfig, family: Family, text: TextEncodingConfig,
               spec: TextEncoderSpec) -> tuple[list[Unit], dict[str, int]]:
    """The texts the encoder sees differently, and each row's index into them: captions that
    coincide once preprocessed and tokenized as the encoder takes them (case and markup a
    pipeline's cleaning removes, whitespace, words past its max length) are encoded and stored
    once; an encoder that sees pictures, captions that coincide once preprocessed, with the same pictures."""
    encoder = load_text_encoder(model, family, spec, text.dtype, text.device, text.offload)
    captions = [caption for caption, _ in texts]
    if encoder.images is None:
        seen: list[tuple] = [tuple(ids) for ids in tokenize(captions, encoder, text)[0]]
    else:
        seen = list(zip(family.text.captions.preprocess(captions, text.caption_preprocessing),
                        [pictures for _, pictures in texts]))
    first: dict[tuple, int] = {}
    same = [first.setdefault(key, index) for index, key in enumerate(seen)]
    kept = {index: position for position, index in enumerate(first.values())}
    return [texts[index] for index in kept], {row: kept[same[index]] for row, index in rows.items()}


def encode_shard(store: Store, model: ModelConfig, family: Family, text: TextEncodingConfig, spec: TextEncoderSpec,
                 fingerprint: str, key: str, shard_id: str, texts: list[Unit], rows: dict[str, int],
                 pictures: Callable[[set[str], Callable[[Any], Any]], dict[str, Any]]) -> dict[str, Any]:
    """One encoder's cache shard of an image shard's captions, committed; `pictures` reads the
    references an encoder that sees them is given, sized as it reads them."""
    numerics = json.loads(store.read_verified(layout.text_numerics(fingerprint)))
    texts, rows = coinciding(texts, rows, model, family, text, spec)
    shown, captions = None, [caption for caption, _ in texts]
    if spec.processor is not None:
        held = pictures({picture for _, ids in texts for picture in ids}, spec.picture)
        shown = [[held[picture] for picture in ids] for _, ids in texts]
    outputs, truncated, lengths = encode_captions(captions, model, family, text, spec, shown)
    heads = list(zip([ids for _, ids in texts], lengths)) if spec.processor is not None else None
    meta = {"format": TEXT_FORMAT, "fingerprint": fingerprint, "shard": shard_id, "truncated": truncated,
            "numerics": numerics, "max_length": family.text.length(model, spec, text)}
    record = store.commit(
        key, packed(rows, outputs, spec, meta, heads), shard=shard_id, rows=len(rows), captions=len(texts),
        samples=len({row.rsplit("/", 1)[0] for row in rows}),
        tokens=sum(len(e) for e in outputs[spec.outputs[0]]), truncated=truncated, numerics=numerics,
    )
    log.info("encoded %d captions of shard %s with %s (%d tokens, %d truncated)", len(texts), shard_id, spec.name,
             record["tokens"], truncated)
    return record


def encode_prompts(
    storage: StorageConfig, model: ModelConfig, text: TextEncodingConfig, fingerprints: dict[str, str],
    prompts: list[str], pictures: list[str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Encode the empty caption and the sample prompts (`identity.prompt_entries`) with each
    encoder; rows are keyed by the prompt text. An encoder that sees pictures reads each prompt
    with its picture (`pictures`: their paths, one a prompt, each checked against the digest its
    entry names) and the empty caption with each picture (the negative its prompt is guided from),
    rows keyed by the entries. Returns each encoder's commit record by name."""
    store, family = Store(storage), family_of(model)
    records = {}
    for spec in family.text.encoders:
        key = prompts_cache_key(fingerprints[spec.name], prompts)
        if (record := store.committed(key)) is None:
            if spec.processor is None:
                rows = {t: i for i, t in enumerate(prompt_rows([entry_prompt(entry) for entry in prompts]))}
                texts, shown, seen = list(rows), None, None
            else:
                rows, texts, shown, seen = seen_prompts(store, family, spec, prompts, pictures)
            outputs, truncated, lengths = encode_captions(texts, model, family, text, spec, shown)
            heads = list(zip(seen, lengths)) if seen is not None else None
            # what `precast sample` must do to a prompt to match: kept with the run's lineage
            meta = {"format": TEXT_FORMAT, "fingerprint": fingerprints[spec.name], "truncated": truncated,
                    "caption_preprocessing": text.caption_preprocessing,
                    "max_length": family.text.length(model, spec, text)}
            record = store.commit(key, packed(rows, outputs, spec, meta, heads), rows=len(rows), captions=len(rows))
        records[spec.name] = record
    return records


def seen_prompts(store: Store, family: Family, spec: TextEncoderSpec, prompts: list[str], pictures: list[str] | None
                 ) -> tuple[dict[str, int], list[str], list[list[Any]], list[int]]:
    """The rows of an encoder that sees pictures: each prompt entry with its picture, and the empty
    caption with each picture (`entry_negative`); their texts, pictures and which prompt's picture each is."""
    from tasks.runs.sampling import read_picture_bytes

    if prompts and (not pictures or SEEN not in prompts[0]):
        raise ValueError(f"training.samples.references: {family.name} reads each sample prompt with its reference "
                         "picture; give one a prompt")
    held = [read_picture_bytes(path, fsspec_options(store.config)) for path in pictures or []]
    for path, entry, (_, data) in zip(pictures or [], prompts, held):
        check_entry_picture(entry, path, data)
    rows: dict[str, int] = {}
    picture: dict[str, int] = {}  # each row's prompt's picture
    for index, entry in enumerate(prompts):
        for row in (entry, entry_negative(entry)):
            picture.setdefault(row, index)
            rows.setdefault(row, len(rows))
    sized = [spec.picture(shown) for shown, _ in held]
    return rows, [entry_prompt(row) for row in rows], [[sized[picture[row]]] for row in rows], list(picture.values())


def text_cache_record(store: Store, fingerprints: dict[str, str], prompts: dict[str, Any],
                      shards: list[dict[str, Any]]) -> CacheRecord:
    """What the encode-text stage returns, wherever its shards ran: the first encoder's cache URL
    and every encoder's (`caches`), the commit records of the prompts (by encoder) and of each
    shard of each encoder, `amount` (captions, once whatever the encoders) and `committed_at`."""
    first = next(iter(fingerprints))
    # named apart: the text-encoding artifact counts the dataset's captions, which the prompts are not
    captions = sum(r["captions"] for r in shards if r.get("encoder", first) == first)
    prompts_count = prompts[first]["captions"]
    return {"url": store.url(layout.cache("text", fingerprints[first])), "prompts": prompts, "shards": shards,
            "caches": {name: store.url(layout.cache("text", fp)) for name, fp in fingerprints.items()},
            "amount": f"{captions} captions and {prompts_count} sample prompts",
            "committed_at": max(r["committed_at"] for r in [*prompts.values(), *shards])}


def encoding_report(records: list[dict[str, Any]]) -> str:
    """Markdown summary of an encode-text stage: each encoder's precision check and per shard counts."""
    encoders = list(dict.fromkeys(r.get("encoder", "") for r in records))
    lines = ["# Text encoding", ""]
    for encoder in encoders:
        numerics = next((r["numerics"] for r in records if r.get("encoder", "") == encoder and r.get("numerics")), {})
        name = f"{encoder}: " if len(encoders) > 1 else ""
        if numerics.get("samples"):
            lines += [f"{name}Precision check ({numerics['dtype']} vs fp32, {numerics['samples']} captions): per-token "
                      f"cosine min {numerics['cosine_min']:.6f}, mean {numerics['cosine_mean']:.6f}; max abs error "
                      f"{numerics['max_abs_error']:.4g} (largest fp32 value {numerics['max_abs_reference']:.4g}).", ""]
        elif numerics:
            lines += [f"{name}Precision: {numerics['dtype']} (no check needed or requested).", ""]
    lines += ["| encoder | shard | captions | tokens | truncated |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r.get('encoder', '')} | {r['shard']} | {r['captions']} | {r['tokens']} | {r['truncated']} |"
              for r in records]
    lines += ["", encoding_totals(records) + " at max_length."]
    return "\n".join(lines)


def encoding_totals(records: list[dict[str, Any]]) -> str:
    """"64 captions; 1,234 tokens stored, 0 captions truncated": the report's last line, and the
    artifact's description in the UI's list."""
    first = [r for r in records if r.get("encoder", "") == records[0].get("encoder", "")] if records else []
    return (f"{sum(r['captions'] for r in first):,} captions; {sum(r['tokens'] for r in records):,} tokens stored, "
            f"{sum(r['truncated'] for r in first):,} captions truncated")
