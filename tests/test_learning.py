"""Training learns what the captions say: the demo's tiny world, trained end to end as `precast demo`
trains it, draws the background colour each held-out prompt names, and does not without the text.

A falling loss cannot show this (a model that ignores the text lowers it too); the colours of
sampled images can, through the whole path at once: caption encoding, latents and their scale,
the noise schedule and target, text conditioning, classifier-free guidance and the sampler.
"""

from __future__ import annotations

import numpy as np
import pytest

from configs.schema import load_config
from tasks.demo_data import COLORS, SHAPES, write_demo_data
from tasks.runner import run_direct
from tasks.sampling import sample_run
from tasks.tiny_models import write_tiny_models

BACKGROUNDS = list(COLORS)
# never a training caption: those say where each shape is ("at the top left") and name its size
PROMPTS = [f"a {colour} {shape} on a {background} background"
           for background, colour, shape in zip(BACKGROUNDS, BACKGROUNDS[3:] + BACKGROUNDS[:3], SHAPES * 3)]


def nearest_colour(rgb: np.ndarray) -> str:
    return min(COLORS, key=lambda name: float(((np.array(COLORS[name]) - rgb) ** 2).sum()))


def dominant_colours(prompts: list[str], run: str, seed: int) -> list[str]:
    """The named colour nearest each sampled image's mean colour."""
    grid = np.asarray(sample_run(run, prompts, steps=10, guidance_scale=4.5, seed=seed), dtype=np.float64)
    width = grid.shape[1] // len(prompts)
    return [nearest_colour(grid[:, i * width:(i + 1) * width].reshape(-1, 3).mean(0)) for i in range(len(prompts))]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> str:
    """The quickstart's training on the demo's models and data (the models' VAE trained as
    `precast demo` trains it)."""
    folder = tmp_path_factory.mktemp("world")
    models = write_tiny_models(folder / "models")
    data = write_demo_data(folder / "data", count=1000)
    config = load_config(None, [f"storage.root={folder / 'store'}", f"model.path={models}",
                                f"dataset.sources=[{{path: {data}}}]"])
    return run_direct(config)["train"]["url"]


def test_samples_follow_the_colours_their_prompts_name(demo_run):
    hits = sum(got == named for got, named in zip(dominant_colours(PROMPTS, demo_run, seed=0), BACKGROUNDS))
    # the same prompts with the text taken away: the colours are the model's unconditional guesses
    blind = sum(got == named for got, named in
                zip(dominant_colours([""] * len(PROMPTS), demo_run, seed=0), BACKGROUNDS))
    assert hits >= 9, f"{hits} of {len(PROMPTS)} samples have the background colour their prompt names"
    assert blind <= 3, f"{blind} of {len(PROMPTS)} samples match a colour no prompt named: the test cannot tell"
