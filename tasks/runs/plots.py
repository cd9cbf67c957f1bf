"""A run's training curves, drawn with matplotlib (its headless Agg canvas, no pyplot state): the
one picture the run folder, the run page, the demo and the README show."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # matplotlib is imported where a run draws: it costs every stage process 0.3 s otherwise
    from matplotlib.figure import Figure


def training_curves(metrics: list[dict[str, Any]]) -> Figure:
    """Two panels over the step: the training loss per step (light) and its running mean over ~2%
    of the run, with the held-out validation loss where it was measured; the learning rate below."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    steps = [m["step"] for m in metrics]
    losses = [m["loss"] for m in metrics]
    window = max(1, len(losses) // 50)
    smooth = [sum(losses[max(0, i - window + 1) : i + 1]) / len(losses[max(0, i - window + 1) : i + 1])
              for i in range(len(losses))]
    validation = [(m["step"], m["validation_loss"]) for m in metrics if "validation_loss" in m]

    figure = Figure(figsize=(8, 5), dpi=100, layout="constrained")
    loss_axes, rate_axes = figure.subplots(2, 1, sharex=True, height_ratios=[3, 1])
    loss_axes.plot(steps, losses, color="#a9c6eb", linewidth=0.8, label="training loss")
    if window > 1:
        loss_axes.plot(steps, smooth, color="#14469f", linewidth=1.8, label=f"training loss, mean of {window} steps")
    if validation:
        loss_axes.plot(*zip(*validation), "o-", color="#e6781e", markersize=4, linewidth=1.5,
                       label="validation loss (held-out samples)")
    loss_axes.set_ylabel("loss")
    loss_axes.grid(alpha=0.3)
    loss_axes.legend(loc="upper right")
    title = f"training, steps {steps[0]}–{steps[-1]}"
    if validation:
        title += f": validation loss {validation[-1][1]:.4f} at step {validation[-1][0]}"
    loss_axes.set_title(title)
    rate_axes.plot(steps, [m["lr"] for m in metrics], color="#3a7d44", linewidth=1.2)
    rate_axes.set_ylabel("learning rate")
    rate_axes.set_xlabel("step")
    rate_axes.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    rate_axes.grid(alpha=0.3)
    rate_axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    return figure


def png(figure: Figure) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    buffer = io.BytesIO()
    FigureCanvasAgg(figure).print_png(buffer)
    return buffer.getvalue()


def loss_curve_png(metrics: list[dict[str, Any]]) -> bytes:
    """`training_curves` as PNG bytes (the run folder's loss_curve.png)."""
    return png(training_curves(metrics))
