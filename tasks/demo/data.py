"""A deterministic generated dataset: images of varied sizes and aspect ratios with captions.

Each image is a coloured background with a few shapes; its caption names what can be seen (the
background colour, each shape's colour, kind, size and place), from a few words to a long
paragraph, so token lengths spread like a real caption set. The same `count` and `seed` always
give the same bytes.
"""

from __future__ import annotations

import random
from pathlib import Path

from PIL import Image, ImageChops, ImageDraw

COLORS = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 210), "yellow": (235, 210, 40),
    "orange": (240, 140, 30), "purple": (140, 50, 170), "white": (245, 245, 245), "black": (15, 15, 15),
    "gray": (128, 128, 128), "pink": (240, 150, 190), "cyan": (40, 200, 210), "brown": (120, 75, 40),
}
SHAPES = ["circle", "square", "triangle", "ring", "stripe"]
# (width, height) pairs spanning the PixArt aspect-ratio tables, portrait to panorama
SIZES = [(256, 256), (320, 240), (240, 320), (384, 216), (216, 384), (300, 300), (400, 200), (200, 400),
         (352, 288), (288, 352), (512, 256), (256, 512), (330, 250)]
STYLES = ["minimal geometric illustration", "soft studio lighting", "flat colour drawing", "abstract render"]


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], fill) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "triangle":
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=fill)
    elif shape == "ring":
        draw.ellipse(box, outline=fill, width=max(2, (x1 - x0) // 8))
    else:
        draw.rectangle((x0, (y0 + y1) // 2 - 6, x1, (y0 + y1) // 2 + 6), fill=fill)


def _position(box: tuple[int, int, int, int], width: int, height: int) -> str:
    """Where a shape sits, in words: "top left", "bottom", "center"…"""
    x, y = (box[0] + box[2]) / 2 / width, (box[1] + box[3]) / 2 / height
    vertical = "top" if y < 1 / 3 else "bottom" if y > 2 / 3 else ""
    horizontal = "left" if x < 1 / 3 else "right" if x > 2 / 3 else ""
    return " ".join(word for word in (vertical, horizontal) if word) or "center"


def _caption(rng: random.Random, background: str, objects: list[tuple[str, str, str, str]]) -> str:
    """Names what can be seen: the background colour, and each shape's colour, kind, size and place."""
    color, shape, _, position = objects[0]
    first = f"a {color} {shape} at the {position} on a {background} background"
    length = rng.choice(["short", "short", "medium", "medium", "medium", "long"])
    if length == "short":
        return first
    parts = [first] + [f"a {size} {color} {shape} at the {position}" for color, shape, size, position in objects[1:]]
    text = ", ".join(parts) + f", {rng.choice(STYLES)}"
    if length == "long":
        extra = [f"the {color} {shape} is {size} and sits at the {position}" for color, shape, size, position in objects]
        text += ". " + ". ".join(extra) + ". " + "The composition is simple and geometric, with " + \
            f"{len(objects)} shapes over a {background} background, rendered in a {rng.choice(STYLES)}."
    return text


def draw_scene(rng: random.Random, width: int, height: int) -> tuple[Image.Image, str, list[tuple[str, str, str, str]]]:
    """A background colour with one to four shapes of other colours: the image, the background's
    name and each shape's (colour, kind, size, position)."""
    names = list(COLORS)
    background = rng.choice(names)
    image = Image.new("RGB", (width, height), COLORS[background])
    draw = ImageDraw.Draw(image)
    objects = []
    for _ in range(rng.randint(1, 4)):
        color = rng.choice([n for n in names if n != background])
        shape = rng.choice(SHAPES)
        side = rng.randint(min(width, height) // 6, min(width, height) // 2)
        x0, y0 = rng.randint(0, width - side), rng.randint(0, height - side)
        box = (x0, y0, x0 + side, y0 + side)
        _draw_shape(draw, shape, box, COLORS[color])
        objects.append((color, shape, "large" if side > min(width, height) // 3 else "small",
                        _position(box, width, height)))
    return image, background, objects


def write_demo_data(folder: str | Path, count: int = 48, seed: int = 0) -> Path:
    """Write `count` images (PNG and JPEG) with sibling `.txt` captions into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for index in range(count):
        width, height = SIZES[index % len(SIZES)]
        image, background, objects = draw_scene(rng, width, height)
        stem = folder / f"{index:05d}"
        if index % 3 == 2:
            image.save(stem.with_suffix(".jpg"), quality=92)
        else:
            image.save(stem.with_suffix(".png"))
        stem.with_suffix(".txt").write_text(_caption(rng, background, objects) + "\n", encoding="utf-8")
    return folder


def write_edit_data(folder: str | Path, count: int = 16, seed: int = 0) -> Path:
    """Write `count` edit pairs into `folder`: each reference (`references/<n>.png`) a demo scene,
    its target (`targets/<n>.png`) the same shapes on another background, captioned with the edit
    ("make the background red"). Every second target is another edit of the reference before it,
    so references are shared as edit datasets share them. Returns the folder."""
    folder = Path(folder)
    for part in ("targets", "references"):
        (folder / part).mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    reference, background = None, None
    for index in range(count):
        if index % 2 == 0:
            width, height = SIZES[index // 2 % len(SIZES)]
            reference, background, objects = draw_scene(rng, width, height)
            taken = {background, *(color for color, *_ in objects)}
        new = rng.choice([name for name in COLORS if name not in taken])
        taken.add(new)  # the second edit of a reference names another colour
        target = edited(reference, background, new)
        reference.save(folder / "references" / f"{index:05d}.png")
        target.save(folder / "targets" / f"{index:05d}.png")
        (folder / "targets" / f"{index:05d}.txt").write_text(f"make the background {new}\n", encoding="utf-8")
    return folder


def edited(reference: Image.Image, background: str, colour: str) -> Image.Image:
    """`reference` with its background (every pixel of the colour named `background`) in the colour
    named `colour`, its shapes kept where they are: an edit's target."""
    target = Image.new("RGB", reference.size, COLORS[colour])
    target.paste(reference, mask=_not_background(reference, COLORS[background]))
    return target


def _not_background(image: Image.Image, color: tuple[int, int, int]) -> Image.Image:
    """A mask of the pixels of `image` that are not of `color` (255 where a shape is)."""
    red, green, blue = (channel.point(lambda v, c=c: 255 * (v != c)) for channel, c in zip(image.split(), color))
    return ImageChops.lighter(ImageChops.lighter(red, green), blue)


def held_out_edits(count: int = 12, seed: int = 1234) -> list[dict]:
    """The edit demo's held-out edits: square scenes no training pair has (their own seed), each with
    an edit naming a colour neither its background nor its shapes have: `reference` (the picture),
    `background` (its colour's name), `colour` (the one named) and `prompt` ("make the background …")."""
    rng = random.Random(seed)
    edits = []
    for _ in range(count):
        reference, background, objects = draw_scene(rng, 256, 256)
        colour = rng.choice([name for name in COLORS if name not in {background, *(c for c, *_ in objects)}])
        edits.append({"reference": reference, "background": background, "colour": colour,
                      "prompt": f"make the background {colour}"})
    return edits


def write_edit_references(paths: list[str | Path]) -> list[Path]:
    """The held-out edits' references (`held_out_edits`, one a path, in order) as PNG files."""
    written = []
    for path, edit in zip(paths, held_out_edits(len(paths))):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        edit["reference"].save(path)
        written.append(Path(path))
    return written
