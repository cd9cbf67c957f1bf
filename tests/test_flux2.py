"""FLUX.2's facts beyond the contracts (tests/test_family_contracts.py): why its text cache holds
every one of the 512 positions, and where the padding goes when a tokenizer pads on the left."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from configs.schema import ModelConfig, StorageConfig, TextEncodingConfig
from storage.shards import RaggedShard
from storage.store import Store
from tasks.encode.text import encode_prompts
from tasks.identity import text_fingerprints


def test_the_paddings_states_depend_on_the_caption_so_the_cache_keeps_all_512_positions(tiny_family, tmp_path):
    """The pipeline pads each caption to 512 and its transformer attends to all of them. A padded
    position is masked as a key but still a query, so it attends to the caption's real tokens: two
    captions of the same length (the same pad count) have other states at the same padded
    position, and no state can be stored once per pad count and rebuilt. The cache keeps the 512."""
    from diffusers import Flux2KleinPipeline

    model = ModelConfig(path=str(tiny_family("flux2-klein")))
    pipeline = Flux2KleinPipeline.from_pretrained(model.path)
    captions = ["a red circle on a blue background", "a green square on a white background"]
    lengths = [len(pipeline.tokenizer(pipeline.tokenizer.apply_chat_template(
        [{"role": "user", "content": caption}], tokenize=False, add_generation_prompt=True,
        enable_thinking=False)).input_ids) for caption in captions]
    assert lengths[0] == lengths[1] < 512
    with torch.no_grad():
        embeds, _ = pipeline.encode_prompt(captions, device=torch.device("cpu"), max_sequence_length=512)
    pads = embeds[:, lengths[0]:]
    assert (pads[0] - pads[1]).abs().amax() > 1e-3  # the same pad count, other states

    storage = StorageConfig(root=str(tmp_path))
    text = TextEncodingConfig(dtype="bf16", device="cpu", numerics_samples=0)
    (record,) = encode_prompts(storage, model, text, text_fingerprints(model, text), captions).values()
    store = Store(storage)
    cache = RaggedShard(store.local_path(store.key(record["url"])))
    for caption, expected in zip(captions, embeds):
        row = cache.get(caption)
        assert row.shape == (512, expected.shape[-1]) and row.dtype == torch.bfloat16  # 512 × 3 layers' width, bf16
        torch.testing.assert_close(row.float(), expected, rtol=2e-2, atol=2e-2)  # bf16 of the fp32 states


def test_a_tokenizer_that_pads_on_the_left_gives_the_cache_the_pipelines_layout(tiny_family, tmp_path):
    """FLUX.2 [dev]'s 512 positions are the tokenizer's: with its padding side set to the left, the
    padding comes before the system message and the caption, where the pipeline's encode_prompt has
    it, and the cache equals it position for position (each caption's real tokens at other RoPE
    positions than with right padding)."""
    from diffusers import Flux2Pipeline
    from transformers import AutoTokenizer

    folder = tmp_path / "flux2-dev"
    shutil.copytree(tiny_family("flux2-dev"), folder)
    tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
    tokenizer.padding_side = "left"
    tokenizer.save_pretrained(folder / "tokenizer")
    model = ModelConfig(path=str(folder))
    pipeline = Flux2Pipeline.from_pretrained(model.path)
    captions = ["a red circle on a blue background", "stripes " * 600]
    with torch.no_grad():
        embeds, _ = pipeline.encode_prompt(captions, device=torch.device("cpu"), max_sequence_length=512)
    storage = StorageConfig(root=str(tmp_path / "store"))
    text = TextEncodingConfig(dtype="fp32", device="cpu", numerics_samples=0)
    (record,) = encode_prompts(storage, model, text, text_fingerprints(model, text), captions).values()
    store = Store(storage)
    cache = RaggedShard(store.local_path(store.key(record["url"])))
    for caption, expected in zip(captions, embeds):
        torch.testing.assert_close(cache.get(caption), expected, rtol=1e-4, atol=5e-5)
    right = TextEncodingConfig(dtype="fp32", device="cpu", numerics_samples=0)
    assert text_fingerprints(model, right) != text_fingerprints(ModelConfig(path=str(tiny_family("flux2-dev"))), right)


def test_sampling_from_text_names_the_backend_a_published_folders_processor_needs(tiny_family, tmp_path):
    """FLUX.2 [dev]'s folder as published names a `PixtralProcessor` for its tokenizer, which needs
    torchvision (not installed): sampling from text says so, naming the component, before the
    pipeline's `from_pretrained` fails on it without a reason. The tiny folder's tokenizer loads."""
    from tasks.runs.sampling import check_components

    check_components(ModelConfig(path=str(tiny_family("flux2-dev"))))
    folder = tmp_path / "flux2-dev"
    shutil.copytree(tiny_family("flux2-dev"), folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "tokenizer": ["transformers", "PixtralProcessor"]}))
    with pytest.raises(ImportError, match=r"its tokenizer is a PixtralProcessor, which needs .*torchvision"):
        check_components(ModelConfig(path=str(folder)))
