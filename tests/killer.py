"""Run the `precast` CLI and SIGKILL it at a named point: `python -m tests.killer POINT -- ARGS...`.

A point fires at the n-th matching event once it is armed (by a file matching `after` being
renamed into place; always armed without one). A point may `hold` the renames of paths matching
a pattern for up to a minute first, so another stage's event comes while that write waits
(ingest's dataset record held back: the latent encoder is killed while ingest has not finished).
Events are the renames that finish every local write (`os.replace`, killed *before* the rename,
so the partial file stays behind, as with a crash mid-write) or calls of a model or optimizer
method (killed mid-shard or mid-step). SIGKILL runs no handler, no `finally` and no flush: exactly
a lost node or an OOM kill.
"""

from __future__ import annotations

import importlib
import os
import re
import signal
import sys
import time
from dataclasses import dataclass


HOLD_SECONDS = 60  # the kill ends the wait: it lasts whole only when the other stage never came


@dataclass(frozen=True)
class Point:
    replace: str | None = None  # kill at the rename of a path matching this
    call: str | None = None  # or at a call of this "module:Class.method"
    after: str | None = None
    nth: int = 1
    hold: str | None = None  # renames of paths matching this wait HOLD_SECONDS first


POINTS = {
    "ingest, second image shard mid-write": Point(replace=r"/shards/images/[^/]+\.parquet$", nth=2),
    "text encoder, mid-shard": Point(call="transformers:T5EncoderModel.forward",
                                     after=r"/cache/text/[^/]+/[^/]+\.safetensors\.done$"),
    "latent encoder, mid-shard": Point(call="diffusers:AutoencoderKL.encode",
                                       after=r"/cache/latents/[^/]+/[^/]+\.safetensors\.done$"),
    "latent encoder, second shard, ingest not finished": Point(
        call="diffusers:AutoencoderKL.encode", after=r"/cache/latents/[^/]+/[^/]+\.safetensors\.done$",
        hold=r"/datasets/[^/]+\.json$"),
    "manifest mid-write": Point(replace=r"/manifests/[^/]+\.json$"),
    "training, between checkpoints": Point(call="torch.optim:AdamW.step",
                                           after=r"/checkpoints/step-00000002\.safetensors\.done$"),
    "training, checkpoint mid-write": Point(replace=r"/checkpoints/step-00000004\.safetensors$"),
    "training, checkpoint before its record": Point(replace=r"/checkpoints/step-00000004\.safetensors\.done$"),
}


def arm(point: Point) -> None:
    state = {"armed": point.after is None, "seen": 0}

    def event() -> None:
        if state["armed"]:
            state["seen"] += 1
            if state["seen"] == point.nth:
                os.kill(os.getpid(), signal.SIGKILL)

    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        if point.hold and re.search(point.hold, str(dst)):
            time.sleep(HOLD_SECONDS)
        if point.replace and re.search(point.replace, str(dst)):
            event()
        real_replace(src, dst, *args, **kwargs)
        if point.after and re.search(point.after, str(dst)):
            state["armed"] = True

    os.replace = replace
    if point.call:
        module, _, qualified = point.call.partition(":")
        owner_name, method_name = qualified.split(".")
        owner = getattr(importlib.import_module(module), owner_name)
        real_method = getattr(owner, method_name)

        def method(*args, **kwargs):
            event()
            return real_method(*args, **kwargs)

        setattr(owner, method_name, method)


if __name__ == "__main__":
    name, separator, *cli_args = sys.argv[1:]
    arm(POINTS[name])
    from flows.cli import main

    sys.exit(main(cli_args))
