"""The demos' tiny worlds, scored: the held-out prompts each world's samples are drawn for, how
many draw what their prompt names (the background colour; for a video world, the direction of
motion from a first frame too), the bars the learning tests hold each family's demo to, and the
demo's training as those tests and `python -m benchmarks --only demo_world` run it. The bars sit
below the worst case of that benchmark's perturbation tables (benchmarks/results/demo-worlds.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from configs.schema import QUICKSTART, load_config
from tasks.demo import DEMO_FAMILIES, EDIT_FAMILIES, VIDEO_FAMILIES, demo_settings, edit_source
from tasks.demo.data import COLORS, SHAPES, held_out_edits, write_edit_references
from tasks.demo.videos import OPPOSITE, demo_prompts, first_frame, held_out, motion, write_first_frames

BACKGROUNDS = list(COLORS)
# never a training caption: those say where each shape is ("at the top left") and name its size
PROMPTS = [f"a {colour} {shape} on a {background} background"
           for background, colour, shape in zip(BACKGROUNDS, BACKGROUNDS[3:] + BACKGROUNDS[:3], SHAPES * 3)]
# what the learning tests assert of each family's unperturbed demo: (at least this many colours
# right with text, at most this many without), none beyond the worst case of its table here (the
# flow families' and Wan's: the bar; Z-Image's, Qwen-Image's and FLUX.2's one under their
# tables' worst)
THRESHOLDS = {"pixart": (8, 3), "flux": (9, 3), "flux-schnell": (9, 3), "sd3": (9, 3), "chroma": (9, 3),
              "zimage": (7, 3), "qwen-image": (8, 3), "flux2-klein": (6, 3), "flux2-dev": (8, 3), "wan": (9, 3)}
# the test file that asserts each family's thresholds
TESTS = {family: "tests/test_learning_families.py" for family in DEMO_FAMILIES if family in THRESHOLDS} | {
    "pixart": "tests/test_learning.py", "wan": "tests/test_learning_video.py"}
# what tests/test_learning_video.py asserts of a video demo's samples from first frames: at least
# this many of 12 move the way their prompt names, and the opposite way when that is named (chance:
# 3), below the worst case of its table here
DIRECTION_THRESHOLDS = {"wan": (7, 6)}
def nearest_colours(picture) -> np.ndarray:
    """Each pixel's nearest named colour (its index in BACKGROUNDS), [H, W]."""
    drawn = np.asarray(picture, dtype=np.float64)
    palette = np.array(list(COLORS.values()), dtype=np.float64)
    return ((drawn[:, :, None, :] - palette) ** 2).sum(-1).argmin(-1)


def dominant_colours(grid, count: int) -> list[str]:
    """The named colour most of each of the `count` pictures side by side in `grid` (samples, or
    videos' first frames) are nearest: its background, whatever shapes are drawn on it (a
    picture's mean colour would mix them in)."""
    nearest = nearest_colours(grid)
    width = nearest.shape[1] // count
    return [BACKGROUNDS[np.bincount(nearest[:, i * width:(i + 1) * width].ravel(), minlength=len(COLORS)).argmax()]
            for i in range(count)]


def held_out_scores(run: str, seed: int = 0, family: str = "pixart") -> dict[str, tuple[int, int]]:
    """Of 12 held-out prompts: `colour`, the samples drawn from text with the background colour
    their prompt names, and of the same with the text taken away (the model's unconditional
    guesses). For a video family (whose prompts, `tasks.demo.videos.held_out`, name a direction of
    motion too), clips drawn from each prompt's first frame (`first_frame`: its shape in the middle,
    free to go any way): `direction`, those whose shape moves the named way from the first frame to
    the last, with the text and without it (chance: 3); `opposite`, with the opposite way named,
    those that follow that word and those that still move the first way. Each a pair, from one
    draw of each."""
    if family in EDIT_FAMILIES:
        return edit_scores(run, seed)
    video = family in VIDEO_FAMILIES
    named = held_out() if video else [{"prompt": prompt, "background": background}
                                      for prompt, background in zip(PROMPTS, BACKGROUNDS)]
    prompts = [n["prompt"] for n in named]

    from tasks.runs.sampling import sample_run

    def draw(texts: list[str], first_frames=None):
        return sample_run(run, texts, steps=10, guidance_scale=4.5, seed=seed, pictures=first_frames)

    def moving(samples, ways: list[str]) -> int:
        return sum(motion([np.asarray(frame) for frame in frames], n["colour"]) == way
                   for frames, n, way in zip(samples, named, ways))

    def backgrounds(texts: list[str]) -> int:
        return sum(got == n["background"] for got, n in zip(dominant_colours(draw(texts).grid(), len(named)), named))

    blank = [""] * len(named)
    scores = {"colour": (backgrounds(prompts), backgrounds(blank))}
    if video:
        firsts, ways = [first_frame(n) for n in named], [n["direction"] for n in named]
        scores["direction"] = tuple(moving(draw(texts, firsts), ways) for texts in (prompts, blank))
        opposites = [OPPOSITE[way] for way in ways]
        opposed = draw([n["prompt"].replace(f"moving {way}", f"moving {other}")
                        for n, way, other in zip(named, ways, opposites)], firsts)
        scores["opposite"] = (moving(opposed, opposites), moving(opposed, ways))
    return scores


def edit_scores(run: str, seed: int = 0) -> dict[str, tuple[int, int]]:
    """Of the 12 held-out edits (`held_out_edits`), each sample drawn from its reference: `colour`,
    those whose background is the colour the edit names, with the edit's text and with none (the
    model's guess); `kept`, those that keep the reference's shapes where they were (the pixels
    whose nearest named colour is not the new background cover the reference's shapes with an
    intersection over union above one half), with the text and without. Each from one draw."""
    from tasks.runs.sampling import sample_run

    edits = held_out_edits()
    references = [edit["reference"] for edit in edits]

    def scored(texts: list[str]) -> tuple[int, int]:
        samples = sample_run(run, texts, steps=10, guidance_scale=4.5, seed=seed, pictures=references,
                             setting="--reference")
        judged = [edit_judged(frames[0], edit) for edit, frames in zip(edits, samples)]
        return sum(right for right, _ in judged), sum(kept for _, kept in judged)

    (colour, kept), (guessed, kept_blank) = scored([edit["prompt"] for edit in edits]), scored([""] * len(edits))
    return {"colour": (colour, guessed), "kept": (kept, kept_blank)}


def edit_judged(picture, edit: dict) -> tuple[bool, bool]:
    """Whether a sample drawn for a held-out `edit` made it (its background, the colour most of it
    is nearest, is the one named) and kept its reference (its pixels not nearest the new colour
    cover the reference's shapes, at the sample's size, with an intersection over union above a half)."""
    from PIL import Image

    picture = picture.convert("RGB")
    nearest = nearest_colours(picture)
    right = dominant_colours(picture, 1)[0] == edit["colour"]
    shown = np.asarray(edit["reference"].resize(picture.size, Image.Resampling.NEAREST), dtype=np.float64)
    shapes = np.abs(shown - np.array(COLORS[edit["background"]])).sum(-1) > 30
    moved = nearest != BACKGROUNDS.index(edit["colour"])
    return bool(right), bool((shapes & moved).sum() > (shapes | moved).sum() / 2)


def colour_scores(run: str, seed: int = 0, family: str = "pixart") -> tuple[int, int]:
    """`held_out_scores`' colours: (with text, without), of 12."""
    return held_out_scores(run, seed, family)["colour"]


def train_demo(folder: Path, models: Path, data: Path, training_seed: int = 0, family: str = "pixart",
               store: str = "store") -> dict:
    """The quickstart's training of `family`'s demo on `models` and `data` (in the store `store`
    under `folder`): the pipeline's stage records (the run in `["train"]`: its `url`, `first_loss`
    and `final_loss`)."""
    source = edit_source(data) if family in EDIT_FAMILIES else f"{{path: {data}}}"
    settings = [*demo_settings(family), f"storage.root={folder / store}", f"model.path={models}",
                f"dataset.sources=[{source}]", f"training.seed={training_seed}"]
    if family in VIDEO_FAMILIES:  # the sample first frames the demo writes, under `folder`
        frames = write_first_frames([folder / "first-frames" / f"{i}.png" for i in range(len(demo_prompts()))])
        settings.append(f"training.samples.first_frames={json.dumps(list(map(str, frames)))}")
    if family in EDIT_FAMILIES:  # the sample references, under `folder`
        references = write_edit_references([folder / "edit-references" / f"{i}.png" for i in range(12)])
        settings.append(f"training.samples.references={json.dumps(list(map(str, references)))}")
    from tasks.runner import run_direct

    return run_direct(load_config(QUICKSTART, settings))
