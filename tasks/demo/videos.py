"""The demo's video world: clips of one shape moving over a coloured background, captions that name
the background, the shape and which way it moves, written as real video files (PyAV, H.264 in mp4)
beside a hostile few that ingest must quarantine, each for its reason (`HOSTILE`).

Each video shows the shape moving TRAVEL pixels in CLIP_SECONDS, from anywhere its path stays in
the frame, at a rate of its own (8 to 16 fps): the demo's clips resample it to DEMO_VIDEO's rate
and frame count, so a clip holds the whole move, and what a model learns of "moving left" shows
between a sample's first and last frames (`motion`). Where a shape starts does not say where it
goes: from a first frame with the shape in the middle (`first_frame`) every way is open, so a
sample drawn from it moves the way its prompt names only if the words were learned.
`write_video` and `write_audio_only` also write the tests' videos.
"""

from __future__ import annotations

import random
from fractions import Fraction
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image, ImageDraw

from tasks.demo.data import COLORS

DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up"}
SHAPES = ("circle", "square", "triangle")
VIDEO_WORDS = ["moving", "moves", "up", "down", "across", "video"]  # the captions' words the picture demo's lack
SIDE = 64  # pixels a frame's side: 8 x 8 latents
MIN_CONTRAST = 150  # RGB distance of a shape's colour from its background's, so that 8 x 8 blocks show it
CLIP_SECONDS = 1.0  # the time a shape takes to move
TRAVEL = 20  # pixels a shape moves: 2.5 latents of the 8 x 8 a frame, more than its own half side
SIZES = (16, 20)  # the shapes' sides, in pixels: small to 18, large above
# the demo's clip policy (dataset.video): 5 frames (Wan's 4N + 1: 2 latent frames) at 4 fps, from
# the start of each video, so a clip's frames are the shape at 0, 1/4 … 4/4 of its way
DEMO_VIDEO = {"frames": 5, "fps": 4, "clips": "head", "max_seconds": 10}
# files ingest must refuse, with the reason it must give: the demo writes them among its videos
HOSTILE = {"truncated.mp4": "bad_video", "audio.mp4": "no_video_stream", "still.mp4": "too_few_frames",
           "uncaptioned.mp4": "missing_caption", "lost.txt": "orphan_caption"}


def _distance(a: str, b: str) -> float:
    return float(np.linalg.norm(np.subtract(COLORS[a], COLORS[b])))


def shape_box(direction: str, progress: float, start: tuple[int, int], size: int) -> tuple[int, int, int, int]:
    """Where a shape of side `size` whose top left corner starts at `start` is, `progress` (0 to
    1) of its TRAVEL in `direction`."""
    dx, dy = DIRECTIONS[direction]
    left, top = round(start[0] + dx * TRAVEL * progress), round(start[1] + dy * TRAVEL * progress)
    return left, top, left + size, top + size


def draw_frame(background: str, colour: str, shape: str, box: tuple[int, int, int, int], side: int = SIDE) -> np.ndarray:
    image = Image.new("RGB", (side, side), COLORS[background])
    draw = ImageDraw.Draw(image)
    if shape == "circle":
        draw.ellipse(box, fill=COLORS[colour])
    elif shape == "square":
        draw.rectangle(box, fill=COLORS[colour])
    else:
        x0, y0, x1, y1 = box
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=COLORS[colour])
    return np.asarray(image)


def draw_clip(rng: random.Random, fps: int, side: int = SIDE) -> tuple[list[np.ndarray], dict[str, str]]:
    """A shape moving TRAVEL pixels over a background at `fps`, from anywhere its path stays in the
    frame, in CLIP_SECONDS, where it then stays for a last 1/4 s (so a 4 fps clip of 5 frames
    fits): the frames, and what they show (background, colour, shape, direction, size)."""
    background = rng.choice(list(COLORS))
    colour = rng.choice([name for name in COLORS if _distance(name, background) > MIN_CONTRAST])
    shape, direction = rng.choice(SHAPES), rng.choice(list(DIRECTIONS))
    size = rng.randint(*SIZES)
    start = tuple(rng.randint(TRAVEL if step < 0 else 0, side - size - (TRAVEL if step > 0 else 0))
                  for step in DIRECTIONS[direction])
    moving = CLIP_SECONDS * fps
    pixels = [draw_frame(background, colour, shape, shape_box(direction, min(i / moving, 1.0), start, size), side)
              for i in range(round((CLIP_SECONDS + 0.25) * fps))]
    return pixels, {"background": background, "colour": colour, "shape": shape, "direction": direction,
                    "size": "large" if size > sum(SIZES) // 2 else "small"}


def caption(rng: random.Random, seen: dict[str, str]) -> str:
    """Words for what a clip shows; never the demo's sample prompts' phrasing ("a red circle
    moving left on a blue background"), so that samples show what was learned, not recalled."""
    background, colour, shape, direction, size = (seen[k] for k in ("background", "colour", "shape", "direction", "size"))
    return rng.choice([
        f"a {size} {colour} {shape} moves {direction} over a {background} background",
        f"a {background} background, a {colour} {shape} moving {direction}",
        f"video of a {colour} {shape} moving {direction} across a {background} background",
        f"a {colour} {shape} moves {direction}. the background is {background}",
    ])


def held_out() -> list[dict[str, str]]:
    """Prompts in a phrasing no caption uses, one a background colour, the directions in turn, a
    shape of the first colour after the background's that stands out on it: each prompt with the
    background, the shape's colour and the direction it names."""
    names, directions = list(COLORS), list(DIRECTIONS)
    out = []
    for i, background in enumerate(names):
        colour = next(name for name in names[i + 1:] + names if _distance(name, background) > MIN_CONTRAST)
        direction = directions[i % len(directions)]
        article = "an" if background[0] in "aeiou" else "a"
        shape = SHAPES[i % len(SHAPES)]
        out.append({"prompt": f"a {colour} {shape} moving {direction} on {article} {background} background",
                    "background": background, "colour": colour, "shape": shape, "direction": direction})
    return out


def first_frame(named: dict[str, str], side: int = SIDE) -> Image.Image:
    """The picture a held-out prompt's clip starts from (`held_out`'s `named`): its shape in its
    colour on its background, in the middle, where it has room to move TRAVEL pixels every way."""
    size = sum(SIZES) // 2
    corner = (side - size) // 2
    box = (corner, corner, corner + size, corner + size)
    return Image.fromarray(draw_frame(named["background"], named["colour"], named["shape"], box, side))


def write_first_frames(paths: list[str | Path]) -> list[Path]:
    """The demo's sample prompts' first frames (`demo_prompts`, in order) as PNG files at `paths`,
    those not there yet."""
    written = []
    for path, named in zip(map(Path, paths), held_out()):
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            first_frame(named).save(path)
        written.append(path)
    return written


def demo_prompts() -> list[str]:
    """What the demo samples: four held-out prompts, one for each direction."""
    return [named["prompt"] for named in held_out()[:4]]


def write_video(path: Path, draw: Callable[[int, int, int], np.ndarray], frames: int = 40, fps: int = 24,
                size: tuple[int, int] = (96, 64), codec: str = "libx264", rotation: int = 0,
                times: list[float] | None = None, container: str | None = None, keyframe_every: int | None = None,
                quality: int | None = None, pixel_aspect: Fraction | None = None, timescale: int | None = None) -> Path:
    """`frames` frames `draw(index, width, height)` (RGB arrays) at `fps` (or shown at `times`,
    seconds: a variable frame rate) of `size` (width, height), the display matrix turned by
    `rotation` degrees counter-clockwise, a keyframe every `keyframe_every` frames (None: the
    codec's default), H.264 at constant quality `quality` (crf) where given, its pixels
    `pixel_aspect` times as wide as high where given (anamorphic), an mp4's times in `timescale`
    ticks a second where given: the same frames, the same H.264 bytes."""
    import av

    options = {"crf": str(quality)} if quality is not None else {}
    if codec == "libx264":  # its AVX-512 code encoded 2 to 4 of 20 clips to other bytes now and then (measured)
        options["x264-params"] = "asm=0"
    muxer = {"video_track_timescale": str(timescale)} if timescale else None
    with av.open(str(path), "w", format=container, options=muxer) as output:
        stream = output.add_stream(codec, rate=fps, options=options or None)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        if keyframe_every:
            stream.codec_context.gop_size = keyframe_every
        if codec == "mpeg4":  # its default 200 kb/s blurs one grey step into the next
            stream.codec_context.bit_rate = 4_000_000
        if times is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        if rotation:
            stream.set_display_rotation(rotation)
        if pixel_aspect:
            stream.codec_context.sample_aspect_ratio = pixel_aspect
        for index in range(frames if times is None else len(times)):
            frame = av.VideoFrame.from_ndarray(draw(index, *size), format="rgb24")
            if times is not None:
                frame.pts, frame.time_base = round(times[index] * 1000), Fraction(1, 1000)
            for packet in stream.encode(frame):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
    return path


def write_audio_only(path: Path) -> Path:
    """A container with one audio stream and no video."""
    import av

    with av.open(str(path), "w", format="mp4") as output:
        stream = output.add_stream("aac", rate=16000)
        for index in range(10):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = 16000, index * 1024
            for packet in stream.encode(frame):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
    return path


def write_demo_videos(folder: str | Path, count: int = 600, seed: int = 0, hostile: bool = True) -> Path:
    """`count` videos (mp4, `SIDE` px square, 8 to 16 fps) with sibling `.txt` captions in
    `folder`, and the `HOSTILE` files among them. The same `count` and `seed` give the same bytes
    (`write_video`: x264's C code, which no CPU feature switches to other code)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for index in range(count):
        fps = rng.choice((8, 12, 16))
        pixels, seen = draw_clip(rng, fps)
        write_video(folder / f"{index:05d}.mp4", lambda i, *_: pixels[i], frames=len(pixels), fps=fps,
                    size=(SIDE, SIDE), quality=12)
        (folder / f"{index:05d}.txt").write_text(caption(rng, seen) + "\n", encoding="utf-8")
    if hostile:
        _write_hostile(folder, rng)
    return folder


def _write_hostile(folder: Path, rng: random.Random) -> None:
    pixels, seen = draw_clip(rng, 8)
    write_video(folder / "uncaptioned.mp4", lambda i, *_: pixels[i], frames=len(pixels), fps=8, size=(SIDE, SIDE))
    data = (folder / "uncaptioned.mp4").read_bytes()
    (folder / "truncated.mp4").write_bytes(data[: len(data) // 2])
    write_audio_only(folder / "audio.mp4")
    write_video(folder / "still.mp4", lambda i, *_: pixels[0], frames=1, fps=8, size=(SIDE, SIDE))
    for name in HOSTILE:
        if name != "uncaptioned.mp4":  # lost.txt: a caption whose video is not there
            (folder / name).with_suffix(".txt").write_text(caption(rng, seen) + "\n", encoding="utf-8")


def motion(frames: list[np.ndarray], colour: str | None = None) -> str | None:
    """Which way the pixels of `colour` (None: what is not background) move from the first frame
    to the last, or None where none moves: the centroid, in each end frame, of the pixels whose
    nearest palette colour is `colour` (or is not the background's, the palette colour most of the
    first frame's pixels are nearest)."""
    palette = np.array(list(COLORS.values()), dtype=np.float64)
    nearest = [((np.asarray(frame, dtype=np.float64)[:, :, None] - palette) ** 2).sum(-1).argmin(-1)
               for frame in (frames[0], frames[-1])]
    background = np.bincount(nearest[0].ravel(), minlength=len(palette)).argmax()
    ends = []
    for labels in nearest:
        rows, columns = np.nonzero(labels != background if colour is None else labels == list(COLORS).index(colour))
        if not len(rows):
            return None
        ends.append(np.array([columns.mean(), rows.mean()]))
    dx, dy = ends[1] - ends[0]
    if max(abs(dx), abs(dy)) < 2:
        return None
    return ("right" if dx > 0 else "left") if abs(dx) > abs(dy) else ("down" if dy > 0 else "up")
