"""Each flow-matching family learns what the captions say, as tests/test_learning.py shows for
PixArt: its tiny world, trained end to end as `precast demo --family F` trains it (the family's
encoders, its latents packed as its transformer reads them, its flow-matching schedule
and its pipeline for the samples), draws the background colour each held-out prompt names, and does
not without the text. Their VAEs are set by hand; the thresholds (`tasks.demo.world.THRESHOLDS`:
the issue's bar, or one under a table's worst) are ones no draw of each family's table in
`python -m benchmarks --only demo_world` falls outside (benchmarks/results/demo-worlds.md).
"""

from __future__ import annotations

import pytest
from diffusers import AutoencoderKL, AutoencoderKLFlux2, AutoencoderKLQwenImage

from tasks.demo.world import PROMPTS, THRESHOLDS, colour_scores, train_demo
from tasks.demo import write_demo_models
from tasks.demo.data import write_demo_data
from tasks.demo.models import palette_confusions

pytestmark = pytest.mark.slow(minutes=9)

FAMILIES = ("flux", "sd3", "chroma", "zimage", "qwen-image", "flux2-klein", "flux2-dev")


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """Each family's demo models and its quickstart run, on one dataset and one store (the latents
    of their one VAE encoded once): {family: (models, run URL)}."""
    folder = tmp_path_factory.mktemp("flow-worlds")
    data = write_demo_data(folder / "data", count=1000)
    out = {}
    for family in FAMILIES:
        models = write_demo_models(folder / family, family)
        out[family] = models, train_demo(folder, models, data, family=family)["train"]["url"]
    return out


def test_the_hand_set_vaes_give_back_every_palette_colour(worlds):
    """FLUX.1's 2-D VAE (SD3, Chroma and Z-Image have the same), Qwen-Image's 3-D one (Wan's kind),
    a picture a one-frame clip, and FLUX.2's 32-channel one with its batch norm of the patches."""
    assert palette_confusions(AutoencoderKL.from_pretrained(worlds[FAMILIES[0]][0] / "vae")) == []
    assert palette_confusions(AutoencoderKLQwenImage.from_pretrained(worlds["qwen-image"][0] / "vae"), frames=1) == []
    assert palette_confusions(AutoencoderKLFlux2.from_pretrained(worlds["flux2-klein"][0] / "vae")) == []


@pytest.mark.parametrize("family", FAMILIES)
def test_samples_follow_the_colours_their_prompts_name(worlds, family):
    hits, blind = colour_scores(worlds[family][1], seed=0)
    least, most = THRESHOLDS[family]
    assert hits >= least, f"{family}: {hits} of {len(PROMPTS)} samples have the background colour their prompt names"
    assert blind <= most, f"{family}: {blind} of {len(PROMPTS)} samples match a colour no prompt named: the test cannot tell"
