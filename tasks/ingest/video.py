"""Video files into clips: probed without decoding, cut by the clip policy (`dataset.video`),
decoded once, front to back, keeping only the frames the clips take, and stored as animated WebP,
one clip a sample.

A video is read through PyAV (FFmpeg's demuxers and decoders, bundled in its wheels). The probe
demuxes packets (streams, codec, size, the frame count and the duration from the packets' own
timestamps, so a container that misreports its duration, or has none, as webm, is measured by what
it holds) and decodes only the first frame, for the display matrix. Clips are times, `frames` of
them at `fps` from a start; each takes the last frame shown at or before each of its times (what
FFmpeg's fps filter does), so a variable frame rate is resampled by the frames' own timestamps.
Frames are turned upright by the display matrix (phone videos) and scaled to at most
`frame_pixels` before they are kept; only the frames of the clips still being filled are held,
never the video.

A clip's id is the hash of the video's bytes, the clip policy and the clip's place in it: a
rewritten video, or another policy, gives other clips, and an unchanged video the same ones.
"""

from __future__ import annotations

import base64
import io
import json
import math
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from configs.schema import DatasetConfig, VideoConfig
from storage.fingerprint import hash_json, sha256_bytes
from storage.store import file_sha256, space_for
from tasks.ingest.untrusted import CLIP_FRAMES, MASK_FROM_FILE, Rejected, check_geometry, mask_layer

# what makes a clip, in its id and the ingest record: a change of it makes every video's clips again
# (2: frames timed to the container's precision, anamorphic pixels made square; 3: edit lists honoured)
CLIPS_VERSION = 3
Video = bytes | Path  # a video's bytes, or the local file that holds them (one read from a file)
# a gap between clips (seconds) worth a seek to the keyframe before the next rather than decoding
# through it: about a keyframe interval of common encodes (2 to 10 s), so a seek skips at least one
SEEK_SECONDS = 4.0
MAX_STREAMS = 1024  # streams a container is opened with decoding off in (films hold a few; FFmpeg's own cap is 1,000)

# what a video container starts with: an ISO/QuickTime box (mp4, mov) or EBML (webm, mkv)
MP4_BOXES = (b"ftyp", b"moov", b"mdat", b"wide", b"free", b"skip")
EBML = b"\x1a\x45\xdf\xa3"


def is_video(data: bytes) -> bool:
    """Whether a file's bytes (its first 8 will do) are a video container (whatever it was named)."""
    return data[4:8] in MP4_BOXES or data[:4] == EBML


@dataclass(frozen=True)
class Probe:
    codec: str
    width: int  # as shown: after rotation
    height: int
    rotation: int  # degrees counter-clockwise the frames are turned to be shown upright
    frames: int  # packets of the video stream
    fps: float  # frames per second on average (frames over duration)
    duration: float  # seconds, from the first frame's timestamp to the end of the last
    start: float = 0.0  # the first frame's timestamp, seconds: clip times count from it
    # seconds a stored timestamp may be off (half the stream's time base): Matroska and WebM store
    # whole milliseconds, so a frame due at 187.5 ms says 188; a frame within it of a time shows at it
    precision: float = 0.0
    coded: tuple[int, int] = (0, 0)  # the decoded frames' size: the first's (every frame is checked against it)


def _open(data: Video, decode: bool = True):
    """The container; with `decode` False, FFmpeg's look at its streams decodes no frame (a frame
    of a 16,000-pixel-square video is 384 MB): their sizes come from the headers."""
    import av

    skip = {} if decode else {"stream_options": [{"skip_frame": "all"}] * MAX_STREAMS}
    try:
        return av.open(io.BytesIO(data) if isinstance(data, bytes) else str(data), mode="r", metadata_errors="ignore",
                       **skip)
    except (av.error.FFmpegError, ValueError, OSError) as error:  # FFmpeg's words, not the local copy's name
        why = getattr(error, "strerror", None) or error
        raise Rejected("bad_video", f"not a readable video container ({type(error).__name__}: {why})") from None


def _video_stream(container):
    """The first video stream that is not cover art (an mp4's or mkv's attached picture)."""
    import av

    streams = [stream for stream in container.streams if stream.type == "video"
               and not stream.disposition & av.stream.Disposition.attached_pic]
    if not streams:
        kinds = sorted({"cover art" if stream.type == "video" else stream.type for stream in container.streams})
        raise Rejected("no_video_stream",
                       f"the container has no video stream (streams: {', '.join(kinds or ['none'])})")
    return streams[0]


def _listed_span(container, stream, first: float) -> float:
    """How long the container's index says the video lasts from its first frame, where it says so:
    an mp4's track duration (after its edit list; the index comes first in a file made for
    streaming), or the per-track DURATION tag FFmpeg and mkvmerge write into Matroska (the track's
    end: FFmpeg gives a Matroska stream the file's duration, its longest track's); 0 when neither
    is there (a live webm)."""
    if "matroska" not in container.format.name:
        return float(stream.duration * stream.time_base) if stream.duration else 0.0
    try:
        hours, minutes, seconds = stream.metadata.get("DURATION", "").split(":")
        return max(0.0, int(hours) * 3600 + int(minutes) * 60 + float(seconds) - first)
    except ValueError:
        return 0.0


def probe(data: Video, video: VideoConfig, dataset: DatasetConfig) -> Probe:
    """The video's facts from its headers and packets, nothing decoded (a size or duration bomb is
    refused before any frame is), then its first frame (for the display matrix, which PyAV reads
    from frames); Rejected when it cannot give a clip. Its size is as shown: the pixels' aspect
    ratio applied (anamorphic video), turned by the display matrix."""
    import av

    with _open(data, decode=False) as container:
        stream = _video_stream(container)
        context = stream.codec_context
        if context is None:  # a stream whose codec FFmpeg does not know, or a file cut before its headers end
            raise Rejected("bad_video", "its video stream has no codec FFmpeg decodes")
        # a timestamp rounded to the time base is off by at most half of it
        codec, width, height, precision = context.name, context.width, context.height, float(stream.time_base) / 2
        check_geometry(width, height, dataset)  # the decoded frames' size
        pixel = stream.sample_aspect_ratio or context.sample_aspect_ratio
        if pixel and pixel > 0 and pixel != 1:
            width = max(1, round(width * pixel))
            check_geometry(width, height, dataset)  # the shown size
        first = end = None
        frames = 0
        try:
            for packet in container.demux(stream):
                if packet.size == 0 or packet.pts is None or packet.is_discard:
                    # the demuxer's flush packet; no time; hidden by an edit list (a trim kept without re-encoding)
                    continue
                start = float(packet.pts * stream.time_base)
                first = start if first is None else min(first, start)
                end = max(end or start, start + float((packet.duration or 0) * stream.time_base))
                frames += 1
                if end - first > video.max_seconds:
                    raise Rejected("too_long", f"longer than video.max_seconds ({video.max_seconds:g} s)")
        except av.error.FFmpegError as error:
            raise Rejected("bad_video", f"the container breaks off after {frames} frames ({error})") from None
        listed = _listed_span(container, stream, first) if frames else 0.0
    # a file cut short whose index comes first (a streaming mp4, Matroska) demuxes to its cut
    # without an error: what it holds is checked against what its index lists, within two frames
    if frames and listed and end - first + 2 * (end - first) / frames + 2 * precision < listed:
        raise Rejected("truncated",
                       f"the file ends {end - first:.3f} s in; its index says the video lasts {listed:.3f} s")
    if frames < 2:
        raise Rejected("too_few_frames", f"{frames} frame{'s' * (frames != 1)}: a clip needs at least 2")
    duration = end - first
    if duration <= 0:
        raise Rejected("bad_video", f"its {frames} frames have no duration (timestamps {first:g} to {end:g} s)")
    with _open(data) as container:
        try:
            first_frame = next(container.decode(_video_stream(container)), None)
        except av.error.FFmpegError as error:
            raise Rejected("bad_video", f"its first frame does not decode ({error})") from None
        if first_frame is None:
            raise Rejected("bad_video", "its first frame does not decode")
        # every frame is this size (a few pixels over the headers' where a crop is not aligned in memory)
        coded = (first_frame.width, first_frame.height)
        check_geometry(*coded, dataset)
        rotation = round(first_frame.rotation) % 360
    if rotation % 180:
        width, height = height, width
    return Probe(codec, width, height, rotation, frames, frames / duration, duration, first, precision, coded)


def clip_times(probed: Probe, video: VideoConfig) -> list[list[float]]:
    """Each clip's frame times, in seconds from the video's first frame: the longest of
    `video.frames` and `video.frame_buckets` that the video holds at `video.fps` (None: the
    video's own), starting where `video.clips` says, at most `video.max_clips` of them. Rejected
    ("too_short") when not even one fits."""
    fps = video.fps or probed.fps
    available = math.floor((probed.duration + probed.precision) * fps + 1e-6)  # frames at `fps` that the video shows
    lengths = sorted({video.frames, *video.frame_buckets})
    if available < lengths[0]:
        takes = f"at least {lengths[0]}" if len(lengths) > 1 else f"{lengths[0]}"
        raise Rejected("too_short", f"{probed.duration:.2f} s holds {available} frames at {fps:g} fps; a clip takes "
                                    f"{takes}")
    frames = max(n for n in lengths if n <= available)
    last = available - frames  # the latest start
    if video.clips == "head":
        starts = [0]
    elif video.clips == "uniform":
        count = min(video.max_clips, last + 1)
        starts = [round(i * last / (count - 1)) for i in range(count)] if count > 1 else [last // 2]
    else:  # sliding
        stride = video.stride or frames
        starts = list(range(0, last + 1, stride))[: video.max_clips]
    return [[(start + k) / fps for k in range(frames)] for start in starts]


def clip_ids(data_sha256: str, probed: Probe, video: VideoConfig, times: list[list[float]],
             mask_sha256: str | None = None) -> list[str]:
    """The sample ids of a video's clips (`clip_times`): its bytes and what each clip is (its rate,
    first frame and length at that rate, how its frames are stored, and its loss mask's bytes if it
    has one). What only chooses clips (where, how many, the limits) is no part of it: a clip
    another policy also takes keeps its id."""
    fps = video.fps or probed.fps
    masked = {} if mask_sha256 is None else {"mask": mask_sha256}
    return [hash_json({"video": data_sha256, "fps": fps, "start": round(clip[0] * fps), "frames": len(clip),
                       "frame_pixels": video.frame_pixels, "quality": video.quality, "made": CLIPS_VERSION, **masked})
            for clip in times]


def decode_clips(data: Video, probed: Probe, times: dict[int, list[float]], video: VideoConfig,
                 take: Callable[[int, list[Image.Image]], None]) -> None:
    """Decode the video front to back, seeking over gaps of more than SEEK_SECONDS between clips
    (to the keyframe at or before the next clip, so the frames after it are decoded as they would
    be from the start), and hand each clip's frames to `take(index, frames)` as soon as its last
    is decoded; a frame no clip still needs is let go. A video whose frames end before its clips
    do is Rejected ("truncated"): the caller keeps nothing of a video that raises, so its clips
    handed on before are dropped too."""
    import av

    if not times:
        return
    wanted = sorted({t for clip in times.values() for t in clip})
    shown: dict[float, Image.Image] = {}
    next_wanted, current, picture = 0, None, None
    pending = dict(times)

    def show(until: float) -> None:
        """The current frame for every wanted time before `until`, made a picture once if at all
        (most decoded frames, between a clip's times or between clips, never are)."""
        nonlocal next_wanted, picture
        while next_wanted < len(wanted) and wanted[next_wanted] < until and current is not None:
            picture = picture or _upright(current, probed, video)
            shown[wanted[next_wanted]] = picture
            next_wanted += 1

    with _open(data) as container:
        stream = _video_stream(container)
        stream.thread_type = "AUTO"
        seek_to: float | None = wanted[0]
        seeking = True  # until a seek lands past its time (a container without an index)
        try:
            while pending:
                if seek_to is not None:  # to the keyframe at or before it
                    container.seek(int((probed.start + seek_to) / stream.time_base), stream=stream, backward=True,
                                   any_frame=False)
                    sought, seek_to, current, picture = seek_to, None, None, None
                for frame in container.decode(stream):
                    if frame.pts is None:
                        continue
                    time = float(frame.pts * stream.time_base) - probed.start
                    check_frame(frame, time, probed.coded)
                    if current is None and time > wanted[next_wanted] + probed.precision + 1e-9 and sought > 0:
                        seek_to, seeking = 0.0, False  # it landed past the time: from the start, never again
                        break
                    show(time - probed.precision - 1e-9)  # every wanted time before this frame shows the one before
                    current, picture = frame, None
                    _hand_on(pending, shown, take)
                    if seeking and pending and wanted[next_wanted] - time > SEEK_SECONDS:
                        seek_to = wanted[next_wanted]  # a gap to seek over
                    if seek_to is not None or not pending:
                        break
                else:
                    show(probed.duration + 1e-9)  # the last frame shows until the video ends
                    break
        except av.error.FFmpegError as error:
            raise Rejected("bad_video", f"decoding failed at {len(shown)} of {len(wanted)} frames ({error})") from None
    _hand_on(pending, shown, take)
    if pending:
        raise Rejected("truncated", f"the video's frames end before its clips do ({len(shown)} of {len(wanted)} "
                                    f"frames decoded)")


def check_frame(frame, time: float, coded: tuple[int, int]) -> None:
    """A decoded frame is the first frame's size: a stream that changes size midway would slip
    past the size limit (checked on the headers and the first frame) and be squashed into the
    first size."""
    if (frame.width, frame.height) != coded:
        raise Rejected("bad_video", f"its frames change size at {time:.2f} s: {frame.width}×{frame.height}, the "
                                    f"first is {coded[0]}×{coded[1]}")


def _hand_on(pending: dict[int, list[float]], shown: dict[float, Image.Image],
             take: Callable[[int, list[Image.Image]], None]) -> None:
    for index in [index for index, clip in pending.items() if clip[-1] in shown]:
        take(index, [shown[t] for t in pending.pop(index)])
    needed = {t for clip in pending.values() for t in clip}
    for t in [t for t in shown if t not in needed]:
        del shown[t]  # no clip still to come shows it


def _upright(frame, probed: Probe, video: VideoConfig) -> Image.Image:
    """The frame as an RGB picture, turned upright, scaled to at most `video.frame_pixels`."""
    width, height = (probed.height, probed.width) if probed.rotation % 180 else (probed.width, probed.height)
    scale = min(1.0, math.sqrt(video.frame_pixels / (width * height)))
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    image = frame.to_image(width=size[0], height=size[1])  # scaled by FFmpeg's swscale, in C
    if probed.rotation:
        image = image.rotate(probed.rotation, expand=True)
    return image


def clip_bytes(frames: list[Image.Image], fps: float, quality: int, mask: Image.Image | None = None) -> bytes:
    """A clip as an animated WebP, each frame shown 1/fps s, its frame count in its XMP: WebP's
    encoder stores a frame that repeats the one before as a longer showing of it. A loss `mask`
    (grey, the frames' size) is stored once, a PNG in the XMP (MASK_FROM_FILE): as the frames'
    alpha, an animated WebP keeps no pixel under a transparent one from frame to frame."""
    out = io.BytesIO()
    meta: dict[str, Any] = {CLIP_FRAMES: len(frames)}
    if mask is not None:
        png = io.BytesIO()
        mask.save(png, format="PNG")
        meta[MASK_FROM_FILE] = base64.b64encode(png.getvalue()).decode()
    # method 0, libwebp's fastest: about the same bytes as its default (4) in half the time or less
    # (benchmarks/video.py)
    frames[0].save(out, format="WEBP", save_all=True, append_images=frames[1:], quality=quality, method=0,
                   duration=round(1000 / fps), loop=0, xmp=json.dumps(meta).encode())
    return out.getvalue()


def clip_mask(data: bytes) -> Image.Image | None:
    """A stored clip's loss mask (grey, the frames' size: every frame's), None when it has none."""
    with Image.open(io.BytesIO(data)) as opened:
        xmp = opened.info.get("xmp") if opened.format == "WEBP" else None
    try:
        png = json.loads(xmp).get(MASK_FROM_FILE) if xmp else None
        if not isinstance(png, str):
            return None
        with Image.open(io.BytesIO(base64.b64decode(png)), formats=["PNG"]) as mask:
            return mask.convert("L")
    except (ValueError, TypeError, AttributeError, OSError, Image.DecompressionBombError):  # another program's XMP
        return None


def clip_frames(data: bytes) -> Iterator[Image.Image]:
    """The frames of a stored sample (a picture is one: its first frame), RGB. libwebp stores a
    clip's frame that repeats the one before (or is within its lossy tolerance of it: 2 grey levels
    at quality 90) as a longer showing of it, down to one frame for a still clip; such a frame is
    given back as often as it was shown, `frame_count` frames in all."""
    from PIL import ImageSequence

    count = frame_count(data)
    with Image.open(io.BytesIO(data)) as opened:
        if count == 1:
            yield opened.convert("RGB")
            return
        frames = [(frame.convert("RGB"), frame.info.get("duration") or 0) for frame in ImageSequence.Iterator(opened)]
    total = sum(duration for _, duration in frames)
    given, shown = 0, 0
    for frame, duration in frames:
        shown += duration if total else 1
        until = round(shown * count / (total or len(frames)))  # frames given by the end of this one's showing
        yield from [frame] * (until - given)
        given = until


def frame_count(data: bytes) -> int:
    """The frames of a stored sample: a clip's from its XMP, a picture's 1."""
    with Image.open(io.BytesIO(data)) as opened:
        xmp = opened.info.get("xmp") if opened.format == "WEBP" else None
    try:
        return int(json.loads(xmp)[CLIP_FRAMES]) if xmp else 1
    except (ValueError, TypeError, KeyError):  # another program's XMP: a picture
        return 1


def read_video(data: Video, dataset: DatasetConfig, stored: Callable[[str], Any],
               keep: Callable[[str, bytes], None], mask: bytes | None = None) -> list[tuple[str, int, int, bool]]:
    """A video's clips as samples: (sample id, width, height, whether it was new) each; new clips
    decoded and handed to `keep`. With `mask` (a mask file's bytes: a source's `masks: files` or
    `column`), every frame of every clip takes it as its alpha, resized to the frames (a mask that
    stays where the video's frames are), and the clips are samples of their own. Rejected as a
    whole when any clip cannot be made."""
    video = dataset.video
    layer = None if mask is None else mask_layer(mask, dataset)  # resized to the frames when the first is made
    probed = probe(data, video, dataset)
    times = clip_times(probed, video)
    ids = clip_ids(sha256_bytes(data) if isinstance(data, bytes) else file_sha256(data), probed, video, times,
                   None if mask is None else sha256_bytes(mask))
    sizes: dict[int, tuple[int, int]] = {}
    for index, sample_id in enumerate(ids):
        if (known := stored(sample_id)) is not None:  # a shard holds it: not decoded again
            sizes[index] = tuple(known)
    made: dict[int, tuple[int, int]] = {}  # a clip's offset and length in `spill`
    with tempfile.TemporaryFile(prefix="precast-clips-") as spill:  # made clips wait on disk, not in memory

        def take(index: int, frames: list[Image.Image]) -> None:
            grey = None if layer is None else layer.resize(frames[0].size, Image.Resampling.BILINEAR)
            if grey is not None and grey.getextrema()[1] == 0:
                raise Rejected("empty_mask", "its mask, at the frames' size, is black everywhere: no pixel of it "
                                             "would be learned")
            clip = clip_bytes(frames, video.fps or probed.fps, video.quality, grey)
            with space_for(tempfile.gettempdir(), "a video's clips"):
                made[index] = (spill.tell(), spill.write(clip))
                spill.flush()  # on disk now: a full disk is DiskFull here, not an error later
            sizes[index] = frames[0].size

        decode_clips(data, probed, {index: clip for index, clip in enumerate(times) if index not in sizes}, video, take)
        for index, (offset, length) in made.items():  # only once every clip is made: nothing of a broken video is kept
            spill.seek(offset)
            keep(ids[index], spill.read(length))
    return [(ids[index], *sizes[index], index in made) for index in range(len(ids))]
