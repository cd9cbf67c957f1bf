"""How precast's training step's memory grows with its tokens, at Wan 2.1's real token counts.

On an H100 a Wan 2.1 1.3B LoRA step at 41 × 480×832 peaked at 10.8 GiB and at 81 frames ran out of
80 GB (docs/benchmarks.md, "GPU: real architectures"): something grew faster than the tokens. This
runs the GPU benchmark's training step (`benchmarks.gpu.lora_step`: the trainer's own
`trainable_network`, `kept_activations`, `diffusion_loss`, backward and AdamW; LoRA r=32, bf16
autocast and base, recompute) on the tiny Wan transformer (`write_tiny_family`: 2
blocks of 96) with latents of the real clips' shape (60 × 104 latents at 21 to 81 frames: 9,360 to
32,760 tokens) and umT5's 512 zero-padded positions, and counts every storage an op creates while
it is alive (`Live`): the peak and the largest one. Bytes a token that stay the same at every
length mean nothing of precast's (a mask, a RoPE table, the loss, a checkpoint boundary) grows with
the square of the tokens; the attention kernel is the device's own (on a CPU, PyTorch's flash
kernel, which keeps no score matrix).
Usage: python -m benchmarks.activation_growth [--frames 21,41,61,81]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class Live(TorchDispatchMode):
    """The bytes of the storages ops create while it is active, as long as each is alive: the peak
    of their sum and the largest one."""

    def __init__(self):
        super().__init__()
        self.now = self.peak = self.largest = 0
        self.alive: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage()._cdata not in self.alive:
                storage = tensor.untyped_storage()
                self.alive.add(storage._cdata)
                self.now += storage.nbytes()
                self.largest, self.peak = max(self.largest, storage.nbytes()), max(self.peak, self.now)
                weakref.finalize(storage, self._freed, storage._cdata, storage.nbytes())
        return out

    def _freed(self, key: int, size: int) -> None:
        self.now -= size
        self.alive.discard(key)


def run(frames: tuple[int, ...] = (21, 41, 61, 81), height: int = 480, width: int = 832) -> dict[str, Any]:
    from benchmarks.gpu import lora_step, wan_caption
    from configs.schema import ModelConfig
    from storage.shards import collate
    from tasks.demo.flow_models import write_tiny_family
    from tasks.families import family_of
    from tasks.families.wan import latent_frames

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = ModelConfig(path=str(write_tiny_family(Path(tmp) / "wan", "wan", random_vae=True)))
        family = family_of(model)
        config = family.denoiser.transformer_class().load_config(model.path, subfolder="transformer")
        step = lora_step(model, "recompute, bf16 base", torch.device("cpu"), torch.Generator().manual_seed(0))
        text = collate([{"umt5_hidden": wan_caption(model, config["text_dim"])}])
        for count in frames:
            latent = (config["in_channels"], latent_frames(count), height // 8, width // 8)
            latents = torch.randn(1, *latent)
            tokens = family.denoiser.image_tokens(config, *latent[1:])
            live, began = Live(), time.perf_counter()
            with live:
                step(latents, text)
            results[str(count)] = {"tokens": tokens, "peak_mib": round(live.peak / 2**20, 1),
                                   "largest_mib": round(live.largest / 2**20, 1),
                                   "kib_per_token": round(live.peak / tokens / 1024, 2),
                                   "seconds": round(time.perf_counter() - began, 1)}
            print(json.dumps({count: results[str(count)]}), flush=True)
    return {"frames": results, "height": height, "width": width}


def rows(result: dict) -> list[tuple[str, str, str, str]]:
    first, *_, last = result["frames"].values()
    return [("training step memory a token, tiny Wan at real token counts",
             f"{last['kib_per_token']} KiB a token at {last['tokens']:,} tokens",
             f"{first['kib_per_token']} KiB at {first['tokens']:,}; largest tensor {last['largest_mib']} MiB",
             "the same at every length (linear)")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--frames", default="21,41,61,81", help="clip lengths, comma-separated")
    args = parser.parse_args()
    print(json.dumps(run(tuple(int(f) for f in args.frames.split(",")))))


if __name__ == "__main__":
    main()
