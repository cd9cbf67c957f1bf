"""Sample images through the model family's own diffusers pipeline.

During training the pipeline gets no tokenizer and no text encoder: prompts come from the text
cache, and the VAE is loaded only here, for decoding. `sample_run` is the user-facing path (`precast
sample`): the full pipeline with the trained weights.
"""

from __future__ import annotations

import io
import tempfile
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import torch
from PIL import Image, ImageOps
from safetensors.torch import load

from configs.schema import ModelConfig, TextEncodingConfig
from storage.shards import collate
from tasks.encode.models import load_vae
from tasks.loading import resolve_device
from tasks.families import Family, family_of, model_index, model_json
from tasks.ingest.video import clip_bytes
from tasks.runs.export import save_diffusers_lora
from tasks.runs.folder import FinishedRun


def side_by_side(images: list[Image.Image]) -> Image.Image:
    grid = Image.new("RGB", (sum(i.width for i in images), max(i.height for i in images)))
    x = 0
    for image in images:
        grid.paste(image, (x, 0))
        x += image.width
    return grid


class Samples(list):
    """Samples drawn by a family's pipeline: a list of PIL frames per prompt (a picture is one)."""

    fps = 16.0  # frames a second their videos are shown at: `sample_run` gives the run's sample_fps

    @property
    def frames(self) -> int:
        return len(self[0])

    def grid(self) -> Image.Image:
        """Each sample's first frame, side by side."""
        return side_by_side([video[0] for video in self])

    def sheets(self) -> list[Image.Image]:
        """Each frame of the samples side by side."""
        return [side_by_side(list(frames)) for frames in zip(*self)]

    def animation(self, fps: float) -> bytes:
        """The samples side by side as an animated WebP, each frame shown 1/fps s."""
        return clip_bytes(self.sheets(), fps, quality=90)

    def mp4(self, fps: float) -> bytes:
        """The samples side by side as an H.264 mp4 (yuv420p, which players take: its sides made even
        with a black edge) at `fps` frames a second."""
        import av

        frames = self.sheets()
        width, height = (side + side % 2 for side in frames[0].size)
        out = io.BytesIO()
        with av.open(out, "w", format="mp4") as container:
            stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001), options={"crf": "18"})
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            for frame in frames:
                canvas = Image.new("RGB", (width, height))
                canvas.paste(frame)
                container.mux(stream.encode(av.VideoFrame.from_image(canvas)))
            container.mux(stream.encode())
        return out.getvalue()

    def save(self, path: str | Path, fps: float) -> None:
        """The videos side by side as an .mp4 or an animated .webp at `fps`, or else (a .png, .jpg…)
        their first frames (`check_output` tells a name that is none of these)."""
        suffix = Path(path).suffix.lower()
        if suffix == ".mp4":
            Path(path).write_bytes(self.mp4(fps))
        elif suffix == ".webp" and self.frames > 1:
            Path(path).write_bytes(self.animation(fps))
        else:
            self.grid().save(path)


def check_output(path: str | Path) -> None:
    """Refuses, before any sample is drawn, a file name `Samples.save` cannot write."""
    suffix = Path(path).suffix.lower()
    pictures = {ext for ext, kind in Image.registered_extensions().items() if kind in Image.SAVE}
    if suffix != ".mp4" and suffix not in pictures:
        raise ValueError(f"--out {path}: write an .mp4 or .webp (videos), or a picture (.png, .jpg…: first frames); "
                         f"{suffix or 'no extension'} is neither")


def read_picture(path: str, options: dict) -> Image.Image:
    """The picture at `path` (a local path, or a URL read with the storage `options`), in RGB; an
    unreadable one is refused naming it."""
    return read_picture_bytes(path, options)[0]


def read_picture_bytes(path: str, options: dict) -> tuple[Image.Image, bytes]:
    """`read_picture`, with the bytes it was read from."""
    import fsspec

    try:
        with fsspec.open(path, "rb", **(options if "://" in path else {})) as file:
            data = file.read()
        return Image.open(io.BytesIO(data)).convert("RGB"), data
    except Exception as error:  # missing, unreachable, not a picture, a decompression bomb: each names the file
        raise ValueError(f"picture {path}: not a readable picture ({type(error).__name__}: {error})") from error


def draw(family: Family, pipeline, call: Callable[[slice], dict], count: int, pictures: list[Image.Image] | None,
         size: tuple[int, int] | None, resolution: int | None = None) -> Samples:
    """`count` samples by `pipeline`, `call(rows)` giving its arguments for those rows of the
    prompts: in one call, or with `pictures` (one a prompt, `check_pictures`: a video family's first
    frames, an edit family's references) by the family's pipeline that draws from a picture, a call
    a picture (it conditions a whole batch on one), given as the family takes it at the samples'
    `size` (width, height; None: the pipeline's own), references sized for `resolution`. The pipelines
    draw without their progress bars (precast reports progress)."""
    if pictures is None:
        pipeline.set_progress_bar_config(disable=True)
        return Samples(family.sampler.videos(pipeline(**call(slice(None)))))
    pipeline, videos = family.sampler.picture_pipeline(pipeline), []
    pipeline.set_progress_bar_config(disable=True)
    for row, picture in enumerate(pictures):
        options = family.picture_options(picture.convert("RGB"), size, resolution)
        videos += family.sampler.videos(pipeline(**call(slice(row, row + 1)), **options))
    return Samples(videos)


def check_pictures(family: Family, pictures: list[Image.Image] | None, count: int, setting: str) -> None:
    """Before anything loads: the pictures `setting` gives only for a family that draws from them,
    one a prompt."""
    if pictures is None:
        return
    family.sampler.picture_pipeline_class(setting)
    if len(pictures) != count:
        raise ValueError(f"{setting}: {len(pictures)} pictures for {count} prompts; give one a prompt")


def check_steps(model: ModelConfig, family: Family, steps: int, setting: str) -> None:
    """Before anything loads: one step where the model's scheduler stretches its sigmas so the
    last is its `shift_terminal` (Qwen-Image's), which divides by zero in its `set_timesteps`:
    the pipeline would draw NaN."""
    if steps > 1:
        return
    try:
        terminal = model_json(model.path, model.revision, "scheduler/scheduler_config.json",
                              "the scheduler's settings").get("shift_terminal")
    except (OSError, ValueError):  # left to the pipeline's loading, which names what is missing
        return
    if terminal:
        raise ValueError(f"{setting}: 1 step with {family.name}'s scheduler (its shift_terminal) gives NaN "
                         "timesteps and blank samples in its pipeline; use 2 or more")


def check_components(model: ModelConfig) -> None:
    """Before the pipeline loads: refuse, naming it and what it needs, a component whose transformers
    class cannot be imported here (a processor that needs torchvision, which precast does not
    install), which `from_pretrained` would fail on without saying why."""
    import transformers
    from transformers.utils import is_torchvision_available

    for name, entry in model_index(model.path, model.revision).items():
        if isinstance(entry, list) and entry[:1] == ["transformers"] and entry[1:]:
            component = getattr(transformers, entry[1], None)
            needs = getattr(component, "_backends", None)
            # a processor with a video processor (Qwen2VLProcessor, which edit pipelines carry)
            # loads it whether or not it is used, and transformers builds one only beside torchvision
            if not needs and "video_processor" in getattr(component, "get_attributes", list)() \
                    and not is_torchvision_available():
                needs = ["torchvision"]
            if needs:
                raise ImportError(f"model.path {model.path}: its {name} is a {entry[1]}, which needs "
                                  f"{', '.join(needs)} (not installed): install it to sample from text; a run's "
                                  f"sample grids, drawn during training from the cached prompts, load no {name}")


def casting(vae):
    """The VAE (loaded once a process, and shared) taking its inputs in its own dtype: latents leave a
    half-precision transformer in its dtype, and a reference's pixels reach the VAE in it (an edit
    pipeline casts them to the prompts'); a reference's latents come back in the pixels' dtype, which
    the pipeline joins to the noise."""
    if getattr(vae, "casting", False):
        return vae
    decode, encode = vae.decode, vae.encode

    def encoded(pixels: torch.Tensor, *args, **kwargs):
        output = encode(pixels.to(vae.dtype), *args, **kwargs)
        posterior = output.latent_dist
        posterior.mean, posterior.std = posterior.mean.to(pixels.dtype), posterior.std.to(pixels.dtype)
        return output

    vae.decode = lambda latents, *args, **kwargs: decode(latents.to(vae.dtype), *args, **kwargs)
    vae.encode, vae.casting = encoded, True
    return vae


def sample_grid(
    model: ModelConfig,
    family: Family,
    transformer,
    prompt_features: list[dict[str, torch.Tensor]],
    negative_features: list[dict[str, torch.Tensor]],
    steps: int,
    guidance_scale: float,
    true_cfg_scale: float,
    seed: int,
    resolution: int,
    frames: int = 1,
    pictures: list[Image.Image] | None = None,
    setting: str = "training.samples.first_frames",
    reference_resolution: int | None = None,
) -> Samples:
    """One sample per prompt of the family's sample size at `resolution` and `frames` frames, by the family's
    pipeline from pre-encoded prompts, each guided from its negative (the empty caption's, seen with
    its picture by an encoder that sees pictures); with `pictures` (one a
    prompt, as `setting` gives them: first frames or references) by its pipeline that draws from a
    picture, a call a picture, as `sample_run` draws them; references sized for `reference_resolution`
    (None: `resolution`), as training sized them."""
    device = next(transformer.parameters()).device
    check_pictures(family, pictures, len(prompt_features), setting)
    height, width = family.codec.sample_size(resolution)
    vae = casting(load_vae(model, family, "fp32", str(device)))
    pipeline = family.embedding_pipeline(model, vae, transformer)
    dtype = next(transformer.parameters()).dtype  # the features in the transformer's, masks as they are

    def call(rows: slice) -> dict:
        features = prompt_features[rows]
        # positive and negative embeddings must share one length for classifier-free guidance
        text = collate(features + negative_features[rows])
        text = {name: value.to(device, dtype if value.is_floating_point() else value.dtype) for name, value in text.items()}
        return {**family.sampler.embedding_kwargs(text, len(features)), **family.sampler.size_options(height, width),
                "num_inference_steps": steps, **family.sampler.guidance(guidance_scale, true_cfg_scale),
                **family.sampler.frame_options(frames), "generator": torch.Generator(device="cpu").manual_seed(seed)}

    return draw(family, pipeline, call, len(prompt_features), pictures, (width, height),
                reference_resolution or resolution)


def sample_run(
    url: str, prompts: list[str], model_path: str | None = None, options: dict | None = None,
    steps: int = 20, guidance_scale: float = 4.5, seed: int = 0, device: str = "auto", true_cfg_scale: float = 1.0,
    frames: int | None = None, pictures: list[Image.Image] | None = None, setting: str | None = None,
) -> Samples:
    """Samples for `prompts` from a finished run (`<root>/runs/<id>`, or its `adapter`/`transformer`
    URL) through its family's pipeline `from_pretrained` with the trained weights: a LoRA adapter
    loaded by the pipeline's `load_lora_weights` (merged by PEFT where the pipeline has no LoRA
    loader), or the fully trained transformer. The model is the run's (`model_path`: its copy at
    another path or hub id, the run's other model settings but its revision kept, as a Wan 2.2 expert);
    `frames` (None: those of the clips it trained on, 1 for pictures) a sample. With `pictures` (one a
    prompt, as `setting` gives them: first frames, or an edit family's references), each sample is
    drawn from its picture by the family's pipeline that takes it, one at a time (the pipeline
    conditions a whole batch on one picture), each from `seed`."""
    run = FinishedRun.at(url, options)
    # another path is another repository: the run's revision is not its
    model = ModelConfig.model_validate({**run.record["model"], **({"path": model_path, "revision": None}
                                                                   if model_path else {})})
    family = family_of(model)
    # (what gave the pictures, named in refusals: an edit family's are references)
    setting = setting or ("--reference" if family.sampler.reference_option else "--first-frame")
    check_pictures(family, pictures, len(prompts), setting)
    check_steps(model, family, steps, "--steps")
    check_components(model)
    with tempfile.TemporaryDirectory() as local:
        slot = family.denoiser.folder(model)  # the pipeline's component the run trained
        config, data = run.adapter() if run.weights == "adapter" else ({}, b"")
        lora = run.weights == "adapter" and config.get("peft_type", "LORA") == "LORA"
        if lora and hasattr(family.sampler.pipeline_class(), "load_lora_weights"):
            # a LoRA as the family's users load it: the pipeline's own LoRA loader (into a second
            # transformer as diffusers' loaders put it there: load_into_transformer_2); a LoHa or
            # LoKr, which it does not read, merged by PEFT below
            pipeline = family.sampler.pipeline_class().from_pretrained(model.path, revision=model.revision)
            pipeline.load_lora_weights(str(save_diffusers_lora(family, load(data), config, local)),
                                       **({"load_into_transformer_2": True} if slot == "transformer_2" else {}))
        else:
            trained = run.trained_transformer(model, family, local)
            pipeline = family.sampler.pipeline_class().from_pretrained(model.path, revision=model.revision,
                                                                       **{slot: trained})
    pipeline.to(resolve_device(device))
    # the prompts read as the run's text cache read its captions
    text = run.lineage.get("text") or {"caption_preprocessing": TextEncodingConfig().caption_preprocessing,
                                       "max_length": family.text.default_max_length(model)}
    # the size it sampled at in training (runs from before the resolution was recorded: the pipeline's default)
    sides = dict(zip(("height", "width"), family.codec.sample_size(run.lineage["resolution"]))) \
        if "resolution" in run.lineage else {}
    frames = frames or run.lineage.get("frames", 1)

    def call(rows: slice) -> dict:
        return {"num_inference_steps": steps, **family.sampler.guidance(guidance_scale, true_cfg_scale),
                "generator": torch.Generator(device="cpu").manual_seed(seed), **family.sampler.frame_options(frames),
                **(family.sampler.size_options(**sides) if sides else {}),
                **family.sampler.prompt_options(pipeline, prompts[rows], text)}

    size = (sides["width"], sides["height"]) if sides else None
    samples = draw(family, pipeline, call, len(prompts), pictures, size,
                   run.lineage.get("reference_resolution") or run.lineage.get("resolution"))
    samples.fps = run.lineage["training"].get("samples", {}).get("fps", Samples.fps)  # runs from before it: Wan's 16
    return samples
