"""Video files written by PyAV for the tests: each frame's index is in its greys (the bottom left
quarter counts frames modulo 32, the bottom right the thirty-twos, 7 levels a step, so a lossy
codec keeps them: 1,024 frames), with a white mark in its top-left corner that shows which way up
it is."""

from __future__ import annotations

import functools
import io
from fractions import Fraction
from pathlib import Path

import numpy as np
from PIL import Image

from tasks.demo import videos

STEP = 7  # colour levels from one count to the next


def frame_pixels(index: int, width: int, height: int) -> np.ndarray:
    pixels = np.full((height, width, 3), 16, np.uint8)
    pixels[height // 2 :, : width // 2] += STEP * (index % 32)
    pixels[height // 2 :, width // 2 :] += STEP * (index // 32)
    pixels[: height // 4, : width // 4] = 255
    return pixels


# the test videos: frame_pixels' frames
write_video = functools.partial(videos.write_video, draw=frame_pixels)


def level(pixels: np.ndarray) -> int:
    """The frame index a frame shows (its greys, read inside each quarter, away from its edges)."""
    height, width = pixels.shape[:2]
    rows = slice(height * 5 // 8, height * 7 // 8)
    low, high = (float(pixels[rows, columns].mean()) for columns in (slice(width // 8, width * 3 // 8),
                                                                     slice(width * 5 // 8, width * 7 // 8)))
    return round((low - 16) / STEP) + 32 * round((high - 16) / STEP)


def remux(source: Path, target: Path, shift: float = 0.0, audio_seconds: float = 0.0, **options: str) -> Path:
    """`source`'s video packets into another container (by `target`'s name) with the muxer's
    `options` (e.g. movflags=faststart: an mp4's index first), their times `shift` seconds earlier
    (what a trim kept without re-encoding is, `ffmpeg -ss 1 -c copy`: the packets from the keyframe
    before, the ones before the cut listed in an edit list that hides them), beside `audio_seconds`
    of silence where given."""
    import av

    with av.open(str(source)) as given, av.open(str(target), "w", options=options or None) as output:
        stream = given.streams.video[0]
        out = output.add_stream_from_template(stream)
        audio = output.add_stream("aac", rate=16000) if audio_seconds else None
        for packet in given.demux(stream):
            if packet.dts is None:
                continue  # the demuxer's flush packet
            ticks = round(shift / stream.time_base)
            packet.pts, packet.dts, packet.stream = packet.pts - ticks, packet.dts - ticks, out
            output.mux(packet)
        if audio is not None:
            _silence(output, audio, audio_seconds)
    return target


def _silence(output, audio, seconds: float) -> None:
    import av

    for index in range(round(seconds * 16000 / 1024)):
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate, frame.pts = 16000, index * 1024
        output.mux(audio.encode(frame))
    output.mux(audio.encode())


def write_cover_art(path: Path) -> Path:
    """An audio file with cover art: an mp4 of AAC with a PNG as an attached picture, which FFmpeg
    shows as a one-frame video stream (as a song or a podcast is)."""
    import av

    with av.open(str(path), "w", format="mp4") as output:
        audio = output.add_stream("aac", rate=16000)
        cover = output.add_stream("png", rate=1)
        cover.width, cover.height, cover.pix_fmt = 64, 64, "rgb24"
        cover.disposition = av.stream.Disposition.attached_pic
        picture = io.BytesIO()
        Image.new("RGB", (64, 64), (200, 0, 0)).save(picture, format="PNG")
        packet = av.Packet(picture.getvalue())
        packet.stream, packet.time_base, packet.pts, packet.dts, packet.is_keyframe = cover, Fraction(1, 1), 0, 0, True
        output.mux(packet)
        _silence(output, audio, 1.28)
    return path


def write_resizing(path: Path, sizes: list[tuple[int, int]], fps: int = 24) -> Path:
    """Motion JPEG in Matroska whose headers say the first frame's size and whose frames have the
    `sizes` given (each packet a JPEG of its own size: a stream can change size midway)."""
    import av

    with av.open(str(path), "w", format="matroska") as output:
        stream = output.add_stream("mjpeg", rate=fps)
        stream.width, stream.height, stream.pix_fmt = *sizes[0], "yuvj420p"
        stream.time_base = Fraction(1, 1000)
        for index, size in enumerate(sizes):
            picture = io.BytesIO()
            Image.fromarray(frame_pixels(index, *size)).save(picture, format="JPEG", quality=90)
            packet = av.Packet(picture.getvalue())
            packet.stream, packet.time_base, packet.is_keyframe = stream, Fraction(1, 1000), True
            packet.pts = packet.dts = round(index * 1000 / fps)
            packet.duration = round(1000 / fps)
            output.mux(packet)
    return path
