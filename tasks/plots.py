"""A loss-curve PNG drawn with Pillow alone (no plotting stack on training nodes)."""

from __future__ import annotations

import io
from typing import Any

from PIL import Image, ImageDraw

WIDTH, HEIGHT, MARGIN = 720, 360, 48


def loss_curve_png(metrics: list[dict[str, Any]]) -> bytes:
    """Per-step loss (light) and its running mean over ~2% of the run (dark blue), and the
    held-out validation loss where it was measured (orange), against the step."""
    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(image)
    losses = [m["loss"] for m in metrics]
    window = max(1, len(losses) // 50)
    smooth = [sum(losses[max(0, i - window + 1) : i + 1]) / len(losses[max(0, i - window + 1) : i + 1])
              for i in range(len(losses))]
    validation = [(i, m["validation_loss"]) for i, m in enumerate(metrics) if "validation_loss" in m]
    low, high = min(losses + [v for _, v in validation]), max(losses + [v for _, v in validation])
    span = (high - low) or 1.0

    def point(index: int, value: float) -> tuple[float, float]:
        x = MARGIN + (WIDTH - 2 * MARGIN) * (index / max(1, len(losses) - 1))
        y = HEIGHT - MARGIN - (HEIGHT - 2 * MARGIN) * ((value - low) / span)
        return x, y

    draw.rectangle((MARGIN, MARGIN, WIDTH - MARGIN, HEIGHT - MARGIN), outline=(160, 160, 160))
    if len(losses) > 1:
        draw.line([point(i, v) for i, v in enumerate(losses)], fill=(170, 200, 235), width=1)
        draw.line([point(i, v) for i, v in enumerate(smooth)], fill=(20, 70, 160), width=2)
    if len(validation) > 1:
        draw.line([point(i, v) for i, v in validation], fill=(230, 120, 20), width=2)
    for i, v in validation:
        x, y = point(i, v)
        draw.ellipse((x - 3, y - 3, x + 3, y + 3), fill=(230, 120, 20))
    title = f"loss  (steps {metrics[0]['step']}-{metrics[-1]['step']})"
    if validation:
        title += f"   validation (orange): {validation[-1][1]:.4f} at step {metrics[validation[-1][0]]['step']}"
    draw.text((MARGIN, 14), title, fill="black")
    draw.text((4, MARGIN - 6), f"{high:.3f}", fill="black")
    draw.text((4, HEIGHT - MARGIN - 6), f"{low:.3f}", fill="black")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
