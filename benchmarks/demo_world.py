"""The demo's tiny world under perturbations that stand in for another machine, for each family.

A CPU of another kind rounds differently, and the demo's 1,000 steps amplify the last bits, so the
trained bytes differ from machine to machine. What must not differ is what the world teaches: the
hand-set VAE gives back every palette colour, and the demo's training draws the background colour each
held-out prompt names (and does not without the text). This retrains each family's demo (`precast
demo --family F`'s models, data, `configs/quickstart.yaml` and the family's `demo_settings`) under
each perturbation: other training seeds, other model seeds, 1 torch thread instead of 2, and every
initial weight moved by one representable value (`tasks.demo.models.perturb_last_bits`), and
reports for each the VAE's palette round trip and the held-out colour score with and without text.
`tests/test_learning.py` asserts the same score for each unperturbed demo, at thresholds below the
worst case here (docs/design.md has the tables).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from configs.schema import QUICKSTART, load_config
from tasks.demo import DEMO_FAMILIES, DEMO_MODELS, VIDEO_FAMILIES, demo_settings, write_demo_dataset, write_demo_models
from tasks.demo.data import COLORS, SHAPES
from tasks.demo.models import palette_round_trip
from tasks.demo.videos import DEMO_VIDEO, OPPOSITE, demo_prompts, first_frame, held_out, motion, write_first_frames
from tasks.runner import run_direct
from tasks.runs.sampling import sample_run

BACKGROUNDS = list(COLORS)
# never a training caption: those say where each shape is ("at the top left") and name its size
PROMPTS = [f"a {colour} {shape} on a {background} background"
           for background, colour, shape in zip(BACKGROUNDS, BACKGROUNDS[3:] + BACKGROUNDS[:3], SHAPES * 3)]
# what tests/test_learning.py asserts of each family's unperturbed demo: (at least this many colours
# right with text, at most this many without), none beyond the worst case of its table here (the
# flow families' and Wan's: the issue's bar)
THRESHOLDS = {"pixart": (8, 3), "flux": (9, 3), "flux-schnell": (9, 3), "sd3": (9, 3), "chroma": (9, 3), "wan": (9, 3)}
# the test file that asserts each family's thresholds
TESTS = {family: "tests/test_learning_families.py" for family in DEMO_FAMILIES} | {
    "pixart": "tests/test_learning.py", "wan": "tests/test_learning_video.py"}
# what tests/test_learning_video.py asserts of a video demo's samples from first frames: at least
# this many of 12 move the way their prompt names, and the opposite way when that is named (chance:
# 3), below the worst case of its table here
DIRECTION_THRESHOLDS = {"wan": (7, 6)}
# name: (model seed, training seed, torch threads, last-bits perturbation seed or None)
PERTURBATIONS = {
    "demo (seed 0, 2 threads)": (0, 0, 2, None),
    "training seed 1": (0, 1, 2, None),
    "training seed 2": (0, 2, 2, None),
    "model seed 1": (1, 0, 2, None),
    "1 thread": (0, 0, 1, None),
    "last bits moved": (0, 0, 2, 1),
    "last bits moved, 1 thread": (0, 0, 1, 2),
}


def dominant_colours(grid, count: int) -> list[str]:
    """The named colour most of each of the `count` pictures side by side in `grid` (samples, or
    videos' first frames) are nearest: its background, whatever shapes are drawn on it (a
    picture's mean colour would mix them in)."""
    grid = np.asarray(grid, dtype=np.float64)
    palette = np.array(list(COLORS.values()), dtype=np.float64)
    nearest = ((grid[:, :, None, :] - palette) ** 2).sum(-1).argmin(-1)
    width = grid.shape[1] // count
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
    video = family in VIDEO_FAMILIES
    named = held_out() if video else [{"prompt": prompt, "background": background}
                                      for prompt, background in zip(PROMPTS, BACKGROUNDS)]
    prompts = [n["prompt"] for n in named]

    def draw(texts: list[str], first_frames=None):
        return sample_run(run, texts, steps=10, guidance_scale=4.5, seed=seed, first_frames=first_frames)

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


def colour_scores(run: str, seed: int = 0, family: str = "pixart") -> tuple[int, int]:
    """`held_out_scores`' colours: (with text, without), of 12."""
    return held_out_scores(run, seed, family)["colour"]


def train_demo(folder: Path, models: Path, data: Path, training_seed: int = 0, family: str = "pixart",
               store: str = "store") -> dict:
    """The quickstart's training of `family`'s demo on `models` and `data` (in the store `store`
    under `folder`): the pipeline's stage records (the run in `["train"]`: its `url`, `first_loss`
    and `final_loss`)."""
    settings = [*demo_settings(family), f"storage.root={folder / store}", f"model.path={models}",
                f"dataset.sources=[{{path: {data}}}]", f"training.seed={training_seed}"]
    if family in VIDEO_FAMILIES:  # the sample first frames the demo writes, under `folder`
        frames = write_first_frames([folder / "first-frames" / f"{i}.png" for i in range(len(demo_prompts()))])
        settings.append(f"training.sample_first_frames={json.dumps(list(map(str, frames)))}")
    config = load_config(QUICKSTART, settings)
    return run_direct(config)


def run(perturbations: list[str] | None = None, sample_seeds: tuple[int, ...] = (0, 1),
        families: tuple[str, ...] = DEMO_FAMILIES) -> dict:
    return {family: run_family(family, perturbations, sample_seeds) for family in families}


def run_family(family: str, perturbations: list[str] | None = None, sample_seeds: tuple[int, ...] = (0, 1)) -> dict:
    from diffusers import AutoencoderKL, AutoencoderKLWan

    video = family in VIDEO_FAMILIES
    threads = torch.get_num_threads()
    results = {}
    with tempfile.TemporaryDirectory(prefix="precast-demo-world-") as tmp:
        folder = Path(tmp)
        data = write_demo_dataset(folder / "data", family)
        for name in perturbations or list(PERTURBATIONS):
            model_seed, training_seed, torch_threads, perturb = PERTURBATIONS[name]
            torch.set_num_threads(torch_threads)
            try:
                began = time.perf_counter()
                models = write_demo_models(folder / f"models-{model_seed}-{torch_threads}-{perturb}",
                                           DEMO_MODELS.get(family, family), seed=model_seed, perturb=perturb)
                trips = palette_round_trip((AutoencoderKLWan if video else AutoencoderKL).from_pretrained(models / "vae"),
                                           frames=DEMO_VIDEO["frames"] if video else None)
                # a store a row: a perturbation that leaves the run id as it was (the thread count,
                # with models that do not depend on it) must train, not find the first row's run
                trained = train_demo(folder, models, data, training_seed, family, store=f"store-{len(results)}")
                drawn = [held_out_scores(trained["train"]["url"], seed, family) for seed in sample_seeds]
                scores = [draw["colour"] for draw in drawn]
                motions = [draw["direction"] for draw in drawn] if video else []
                opposed = [draw["opposite"] for draw in drawn] if video else []
            finally:
                torch.set_num_threads(threads)
            results[name] = {
                "vae_palette": sum(own < other for own, _, other in trips.values()),
                "vae_worst_error": round(max(own for own, _, _ in trips.values()), 1),
                "vae_worst_ratio": round(max(own / other for own, _, other in trips.values()), 2),
                "with_text": [hits for hits, _ in scores], "without_text": [blind for _, blind in scores],
                **({"direction_with_text": [hits for hits, _ in motions],
                    "direction_without_text": [blind for _, blind in motions],
                    "opposite_followed": [followed for followed, _ in opposed],
                    "opposite_ignored": [ignored for _, ignored in opposed]} if video else {}),
                "loss": [round(trained["train"]["first_loss"], 3), round(trained["train"]["final_loss"], 3)],
                "seconds": round(time.perf_counter() - began, 1),
            }
            print(f"  {family}, {name}: {results[name]}", flush=True)
    return {"perturbations": results,
            "worst_with_text": min(min(r["with_text"]) for r in results.values()),
            "worst_without_text": max(max(r["without_text"]) for r in results.values()),
            "worst_vae_palette": min(r["vae_palette"] for r in results.values()),
            **({"worst_direction": min(min(r["direction_with_text"]) for r in results.values()),
                "worst_opposite": min(min(r["opposite_followed"]) for r in results.values())} if video else {})}


def rows(result: dict) -> list[tuple[str, str, str, str]]:
    out = []
    for family, table in result.items():
        out += [(f"demo world ({family}): {name}",
                 f"{r['with_text']} of 12 colours with text, {r['without_text']} without; loss {r['loss'][0]} -> {r['loss'][1]}"
                 + (f"; from first frames {r['direction_with_text']} of 12 move the named way, "
                    f"{r['direction_without_text']} without text (chance: 3), {r['opposite_followed']} the opposite "
                    f"way when it is named ({r['opposite_ignored']} the first way)" if "direction_with_text" in r else ""),
                 f"VAE palette {r['vae_palette']} of 12 (worst error {r['vae_worst_error']}, {r['vae_worst_ratio']} of the way to another colour)",
                 "") for name, r in table["perturbations"].items()]
        out.append((f"demo world ({family}): worst case", f"{table['worst_with_text']} of 12 with text",
                    f"{table['worst_without_text']} of 12 without; VAE palette {table['worst_vae_palette']} of 12",
                    f"{TESTS[family]}: >= {THRESHOLDS[family][0]} with, <= {THRESHOLDS[family][1]} without"))
        if "worst_direction" in table:
            out.append((f"demo world ({family}): worst direction", f"{table['worst_direction']} of 12 the named way",
                        f"{table['worst_opposite']} of 12 the opposite way when it is named",
                        f"{TESTS[family]}: >= {DIRECTION_THRESHOLDS[family][0]} and "
                        f">= {DIRECTION_THRESHOLDS[family][1]}"))
    return out
