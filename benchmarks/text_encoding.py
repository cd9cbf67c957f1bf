"""Text encoding: precast's encoder vs the reference scripts' method vs batched-but-padded.

One run, one model, one caption set whose token lengths spread like real caption sets (log-normal,
median about 60 tokens, a tail up to and past max_length 300):
- reference: one caption per call, padded to max_length (how the reference training scripts'
  feature extraction runs);
- padded batched: batches of `--batch` captions, each padded to max_length;
- precast: `encode_captions`, captions sorted by length and batched under a token budget, only
  the real tokens kept.
Reports captions/s and the ratios, bytes per caption stored by precast (ragged, bf16) vs
max_length-padded fp16, and the per-token error of bf16, fp16 and int8 (torchao weight-only)
against fp32 on 64 of the captions. The model is a randomly initialised T5 v1.1 encoder of the
given width and depth, saved and loaded through `from_pretrained` like the real one.
Usage: python -m benchmarks.text_encoding [--captions 512] [--d-model 512] [--layers 6]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from configs.schema import ModelConfig, TextEncodingConfig
from tasks.demo.models import WORDS, build_tokenizer, write_model_index
from storage.shards import pack_ragged
from tasks.encode.text import encode_captions
from tasks.encode.models import load_text_encoder
from tasks.families import family_of


def make_model(folder: Path, d_model: int, layers: int) -> Path:
    from transformers import T5Config, T5EncoderModel

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(folder / "tokenizer")
    config = T5Config(vocab_size=len(tokenizer), d_model=d_model, d_kv=64, d_ff=d_model * 5 // 2,
                      num_layers=layers, num_heads=d_model // 64, feed_forward_proj="gated-gelu", dropout_rate=0.0)
    torch.manual_seed(0)
    T5EncoderModel(config).save_pretrained(folder / "text_encoder")
    write_model_index(folder)
    return folder


def make_captions(count: int, seed: int = 0) -> list[str]:
    """Captions of known words (one token each) with log-normal lengths: median ~60, tail past 300."""
    rng = random.Random(seed)
    lengths = [max(3, min(340, int(rng.lognormvariate(4.1, 0.55)))) for _ in range(count)]
    return [" ".join(rng.choice(WORDS) for _ in range(n)) for n in lengths]


@torch.inference_mode()
def padded(captions: list[str], tokenizer, model, max_length: int, batch: int) -> None:
    for start in range(0, len(captions), batch):
        inputs = tokenizer(captions[start : start + batch], padding="max_length", truncation=True,
                           max_length=max_length, return_tensors="pt")
        model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask)


def run(captions: int = 512, reference_captions: int = 128, d_model: int = 512, layers: int = 6,
        batch: int = 32, max_length: int = 300) -> dict:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = ModelConfig(path=str(make_model(Path(tmp), d_model, layers)))
        config = TextEncodingConfig(max_length=max_length, dtype="fp32", device="cpu", batch_tokens=8192,
                                    numerics_samples=0)
        family = family_of(model)
        t5 = family.text.encoders[0]
        encoder = load_text_encoder(model, family, t5, config.dtype, config.device, config.offload)
        texts = make_captions(captions)
        lengths = sorted(len(x) for x in encoder.tokenizer(texts).input_ids)
        encode_captions(texts[:16], model, family, config, t5)  # warm-up

        timings = {}
        started = time.perf_counter()
        padded(texts[: reference_captions], encoder.tokenizer, encoder.model, max_length, 1)
        timings["reference"] = reference_captions / (time.perf_counter() - started)
        started = time.perf_counter()
        padded(texts, encoder.tokenizer, encoder.model, max_length, batch)
        timings["padded_batched"] = len(texts) / (time.perf_counter() - started)
        started = time.perf_counter()
        outputs, truncated, _ = encode_captions(texts, model, family, config, t5)
        embeddings = outputs["hidden"]
        timings["precast"] = len(texts) / (time.perf_counter() - started)

        # accuracy of each reduced precision against these fp32 embeddings, per token
        accuracy = {}
        reference = torch.cat(embeddings[:64]).float()
        for dtype in ["bf16", "fp16", "int8"]:
            low, *_ = encode_captions(texts[:64], model, family, config.model_copy(update={"dtype": dtype}), t5)
            low = torch.cat(low["hidden"]).float()
            cosine = torch.nn.functional.cosine_similarity(low, reference, dim=-1)
            accuracy[dtype] = {"cosine_min": round(cosine.min().item(), 5), "cosine_mean": round(cosine.mean().item(), 6),
                               "max_abs_error": round((low - reference).abs().max().item(), 4)}

    rows = {str(i): i for i in range(len(embeddings))}
    # the shard as precast stores it for dtype bf16 (this CPU run computes in fp32)
    stored = len(pack_ragged(rows, [e.to(torch.bfloat16) for e in embeddings], {}))
    padded_fp16 = max_length * d_model * 2
    return {
        "captions": len(texts), "d_model": d_model, "layers": layers, "max_length": max_length,
        "tokens_median": lengths[len(lengths) // 2], "tokens_p95": lengths[int(len(lengths) * 0.95)],
        "truncated": truncated,
        "captions_per_s": {k: round(v, 1) for k, v in timings.items()},
        "precast_vs_padded_batched": round(timings["precast"] / timings["padded_batched"], 2),
        "precast_vs_reference": round(timings["precast"] / timings["reference"], 2),
        "bytes_per_caption": {"precast_bf16": round(stored / len(texts)), "padded_fp16": padded_fp16},
        "precast_bytes_vs_padded_fp16": round(stored / len(texts) / padded_fp16, 3),
        "accuracy_vs_fp32": accuracy, "max_abs_fp32": round(max(e.abs().max().item() for e in embeddings), 4),
    }


def rows(result: dict) -> list[tuple[str, str, str, str]]:
    speed = result["captions_per_s"]
    return [
        ("text encoding", f"{speed['precast']:,.1f} captions/s",
         f"{result['precast_vs_padded_batched']}x padded batches ({speed['padded_batched']:,.1f}), "
         f"{result['precast_vs_reference']}x the reference's one-per-call ({speed['reference']:,.1f})", "3x padded batches"),
        ("text cache size", f"{result['bytes_per_caption']['precast_bf16']:,} B/caption",
         f"{result['precast_bytes_vs_padded_fp16']:.1%} of padded-to-{result['max_length']} fp16", "< 35%"),
        ("int8 T5 precision", f"cosine min {result['accuracy_vs_fp32']['int8']['cosine_min']}", "vs fp32, per token", ""),
    ]

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--captions", type=int, default=512)
    parser.add_argument("--reference-captions", type=int, default=128, help="the one-per-call method is slow")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=300)
    args = parser.parse_args()
    print(json.dumps(run(**vars(args))))


if __name__ == "__main__":
    main()
