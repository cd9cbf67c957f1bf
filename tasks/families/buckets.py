"""Aspect-ratio buckets by area, as the flow-matching families' trainers bucket (kohya, SimpleTuner,
ai-toolkit): every shape whose sides are multiples of `step` pixels and whose area is nearest
resolution², from 1:4 to 4:1. Their VAEs downsample 8× and their transformers pack 2×2 latent
pixels into a token, so 16 px is the smallest side step that tokenizes whole."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=8)
def area_buckets(resolution: int, step: int = 16) -> dict[str, list[float]]:
    """height/width ratio → [height, width] in pixels: for each height a multiple of `step` from
    resolution/2 to 2 × resolution, the width (a multiple of `step`) that keeps the area nearest
    resolution²."""
    table = {}
    for height in range(resolution // 2 // step * step, 2 * resolution + 1, step):
        width = max(step, round(resolution * resolution / height / step) * step)
        table[f"{height / width:.4f}"] = [float(height), float(width)]
    return table
