"""The rules for untrusted input: what an image, a caption, a file or an archive member may be
before it becomes part of a sample, and the reason code (`Rejected`) when it may not.

No read is unbounded: an image is read to at most `max_image_bytes` + 1 bytes (enough to call it
`too_large`), a caption file to MAX_CAPTION_BYTES + 1 (`caption_too_long`), and a local FIFO or
device is never opened (`special_file`).

Images: only the formats the README lists are parsed (Pillow would otherwise try every plugin it
has, TGA among them, which has no magic number: noise behind a plausible header decodes), a file
larger than any `max_pixels` image can honestly be is refused undecoded, and dimensions are checked
before pixels are decoded.

Captions lose terminal escape sequences and invisible bidi/zero-width characters, other control
characters become spaces, whitespace is collapsed, and what is left empty is `empty_caption`. A
variant longer than MAX_CAPTION_CHARS quarantines the sample (`caption_too_long`) rather than being
cut: T5 reads only the first few hundred tokens anyway, so a caption that long is a broken file (a
mis-parsed CSV, a binary dump), not a description worth keeping part of.

In a tar, links, devices and members named outside it are `unsafe_member`, archives inside it
`nested_archive` (never opened). Names and messages are stored with control characters escaped
(`printable`).
"""

from __future__ import annotations

import errno
import io
import json
import os
import posixpath
import re
import tarfile
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem
from PIL import Image, ImageChops, ImageOps, PngImagePlugin, UnidentifiedImageError

from configs.schema import DatasetConfig
from storage.store import space_for

MAX_ASPECT_RATIO = 4.0  # the families' bucket tables span 1:4 … 4:1
KEEP_AS_IS = ("JPEG", "PNG", "WEBP")  # RGB files in these formats are stored byte for byte
CLIP_FRAMES = "precast.clip_frames"  # a stored clip's XMP: its frame count (tasks/ingest/video.py)
# a stored picture's PNG text: its alpha is a loss mask from a file, its pixels whole (not to be composited)
MASK_FROM_FILE = "precast.mask_from_file"
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
# the largest honest encoding is 16-bit RGBA stored uncompressed, plus its metadata
MAX_BYTES_PER_PIXEL, METADATA_BYTES = 8, 16 << 20
MAX_CAPTION_CHARS = 10_000  # per variant: about 2,500 T5 tokens, where encoders read 120 to 512
MAX_CAPTION_BYTES = 1 << 20  # a caption file, member or cell, all variants together
COPY_CHUNK = 8 << 20  # bytes a read when a file is copied to local disk: a request each on an object store
ARCHIVE_EXTENSIONS = frozenset({"tar", "tgz", "zip"})

# ECMA-48 escape sequences (colours, cursor moves, OSC titles and links): invisible in a terminal
ANSI_ESCAPE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])")
# characters that only hide or reorder text: bidi controls (Trojan Source), zero-width space, word
# joiner, soft hyphen, BOM; ZWJ and ZWNJ stay (emoji sequences, Indic and Persian scripts)
INVISIBLE = re.compile("[\u00ad\u061c\u200b\u200e\u200f\u202a-\u202e\u2060\u2066-\u2069\ufeff]")
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
SURROGATE = re.compile("[\ud800-\udfff]")  # undecodable bytes (surrogateescape), or a lone half of a pair


class Rejected(Exception):
    """An input that cannot become a sample; `reason` is a stable code, `message` the detail."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message


def printable(text: str) -> str:
    """`text` with control, invisible and undecodable characters escaped (`\\x1b`, `\\u202e`,
    `\\udcff`): names and messages reach logs, terminals, reports and parquet (which needs UTF-8)."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode() for ch in text)


def read_file(fs: fsspec.AbstractFileSystem, path: str, limit: int, missing: str,
              on_disk: bool = False) -> bytes | Path:
    """At most `limit` + 1 bytes of a file: enough to tell it is over the limit, never more; with
    `on_disk`, copied a chunk at a time into a local temporary file (a video: its bytes are never
    held in memory, whatever its size; the caller removes the file). A local FIFO or device is
    refused unopened: reading one would block or never end. A file that is not there (or a link
    to nothing) is Rejected with the reason `missing`."""
    name = posixpath.basename(path)
    try:
        if isinstance(fs, LocalFileSystem) and fs.info(path)["type"] != "file":  # info follows links
            raise Rejected("special_file", f"{name} is not a regular file")
        if not on_disk:
            return fs.cat_file(path, start=0, end=limit + 1)
        with fs.open(path, "rb", block_size=COPY_CHUNK) as source:
            return copy_to_disk(source, limit + 1)
    except FileNotFoundError as error:
        raise Rejected(missing, f"{name} does not exist") from error
    except (NotADirectoryError, IsADirectoryError) as error:  # a row's name through a file, or of a folder
        raise Rejected(missing, f"{name} is not a file: {error.strerror}") from error
    except OSError as error:
        if error.errno != errno.ENAMETOOLONG:  # the machine's fault, not the name's: fails the stage
            raise
        raise Rejected(missing, f"{name[:100]}… is too long a name for the filesystem") from error


def copy_to_disk(source: BinaryIO, most: int) -> Path:
    """At most `most` bytes of `source` in a local temporary file, copied a chunk at a time (the
    caller removes it)."""
    handle, local = tempfile.mkstemp(prefix="precast-video-")
    try:
        with os.fdopen(handle, "wb") as out, space_for(local, "a video file's bytes"):
            while most > 0 and (block := source.read(min(COPY_CHUNK, most))):
                out.write(block)
                most -= len(block)
    except BaseException:
        os.unlink(local)
        raise
    return Path(local)


def parse_json(text: str | bytes, what: str) -> Any:
    """Lenient JSON (raw control characters in strings are cleaned later); Rejected when it is not
    JSON, nests too deep, or holds a number too long to convert."""
    try:
        return json.loads(text, strict=False)
    except (ValueError, RecursionError) as error:
        raise Rejected("bad_metadata", f"{what} is not JSON: {error}") from error


def member_problem(member: tarfile.TarInfo) -> Rejected | None:
    """Why a tar member cannot be read as part of a sample, None when it can."""
    if member.issym() or member.islnk():
        return Rejected("unsafe_member", f"{member.name} is a link")
    if member.name.startswith("/") or ".." in member.name.split("/"):
        return Rejected("unsafe_member", f"{member.name} points outside the archive")
    if not (member.isfile() or member.isdir()):
        return Rejected("unsafe_member", f"{member.name} is a device, FIFO or unknown type")
    if ARCHIVE_EXTENSIONS & set(posixpath.basename(member.name).lower().split(".")[1:]):
        return Rejected("nested_archive", f"{member.name} is an archive inside the archive: not opened")
    return None


def clean_caption(line: str) -> str:
    """One variant: escape sequences and invisible characters dropped, other control characters
    read as spaces (a NUL or a stray separator still parts two words), whitespace collapsed."""
    return " ".join(CONTROL.sub(" ", INVISIBLE.sub("", ANSI_ESCAPE.sub("", line))).split())


def with_prefix(captions: list[str], prefix: str) -> list[str]:
    """A source's `caption_prefix` in each variant: in place of `[trigger]`, else first (joined by
    ", " unless the caption starts with it already); sorted as ingest keeps variants."""
    if not prefix:
        return captions
    prefix = clean_caption(prefix)
    return sorted({caption.replace("[trigger]", prefix) if "[trigger]" in caption else
                   caption if caption.startswith(prefix) else f"{prefix}, {caption}" for caption in captions})


def caption_variants(value: Any) -> list[str]:
    """Caption variants from a caption file's bytes, a string (one variant per non-empty line) or a
    list of strings; cleaned. Raises Rejected for missing, empty, non-UTF-8 or absurdly long text."""
    if value is None:
        raise Rejected("missing_caption", "no caption")
    if isinstance(value, bytes):
        if len(value) > MAX_CAPTION_BYTES:
            raise Rejected("caption_too_long", f"caption is over {MAX_CAPTION_BYTES} bytes")
        try:
            value = value.decode("utf-8-sig")
        except UnicodeDecodeError as error:
            raise Rejected("caption_encoding", f"caption is not UTF-8: {error}") from error
    if isinstance(value, str):
        lines = value.splitlines()
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        lines = list(value)
    else:
        raise Rejected("missing_caption", f"caption is a {type(value).__name__}, not text")
    if any(SURROGATE.search(line) for line in lines):
        raise Rejected("caption_encoding", "caption is not UTF-8")
    variants = [v for v in map(clean_caption, lines) if v]
    if not variants:
        raise Rejected("empty_caption", "caption has no text")
    if max(map(len, variants)) > MAX_CAPTION_CHARS:
        raise Rejected("caption_too_long", f"a caption variant is over {MAX_CAPTION_CHARS} characters")
    return list(dict.fromkeys(variants))


def max_image_bytes(config: DatasetConfig) -> int:
    """The most bytes an image within `max_pixels` can honestly take."""
    return config.max_pixels * MAX_BYTES_PER_PIXEL + METADATA_BYTES


def max_bytes(config: DatasetConfig, video: bool) -> int:
    """The most bytes read of a file: a picture's (`max_image_bytes`), or a video's (`video.max_bytes`)."""
    return config.video.max_bytes if video else max_image_bytes(config)


def check_geometry(width: int, height: int, config: DatasetConfig) -> None:
    """Raises Rejected for an image too large, too small or too far from square for the rules."""
    if width * height > config.max_pixels:
        raise Rejected("too_large", f"{width}x{height} exceeds max_pixels={config.max_pixels}")
    if min(width, height) < config.min_side:
        raise Rejected("too_small", f"{width}x{height}, shorter side below min_side={config.min_side}")
    if max(width / height, height / width) > MAX_ASPECT_RATIO:
        raise Rejected("aspect_ratio", f"{width}x{height} is beyond 1:{MAX_ASPECT_RATIO:g}")


SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I")  # integer modes `to_rgb` scales to 8 bits


def to_rgba(image: Image.Image) -> Image.Image:
    """RGBA pixels of a picture with alpha (16-bit modes have none)."""
    return image.convert("RGBA")


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB pixels of any mode: 16-bit scaled to 8, palette and LA through RGBA, alpha composited on
    white (what most trainers do), CMYK and grayscale converted."""
    if image.mode in SIXTEEN_BIT:
        pixels = np.asarray(image, dtype=np.float64)
        peak = 65535.0 if image.mode != "I" or pixels.max() > 255 else 255.0
        image = Image.fromarray(np.clip(pixels * (255.0 / peak), 0, 255).round().astype(np.uint8), "L")
    if image.mode in ("P", "PA", "LA", "La", "RGBa") or "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode == "RGBA":
        canvas = Image.new("RGB", image.size, (255, 255, 255))
        canvas.paste(image, mask=image.getchannel("A"))
        return canvas
    return image.convert("RGB")


def has_alpha(image: Image.Image) -> bool:
    """Whether a picture carries transparency: an alpha channel, or a transparent colour of a
    palette or an 8-bit picture (a 16-bit one's is dropped where `to_rgb` scales it to 8 bits)."""
    return image.mode in ("RGBA", "PA", "LA", "La", "RGBa") or (
        "transparency" in image.info and image.mode not in SIXTEEN_BIT)


def normalise_image(data: bytes, config: DatasetConfig, alpha: bool = False,
                    mask: bytes | None = None) -> tuple[bytes, int, int]:
    """Decode-check an image; returns its bytes (re-encoded as lossless PNG only when it needed
    conversion or rotation) and its size after EXIF orientation. With `alpha` (a source's `masks:
    alpha`), a picture with an alpha channel keeps it as RGBA, its loss mask; with `mask` (a mask
    file's bytes), the picture's pixels take the mask as their alpha, marked MASK_FROM_FILE.
    Raises Rejected."""
    if mask is not None:
        return masked_image(data, mask, config)
    if not data:
        raise Rejected("empty_file", "zero bytes")
    if len(data) > max_image_bytes(config):
        raise Rejected("too_large", f"over {max_image_bytes(config)} bytes, more than max_pixels={config.max_pixels} needs")
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as opened:
            check_geometry(*opened.size, config)  # before decoding: a bomb is refused unread
            opened.load()
            rotated = opened.getexif().get(0x0112, 1) != 1  # EXIF orientation other than "as stored"
            image = ImageOps.exif_transpose(opened) if rotated else opened
            # an animated picture is stored as its first frame, and a WebP whose XMP reads as a
            # clip's (its frame count, its mask) is stored without it: a picture never passes for a clip
            clip_like = opened.format == "WEBP" and reads_as_clip(opened.info.get("xmp"))
            mode = "RGBA" if alpha and has_alpha(opened) else "RGB"
            converted = (rotated or opened.mode != mode or opened.format not in KEEP_AS_IS
                         or getattr(opened, "n_frames", 1) > 1 or clip_like or MASK_FROM_FILE in opened.info)
            if converted:
                image = to_rgb(image) if mode == "RGB" else to_rgba(image)
            if mode == "RGBA" and image.getchannel("A").getextrema()[1] == 0:
                raise Rejected("empty_mask", "its alpha channel, part of its loss mask, is 0 everywhere: no pixel "
                                             "of it would be learned")
    except UnidentifiedImageError as error:
        raise Rejected("not_image", f"not {', '.join(IMAGE_FORMATS)}") from error
    except Image.DecompressionBombError as error:
        raise Rejected("too_large", str(error)) from error
    except (OSError, SyntaxError, ValueError) as error:
        raise Rejected("unreadable", f"cannot decode: {error}") from error
    check_geometry(*image.size, config)  # again: orientation swaps the sides
    if converted:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        data = buffer.getvalue()
    return data, image.width, image.height


def masked_image(data: bytes, mask: bytes, config: DatasetConfig) -> tuple[bytes, int, int]:
    """A picture with its loss mask from a file as an RGBA PNG marked MASK_FROM_FILE: its pixels
    (a transparent picture's composited on white, as always), the mask their alpha, times the
    picture's own alpha where it has one (transparent parts are not learned either). Raises
    Rejected, the mask's problems as bad_mask or empty_mask."""
    picture, width, height = normalise_image(data, config, alpha=True)  # its own alpha kept, to weigh the mask
    layer = mask_layer(mask, config)
    with Image.open(io.BytesIO(picture)) as opened:
        image = to_rgb(opened)
        if layer.size != image.size:
            layer = layer.resize(image.size, Image.Resampling.BILINEAR)
        if has_alpha(opened):
            layer = ImageChops.multiply(layer, opened.convert("RGBA").getchannel("A"))
    if layer.getextrema()[1] == 0:
        raise Rejected("empty_mask", "its mask file is black everywhere: no pixel of it would be learned")
    image.putalpha(layer)
    marked = PngImagePlugin.PngInfo()
    marked.add_text(MASK_FROM_FILE, "1")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", pnginfo=marked)
    return buffer.getvalue(), width, height


def mask_layer(mask: bytes, config: DatasetConfig) -> Image.Image:
    """A mask file as 8-bit grey (white learned, black not; transparent parts black, as ai-toolkit
    reads them), EXIF orientation applied. Bounded as a picture is (bytes and pixels, refused
    before decoding), but of any size or shape: it is resized to its picture. Raises Rejected."""
    if len(mask) > max_image_bytes(config):
        raise Rejected("bad_mask", f"its mask is over {max_image_bytes(config)} bytes")
    try:
        with Image.open(io.BytesIO(mask), formats=IMAGE_FORMATS) as opened:
            if opened.width * opened.height > config.max_pixels:
                raise Rejected("bad_mask", f"its mask, {opened.width}x{opened.height}, exceeds max_pixels={config.max_pixels}")
            opened.load()
            drawn = ImageOps.exif_transpose(opened)
            if has_alpha(drawn):
                rgba = drawn.convert("RGBA")
                return ImageChops.multiply(rgba.convert("L"), rgba.getchannel("A"))
            return drawn.convert("L") if drawn.mode in ("L", "1") else to_rgb(drawn).convert("L")
    except Rejected:
        raise
    except UnidentifiedImageError as error:
        raise Rejected("bad_mask", f"its mask is not {', '.join(IMAGE_FORMATS)}") from error
    except (Image.DecompressionBombError, OSError, SyntaxError, ValueError) as error:
        raise Rejected("bad_mask", f"its mask cannot be decoded: {error}") from error


def reads_as_clip(xmp: str | bytes | None) -> bool:
    """Whether a WebP's XMP is what a stored clip's is read as: JSON naming a frame count or a mask
    (however its keys are escaped)."""
    try:
        meta = json.loads(xmp) if xmp else None
    except (ValueError, TypeError):
        return False
    return isinstance(meta, dict) and (CLIP_FRAMES in meta or MASK_FROM_FILE in meta)


def picture_has_alpha(data: bytes) -> bool:
    """Whether a picture's header says it carries transparency (not decoded; False for what is no picture)."""
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as opened:
            return has_alpha(opened)
    except Exception:
        return False
