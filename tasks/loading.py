"""What every model load shares: the dtypes by config name, the device a name means, and the
lock every `from_pretrained` holds (which also names a full hub cache)."""

from __future__ import annotations

import functools
import importlib
import threading
from typing import Any

import torch

from storage.fingerprint import HUB_CACHE_SETTINGS
from storage.store import space_for
from tasks.log_filter import quiet_diffusers

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# from_pretrained patches torch.nn.Module globally while it builds empty weights; two threads
# loading at once can leave the patch in place ("Cannot copy out of meta tensor"), so every load
# (cached or not) holds this lock, and so does every lookup in a library (`library`); re-entrant,
# because a cached loader locks around its builder.
LOAD_LOCK = threading.RLock()


def library(module: str, name: str) -> Any:
    """`name` of `module` (diffusers and transformers import their classes on first use), looked
    up under LOAD_LOCK: the two encoders start at once in threads, and two threads importing a
    library's modules in another order can each be handed the other's half-imported module
    (importlib breaks the cycle of their import locks), failing with "module 'diffusers' has no
    attribute 'AutoencoderKL'"."""
    with LOAD_LOCK:
        imported = importlib.import_module(module)
        if module == "diffusers":
            quiet_diffusers(imported)
        return getattr(imported, name)


def serialised(load):
    """`load` under LOAD_LOCK; a full disk while it downloads a hub model's files is named as such."""
    @functools.wraps(load)
    def locked(*args, **kwargs):
        from huggingface_hub import constants

        with LOAD_LOCK, space_for(constants.HF_HUB_CACHE, "room for the model's files (HF_HOME / HF_HUB_CACHE "
                                                          "move the hub cache)", moved_by=HUB_CACHE_SETTINGS):
            return load(*args, **kwargs)

    return locked


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
