"""Video into clips, and the encoders' work per clip, at real shapes: what caching 100,000 clips
on one 8-GPU node costs.

Measured here (CPU): a 1280×720 H.264 video at 30 fps (`write_source`) is probed and cut into Wan's default clip
(81 frames at 16 fps) and into sliding clips, by `tasks.ingest.video.read_video` as ingest runs it:
seconds per clip, frames decoded per second, bytes stored per clip (animated WebP at 1280×720
at most). A 3840×2160 video is decoded in a fresh process, whose peak resident memory shows what
is held: its clip's frames at the stored size and FFmpeg's few decoding frames, not the video.
A parquet of 8 such videos in one row group is read as ingest reads it, in a fresh process too:
Arrow holds the row group's column, the rows are taken one video at a time.

Counted on the meta device (no weights, no GPU): the floating-point operations of Wan 2.1's VAE
encoder on an 81-frame clip at 480×832 and 720×1280 and of umT5-XXL on a 40-token caption
(`torch.utils.flop_counter`); docs/benchmarks.md turns them into GPU seconds.
Usage: python -m benchmarks.video [--quick]
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from configs.schema import DatasetConfig

CLIP = (81, 480, 832)


def write_source(path: Path, seconds: float, size: tuple[int, int], fps: int = 30) -> Path:
    """A camera-like video, H.264: a drifting gradient with a moving disc, under sensor noise (σ 6
    grey levels), which no codec can make small."""
    import av

    width, height = size
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:height, 0:width]
    with av.open(str(path), "w") as output:
        stream = output.add_stream("libx264", rate=fps, options={"preset": "ultrafast", "crf": "23"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for index in range(round(seconds * fps)):
            disc = (x - (index * 8) % width) ** 2 + (y - height / 2) ** 2 < (height / 6) ** 2
            scene = np.stack([(x * 200 / width + index) % 256, y * 200 / height, np.where(disc, 230, 60)], -1)
            scene += rng.normal(0, 6, scene.shape)
            pixels = np.clip(scene, 0, 255).astype(np.uint8)
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            for packet in stream.encode(frame):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
    return path


def clips_of(data: bytes, **video) -> dict:
    from tasks.ingest.video import read_video

    dataset = DatasetConfig(sources=[{"path": "x"}], video=video, max_pixels=4096 * 4096)
    kept: dict[str, int] = {}
    started = time.perf_counter()
    clips = read_video(data, dataset, lambda _: None, lambda sample_id, clip: kept.update({sample_id: len(clip)}))
    seconds = time.perf_counter() - started
    return {"clips": len(clips), "seconds": round(seconds, 2), "bytes_per_clip": round(np.mean(list(kept.values())))}


def peak_decoding(path: str, queue) -> None:
    """In a fresh process: one clip of a 4K video read, and how far the peak memory rose."""
    import av  # noqa: F401  (the libraries load before the baseline: they are not what is measured)

    from benchmarks.ingest_memory import vm
    from tasks.ingest import video  # noqa: F401

    data = Path(path).read_bytes()
    Path("/proc/self/clear_refs").write_text("5")
    start = vm("VmRSS")
    result = clips_of(data)
    queue.put({**result, "peak_rise_mib": round((vm("VmHWM") - start) / 1024, 1)})


def peak_parquet(path: str, queue) -> None:
    """In a fresh process: every row of a parquet of videos read as ingest reads it, and how far
    the peak memory rose (Arrow holds the row group's column; the rows are taken a video at a time)."""
    import fsspec

    from benchmarks.ingest_memory import vm
    from configs.schema import SourceConfig
    from tasks.ingest.formats.parquet import read_parquet

    Path("/proc/self/clear_refs").write_text("5")
    start = vm("VmRSS")
    rows = sum(1 for _ in read_parquet(fsspec.filesystem("file"), "parquet", SourceConfig(path=path), [path],
                                       lambda name: -1))
    queue.put({"rows": rows, "peak_rise_mib": round((vm("VmHWM") - start) / 1024, 1)})


def flops() -> dict:
    """Forward FLOPs of Wan 2.1's VAE encoder on a clip and of umT5-XXL on a caption, on meta."""
    import torch
    import transformers
    from diffusers import AutoencoderKLWan
    from torch.utils.flop_counter import FlopCounterMode

    from benchmarks.family_costs import UMT5_XXL, WAN_VAE

    out = {}
    with torch.device("meta"):
        vae = AutoencoderKLWan(**WAN_VAE).to(torch.bfloat16)
        for name, (frames, height, width) in {"480x832": CLIP, "720x1280": (81, 720, 1280)}.items():
            with FlopCounterMode(display=False) as counter:
                vae.encode(torch.empty(1, 3, frames, height, width, dtype=torch.bfloat16))
            out[f"vae_encode_{name}"] = counter.get_total_flops()
        umt5 = transformers.UMT5EncoderModel(transformers.UMT5Config(**UMT5_XXL)).to(torch.bfloat16)
        with FlopCounterMode(display=False) as counter:
            umt5(input_ids=torch.zeros(1, 40, dtype=torch.long))  # 40 real tokens: no padding to mask
        out["umt5_40_tokens"] = counter.get_total_flops()
    return out


def run(seconds: float = 12.0, four_k_seconds: float = 6.0) -> dict:
    from benchmarks.ingest_memory import in_fresh_process

    result: dict = {}
    with tempfile.TemporaryDirectory(prefix="precast-video-") as tmp:
        source = write_source(Path(tmp) / "720p.mp4", seconds, (1280, 720))
        data = source.read_bytes()
        result["source_720p"] = {"seconds": seconds, "bytes": len(data), "frames": round(seconds * 30)}
        result["head"] = clips_of(data)
        result["sliding"] = clips_of(data, clips="sliding", max_clips=100, stride=40)
        four_k = write_source(Path(tmp) / "2160p.mp4", four_k_seconds, (3840, 2160))
        result["head_2160p"] = {**in_fresh_process(peak_decoding, str(four_k)), "bytes": four_k.stat().st_size,
                                "seconds_of_video": four_k_seconds}
        # HF-datasets-like: a struct cell per video, pyarrow's defaults, the 8 rows one row group
        cells = [{"bytes": four_k.read_bytes(), "path": f"{row}.mp4"} for row in range(8)]
        table = pa.table({"image": cells, "text": ["a clip"] * 8})
        pq.write_table(table, Path(tmp) / "videos.parquet")
        result["parquet"] = {**in_fresh_process(peak_parquet, str(Path(tmp) / "videos.parquet")),
                             "row_group_bytes": 8 * four_k.stat().st_size}
        del cells, table
    result["flops"] = flops()
    return result


def rows(result: dict) -> list[tuple[str, str, str, str]]:
    head, sliding, four_k, counted = result["head"], result["sliding"], result["head_2160p"], result["flops"]
    frames = result["source_720p"]["frames"]
    return [
        ("video: a 720p clip (81 frames at 16 fps of a 30 fps H.264 video)", f"{head['seconds']:.2f} s",
         f"{head['bytes_per_clip']:,} B stored (animated WebP)", ""),
        ("video: sliding clips of the whole 720p video", f"{sliding['seconds'] / sliding['clips']:.2f} s a clip",
         f"{sliding['clips']} clips; {frames / sliding['seconds']:.0f} source frames decoded a second", ""),
        ("video: one clip of a 4K video, peak memory", f"{four_k['peak_rise_mib']:,} MiB",
         f"{four_k['seconds']:.1f} s; the 81 frames at 1280×720 are {81 * 1280 * 720 * 3 / 2**20:.0f} MiB of RGB",
         "bounded: never the video"),
        ("video: reading a parquet of 8 such videos (one row group)", f"{result['parquet']['peak_rise_mib']:,} MiB",
         f"the row group is {result['parquet']['row_group_bytes'] / 2**20:,.0f} MiB", "about twice the row group"),
        ("video: Wan VAE encoder FLOPs per clip", f"{counted['vae_encode_480x832'] / 1e12:.1f} TFLOP (480p)",
         f"{counted['vae_encode_720x1280'] / 1e12:.1f} TFLOP (720p); umT5-XXL "
         f"{counted['umt5_40_tokens'] / 1e12:.2f} TFLOP a 40-token caption", ""),
    ]


def main() -> None:
    print(json.dumps(run()))


if __name__ == "__main__":
    main()
