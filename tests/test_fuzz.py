"""Hostile input: fuzzed images, videos, captions, names and archives go through ingest without a crash.

A seeded corpus mixes good samples (some with hostile names or dirty but usable captions, two
videos) with random bytes, truncated and bit-flipped images and videos, video magic numbers over
noise, an audio-only container, headers declaring huge sizes, compression bombs,
unusable captions, path-traversal and special tar members, nested and damaged tars, and metadata
rows that are not JSON. Every good sample must be accepted with its cleaned captions; every hostile
input must be quarantined with one of its expected reasons (or, for a bit flip that still decodes,
accepted); nothing else may appear, and the report's counts must add up.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
import random
import re
import resource
import struct
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from storage.shards import read_image_shard
from storage.store import Store
from tasks.ingest.stage import ingest
from tests.corpus import MAX_PIXELS, _encode

SEED = 8_06  # issue 8, point 6
IMAGE_REASONS = frozenset({"not_image", "unreadable", "too_large", "too_small", "aspect_ratio"})
CUT = frozenset({"not_image", "unreadable"})
REASONS = IMAGE_REASONS | {"empty_file", "missing_caption", "empty_caption", "caption_encoding", "caption_too_long",
                           "missing_image", "orphan_caption", "bad_metadata", "unsafe_path", "unsafe_member", "special_file",
                           "nested_archive", "bad_archive"}
# a video cut or flipped: not a container, a container that breaks off, or what is left too short
VIDEO_REASONS = frozenset({"bad_video", "truncated", "too_short", "too_few_frames", "not_image", "no_video_stream"})
UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u200b\u202a-\u202e\u2066-\u2069\ufeff\ud800-\udfff]")


@dataclass
class Item:
    label: str  # part of the file name: may hold control characters, never "." or "/"
    ext: str
    image: bytes
    caption: str | bytes | None
    reasons: frozenset[str] = frozenset()  # a hostile input: quarantined for one of these
    captions: list[str] | None = None  # a good sample: accepted with exactly these
    may_decode: bool = False  # hostile, but may still decode (a bit flip): accepting it is fine


@dataclass
class Expect:
    match: str  # regex that finds this input in a candidate's source
    reasons: frozenset[str] = frozenset()
    captions: list[str] | None = None
    may_decode: bool = False
    may_vanish: bool = False  # behind a damaged tar header: reported as the tar's bad_archive


def good(label: str, ext: str, image: bytes, caption, captions: list[str]) -> Item:
    return Item(label, ext, image, caption, captions=captions)


def bad(label: str, ext: str, image: bytes, reasons, caption="a hostile input", may_decode=False) -> Item:
    return Item(label, ext, image, caption, frozenset(reasons), may_decode=may_decode)


def _flat(index: int) -> bytes:
    """A small valid PNG, different for every index."""
    return _encode(Image.new("RGB", (96 + index % 200, 96), (index % 256, index // 256, 7 * index % 256)), "PNG")


def _png(width: int, height: int, idat: bytes, extra: bytes = b"") -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))  # 8-bit grey
    return b"\x89PNG\r\n\x1a\n" + header + extra + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _zeros(size: int) -> bytes:
    squeeze = zlib.compressobj(9)
    return b"".join(squeeze.compress(bytes(1 << 20)) for _ in range(size >> 20)) + squeeze.flush()


def _patched(data: bytes, at: int, fmt: str, *values: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, at, *values)
    return bytes(out)


def _huge_headers(plain_png: bytes, jpeg: bytes) -> list[Item]:
    """Headers declaring far more pixels than max_pixels (refused before any decoding), and
    compression bombs."""
    gif = _encode(Image.new("P", (100, 100)), "GIF")
    bmp = _encode(Image.new("RGB", (100, 100)), "BMP")
    frames = [Image.new("RGB", (100, 100), c) for c in ((1, 2, 3), (4, 5, 6))]
    webp = io.BytesIO()
    frames[0].save(webp, format="WEBP", save_all=True, append_images=frames[1:], lossless=True)
    webp = webp.getvalue()
    vp8x = webp.index(b"VP8X") + 12  # canvas width - 1, height - 1: 24 bits each
    tiff = _encode(Image.new("L", (100, 100)), "TIFF")
    sof = jpeg.index(b"\xff\xc0") + 5
    items = [
        bad("png-60000", "png", _png(60000, 60000, zlib.compress(bytes(60001))), {"too_large"}),
        bad("png-2^31", "png", _png(2**31 - 1, 2**31 - 1, zlib.compress(b"\0")), {"too_large"}),
        bad("png-wide", "png", _png(2**31 - 1, 1, zlib.compress(b"\0")), {"too_large"}),
        bad("png-bomb", "png", _png(20000, 20000, _zeros(64 << 20)), {"too_large"}),
        bad("png-0x0", "png", _png(0, 0, zlib.compress(b"")), {"not_image", "too_small"}),
        bad("jpeg-60000", "jpg", _patched(jpeg, sof, ">HH", 60000, 60000), {"too_large"}),
        bad("jpeg-65535", "jpg", _patched(jpeg, sof, ">HH", 65535, 65535), {"too_large"}),
        bad("gif-65535", "gif", _patched(gif, 6, "<HH", 65535, 65535), {"too_large"}),
        bad("bmp-60000", "bmp", _patched(bmp, 18, "<ii", 60000, 60000), {"too_large"}),
        bad("bmp-topdown", "bmp", _patched(bmp, 18, "<ii", 60000, -60000), {"too_large"}),
        bad("webp-16383", "webp", _patched(webp, vp8x, "<HBHB", 0xFFFE, 0x3F, 0xFFFE, 0x3F), {"too_large"}),
    ]
    for tag in (256, 257):  # ImageWidth, ImageLength: LONG entries of the first IFD
        tiff = _patched(tiff, tiff.index(struct.pack("<HHI", tag, 4, 1)) + 8, "<I", 60000)
    items.append(bad("tiff-60000", "tif", tiff, {"too_large"}))
    # within max_pixels, but its data inflates to 64 MiB: Pillow stops at the image's end
    items.append(bad("png-inflates", "png", _png(1000, 1000, _zeros(64 << 20)), {"unreadable"}, may_decode=True))
    text_bomb = b"zTXt" + b"k\0\0" + _zeros(64 << 20)  # a text chunk after IHDR that inflates to 64 MiB
    items.append(bad("png-ztxt-bomb", "png", plain_png[:33] + struct.pack(">I", len(text_bomb) - 4) + text_bomb
                     + struct.pack(">I", zlib.crc32(text_bomb)) + plain_png[33:], {"unreadable"}))
    return items


def corpus_items() -> list[Item]:
    """The same hostile corpus for every layout (names and captions, not paths or archives)."""
    rng = random.Random(SEED)
    pixels = np.random.default_rng(SEED).integers(0, 256, (150, 200, 3), dtype=np.uint8)
    noisy = Image.fromarray(pixels)
    png, jpeg, webp = _encode(noisy, "PNG"), _encode(noisy, "JPEG", quality=90), _encode(noisy, "WEBP")
    flat = map(_flat, range(100))
    items = [
        good("plain", "png", png, "a noisy png", ["a noisy png"]),
        good("photo", "jpg", jpeg, "a noisy jpeg", ["a noisy jpeg"]),
        good("tile", "webp", webp, "a noisy webp", ["a noisy webp"]),
        good("ansi", "png", next(flat), "a \x1b[31mred\x1b[0m kite\x07", ["a red kite"]),
        good("bidi", "png", next(flat), "bidi \u202eevil\u202c text\u200b here", ["bidi evil text here"]),
        good("controls", "png", next(flat), b"nul\x00byte and\ttab\x7f\r\nsecond\x1b]0;title\x07 line",
             ["nul byte and tab", "second line"]),
        good("soft", "png", next(flat), "\ufeffco\u00adoperate", ["cooperate"]),
        good("emoji", "png", next(flat), "a family \U0001f468\u200d\U0001f469\u200d\U0001f467",
             ["a family \U0001f468\u200d\U0001f469\u200d\U0001f467"]),
        good("name\x1b[31m\r\u202e", "png", next(flat), "a hostile name", ["a hostile name"]),
        good("name \x07 bell", "jpg", _encode(Image.new("RGB", (120, 90), (9, 99, 199)), "JPEG"), "a bell",
             ["a bell"]),
        bad("empty", "png", b"", {"empty_file"}),
        bad("no-caption", "png", next(flat), {"missing_caption"}, caption=None),
        bad("caption-empty", "png", next(flat), {"empty_caption"}, caption=""),
        bad("caption-controls", "png", next(flat), {"empty_caption"}, caption="\x1b[31m\x1b[0m\x00\x07 \x08"),
        bad("caption-invisible", "png", next(flat), {"empty_caption"}, caption="\u202e\u200b\ufeff\u2066"),
        bad("caption-20k", "png", next(flat), {"caption_too_long"}, caption="word " * 4000),
        bad("caption-latin1", "png", next(flat), {"caption_encoding"}, caption=b"caf\xe9 \xff\xfe broken"),
        bad("caption-utf16", "png", next(flat), {"caption_encoding"}, caption="hello".encode("utf-16")),
        bad("caption-surrogate", "png", next(flat), {"caption_encoding"}, caption=b"half \xed\xa0\x80 a pair"),
    ]
    for index, size in enumerate([1, 7, 64, 512, 4096, 65536]):
        ext = ["jpg", "png", "webp", "gif", "bmp", "tiff"][index]
        items.append(bad(f"random-{size}", ext, rng.randbytes(size), {"not_image"}))
    # formats ingest does not read: TGA has no magic number, so noise behind its header decodes;
    # EPS would be handed to Ghostscript
    tga = struct.pack("<BBBHHBHHHHBB", 0, 0, 2, 0, 0, 0, 0, 0, 120, 90, 24, 0) + rng.randbytes(120 * 90 * 3)
    items += [bad("tga-noise", "jpg", tga, {"not_image"}),
              bad("eps", "png", b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 100 100\nshowpage\n", {"not_image"})]
    magic = {"png": b"\x89PNG\r\n\x1a\n", "jpg": b"\xff\xd8\xff", "gif": b"GIF89a", "webp": b"RIFF\0\1\0\0WEBPVP8 ",
             "bmp": b"BM", "tif": b"II*\0"}
    for ext, prefix in magic.items():
        for size in (0, 30, 3000):
            items.append(bad(f"magic-{size}", ext, prefix + rng.randbytes(size), IMAGE_REASONS))
    cuts = {"png": (png, [1, 8, 12, 16, 20, 29, 33, 41]), "jpg": (jpeg, [2, 3, 10, 20, 100, 300]),
            "webp": (webp, [4, 12, 16, 20, 30])}
    for ext, (data, offsets) in cuts.items():
        for offset in offsets + [len(data) // 4, len(data) // 2, len(data) * 3 // 4]:
            items.append(bad(f"cut-{offset}", ext, data[:offset], CUT))
        # the last bytes only: a PNG may hold every pixel by then and still decode
        items.append(bad("cut-tail", ext, data[:-20], CUT, may_decode=True))
    for ext, (data, _) in cuts.items():
        for flips in (1, 3, 8, 32):
            flipped = bytearray(data)
            for position in rng.sample(range(len(data) * 8), flips):
                flipped[position // 8] ^= 1 << position % 8
            items.append(bad(f"flip-{flips}", ext, bytes(flipped), IMAGE_REASONS, may_decode=True))
    return items + _huge_headers(next(flat), jpeg) + _videos(rng)


def _videos(rng: random.Random) -> list[Item]:
    """Two good videos of one default clip each (81 frames at 16 fps: 6 s), and hostile ones: cut,
    flipped, audio with or without cover art, growing midway."""
    import tempfile

    from tasks.demo.videos import write_audio_only
    from tests.videos import remux, write_cover_art, write_resizing, write_video

    with tempfile.TemporaryDirectory() as folder:
        mp4 = write_video(Path(folder) / "a.mp4", frames=96, fps=16).read_bytes()
        webm = write_video(Path(folder) / "a.webm", frames=96, fps=16, codec="libvpx-vp9").read_bytes()
        audio = write_audio_only(Path(folder) / "b.mp4").read_bytes()
        cover = write_cover_art(Path(folder) / "c.mp4").read_bytes()
        faststart = remux(Path(folder) / "a.mp4", Path(folder) / "f.mp4", movflags="faststart").read_bytes()
        grows = write_resizing(Path(folder) / "g.mkv", [(96, 64)] * 10 + [(512, 512)] * 86, fps=16).read_bytes()
    items = [good("video", "mp4", mp4, "a grey video", ["a grey video"]),
             good("video", "webm", webm, "a grey webm", ["a grey webm"]),
             bad("audio-only", "mp4", audio, {"no_video_stream"}),
             bad("cover-art", "mp4", cover, {"no_video_stream"}),
             bad("grows-midway", "mkv", grows, {"bad_video"}),
             # the index first: what is cut is known from it
             bad("faststart-cut-half", "mp4", faststart[: len(faststart) // 2], {"truncated"}),
             bad("magic-ftyp", "mp4", b"\0\0\0\x18ftypisom" + rng.randbytes(3000), {"bad_video"}),
             bad("magic-ebml", "mkv", b"\x1a\x45\xdf\xa3" + rng.randbytes(3000), {"bad_video"})]
    for ext, data in (("mp4", mp4), ("webm", webm)):
        for offset in (6, 40, 400, len(data) // 2):
            items.append(bad(f"cut-{offset}", ext, data[:offset], VIDEO_REASONS))
        # the last bytes only: an index's tail, which a demuxer may not need
        items.append(bad("cut-tail", ext, data[:-50], VIDEO_REASONS, may_decode=True))
        for flips in (1, 8, 64):
            flipped = bytearray(data)
            for position in rng.sample(range(len(data) * 8), flips):
                flipped[position // 8] ^= 1 << position % 8
            items.append(bad(f"flip-{flips}", ext, bytes(flipped), VIDEO_REASONS, may_decode=True))
    return items


def _token(number: int) -> str:
    return f"~{number:03d}~"  # in every name: finds the input in a candidate's source


def _caption_bytes(caption: str | bytes) -> bytes:
    return caption if isinstance(caption, bytes) else caption.encode()


def _caption_text(caption: str | bytes) -> str:
    """For metadata: undecodable bytes ride along as surrogates and are written back as bytes."""
    return caption.decode("utf-8", "surrogateescape") if isinstance(caption, bytes) else caption


def _expects(items: list[Item]) -> list[Expect]:
    return [Expect(re.escape(_token(i)), item.reasons, item.captions, item.may_decode) for i, item in enumerate(items)]


def _reject(match: str, *reasons: str) -> Expect:
    return Expect(match, frozenset(reasons))


def _check(config, expects: list[Expect]) -> None:
    """Ingest; every accepted and quarantined input belongs to exactly one expectation and meets it,
    every expectation is met, and the counts add up."""
    result = ingest(config.storage, config.dataset)
    store = Store(config.storage)
    report = store.read_json(store.key(result["report"]))
    rows = [row for shard in result["shards"]
            for row in read_image_shard(store.read_bytes(f"shards/images/{shard['id']}.parquet")).to_pylist()]
    seen: set[int] = set()

    def owner(source: str) -> Expect:
        assert source.isprintable(), source
        found = [i for i, e in enumerate(expects) if re.search(e.match, source)]
        assert len(found) == 1 and found[0] not in seen, f"{source!r} matches {[expects[i].match for i in found]}"
        seen.add(found[0])
        return expects[found[0]]

    for row in rows:
        expect = owner(row["source"])
        assert expect.captions is not None or expect.may_decode, f"hostile input accepted: {row['source']}"
        if expect.captions is not None:
            assert row["captions"] == sorted(expect.captions), row["source"]
        assert not any(UNPRINTABLE.search(c) for c in row["captions"]), row["captions"]
    for entry in report["quarantine"]:
        expect = owner(entry["source"])
        assert expect.captions is None, f"good sample lost: {entry}"
        assert entry["reason"] in expect.reasons, entry
        assert entry["message"].isprintable(), entry
    missing = [e.match for i, e in enumerate(expects) if i not in seen and not e.may_vanish]
    assert not missing, f"neither accepted nor quarantined: {missing}"
    assert (len(rows), len(report["quarantine"])) == (report["samples"], report["quarantined"])
    assert report["samples"] + report["quarantined"] + report["duplicates"] == report["candidates"] == len(seen)


@pytest.fixture(scope="module")
def items() -> list[Item]:
    return corpus_items()


def _config(make_config, source: Path, fmt: str):
    return make_config(dataset={"max_pixels": MAX_PIXELS, "sources": [{"path": str(source), "format": fmt}]})


def _sparse(path: Path) -> None:
    with path.open("wb") as handle:
        handle.truncate(2 << 30)  # 2 GiB that take no disk: reading it all would show in peak memory


def test_folder(items, make_config, tmp_path):
    root = tmp_path / "folder"
    root.mkdir()
    for index, item in enumerate(items):
        image = root / f"{_token(index)}{item.label}.{item.ext}"
        image.write_bytes(item.image)
        if item.caption is not None:
            image.with_suffix(".txt").write_bytes(_caption_bytes(item.caption))
    expects = _expects(items)
    outside = tmp_path / "outside.png"
    outside.write_bytes(_flat(200))
    extras = [  # name, how to make it, its caption, expectation
        ("~900~fifo.png", os.mkfifo, "a pipe", _reject("~900~", "special_file")),
        ("~901~zero.png", lambda p: p.symlink_to("/dev/zero"), "endless", _reject("~901~", "special_file")),
        ("~902~dangling.png", lambda p: p.symlink_to(tmp_path / "nothing"), "a link to nothing",
         _reject("~902~", "missing_image")),
        ("~903~linked.png", lambda p: p.symlink_to(outside), "a linked image", Expect("~903~", captions=["a linked image"])),
        ("~904~sparse.png", _sparse, "two sparse gigabytes", _reject("~904~", "too_large")),
        ("~905~huge-caption.png", lambda p: p.write_bytes(_flat(201)), "word " * 200_000,
         _reject("~905~", "caption_too_long")),
        ("~906~bigger-caption.png", lambda p: p.write_bytes(_flat(202)), "x" * (3 << 20),
         _reject("~906~", "caption_too_long")),
        ("~907~caption-pipe.png", lambda p: p.write_bytes(_flat(203)), None, _reject("~907~", "special_file")),
        ("~908~new\nline.png", lambda p: p.write_bytes(_flat(204)), "a newline in the name",
         Expect("~908~", captions=["a newline in the name"])),
        ("~910~lost.mp4", lambda p: None, "a caption whose video never came", _reject("~910~", "orphan_caption")),
    ]
    for name, make, caption, expect in extras:
        make(root / name)
        if caption is not None:
            (root / name).with_suffix(".txt").write_text(caption)
        expects.append(expect)
    os.mkfifo(root / "~907~caption-pipe.txt")  # the caption of ~907~
    for name, content in [(b"~909~bytes\xff\xfe.png", _flat(205)), (b"~909~bytes\xff\xfe.txt", b"not UTF-8, the name")]:
        (root / os.fsdecode(name)).write_bytes(content)  # a name that is not UTF-8 at all
    expects.append(Expect("~909~", captions=["not UTF-8, the name"]))

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _check(_config(make_config, root, "folder"), expects)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10  # KiB → MiB
    assert grown < 400, f"peak memory grew by {grown} MiB"


def _metadata_rows(items: list[Item], root: Path, fmt: str) -> list[tuple[dict, Expect]]:
    """One row per corpus item, then rows whose paths are hostile."""
    images = root / "images"
    images.mkdir(parents=True)
    rows = []
    for index, (item, expect) in enumerate(zip(items, _expects(items))):
        name = f"{_token(index)}{item.label}.{item.ext}"
        (images / name).write_bytes(item.image)
        record = {"file_name": f"images/{name}"}
        if item.caption is not None:
            record["text"] = _caption_text(item.caption)
        rows.append((record, expect))
    os.mkfifo(images / "pipe.png")
    (images / "zero.png").symlink_to("/dev/zero")
    _sparse(images / "sparse.png")
    first_row = 1 if fmt == "jsonl" else 2  # csv: after the header
    for name, reason in [("../outside.png", "unsafe_path"), ("/etc/passwd", "unsafe_path"),
                         ("images/../../x.png", "unsafe_path"), ("images/\x00.png", "unsafe_path"),
                         ("images/pipe.png", "special_file"), ("images/zero.png", "special_file"),
                         ("images", "special_file"), ("images/absent.png", "missing_image"),
                         ("images/absent.mp4", "missing_video"),
                         ("images/sparse.png", "too_large")]:
        # rows refused before their file is known are named by their line
        line = rf"metadata\.{fmt}:{len(rows) + first_row}$"
        rows.append(({"file_name": name, "text": "a hostile path"},
                     _reject(line if reason == "unsafe_path" else re.escape(name) + "$", reason)))
    return rows


def test_jsonl(items, make_config, tmp_path):
    root = tmp_path / "jsonl"
    rows = _metadata_rows(items, root, "jsonl")
    lines = [json.dumps(record, ensure_ascii=False).encode("utf-8", "surrogateescape") for record, _ in rows]
    expects = [expect for _, expect in rows]
    for number, (fields, reason) in enumerate([(b'"text": ' + b"[" * 100_000 + b"]" * 100_000, "bad_metadata"),
                                                (b'"text": "a", "n": ' + b"1" * 5000, "bad_metadata"),  # int too long
                                                (b'"text": "half \\ud800 a pair"', "caption_encoding"),
                                                (b'"text": "' + b"word " * 200_000 + b'"', "caption_too_long")],
                                               start=960):
        lines.append(f'{{"file_name": "images/{_token(number)}.png", '.encode() + fields + b"}")
        # named by its line when the row is refused before its file is known
        expects.append(_reject(rf"metadata\.jsonl:{len(lines)}$|{_token(number)}", reason))
    for raw in [b"{{{ not json", b"[1, 2]", b'{"text": "no file"}']:
        lines.append(raw)
        expects.append(_reject(rf"metadata\.jsonl:{len(lines)}$", "bad_metadata"))
    # raw line separators and control characters inside JSON strings: the rows still read
    for number, caption, cleaned in [(990, "one\u2028two\x85three", ["one", "two", "three"]),
                                     (991, "raw \x1b[1mbold\x1b[0m\ttab\x00nul", ["raw bold tab nul"])]:
        (root / "images" / f"{_token(number)}.png").write_bytes(_flat(number))
        lines.append(f'{{"file_name": "images/{_token(number)}.png", "text": "{caption}"}}'.encode())
        expects.append(Expect(_token(number), captions=cleaned))
    (root / "metadata.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    _check(_config(make_config, root, "jsonl"), expects)


def test_csv(items, make_config, tmp_path):
    root = tmp_path / "csv"
    rows = _metadata_rows(items, root, "csv")
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(["file_name", "text"])
    for record, _ in rows:
        writer.writerow([record["file_name"]] + ([record["text"]] if "text" in record else []))
    expects = [expect for _, expect in rows]
    # a field over csv's size limit costs only its row; the next one still reads
    writer.writerow(["images/extra.png", "word " * 200_000])
    expects.append(_reject(rf"metadata\.csv:{len(rows) + 2}$", "bad_metadata"))
    (root / "images" / "~990~after.png").write_bytes(_flat(990))
    writer.writerow(["images/~990~after.png", "after\x00the \x1b[7mlong\x1b[0m row"])
    expects.append(Expect("~990~", captions=["after the long row"]))
    (root / "metadata.csv").write_bytes(text.getvalue().encode("utf-8", "surrogateescape"))
    _check(_config(make_config, root, "csv"), expects)


def _tar(entries: list[tuple[str, bytes | dict]], compress: bool = False) -> bytes:
    """A tar of (name, data) and (name, TarInfo attributes) entries."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as archive:
        for name, content in entries:
            info = tarfile.TarInfo(name)
            for key, value in ({"size": len(content)} if isinstance(content, bytes) else content).items():
                setattr(info, key, value)
            archive.addfile(info, io.BytesIO(content if isinstance(content, bytes) else bytes(info.size)))
    return gzip.compress(buffer.getvalue(), mtime=0) if compress else buffer.getvalue()


def _lying(entries: list[tuple[str, bytes]], name: str) -> bytes:
    """`entries`, then a member `name` that declares 2^50 bytes and holds 4 KiB; no end."""
    members = [(tarfile.TarInfo(n), data) for n, data in entries] + [(tarfile.TarInfo(name), b"\x89" * 4096)]
    out = b""
    for info, data in members:
        info.size = len(data) if info.name != name else 2**50
        out += info.tobuf(tarfile.GNU_FORMAT) + data + bytes(-len(data) % tarfile.BLOCKSIZE)
    return out


def _sample(key: str, image: bytes, caption: str) -> list[tuple[str, bytes]]:
    return [(f"{key}.png", image), (f"{key}.txt", caption.encode())]


def _offsets(data: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        return {member.name: member for member in archive.getmembers()}


def _damaged_tars() -> dict[str, tuple[bytes, list[Expect]]]:
    """Tars that break off, lie about sizes or are not tars; samples before the damage are kept."""
    cut = _tar(_sample("~800~first", _flat(800), "before the cut") + _sample("~801~cut", _flat(801), "cut short"))
    header = _tar(_sample("~802~ok", _flat(802), "intact") + _sample("~803~behind", _flat(803), "behind"))
    broken = _offsets(header)["~803~behind.png"].offset  # its header's checksum no longer matches
    return {
        "random": (random.Random(SEED).randbytes(5000), []),
        "empty": (b"", []),
        "gzip-not-tar": (gzip.compress(b"hello, not a tar", mtime=0), []),
        "cut": (cut[: _offsets(cut)["~801~cut.png"].offset_data + 100],
                [Expect("~800~", captions=["before the cut"]), Expect("~801~", may_vanish=True)]),
        "bad-header": (header[:broken] + b"X" + header[broken + 1:],
                       [Expect("~802~", captions=["intact"]), Expect("~803~", captions=["behind"], may_vanish=True)]),
        "huge-unsafe": (_lying(_sample("~804~before", _flat(804), "before a huge member"), "../~807~huge.png"),
                        [Expect("~804~", captions=["before a huge member"]), _reject("~807~", "unsafe_member")]),
        "huge-unused": (_lying([], "~805~huge.npy"), []),
        "huge-image": (_lying([], "~806~huge.png"), []),
    }


def test_webdataset(items, make_config, tmp_path):
    root = tmp_path / "wds"
    root.mkdir()
    entries = []
    for index, item in enumerate(items):
        key = f"{_token(index)}{item.label}"
        entries.append((f"{key}.{item.ext}", item.image))
        if item.caption is not None:
            entries.append((f"{key}.txt", _caption_bytes(item.caption)))
    expects = _expects(items)
    filler = _flat(900)  # only in members that are refused
    nested = _tar(_sample("deepest", filler, "four tars down"))
    for level in range(3):
        nested = _tar([(f"level{level}.tar", nested)])
    hostile = [  # name ({} is the token), content, reason
        ("../{}escape.png", filler, "unsafe_member"),
        ("/etc/{}absolute.png", filler, "unsafe_member"),
        ("a/../../{}up.png", filler, "unsafe_member"),
        ("./../{}dot.png", filler, "unsafe_member"),
        ("{}link.png", {"type": tarfile.SYMTYPE, "linkname": "/etc/passwd"}, "unsafe_member"),
        ("{}hard.png", {"type": tarfile.LNKTYPE, "linkname": entries[0][0]}, "unsafe_member"),
        ("{}char.png", {"type": tarfile.CHRTYPE, "devmajor": 1, "devminor": 3}, "unsafe_member"),
        ("{}block.png", {"type": tarfile.BLKTYPE, "devmajor": 8, "devminor": 0}, "unsafe_member"),
        ("{}fifo.png", {"type": tarfile.FIFOTYPE}, "unsafe_member"),
        ("{}unknown.png", {"type": b"Z", "size": 3000}, "unsafe_member"),
        ("{}nested.tar", nested, "nested_archive"),
        ("{}nested.tar.gz", gzip.compress(nested, mtime=0), "nested_archive"),
        ("{}nested.zip", b"PK\x03\x04" + bytes(100), "nested_archive"),
    ]
    for number, (name, content, reason) in enumerate(hostile, start=910):
        entries.append((name.format(_token(number)), content))
        expects.append(_reject(_token(number), reason))
    entries += [("~930~meta.png", _flat(930)), ("~930~meta.json", b'{"text": "a \\u001b[1mjson\\u001b[0m caption"}'),
                ("~931~raw.png", _flat(931)), ("~931~raw.json", b'{"text": "raw\x1b[1m control\x1b[0m"}'),
                ("~932~deep.png", filler), ("~932~deep.json", b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
                ("~933~big.png", filler), ("~933~big.txt", b"y" * (3 << 20)),
                ("~934~lost.txt", b"a caption whose clip is not in the archive")]
    expects += [Expect("~930~", captions=["a json caption"]), Expect("~931~", captions=["raw control"]),
                _reject("~932~", "bad_metadata"), _reject("~933~", "caption_too_long"),
                _reject("~934~", "orphan_caption")]
    (root / "shard-00000.tar").write_bytes(_tar(entries))
    for name, (data, inside) in _damaged_tars().items():
        (root / f"{name}.tar").write_bytes(data)
        expects += [_reject(rf"/{name}\.tar$", "bad_archive")] + inside
    (root / "compressed.tar").write_bytes(_tar(_sample("~940~zipped", _flat(940), "from a gzip tar"), compress=True))
    expects.append(Expect("~940~", captions=["from a gzip tar"]))
    _check(_config(make_config, root, "webdataset"), expects)


def test_bit_flipped_tars_never_fail_ingest(make_config, tmp_path):
    """Random bit flips anywhere in a tar: what can be read is accepted or quarantined."""
    rng = random.Random(SEED)
    root = tmp_path / "flipped"
    root.mkdir()
    (root / "intact.tar").write_bytes(_tar(_sample("kept", _flat(0), "an intact sample")))
    source = _tar(_sample("a", _flat(1), "first") + _sample("b", _flat(2), "second") + [("c.txt", b"stray")])
    for index in range(40):
        flipped = bytearray(source)
        for position in rng.sample(range(len(source) * 8), rng.choice([1, 2, 8, 64])):
            flipped[position // 8] ^= 1 << position % 8
        (root / f"flipped-{index:02d}.tar").write_bytes(bytes(flipped))
    config = _config(make_config, root, "webdataset")
    result = ingest(config.storage, config.dataset)
    store = Store(config.storage)
    report = store.read_json(store.key(result["report"]))
    assert set(report["by_reason"]) <= REASONS, report["by_reason"]
    assert report["samples"] + report["quarantined"] + report["duplicates"] == report["candidates"]
    assert report["by_reason"].get("bad_archive"), report["by_reason"]
    rows = [row for shard in result["shards"]
            for row in read_image_shard(store.read_bytes(f"shards/images/{shard['id']}.parquet")).to_pylist()]
    assert ["an intact sample"] in [row["captions"] for row in rows]
