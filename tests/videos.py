"""Video files written by PyAV for the tests: each frame's index is in its greys (the bottom left
quarter counts frames modulo 32, the bottom right the thirty-twos, 7 levels a step, so a lossy
codec keeps them: 1,024 frames), with a white mark in its top-left corner that shows which way up
it is."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np

STEP = 7  # colour levels from one count to the next


def frame_pixels(index: int, width: int, height: int) -> np.ndarray:
    pixels = np.full((height, width, 3), 16, np.uint8)
    pixels[height // 2 :, : width // 2] += STEP * (index % 32)
    pixels[height // 2 :, width // 2 :] += STEP * (index // 32)
    pixels[: height // 4, : width // 4] = 255
    return pixels


def write_video(path: Path, frames: int = 40, fps: int = 24, size: tuple[int, int] = (96, 64),
                codec: str = "libx264", rotation: int = 0, times: list[float] | None = None,
                container: str | None = None, keyframe_every: int | None = None) -> Path:
    """`frames` frames at `fps` (or shown at `times`, seconds: a variable frame rate) of
    `size` (width, height), the display matrix turned by `rotation` degrees counter-clockwise, a
    keyframe every `keyframe_every` frames (None: the codec's default)."""
    import av

    with av.open(str(path), "w", format=container) as output:
        stream = output.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        if keyframe_every:
            stream.codec_context.gop_size = keyframe_every
        if codec == "mpeg4":  # its default 200 kb/s blurs one grey step into the next
            stream.codec_context.bit_rate = 4_000_000
        if times is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        if rotation:
            stream.set_display_rotation(rotation)
        for index in range(frames if times is None else len(times)):
            frame = av.VideoFrame.from_ndarray(frame_pixels(index, *size), format="rgb24")
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


def level(pixels: np.ndarray) -> int:
    """The frame index a frame shows (its greys, read inside each quarter, away from its edges)."""
    height, width = pixels.shape[:2]
    rows = slice(height * 5 // 8, height * 7 // 8)
    low, high = (float(pixels[rows, columns].mean()) for columns in (slice(width // 8, width * 3 // 8),
                                                                     slice(width * 5 // 8, width * 7 // 8)))
    return round((low - 16) / STEP) + 32 * round((high - 16) / STEP)
