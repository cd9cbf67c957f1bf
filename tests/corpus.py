"""A hostile little corpus, written in each source format with the same content.

Nine images are accepted (with every oddity users bring: EXIF rotation, CMYK, 16-bit, palette GIF,
alpha, WebP, a BOM caption, a multi-line caption, an exact duplicate) and nine are quarantined,
one per reason; webdataset tars add three unsafe members.
"""

from __future__ import annotations

import csv
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

MAX_PIXELS = 1_000_000  # the test config's limit: `huge` is over it


def _encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def _rotated_jpeg() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90° clockwise to display
    return _encode(Image.new("RGB", (200, 100), (250, 10, 10)), "JPEG", exif=exif, quality=95)


def _deep_png() -> bytes:
    pixels = np.full((96, 128), 40000, dtype=np.uint16)
    return _encode(Image.fromarray(pixels), "PNG")  # uint16 → mode I;16


def _palette_gif() -> bytes:
    frames = [Image.new("P", (120, 90), i) for i in (3, 7)]
    for frame in frames:
        frame.putpalette([0, 0, 0] * 3 + [10, 200, 30] + [0, 0, 0] * 3 + [200, 10, 250] + [0, 0, 0] * 248)
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:])
    return buffer.getvalue()


def items() -> list[dict]:
    """name, image bytes, caption (str, list or raw bytes; None: no caption) and expectation."""
    rotated = _rotated_jpeg()
    plain = _encode(Image.new("RGB", (160, 120), (20, 120, 220)), "PNG")
    return [
        {"name": "plain.png", "image": plain, "caption": "a plain blue picture", "accept": True},
        {"name": "rotated.jpg", "image": rotated, "caption": "a rotated red photo", "accept": True},
        {"name": "copy_of_rotated.jpg", "image": rotated, "caption": "the same red photo again", "accept": True},
        {"name": "cmyk.jpg", "image": _encode(Image.new("CMYK", (120, 90), (0, 255, 255, 0)), "JPEG"),
         "caption": "a cmyk jpeg", "accept": True},
        {"name": "deep.png", "image": _deep_png(), "caption": "a sixteen bit png", "accept": True},
        {"name": "palette.gif", "image": _palette_gif(), "caption": "an animated palette gif", "accept": True},
        {"name": "alpha.png", "image": _encode(Image.new("RGBA", (128, 128), (0, 0, 255, 0)), "PNG"),
         "caption": "a transparent png", "accept": True},
        {"name": "photo.webp", "image": _encode(Image.new("RGB", (150, 100), (90, 90, 20)), "WEBP"),
         "caption": "a webp photo", "accept": True},
        {"name": "bom.png", "image": _encode(Image.new("RGB", (100, 100), (1, 1, 1)), "PNG"),
         "caption": "\ufeffa caption that starts with a byte order mark", "accept": True},
        {"name": "variants.png", "image": _encode(Image.new("RGB", (100, 140), (2, 2, 2)), "PNG"),
         "caption": ["the first variant", "the second variant"], "accept": True},
        {"name": "truncated.png", "image": _encode(Image.new("RGB", (300, 300), (9, 9, 9)), "PNG",
                                                   compress_level=0)[:5000],
         "caption": "cut short", "reason": "unreadable"},
        {"name": "zero.jpg", "image": b"", "caption": "nothing at all", "reason": "empty_file"},
        {"name": "letter.jpg", "image": b"Dear reader, this is not a picture.", "caption": "text",
         "reason": "not_image"},
        {"name": "huge.png", "image": _encode(Image.new("RGB", (1100, 1000)), "PNG"), "caption": "too many pixels",
         "reason": "too_large"},
        {"name": "small.png", "image": _encode(Image.new("RGB", (30, 30)), "PNG"), "caption": "tiny",
         "reason": "too_small"},
        {"name": "thin.png", "image": _encode(Image.new("RGB", (500, 100)), "PNG"), "caption": "a banner",
         "reason": "aspect_ratio"},
        {"name": "nocaption.png", "image": _encode(Image.new("RGB", (100, 100), (3, 3, 3)), "PNG"),
         "caption": None, "reason": "missing_caption"},
        {"name": "blank.png", "image": _encode(Image.new("RGB", (100, 100), (4, 4, 4)), "PNG"),
         "caption": "  \n\t ", "reason": "empty_caption"},
        {"name": "latin1.png", "image": _encode(Image.new("RGB", (100, 100), (5, 5, 5)), "PNG"),
         "caption": "caf\xe9".encode("latin-1"), "reason": "caption_encoding"},
    ]


ACCEPTED = 9  # ten accepted inputs, one an exact duplicate
REASONS = {"aspect_ratio": 1, "caption_encoding": 1, "empty_caption": 1, "empty_file": 1, "missing_caption": 1,
           "not_image": 1, "too_large": 1, "too_small": 1, "unreadable": 1}


def _caption_text(caption) -> bytes:
    if isinstance(caption, list):
        return "\n".join(caption).encode()
    return caption if isinstance(caption, bytes) else caption.encode("utf-8")


def write_folder(root: Path) -> Path:
    root.mkdir(parents=True)
    for index, item in enumerate(items()):
        sub = root / ("nested/deeper" if index % 3 == 0 else "")
        sub.mkdir(parents=True, exist_ok=True)
        (sub / item["name"]).write_bytes(item["image"])
        if item["caption"] is not None:
            # .caption for one, with a BOM written as bytes for the BOM case
            suffix = ".caption" if item["name"] == "cmyk.jpg" else ".txt"
            (sub / item["name"]).with_suffix(suffix).write_bytes(_caption_text(item["caption"]))
    return root


def _metadata_value(caption):
    """A JSON/CSV-safe caption value; raw bytes are spliced in by the writers."""
    return caption.decode("latin-1") if isinstance(caption, bytes) else caption


def write_jsonl(root: Path) -> Path:
    (root / "images").mkdir(parents=True)
    lines = []
    for item in items():
        (root / "images" / item["name"]).write_bytes(item["image"])
        record = {"file_name": f"images/{item['name']}"}
        if item["caption"] is not None:
            record["text"] = _metadata_value(item["caption"])
        line = json.dumps(record, ensure_ascii=False)
        # a latin-1 caption: the line holds a byte that is not UTF-8
        lines.append(line.encode("latin-1" if isinstance(item["caption"], bytes) else "utf-8"))
    (root / "metadata.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    return root


def write_csv(root: Path) -> Path:
    (root / "images").mkdir(parents=True)
    out = io.BytesIO()
    header = io.StringIO()
    csv.writer(header).writerow(["file_name", "text"])
    out.write(header.getvalue().encode())
    for item in items():
        (root / "images" / item["name"]).write_bytes(item["image"])
        row = io.StringIO()
        caption = item["caption"]
        fields = [f"images/{item['name']}"]
        if caption is not None:  # a missing caption is a short row
            fields.append("\n".join(caption) if isinstance(caption, list) else _metadata_value(caption))
        csv.writer(row).writerow(fields)
        out.write(row.getvalue().encode("latin-1" if isinstance(caption, bytes) else "utf-8"))
    (root / "metadata.csv").write_bytes(out.getvalue())
    return root


def write_parquet(root: Path) -> Path:
    root.mkdir(parents=True)
    rows = [{"image": {"bytes": item["image"], "path": item["name"]},
             "text": None if item["caption"] is None else _caption_text(item["caption"])} for item in items()]
    schema = pa.schema([("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])), ("text", pa.binary())])
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table.slice(0, 10), root / "part-0.parquet")
    pq.write_table(table.slice(10), root / "part-1.parquet")
    return root


def write_webdataset(root: Path) -> Path:
    root.mkdir(parents=True)

    def add(archive: tarfile.TarFile, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))

    all_items = items()
    for part, chunk in enumerate([all_items[:10], all_items[10:]]):
        with tarfile.open(root / f"shard-{part:05d}.tar", "w") as archive:
            for item in chunk:
                key, ext = item["name"].rsplit(".", 1)
                add(archive, f"{key}.{ext}", item["image"])
                if item["caption"] is not None:
                    add(archive, f"{key}.txt", _caption_text(item["caption"]))
            if part == 1:
                add(archive, "/etc/absolute.jpg", all_items[0]["image"])
                add(archive, "../escape.jpg", all_items[0]["image"])
                link = tarfile.TarInfo("link.jpg")
                link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
                archive.addfile(link)
    return root


WRITERS = {"folder": write_folder, "jsonl": write_jsonl, "csv": write_csv, "parquet": write_parquet,
           "webdataset": write_webdataset}
