"""Video files written by PyAV for the tests: each frame's index is in its greys (the bottom left
quarter counts frames modulo 32, the bottom right the thirty-twos, 7 levels a step, so a lossy
codec keeps them: 1,024 frames), with a white mark in its top-left corner that shows which way up
it is."""

from __future__ import annotations

import functools

import numpy as np

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
