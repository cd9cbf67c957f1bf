"""Video files into clips (tasks/ingest/video.py), through the ingest stage as users run it: mp4,
webm, mkv and mov beside pictures, cut by the clip policy, resampled by the frames' own
timestamps, turned upright, and every hostile video quarantined with its reason; a nightly ingest
after one new video reads only that video; Wan encodes and trains on the clips, and a family that
trains on pictures quarantines them, naming why."""

from __future__ import annotations

import io
import json
import shutil
from fractions import Fraction

import numpy as np
import pytest
import torch
from PIL import Image, ImageSequence

from configs.schema import DatasetConfig, PipelineConfig, StorageConfig
from storage import layout
from storage.shards import LatentShard, read_image_shard
from storage.store import Store
from tasks.ingest.stage import ingest
from flows.cli import main
from tasks.ingest.untrusted import Rejected
from tasks.ingest.video import CLIP_FRAMES, clip_frames, clip_mask, clip_times, decode_clips, frame_count, probe
from tasks.demo.videos import write_audio_only
from tests.videos import frame_pixels, level, remux, write_cover_art, write_resizing, write_video

# 17 frames a clip at 16 fps, every 8 frames, two clips at most a video; pictures and videos of at
# most 10,000 pixels and 3 s
VIDEO = {"frames": 17, "fps": 16, "clips": "sliding", "max_clips": 2, "stride": 8, "max_seconds": 3}
RULES = {"min_side": 32, "max_pixels": 10_000}
CLIPS = {"ok.mp4": 2, "ok.webm": 2, "ok.mkv": 2, "portrait.mov": 1, "vfr.mp4": 2, "anamorphic.mp4": 2, "still.mp4": 2,
         "sound.mkv": 2, "late.mkv": 2}
PICTURES = ("picture.png", "animated.webp", "forged.webp", "escaped.webp", "tagged.webp")  # each a one-frame sample
QUARANTINED = {"truncated.mp4": {"bad_video"}, "audio.mp4": {"no_video_stream"}, "single.mp4": {"too_few_frames"},
               "short.mp4": {"too_short"}, "huge.mp4": {"too_large"}, "long.mp4": {"too_long"},
               "uncaptioned.mp4": {"missing_caption"}, "lonely.txt": {"orphan_caption"},
               # an mp4 box, then zeros: FFmpeg's probe may read it as another format, with no video
               "noise.mp4": {"bad_video", "no_video_stream"}, "notes.mov": {"bad_video"},
               # cut short with the index first: their demuxers end at the cut without an error
               "cut-faststart.mp4": {"truncated"}, "cut.mkv": {"truncated"},
               "song.mp4": {"no_video_stream"}, "resizing.mkv": {"bad_video"}}
VFR_TIMES = [sum(0.04 if i % 2 else 0.08 for i in range(n)) for n in range(30)]  # 12.5 and 25 fps by turns


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    """A folder of videos and a picture, each with its caption but one, a caption alone, and the
    hostile ones."""
    root = tmp_path_factory.mktemp("videos")
    write_video(root / "ok.mp4")  # 40 frames at 24 fps: 1.67 s, 26 frames at 16 fps
    write_video(root / "ok.webm", frames=50, fps=30, codec="libvpx-vp9")
    write_video(root / "ok.mkv", frames=40, fps=25, codec="mpeg4")
    write_video(root / "portrait.mov", frames=30, rotation=90)  # shown 64 wide and 96 high
    write_video(root / "vfr.mp4", times=VFR_TIMES)
    write_video(root / "anamorphic.mp4", size=(64, 64), pixel_aspect=Fraction(3, 2))  # shown 96 wide
    write_video(root / "still.mp4", draw=lambda index, width, height: frame_pixels(0, width, height))
    Image.fromarray(frame_pixels(0, 80, 80)).save(root / "picture.png")
    frames = [Image.fromarray(frame_pixels(index, 64, 64)) for index in range(3)]
    frames[0].save(root / "animated.webp", save_all=True, append_images=frames[1:], duration=100)
    # a picture whose XMP says what precast's clips say there: still one frame
    frames[0].save(root / "forged.webp", xmp=json.dumps({CLIP_FRAMES: 5}).encode())
    # the same, its keys escaped, with a mask that is no PNG: a picture all the same
    frames[0].save(root / "escaped.webp", xmp=b'{"precast.clip\\u005fframes": 5, "precast.mask_from_file": "!"}')
    frames[0].save(root / "tagged.webp", xmp=b"<x:xmpmeta>a photographer's own XMP</x:xmpmeta>")  # stored as is
    # what its index says of the file is its longest track's (audio 4 s), or its video's end (from 0.5 s)
    remux(root / "ok.mp4", root / "sound.mkv", audio_seconds=4.0)
    write_video(root / "late.mkv", times=[0.5 + index / 24 for index in range(40)])
    remux(root / "ok.mp4", root / "faststart.mp4", movflags="faststart")
    for whole, cut in (("faststart.mp4", "cut-faststart.mp4"), ("ok.mkv", "cut.mkv")):
        data = (root / whole).read_bytes()
        (root / cut).write_bytes(data[: len(data) * 3 // 5])
    (root / "faststart.mp4").unlink()
    write_cover_art(root / "song.mp4")
    write_resizing(root / "resizing.mkv", [(96, 64)] * 10 + [(3000, 3000)] * 30)
    data = (root / "ok.mp4").read_bytes()
    (root / "truncated.mp4").write_bytes(data[: len(data) * 2 // 3])
    (root / "noise.mp4").write_bytes(data[:8] + bytes(4000))  # an mp4 box, then nothing
    (root / "notes.mov").write_text("a text file named as a video")
    write_audio_only(root / "audio.mp4")
    write_video(root / "single.mp4", frames=1)
    write_video(root / "short.mp4", frames=5)  # 0.21 s: 3 frames at 16 fps
    write_video(root / "huge.mp4", size=(128, 128))  # 16,384 pixels a frame
    write_video(root / "long.mp4", frames=100)  # 4.2 s
    for path in root.iterdir():
        path.with_suffix(".txt").write_text(f"a grey {path.stem} clip")
    write_video(root / "uncaptioned.mp4")
    (root / "lonely.txt").write_text("a caption whose video never came")
    return root


def _ingest(root, source, **video) -> tuple[dict, Store]:
    storage = StorageConfig(root=str(root))
    dataset = DatasetConfig(sources=[{"path": str(source)}], shard_size=8, video={**VIDEO, **video}, **RULES)
    return ingest(storage, dataset), Store(storage)


def _samples(store: Store, record: dict) -> dict[str, list[dict]]:
    """The dataset's stored samples by their source file's name."""
    by_source: dict[str, list[dict]] = {}
    for shard in store.read_json(store.key(record["url"]))["shards"]:
        for row in read_image_shard(store.read_bytes(layout.image_shard(shard["id"]))).to_pylist():
            if shard["samples"] is None or row["sample_id"] in shard["samples"]:  # a shard partly superseded
                by_source.setdefault(row["source"].rsplit("/", 1)[-1], []).append(row)
    return by_source


def test_videos_become_clips_and_hostile_videos_are_quarantined_with_their_reason(videos, tmp_path):
    record, store = _ingest(tmp_path / "store", videos)
    samples = _samples(store, record)
    assert {name: len(rows) for name, rows in samples.items()} == {**CLIPS, **dict.fromkeys(PICTURES, 1)}
    report = store.read_json(store.key(record["report"]))
    quarantined = {q["source"].rsplit("/", 1)[-1]: q["reason"] for q in report["quarantine"]}
    assert set(quarantined) == set(QUARANTINED) and report["quarantined"] == len(QUARANTINED), report["quarantine"]
    assert all(reason in QUARANTINED[name] for name, reason in quarantined.items()), quarantined
    assert not [q for q in report["quarantine"] if "precast-video-" in q["message"]]  # no local copy's name
    for name, count in CLIPS.items():
        for row in samples[name]:
            frames = list(clip_frames(row["image"]))
            assert len(frames) == 17 and frames[0].size == (row["width"], row["height"])
            assert row["captions"] == [f"a grey {name.split('.')[0]} clip"]
    assert (samples["portrait.mov"][0]["width"], samples["portrait.mov"][0]["height"]) == (64, 96)
    assert (samples["anamorphic.mp4"][0]["width"], samples["anamorphic.mp4"][0]["height"]) == (96, 64)
    for name in PICTURES:  # an animated picture is its first frame
        assert frame_count(samples[name][0]["image"]) == len(list(clip_frames(samples[name][0]["image"]))) == 1
        assert clip_mask(samples[name][0]["image"]) is None
    assert samples["tagged.webp"][0]["image"] == (videos / "tagged.webp").read_bytes()
    still = [level(np.asarray(frame)) for frame in clip_frames(samples["still.mp4"][0]["image"])]
    assert still == [0] * 17  # libwebp stores it as one frame shown 17 times


@pytest.mark.parametrize("clips, starts", [("head", [0]), ("uniform", [0, 4, 9]), ("sliding", [0, 8])])
def test_clips_take_the_frame_shown_at_each_time_of_the_resampled_rate(videos, tmp_path, clips, starts):
    """ok.mp4 at 24 fps resampled to 16: a clip's frame k at (start + k) / 16 s shows source
    frame ⌊(start + k) · 24 / 16⌋, the last one shown by then; its clips start where the policy says."""
    source = tmp_path / "source"
    source.mkdir()
    shutil.copy(videos / "ok.mp4", source)
    shutil.copy(videos / "ok.txt", source)
    record, store = _ingest(tmp_path / "store", source, clips=clips, max_clips=3)
    rows = _samples(store, record)["ok.mp4"]
    shown = sorted([level(np.asarray(frame)) for frame in clip_frames(row["image"])] for row in rows)
    assert shown == [[(start + k) * 24 // 16 for k in range(17)] for start in starts]


@pytest.mark.parametrize("name, rate, fps", [("at16.webm", 16, 16), ("at24.mkv", 24, 24), ("at24.mkv", 24, 12),
                                              ("at30.mkv", 30, 15), ("at16.mkv", 16, 16), ("coarse.mp4", 24, 24),
                                              ("coarse.mp4", 24, 12)])
def test_clips_of_containers_that_round_their_times_show_every_frame_they_should(tmp_path, name, rate, fps):
    """WebM and Matroska store a frame's time in whole milliseconds (a frame due at 187.5 ms says
    188), some mp4s in ticks of a whole frame: a clip at the video's own rate, or half of it, shows
    each source frame once, or every second one, and a video exactly one clip long gives that clip
    (17 frames at 16 fps: 1.0625 s)."""
    codec = "libvpx-vp9" if name.endswith(".webm") else "libx264"
    frames = 17 if fps == rate == 16 else 40
    data = write_video(tmp_path / name, frames=frames, fps=rate, codec=codec, container="matroska"
                       if name.endswith(".mkv") else None, timescale=rate if name == "coarse.mp4" else None).read_bytes()
    dataset = DatasetConfig(sources=[{"path": "x"}], video={**VIDEO, "fps": fps, "clips": "head"}, **RULES)
    probed = probe(data, dataset.video, dataset)
    (times,) = clip_times(probed, dataset.video)
    clips = {}
    decode_clips(data, probed, {0: times}, dataset.video, lambda i, frames: clips.update({i: frames}))
    assert [level(np.asarray(frame)) for frame in clips[0]] == [k * rate // fps for k in range(17)]


@pytest.mark.parametrize("name, codec", [("long.mp4", "libx264"), ("long.webm", "libvpx-vp9"), ("long.mkv", "mpeg4")])
def test_clips_far_apart_are_reached_by_seeking_and_show_the_frames_decoding_from_the_start_shows(
        tmp_path, name, codec):
    """Three clips spread over a 25 s video (a keyframe every 2 s): the decoder seeks over the gaps
    to the keyframe before each clip, and each clip frame is still the source frame shown at its
    time, ⌊t · 24⌋."""
    from tasks.ingest.video import SEEK_SECONDS

    data = write_video(tmp_path / name, frames=600, codec=codec, keyframe_every=48).read_bytes()
    dataset = DatasetConfig(sources=[{"path": "x"}], video={**VIDEO, "clips": "uniform", "max_clips": 3,
                                                            "max_seconds": 60}, **RULES)
    probed = probe(data, dataset.video, dataset)
    times = clip_times(probed, dataset.video)
    assert times[1][0] - times[0][-1] > SEEK_SECONDS  # gaps worth a seek
    clips = {}
    decode_clips(data, probed, dict(enumerate(times)), dataset.video, lambda i, frames: clips.update({i: frames}))
    for index, clip in enumerate(times):
        assert [level(np.asarray(frame)) for frame in clips[index]] == [int(t * 24 + 1e-9) for t in clip], index


PROBE_PEAK = """
import resource, sys
from configs.schema import DatasetConfig
from tasks.ingest.untrusted import Rejected
from tasks.ingest.video import probe
data = open(sys.argv[1], "rb").read()
dataset = DatasetConfig(sources=[{"path": "x"}])  # the default rules: at most 89,478,485 pixels
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    probe(data, dataset.video, dataset)
except Rejected as problem:
    print(problem.reason, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10)
"""
BOMB = """
import av, sys
with av.open(sys.argv[1], "w", format="mp4") as out:
    stream = out.add_stream("libx264", rate=16, options={"preset": "ultrafast"})
    stream.width = stream.height = 10_000
    frame = av.VideoFrame(10_000, 10_000, "yuv420p")
    for plane in frame.planes:
        plane.update(bytes(plane.buffer_size))
    for index in range(2):
        frame.pts = index
        out.mux(stream.encode(frame))
    out.mux(stream.encode())
"""


def test_a_video_of_absurd_size_is_refused_from_its_headers_before_a_frame_is_decoded(tmp_path):
    """10,000 x 10,000 pixels of H.264 in 0.3 MB: refused as too_large with memory flat (a decoded
    frame alone is 150 MB; FFmpeg's first look at the streams decoded one, and so did the probe).
    Each side in a process of its own: writing it takes 1 GB."""
    import subprocess
    import sys

    bomb = tmp_path / "bomb.mp4"
    subprocess.run([sys.executable, "-c", BOMB, str(bomb)], check=True)
    found = subprocess.run([sys.executable, "-c", PROBE_PEAK, str(bomb)], check=True, capture_output=True, text=True)
    reason, grown = found.stdout.split()
    assert reason == "too_large" and int(grown) < 50, found.stdout  # MiB


def test_frame_buckets_give_short_videos_shorter_clips_and_a_clip_keeps_its_id_under_another_policy(videos, tmp_path):
    """With frame_buckets a video too short for `frames` gives clips of the longest bucket it holds;
    a clip's id names what it is (video, rate, start, length, storage), so a policy that takes the
    same clip, or changes only a limit, keeps its id and its stored frames."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("ok.mp4", "ok.txt", "short.mp4", "short.txt"):  # 26 and 3 frames at 16 fps
        shutil.copy(videos / name, source)
    write_video(source / "mid.mp4", frames=12)  # 0.5 s: 8 frames at 16 fps
    (source / "mid.txt").write_text("a grey mid clip")
    record, store = _ingest(tmp_path / "buckets", source, clips="head", frame_buckets=[5, 9])
    samples = _samples(store, record)
    lengths = {name: [len(list(clip_frames(row["image"]))) for row in rows] for name, rows in samples.items()}
    assert lengths == {"ok.mp4": [17], "mid.mp4": [5]}
    (entry,) = store.read_json(store.key(record["report"]))["quarantine"]
    assert (entry["reason"], entry["message"]) == ("too_short", "0.21 s holds 3 frames at 16 fps; a clip takes at least 5")

    def ids(name: str, **video) -> list[str]:
        found, found_store = _ingest(tmp_path / name, source, **video)
        return sorted(row["sample_id"] for row in _samples(found_store, found)["ok.mp4"])

    head = ids("head", clips="head")
    assert ids("limits", clips="head", max_seconds=30, max_clips=5) == head
    assert head == [samples["ok.mp4"][0]["sample_id"]]  # buckets do not rename a clip of `frames`
    sliding = ids("sliding", clips="sliding", stride=8)  # clips from 0 and 8
    assert len(sliding) == 2 and head[0] in sliding


INGEST_PEAK = """
import json, resource, sys
from configs.schema import DatasetConfig, StorageConfig
from tasks.ingest.stage import ingest
dataset = DatasetConfig(sources=[{"path": sys.argv[1]}], min_side=32, video=json.loads(sys.argv[3]))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
record = ingest(StorageConfig(root=sys.argv[2]), dataset)
print(record["samples"], (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10)
"""


def test_a_large_video_file_is_read_through_local_disk_never_held_in_memory(videos, tmp_path):
    """A 400 MiB mp4 (a short video, then a `free` box of zeros, sparse on disk): its clips come out
    and the ingest's peak memory grows by far less than the file (it grew by more than the file when
    a video was read into memory to be hashed and decoded). In a process of its own."""
    import json
    import struct
    import subprocess
    import sys

    source = tmp_path / "source"
    source.mkdir()
    padding = 400 << 20
    with (source / "large.mp4").open("wb") as handle:
        handle.write((videos / "ok.mp4").read_bytes() + struct.pack(">I4s", padding, b"free"))
        handle.truncate(handle.tell() + padding - 8)
    (source / "large.txt").write_text("a large grey clip")
    found = subprocess.run([sys.executable, "-c", INGEST_PEAK, str(source), str(tmp_path / "store"),
                            json.dumps({**VIDEO, "max_seconds": 3})], check=True, capture_output=True, text=True)
    samples, grown = map(int, found.stdout.split())
    assert samples == 2 and grown < 200, found.stdout  # MiB


def test_a_variable_frame_rate_is_resampled_by_the_frames_timestamps(videos):
    data = (videos / "vfr.mp4").read_bytes()
    dataset = DatasetConfig(sources=[{"path": "x"}], video=VIDEO, **RULES)
    probed = probe(data, dataset.video, dataset)
    assert probed.frames == 30 and probed.duration == pytest.approx(VFR_TIMES[-1] + 0.04, abs=0.05)
    times = clip_times(probed, dataset.video)
    assert [clip[0] for clip in times] == [0, 0.5]
    from tasks.ingest.video import decode_clips

    clips = {}
    decode_clips(data, probed, dict(enumerate(times)), dataset.video, lambda i, frames: clips.update({i: frames}))
    for index, clip in enumerate(times):
        expected = [max(i for i, shown in enumerate(VFR_TIMES) if shown <= t + 1e-9) for t in clip]
        assert [level(np.asarray(frame)) for frame in clips[index]] == expected


def test_a_video_trimmed_by_an_edit_list_gives_the_frames_it_shows_not_the_ones_it_hides(tmp_path):
    """A trim kept without re-encoding (the packets from the keyframe before the cut, an edit list
    hiding those before it) shows its frames from the cut: a clip starts there, and its length is
    what is shown."""
    whole = write_video(tmp_path / "whole.mp4", frames=60, fps=24, keyframe_every=60)  # one keyframe
    data = remux(whole, tmp_path / "trimmed.mp4", shift=1.0).read_bytes()  # frames 24 to 59 shown
    dataset = DatasetConfig(sources=[{"path": "x"}], video={"frames": 17, "fps": 16}, **RULES)
    probed = probe(data, dataset.video, dataset)
    assert (probed.frames, probed.duration, probed.start) == (36, 1.5, 0.0)
    clips = {}
    decode_clips(data, probed, dict(enumerate(clip_times(probed, dataset.video))), dataset.video,
                 lambda index, frames: clips.update({index: frames}))
    assert [level(np.asarray(frame)) for frame in clips[0]] == [24 + k * 24 // 16 for k in range(17)]
    longer = DatasetConfig(sources=[{"path": "x"}], video={"frames": 25, "fps": 16}, **RULES)
    with pytest.raises(Rejected, match="1.50 s holds 24 frames"):  # the 2.5 s the packets span is not shown
        clip_times(probe(data, longer.video, longer), longer.video)


def test_a_rotated_video_is_stored_upright(videos, tmp_path):
    """The display matrix turns the frames 90° counter-clockwise: the stored clip is portrait, the
    mark that was top left of the coded frame bottom left."""
    record, store = _ingest(tmp_path / "store", videos)
    frame = np.asarray(next(clip_frames(_samples(store, record)["portrait.mov"][0]["image"])))
    assert frame.shape[:2] == (96, 64)
    assert frame[-10:, :10].mean() > 240 and frame[:10, :10].mean() < 200


def test_a_nightly_ingest_after_one_new_video_reads_only_that_videos_bytes(videos, tmp_path):
    source = tmp_path / "source"
    shutil.copytree(videos, source)
    first, _ = _ingest(tmp_path / "store", source)
    write_video(source / "new.mp4", frames=30)
    (source / "new.txt").write_text("a new clip")
    again, store = _ingest(tmp_path / "store", source)
    assert again["work"]["units_read"] == 1 and again["work"]["units_reused"] == first["work"]["units_read"]
    assert again["work"]["bytes_read"] == (source / "new.mp4").stat().st_size + (source / "new.txt").stat().st_size
    assert again["samples"] == first["samples"] + 1 and again["new_samples"] == 1


def test_an_ingest_recorded_before_clips_were_made_this_way_reads_its_videos_again_not_its_pictures(
        videos, tmp_path, monkeypatch):
    """Clips made another way (an older CLIPS_VERSION in the last ingest's record) are made again
    from their videos, wherever they are (a parquet cell, a file named as a picture); the pictures
    are taken from the record, unread."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import tasks.ingest.record
    import tasks.ingest.video

    cells = tmp_path / "cells"
    cells.mkdir()
    for name, picture in (("video", "ok.mp4"), ("picture", "picture.png")):  # a parquet file each
        pq.write_table(pa.table({"image": [{"bytes": (videos / picture).read_bytes()}], "text": [f"a {name} cell"]}),
                       cells / f"{name}.parquet")
    disguised = tmp_path / "disguised"
    disguised.mkdir()
    shutil.copy(videos / "ok.webm", disguised / "clip.jpg")
    (disguised / "clip.txt").write_text("a video named as a picture")
    storage = StorageConfig(root=str(tmp_path / "store"))
    dataset = DatasetConfig(sources=[{"path": str(videos)}, {"path": str(cells)}, {"path": str(disguised)}],
                            shard_size=8, video=VIDEO, **RULES)
    for module in (tasks.ingest.record, tasks.ingest.video):  # clips of another version: other ids
        monkeypatch.setattr(module, "CLIPS_VERSION", 1)
    first = ingest(storage, dataset)
    monkeypatch.undo()
    again = ingest(storage, dataset)
    # the pictures, and what was quarantined before a video was read (no caption, or no video)
    unread = [path for path in videos.iterdir() if path.name in PICTURES] + [cells / "picture.parquet"] + [
        videos / "uncaptioned.mp4", videos / "lonely.txt"]
    assert again["work"]["units_reused"] == len(unread)
    assert again["work"]["units_read"] == first["work"]["units_read"] - len(unread)
    fresh = ingest(StorageConfig(root=str(tmp_path / "fresh")), dataset)

    def clips(store: Store, record: dict) -> set[str]:
        return {row["sample_id"] for rows in _samples(store, record).values() for row in rows}

    # the clips of this version, wherever their video was
    assert clips(Store(storage), again) == clips(Store(StorageConfig(root=str(tmp_path / "fresh"))), fresh)
    latest = ingest(storage, dataset)
    assert latest["work"]["units_read"] == 0


def test_wan_encodes_and_trains_on_clips_and_a_picture_family_quarantines_them(videos, tmp_path, tiny_models,
                                                                                tiny_family):
    from tasks.runner import run_direct

    wan = tiny_family("wan")
    source = tmp_path / "source"
    source.mkdir()
    for name in ("ok.mp4", "ok.txt", "portrait.mov", "portrait.txt", "picture.png", "picture.txt"):
        shutil.copy(videos / name, source)

    def config(model, root, resolution=64):
        return PipelineConfig.model_validate({
            "storage": {"root": str(tmp_path / root)},
            "dataset": {"sources": [{"path": str(source)}], "video": VIDEO, **RULES},
            "model": {"path": str(model)}, "text_encoding": {"dtype": "fp32"},
            "latent_encoding": {"resolution": resolution, "storage_dtype": "fp32", "batch_size": 2},
            "training": {"rank": 4, "alpha": 4, "steps": 3, "batch_size": 1, "validation_samples": 0,
                         "sample_prompts": ["a grey clip"], "sample_steps": 1, "guidance_scale": 1.0},
            "execution": {"retries": 0}})

    done = run_direct(config(wan, "wan-store"))
    (shard,) = done["encode-latents"]["shards"]
    # 17 frames: 5 latent frames (the first alone, then 4 a frame), 64 px buckets at 1/8
    assert shard["buckets"] == {"5x6x10": 2, "5x10x6": 1, "1x8x8": 1} and shard["quarantined"] == []
    store = Store(StorageConfig(root=str(tmp_path / "wan-store")))
    latents = LatentShard(store.local_path(store.key(shard["url"])))
    assert latents.get(next(iter(latents.rows)))[0].ndim == 4  # [C, F, h, w]
    assert done["train"]["steps"] == 3 and done["train"]["final_loss"] == done["train"]["final_loss"]
    # its samples are 17-frame videos (an animated WebP of them side by side) beside their first frames
    (video,) = done["train"]["sample_videos"]
    assert frame_count(store.read_bytes(store.key(video))) == 17
    grid = Image.open(io.BytesIO(store.read_bytes(store.key(done["train"]["samples"][-1]))))
    assert grid.size == (64, 64) and next(clip_frames(store.read_bytes(store.key(video)))).size == (64, 64)
    out = tmp_path / "sample.webp"
    assert main(["sample", done["train"]["run"], "--prompt", "a grey clip", "--prompt", "a clip", "--steps", "1",
                 "--out", str(out), "--device", "cpu"]) == 0
    assert frame_count(out.read_bytes()) == 17 and Image.open(out).size == (128, 64)
    assert main(["sample", done["train"]["run"], "--prompt", "a clip", "--steps", "1", "--frames", "5",
                 "--out", str(tmp_path / "five.webp"), "--device", "cpu"]) == 0
    assert frame_count((tmp_path / "five.webp").read_bytes()) == 5
    from tasks.runs.page import RunPage

    page = RunPage.at(done["train"]["run"])
    assert {row["bucket"] for row in page.metrics} <= set(shard["buckets"]), page.metrics  # frames x h x w
    assert f"sample videos: {video}" in page.text() and f"`runs/{video.split('/runs/', 1)[1]}`" in page.markdown()

    pictures = run_direct(config(tiny_models, "pixart-store", 256), until="encode-latents")
    (shard,) = pictures["encode-latents"]["shards"]
    assert shard["samples"] == 1 and {q["reason"] for q in shard["quarantined"]} == {"frames"}
    assert all("trains on pictures" in q["message"] for q in shard["quarantined"]) and len(shard["quarantined"]) == 3


def test_a_videos_mask_file_weighs_every_frame_of_its_clips_and_leaves_their_pixels_whole(videos, tmp_path,
                                                                                            tiny_family):
    """`masks: files` on videos: a video's mask is a picture (any size, upright as the video is
    shown) that every frame of each of its clips takes, so its latent mask is the same in every
    latent frame; the clips are samples of their own, their frames as without the mask (the mask is
    stored once beside them), and a training step weighs their loss by it."""
    from tasks.runner import run_direct

    wan = tiny_family("wan")
    source, masks = tmp_path / "source", tmp_path / "masks"
    source.mkdir()
    masks.mkdir()
    for name in ("ok.mp4", "ok.txt", "portrait.mov", "portrait.txt"):
        shutil.copy(videos / name, source)
    left = np.zeros((32, 32), np.uint8)
    left[:, :16] = 255
    Image.fromarray(left).save(masks / "ok.png")
    top = np.zeros((96, 64), np.uint8)  # the portrait video as it is shown: 64 wide, 96 high
    top[:48] = 255
    Image.fromarray(top).save(masks / "portrait.png")

    def config(root, **settings):
        return PipelineConfig.model_validate({
            "storage": {"root": str(tmp_path / root)},
            "dataset": {"sources": [{"path": str(source), **settings}], "video": VIDEO, **RULES},
            "model": {"path": str(wan)}, "text_encoding": {"dtype": "fp32"},
            "latent_encoding": {"resolution": 64, "storage_dtype": "fp32", "batch_size": 2},
            "training": {"rank": 4, "alpha": 4, "steps": 2, "batch_size": 1, "validation_samples": 0,
                         "sample_prompts": []},
            "execution": {"retries": 0}})

    masked_config = config("masked", masks="files", mask_path=str(masks))
    done = run_direct(masked_config)
    plain = run_direct(config("plain"), until="encode-latents")
    assert done["ingest"]["quarantined"] == 0 and done["train"]["final_loss"] == done["train"]["final_loss"]
    shards = {}
    for name, record in (("masked", done), ("plain", plain)):
        store = Store(StorageConfig(root=str(tmp_path / name)))
        (shard,) = record["encode-latents"]["shards"]
        shards[name] = LatentShard(store.local_path(store.key(shard["url"])))
    assert not set(shards["masked"].rows) & set(shards["plain"].rows)  # samples of their own
    assert len(shards["masked"].rows) == len(shards["plain"].rows) == 3  # the portrait's clip and ok.mp4's two
    for sample_id in shards["masked"].rows:
        latents, mask = shards["masked"].get(sample_id)[0], shards["masked"].mask(sample_id).float()
        # its unmasked twin: the same frames, so the same latents (within float rounding: the VAE's
        # batches are cut in sample id order)
        nearest = min((latents - shards["plain"].get(twin)[0]).abs().max().item() for twin in shards["plain"].rows
                      if shards["plain"].get(twin)[0].shape == latents.shape)
        assert nearest < 1e-4, nearest
        assert mask.shape[1:] == latents.shape[1:] and torch.equal(mask, mask[:, :1].expand_as(mask))
        frames, height, width = mask.shape[1:]
        if height > width:  # the portrait: learned on its top half
            assert mask[..., : height // 2 - 1, :].min() > 0.95 and mask[..., height // 2 + 1:, :].max() < 0.05
        else:
            assert mask[..., : width // 2 - 1].min() > 0.95 and mask[..., width // 2 + 1:].max() < 0.05
    # what training reads: each clip's mask beside its latents, [B, 1, F, h, w]
    from tasks.families import family_of
    from tasks.train.data import CachedFeatures

    store = Store(masked_config.storage)
    features = CachedFeatures(store, store.read_json(store.key(done["manifest"]["url"])), family_of(masked_config.model))
    sample_id = next(iter(shards["masked"].rows))
    latents, _, weights = features.batch([sample_id], torch.Generator().manual_seed(0), 0.0)
    assert weights.shape == (1, 1, *latents.shape[2:]) and 0 < weights.mean() < 1


def test_wan_2_2_ti2v_trains_image_to_video_and_samples_clips_from_the_first_frames_given(videos, tmp_path, capfd,
                                                                                           tiny_family):
    """A TI2V run with half its clips trained image to video (`training.image_to_video`) samples
    from a first frame through `precast sample --first-frame`, as `WanImageToVideoPipeline`'s own
    call with the run's adapter loaded draws it, with no progress bar of the pipeline's in the
    output; one frame a prompt, else refused by name."""
    import av
    import torch
    from diffusers import WanImageToVideoPipeline

    from tasks.runner import run_direct
    from tasks.runs.folder import FinishedRun
    from tasks.runs.sampling import sample_run

    ti2v = tiny_family("wan2.2-ti2v")
    source = tmp_path / "source"
    source.mkdir()
    for name in ("ok.mp4", "ok.txt", "ok.webm"):
        shutil.copy(videos / name, source)
    first = Image.fromarray(frame_pixels(3, 64, 64))
    first.save(tmp_path / "first.png")
    config = PipelineConfig.model_validate({
        "storage": {"root": str(tmp_path / "store")},
        "dataset": {"sources": [{"path": str(source)}], "video": VIDEO, **RULES},
        "model": {"path": str(ti2v)}, "text_encoding": {"dtype": "fp32", "max_length": 16},
        "latent_encoding": {"resolution": 64, "storage_dtype": "fp32", "batch_size": 2},
        "training": {"rank": 4, "alpha": 4, "steps": 3, "batch_size": 2, "validation_samples": 0,
                     "image_to_video": 0.5, "mixed_precision": "bf16", "base_precision": "bf16",
                     "sample_prompts": ["a grey clip"], "sample_steps": 1, "sample_fps": 8,
                     "sample_first_frames": [str(tmp_path / "first.png")]}})
    done = run_direct(config)
    assert FinishedRun.at(done["train"]["run"]).lineage["training"]["image_to_video"] == 0.5
    clips = sum(shard["samples"] for shard in done["encode-latents"]["shards"])
    assert clips > 0 and done["encode-latents"]["amount"] == f"{clips} clips"  # what the run's summary says
    assert done["train"]["final_loss"] == done["train"]["final_loss"]
    # the run's sample video starts from the picture: what `precast sample --first-frame` draws
    store = Store(config.storage)
    grid = Image.open(io.BytesIO(store.read_bytes(store.key(done["train"]["samples"][-1]))))
    drawn = sample_run(done["train"]["run"], ["a grey clip"], steps=1, pictures=[first], device="cpu").grid()
    plain = sample_run(done["train"]["run"], ["a grey clip"], steps=1, device="cpu").grid()  # from text alone
    assert "it/s]" not in capfd.readouterr().err  # the pipelines' progress bars, in training's samples and these
    assert np.abs(np.asarray(grid, dtype=float) - np.asarray(drawn, dtype=float)).mean() < 0.5
    assert np.abs(np.asarray(grid, dtype=float) - np.asarray(plain, dtype=float)).mean() > 5
    video = store.read_bytes(store.key(done["train"]["sample_videos"][-1]))
    assert frame_count(video) == 17 and _shown_ms(video) == 17 * 125  # sample_fps 8

    out = tmp_path / "from-first.webp"
    assert main(["sample", done["train"]["run"], "--prompt", "a grey clip", "--first-frame", str(tmp_path / "first.png"),
                 "--steps", "2", "--out", str(out), "--device", "cpu"]) == 0
    assert frame_count(out.read_bytes()) == 17 and Image.open(out).size == (64, 64)
    ours = sample_run(done["train"]["run"], ["a grey clip"], steps=2, pictures=[first], device="cpu")
    # as an H.264 mp4: at the run's sample_fps, or --fps; a name it cannot write is refused before drawing
    for fps, args in ((8, []), (24, ["--fps", "24"])):
        assert main(["sample", done["train"]["run"], "--prompt", "a grey clip", "--first-frame",
                     str(tmp_path / "first.png"), "--steps", "2", "--out", str(tmp_path / "a.mp4"), "--device", "cpu",
                     *args]) == 0
        with av.open(str(tmp_path / "a.mp4")) as container:
            stream = container.streams.video[0]
            frames = [frame.to_image() for frame in container.decode(stream)]
            assert (stream.codec_context.name, stream.average_rate, len(frames)) == ("h264", fps, 17)
        # the frames drawn, as H.264 keeps noise: its 8 x 8 blocks' colours
        errors = [np.abs(_blocks(a) - _blocks(b)).mean() for a, b in zip(frames, ours[0])]
        assert max(errors) < 3, errors  # 1.3 to 1.5 (2026-11-29)
    capfd.readouterr()
    assert main(["sample", done["train"]["run"], "--prompt", "a", "--out", str(tmp_path / "a.mkv")]) == 1
    assert "--out " + str(tmp_path / "a.mkv") + ": write an .mp4 or .webp" in capfd.readouterr().err

    lora = tmp_path / "lora.safetensors"
    assert main(["export", done["train"]["run"], "--format", "diffusers", "--out", str(lora)]) == 0
    pipeline = WanImageToVideoPipeline.from_pretrained(ti2v, image_encoder=None, image_processor=None)
    pipeline.load_lora_weights(str(lora))
    pipeline.set_progress_bar_config(disable=True)
    theirs = pipeline(image=first, prompt=["a grey clip"], negative_prompt=[""], max_sequence_length=16, height=64,
                      width=64, num_frames=17, num_inference_steps=2, guidance_scale=4.5,
                      generator=torch.Generator().manual_seed(0), output_type="pil").frames[0]
    assert len(ours[0]) == 17
    for mine, reference in zip(ours[0], theirs):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(reference))

    # a picture of another shape is centre-cropped to the run's side, not stretched
    wide = Image.fromarray(frame_pixels(5, 96, 64))
    cropped = sample_run(done["train"]["run"], ["a grey clip"], steps=1, pictures=[wide], device="cpu")
    fitted = sample_run(done["train"]["run"], ["a grey clip"], steps=1, device="cpu",
                        pictures=[wide.crop((16, 0, 80, 64))])
    assert [np.asarray(f).tolist() for f in cropped[0]] == [np.asarray(f).tolist() for f in fitted[0]]
    with pytest.raises(ValueError, match=r"--first-frame: 1 pictures for 2 prompts; give one a prompt"):
        sample_run(done["train"]["run"], ["a", "b"], pictures=[first], device="cpu")
    with pytest.raises(ValueError, match=r"first_frames: 1 pictures for 2 prompts; give one a prompt"):
        config.updated({"training.samples.prompts": ["a", "b"]})
    assert main(["sample", done["train"]["run"], "--prompt", "a", "--first-frame", str(tmp_path / "none.png"),
                 "--out", str(out), "--device", "cpu"]) == 1


def _blocks(image: Image.Image) -> np.ndarray:
    """The mean colour of each 8 x 8 block of a picture."""
    pixels = np.asarray(image, dtype=float)
    return pixels.reshape(pixels.shape[0] // 8, 8, pixels.shape[1] // 8, 8, 3).mean(axis=(1, 3))


def _shown_ms(webp: bytes) -> int:
    """How long an animated WebP plays, in milliseconds."""
    shown = 0
    for frame in ImageSequence.Iterator(Image.open(io.BytesIO(webp))):
        frame.load()  # a frame's duration is read with its data
        shown += frame.info["duration"]
    return shown


def test_wan_refuses_a_clip_policy_that_is_not_4n_plus_1_frames_and_quarantines_such_clips(videos, tmp_path,
                                                                                            tiny_family):
    from configs.schema import VideoConfig
    from tasks.runner import Direct, Shards, run_direct

    wan = tiny_family("wan")
    source = tmp_path / "source"
    source.mkdir()
    shutil.copy(videos / "ok.mp4", source)
    shutil.copy(videos / "ok.txt", source)
    config = PipelineConfig.model_validate({
        "storage": {"root": str(tmp_path / "store")},
        "dataset": {"sources": [{"path": str(source)}], "video": {**VIDEO, "frames": 16}, **RULES},
        "model": {"path": str(wan)}, "text_encoding": {"dtype": "fp32"},
        "latent_encoding": {"resolution": 64, "storage_dtype": "fp32"}})
    # refused before anything is ingested, naming the setting; a frame bucket too
    for video in ({**VIDEO, "frames": 16}, {**VIDEO, "frame_buckets": [5, 12]}):
        refused = config.model_copy(update={"dataset": config.dataset.model_copy(update={"video": VideoConfig(**video)})})
        with pytest.raises(ValueError, match=r"dataset.video: a clip of (16|12) frames: Wan's VAE takes 4N \+ 1"):
            run_direct(refused, until="encode-latents")
        assert not (tmp_path / "store").exists()  # nothing left behind, not even the root
    # clips of such a length ingested all the same (the stage alone) are quarantined one by one
    executor = Direct(config)
    shards = Shards.of(executor.store, executor.ingest())
    (shard,) = executor.encode_latents(shards)["shards"]
    assert shard["samples"] == 0 and len(shard["quarantined"]) == 2
    assert "a clip of 16 frames: Wan's VAE takes 4N + 1 (such as 13 or 17" in shard["quarantined"][0]["message"]


def test_wan_clips_of_shards_encoded_at_once_are_the_latents_one_at_a_time_gives(tmp_path, tiny_family):
    """Shards encoded in parallel threads, as an encoding stage runs `max_parallel_shards` of them,
    share one cached VAE: every clip's latents are those of the shards encoded one after another
    (Wan's VAE keeps its causal cache on itself: two calls at once gave 5-frame clips 5 latent
    frames, or failed)."""
    from concurrent.futures import ThreadPoolExecutor

    from storage.shards import LatentShard
    from tasks.demo.videos import DEMO_VIDEO, write_demo_videos
    from tasks.encode.latents import encode_latents_shard
    from tasks.identity import vae_fingerprint

    wan = tiny_family("wan")
    source = write_demo_videos(tmp_path / "clips", count=45, hostile=False)

    def encoded(name: str, threads: int) -> dict[str, tuple]:
        config = PipelineConfig.model_validate({
            "storage": {"root": str(tmp_path / name)}, "model": {"path": str(wan)},
            "dataset": {"sources": [{"path": str(source)}], "shard_size": 8, "video": DEMO_VIDEO},
            "latent_encoding": {"resolution": 64, "storage_dtype": "fp32", "batch_size": 3}})
        store, latents = Store(config.storage), config.latent_encoding
        fingerprint = vae_fingerprint(config.model, latents)
        shards = [shard["id"] for shard in ingest(config.storage, config.dataset)["shards"]]
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda shard: encode_latents_shard(config.storage, config.model, latents, fingerprint,
                                                             store.url(layout.image_shard(shard))), shards))
        found = {}
        for shard in shards:
            cache = LatentShard(store.local_path(layout.cache_shard("latents", fingerprint, shard)))
            found.update({sample_id: (cache.rows[sample_id][0], cache.get(sample_id)[0]) for sample_id in cache.rows})
        return found

    alone, together = encoded("alone", 1), encoded("together", 3)
    assert len(alone) == 45 and {bucket for bucket, _ in alone.values()} == {"2x8x8"}
    assert alone.keys() == together.keys()
    for sample_id, (bucket, mean) in together.items():
        assert bucket == alone[sample_id][0] and torch.equal(mean, alone[sample_id][1]), sample_id


def test_videos_from_s3_give_the_clips_a_local_folder_gives(videos, tmp_path, s3_endpoint):
    """The same folder of videos on an S3 API (moto): the same clips, bytes and quarantine."""
    import s3fs

    s3 = s3fs.S3FileSystem(endpoint_url=s3_endpoint)
    s3.mkdir("precast-videos")
    s3.put(str(videos), "precast-videos/clips", recursive=True)
    local, local_store = _ingest(tmp_path / "local", videos)
    storage = StorageConfig(root=str(tmp_path / "remote"), options={"endpoint_url": s3_endpoint})
    dataset = DatasetConfig(sources=[{"path": "s3://precast-videos/clips"}], shard_size=8, video=VIDEO, **RULES)
    remote = ingest(storage, dataset)
    assert remote["id"] == local["id"] and remote["quarantined"] == local["quarantined"] == len(QUARANTINED)
    assert sum(len(rows) for rows in _samples(Store(storage), remote).values()) == sum(CLIPS.values()) + len(PICTURES)


def test_videos_in_metadata_parquet_and_tars_give_the_clips_a_folder_gives(videos, tmp_path):
    """The good videos as a jsonl's and a csv's files, parquet cells (HF datasets' struct) and tar
    members: the same clip ids and captions as from the folder; a row naming a video that is not
    there, a cut video's cell and a tar's caption member alone are quarantined, naming why."""
    import csv
    import json
    import tarfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    names = ["ok.mp4", "ok.webm", "ok.mkv", "portrait.mov"]
    captions = {name: f"a grey {name.split('.')[0]} clip" for name in names + ["gone.mp4"]}
    record, store = _ingest(tmp_path / "folder", _only(videos, names, tmp_path / "only"))
    expected = {(row["sample_id"], tuple(row["captions"])) for rows in _samples(store, record).values() for row in rows}
    assert len(expected) == 7
    layouts = {fmt: tmp_path / fmt for fmt in ("jsonl", "csv", "parquet", "webdataset")}
    for root in layouts.values():
        root.mkdir()
    for name in names:
        shutil.copy(videos / name, layouts["jsonl"] / name)
        shutil.copy(videos / name, layouts["csv"] / name)
    rows = [{"file_name": name, "text": captions[name]} for name in names + ["gone.mp4"]]
    (layouts["jsonl"] / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with open(layouts["csv"] / "metadata.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, ["file_name", "text"])
        writer.writeheader()
        writer.writerows(rows)
    cut = (videos / "truncated.mp4").read_bytes()
    cells = [{"bytes": (videos / name).read_bytes(), "path": name} for name in names] + [{"bytes": cut, "path": "cut.mp4"}]
    pq.write_table(pa.table({"image": cells, "text": [captions[name] for name in names] + ["cut"]}),
                   layouts["parquet"] / "part-0.parquet")
    with tarfile.open(layouts["webdataset"] / "shard-0.tar", "w") as archive:
        for name in names:
            archive.add(videos / name, f"{name.replace('.', '-', 1)}.{name.split('.')[1]}")
            archive.add(videos / name.replace(name.split(".")[1], "txt"), f"{name.replace('.', '-', 1)}.txt")
        archive.add(videos / "lonely.txt", "lonely.txt")
    why = {"jsonl": "missing_video", "csv": "missing_video", "parquet": "bad_video", "webdataset": "orphan_caption"}
    for fmt, root in layouts.items():
        record, store = _ingest(tmp_path / f"store-{fmt}", root)
        found = {(row["sample_id"], tuple(row["captions"])) for rows in _samples(store, record).values() for row in rows}
        assert found == expected, fmt
        report = store.read_json(store.key(record["report"]))
        assert report["by_reason"] == {why[fmt]: 1}, (fmt, report["quarantine"])


def test_no_copy_of_a_video_is_left_on_local_disk_when_its_tar_breaks_off_or_its_read_fails(videos, tmp_path,
                                                                                          monkeypatch):
    """A tar cut inside an over-limit video, a tar of two videos of one key, and a read that fails
    (the object store resets) inside a group: quarantined or failed as before, and no local copy of
    any video is left behind."""
    import tarfile
    import tempfile

    import fsspec

    from tasks.ingest.examine import examine_unit, video_decodes
    from configs.schema import SourceConfig

    local = tmp_path / "local"
    local.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(local))
    root = tmp_path / "tars"
    root.mkdir()
    with tarfile.open(root / "whole.tar", "w") as archive:
        for name, member in (("ok.txt", "a.txt"), ("ok.mp4", "a.mp4"), ("ok.webm", "a.webm"), ("ok.mp4", "b.mp4")):
            archive.add(videos / name, member)
    with tarfile.open(root / "whole.tar") as archive:
        last = archive.getmember("b.mp4")
    (root / "cut.tar").write_bytes((root / "whole.tar").read_bytes()[: last.offset_data + last.size // 2])
    dataset = DatasetConfig(sources=[{"path": str(root)}], video={**VIDEO, "max_bytes": 1000}, **RULES)
    fs = fsspec.filesystem("file")

    def examined(name: str) -> list[str]:
        return [o.reason for o in examine_unit(fs, "webdataset", SourceConfig(path=str(root)), ["tar", str(root / name)],
                                               dataset, lambda _: None, lambda *_: None, video_decodes())]

    assert examined("cut.tar") == ["too_large", "bad_archive"] and not list(local.iterdir())
    assert examined("whole.tar") == ["too_large", "missing_caption"] and not list(local.iterdir())

    class Resets(type(fs)):
        def open(self, path, *args, **kwargs):  # the connection resets after the first video's bytes
            handle = super().open(path, *args, **kwargs)
            read, given = handle.read, [0]

            def failing(size=-1):
                given[0] += 1
                if given[0] > 2:
                    raise ConnectionResetError("reset by peer")
                return read(size)
            handle.read = failing
            return handle

    with pytest.raises(ConnectionResetError):
        examine_unit(Resets(), "webdataset", SourceConfig(path=str(root)), ["tar", str(root / "whole.tar")], dataset,
                     lambda _: None, lambda *_: None, video_decodes())
    assert not list(local.iterdir())


def _only(folder, names, into):
    """A folder holding only `names` of `folder` and their captions."""
    into.mkdir()
    for name in names:
        for path in (folder / name, (folder / name).with_suffix(".txt")):
            shutil.copy(path, into / path.name)
    return into


def test_the_demo_videos_are_the_same_bytes_each_time_they_are_written(tmp_path):
    """The demo's world is one world, the one its table measured (benchmarks/results/demo-worlds.md): its clips' ids
    come from their bytes, so the videos the same seed writes are the same files (x264's AVX-512
    code wrote about 1 clip in 40 to other bytes)."""
    from tasks.demo.videos import write_demo_videos

    first, second = (write_demo_videos(tmp_path / name, count=100, hostile=False) for name in ("a", "b"))
    names = sorted(path.name for path in first.iterdir())
    assert len(names) == 200 and names == sorted(path.name for path in second.iterdir())
    assert [name for name in names if (first / name).read_bytes() != (second / name).read_bytes()] == []
