"""The demo's fixtures: generated pictures with captions that name what they show (`data`), and
tiny models in the hub layout that load through the real `from_pretrained` path (`models`: PixArt-Σ;
`flow_models`: FLUX.1, SD3.5, Chroma, Z-Image, Qwen-Image, FLUX.2, Wan). Used by
`precast demo`, the tests and the benchmarks; no stage imports them."""

from __future__ import annotations

import json
from pathlib import Path

# what `--family` chooses
DEMO_FAMILIES = ("pixart", "flux", "flux-schnell", "sd3", "chroma", "zimage", "qwen-image", "flux2-klein",
                 "flux2-dev", "wan", "flux-kontext")
# every tiny model folder precast writes: the demos' (the wan demo's is wan-ti2v) and Wan 2.2's
# published layouts (TI2V-5B, A14B), which have no demo
TINY_FAMILIES = (*DEMO_FAMILIES, "wan-ti2v", "wan2.2-ti2v", "wan2.2-a14b", "qwen-image-edit", "qwen-image-edit-plus")
VIDEO_FAMILIES = ("wan",)  # their demo learns from generated videos (`videos`), the others' from pictures
EDIT_FAMILIES = ("flux-kontext",)  # their demo learns edits from generated pairs (`data.write_edit_data`)
# the tiny models a demo trains, where not its own family's: the wan demo's sample from a first frame too
DEMO_MODELS = {"wan": "wan-ti2v"}
# the picture demos' training, where not the quickstart's (PixArt's: 700 steps at a learning rate of
# 1e-3, the weights averaged with decay 0.995): FLUX.1-dev, SD3 and Chroma learn their world in fewer
# steps at twice the rate with a shorter average, each the fewest steps whose seven perturbations stay
# above its bar; FLUX.2 [klein] 1,000 at that rate after 100 steps of warmup (without it, two of
# three other training seeds never learned to read the text; at 700, one of four model draws drew 7
# and 6 of 12); FLUX.1-schnell, Z-Image and Qwen-Image train 1,000 at the quickstart's rate, as their tables
# were drawn (Z-Image and Qwen-Image do not learn in 600 at twice it): benchmarks/results/demo-worlds.md
FASTER = {"training.optimizer.learning_rate": 0.002, "training.optimizer.ema_decay": 0.99}
DEMO_TRAINING = {"flux": {"training.steps": 700, **FASTER}, "sd3": {"training.steps": 400, **FASTER},
                 "chroma": {"training.steps": 400, **FASTER}, "flux-schnell": {"training.steps": 1000},
                 "zimage": {"training.steps": 1000}, "qwen-image": {"training.steps": 1000},
                 "flux2-klein": {"training.steps": 1000, **FASTER, "training.optimizer.warmup_steps": 100},
                 # klein's training; its template (the system message) takes 33 of the text's
                 # positions, so 48 leave a caption 15
                 "flux2-dev": {"training.steps": 1000, **FASTER, "training.optimizer.warmup_steps": 100,
                               "text_encoding.max_length": 48},
                 "flux-kontext": {"training.steps": 2000, **FASTER}}
FIRST_FRAMES = "precast-demo/first-frames"  # the video demo's sample prompts' first frames (`videos.first_frame`)
EDIT_PAIRS = "precast-demo/edit-pairs"  # the edit demo's pairs: targets/ and references/
EDIT_REFERENCES = "precast-demo/edit-references"  # its sample prompts' references (`data.held_out_edits`)


def demo_settings(family: str) -> list[str]:
    """The quickstart's settings for `family`'s demo: its tiny models in a folder of their own (the
    first family's are the quickstart's own `model.path`). The flow families' tiny world is drawn at
    128 px (64 image tokens a picture, area buckets take any multiple of 16) with 32 text tokens:
    every caption names its first shape and the background in its first 11 words (a third of them
    run longer and are cut, as a family's own length cuts long captions), and the family's own 256
    or 512 unmasked T5 positions would be 4 to 8 times the image's tokens, so training would spend
    most of its time on padding; what the demo shows (the text learned, in the family's layout) is
    the same."""
    if family == DEMO_FAMILIES[0]:
        return []
    if family in VIDEO_FAMILIES:
        from tasks.demo.videos import DEMO_VIDEO, SIDE, demo_prompts

        # 32 umT5 positions (Wan attends to the zeros that pad them); 2,000 steps from first frames
        # (the way each word moves a given first frame), then 4,000 with 2 clips in 10 from their
        # first frame and 8 from text (the colours); the weights' average over about the last 500
        # steps (the quickstart's 200) sharpens the colours: benchmarks/results/demo-worlds.md has the trials
        prompts = demo_prompts()
        # folders of their own: an earlier demo's Wan 2.1 T2V models and edge-to-edge clips stay apart
        return [f"model.path=precast-demo/models/{DEMO_MODELS[family]}", "dataset.sources=[{path: precast-demo/moving-shapes}]",
                f"dataset.video={json.dumps(DEMO_VIDEO)}", f"latent_encoding.resolution={SIDE}",
                f"training.samples.fps={DEMO_VIDEO['fps']}",  # the videos move at the clips' speed
                # 8 clips a VAE call: one at a time, PyTorch runs the tiny 3-D VAE's convolutions on its
                # slow path, not oneDNN's (31 s for the 600 clips against 14 s, the same bits)
                "latent_encoding.batch_size=8", "text_encoding.max_length=32", "training.steps=6000",
                "training.image_to_video_warmup=2000", "training.image_to_video=0.2",
                "training.optimizer.ema_decay=0.998",
                f"training.samples.prompts={json.dumps(prompts)}",
                f"training.samples.first_frames={json.dumps([f'{FIRST_FRAMES}/{i}.png' for i in range(len(prompts))])}"]
    training = [f"{key}={value}" for key, value in DEMO_TRAINING.get(family, {}).items()]
    if family in EDIT_FAMILIES:  # pairs, and samples drawn from held-out references
        from tasks.demo.data import held_out_edits

        edits = held_out_edits()
        training += [f"dataset.sources=[{edit_source(EDIT_PAIRS)}]",
                     f"training.samples.prompts={json.dumps([edit['prompt'] for edit in edits])}",
                     f"training.samples.references={json.dumps([f'{EDIT_REFERENCES}/{i}.png' for i in range(len(edits))])}"]
    return [f"model.path=precast-demo/models/{family}", "latent_encoding.resolution=128", "text_encoding.max_length=32",
            *training]


def edit_source(pairs: str | Path) -> str:
    """The dataset source (YAML) of edit pairs written by `data.write_edit_data` into `pairs`."""
    return f"{{path: {pairs}/targets, references: files, reference_path: {pairs}/references}}"


def write_demo_dataset(folder: str | Path, family: str = "pixart", count: int | None = None, seed: int = 0) -> Path:
    """The demo's data for `family`: `count` captioned pictures (`data`; None: the demo's 1,000),
    for a video family captioned videos with the hostile files among them (`videos`; None: 600), for
    an edit family `count` edit pairs (None: 600) in targets/ and references/."""
    if family in EDIT_FAMILIES:
        from tasks.demo.data import write_edit_data

        return write_edit_data(folder, count=600 if count is None else count, seed=seed)
    if family in VIDEO_FAMILIES:
        from tasks.demo.videos import write_demo_videos

        return write_demo_videos(folder, count=600 if count is None else count, seed=seed)
    from tasks.demo.data import write_demo_data

    return write_demo_data(folder, count=1000 if count is None else count, seed=seed)


def write_demo_inputs(config, family: str, count: int | None = None) -> None:
    """What `family`'s demo run of `config` (`demo_settings`) reads and does not find: its tiny
    models (DEMO_MODELS), its data (`count` as `write_demo_dataset`'s) and its sample first frames."""
    write_demo_models(config.model.path, DEMO_MODELS.get(family, family))
    for source in config.dataset.sources:
        if not Path(source.path).exists():  # an edit demo's source is its pairs' targets/
            write_demo_dataset(Path(source.path).parent if family in EDIT_FAMILIES else source.path, family, count)
    firsts = [path for path in config.training.samples.first_frames if path.startswith(FIRST_FRAMES)]
    if firsts:  # the demo's own, not pictures a user named
        from tasks.demo.videos import write_first_frames

        write_first_frames(firsts)
    references = [path for path in config.training.samples.references if path.startswith(EDIT_REFERENCES)]
    if references:
        from tasks.demo.data import write_edit_references

        write_edit_references(references)


def write_demo_models(folder: str | Path, family: str = "pixart", **options) -> Path:
    """The tiny model folder of `family` (one of TINY_FAMILIES): PixArt-Σ's (`models`) or a
    flow-matching family's (`flow_models`), with the writer's options (seed, random_vae, perturb)."""
    if family == "pixart":
        from tasks.demo.models import write_tiny_models

        return write_tiny_models(folder, **options)
    from tasks.demo.flow_models import write_tiny_family

    return write_tiny_family(folder, family, **options)
