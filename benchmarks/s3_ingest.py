"""Ingest from an object store: concurrent reads against one sequential reader, at 0 and 20 ms a
request, and what a nightly run reads.

The source is `count` demo images with captions on a moto S3 server (its own process), reached
through `storage.slow_endpoint.SlowEndpoint`, which adds a fixed delay to every request (20 ms: what a
real object store costs) and counts requests and bytes. The sequential reader is precast's ingest
with `read_concurrency: 1`, one object after another as the ingest before concurrent reads did;
the new one uses the default (32). Each run starts on an empty store, so both read everything.
Then the nightly cases on the concurrent store: unchanged, and one new image.
Usage: python -m benchmarks.s3_ingest [--count 400]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

from configs.schema import DatasetConfig, SourceConfig, StorageConfig
from storage.slow_endpoint import SlowEndpoint
from tasks.demo.data import write_demo_data
from tasks.ingest.stage import ingest

DELAYS = (0.0, 0.020)


def moto(port: int) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server
        except OSError:
            time.sleep(0.2)
    server.kill()
    raise RuntimeError("moto server did not start")


def run(count: int = 400) -> dict:
    import s3fs

    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = moto(port)
    result: dict = {"images": count}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            data = write_demo_data(Path(tmp) / "data", count=count)
            s3 = s3fs.S3FileSystem(endpoint_url=f"http://127.0.0.1:{port}")
            s3.mkdir("bench-source")
            s3.put(str(data), "bench-source/data", recursive=True)
            result["source_bytes"] = sum(p.stat().st_size for p in data.iterdir())
            for delay in DELAYS:
                with SlowEndpoint(f"http://127.0.0.1:{port}", delay) as proxy:
                    for name, concurrency in (("sequential", 1), ("concurrent", 32)):
                        storage = StorageConfig(root=str(Path(tmp) / f"store-{name}-{delay}"),
                                                options={"endpoint_url": proxy.url})
                        dataset = DatasetConfig(sources=[SourceConfig(path="s3://bench-source/data")],
                                                read_concurrency=concurrency)
                        proxy.reset()
                        began = time.perf_counter()
                        done = ingest(storage, dataset)
                        seconds = time.perf_counter() - began
                        assert done["samples"] == count, done["samples"]
                        tag = f"{name}_{round(delay * 1000)}ms"
                        result[f"{tag}_images_per_s"] = round(count / seconds, 1)
                        result[f"{tag}_requests_per_image"] = round(len(proxy.requests) / count, 2)
                    if delay:  # the nightly cases, on the concurrent store
                        proxy.reset()
                        unchanged = ingest(storage, dataset)["work"]
                        result["nightly_unchanged_bytes_read"] = unchanged["bytes_read"]
                        result["nightly_unchanged_object_gets"] = len(proxy.gets("/bench-source/"))
                        Image.new("RGB", (120, 100), (10, 200, 10)).save(data / "zz-new.png")
                        (data / "zz-new.txt").write_text("a green square")
                        for name in ("zz-new.png", "zz-new.txt"):
                            s3.put_file(str(data / name), f"bench-source/data/{name}")
                        proxy.reset()
                        added = ingest(storage, dataset)["work"]
                        result["nightly_one_new_bytes_read"] = added["bytes_read"]
                        result["nightly_one_new_image_bytes"] = sum((data / n).stat().st_size
                                                                    for n in ("zz-new.png", "zz-new.txt"))
                        result["nightly_one_new_object_gets"] = len(proxy.gets("/bench-source/"))
    finally:
        server.kill()
        server.wait()
    for name in ("sequential", "concurrent"):
        result[f"{name}_20ms_vs_0ms"] = round(result[f"{name}_20ms_images_per_s"] / result[f"{name}_0ms_images_per_s"], 3)
    result["concurrent_vs_sequential_at_20ms"] = round(
        result["concurrent_20ms_images_per_s"] / result["sequential_20ms_images_per_s"], 2)
    return result


def rows(result: dict) -> list[tuple[str, str, str, str]]:
    return [
        ("S3 ingest at 20 ms a request", f"{result['concurrent_20ms_images_per_s']:,.0f} img/s",
         f"sequential reader {result['sequential_20ms_images_per_s']:,.0f} img/s "
         f"(x{result['concurrent_vs_sequential_at_20ms']}; {result['images']} images)", ">= 2x"),
        ("S3 ingest, 20 ms vs 0 ms", f"{result['concurrent_20ms_vs_0ms']:.0%} of its 0 ms rate "
         f"({result['concurrent_0ms_images_per_s']:,.0f} img/s)",
         f"sequential: {result['sequential_20ms_vs_0ms']:.0%}", ">= 90%"),
        ("S3 ingest, requests per image", f"{result['concurrent_20ms_requests_per_image']}",
         f"sequential {result['sequential_20ms_requests_per_image']}", ""),
        ("nightly ingest, bytes read", f"unchanged {result['nightly_unchanged_bytes_read']:,} B; one new image "
         f"{result['nightly_one_new_bytes_read']:,} B", f"the new image and caption: "
         f"{result['nightly_one_new_image_bytes']:,} B; the source: {result['source_bytes']:,} B", "∝ new bytes"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=400)
    print(json.dumps(run(**vars(parser.parse_args()))))


if __name__ == "__main__":
    main()
