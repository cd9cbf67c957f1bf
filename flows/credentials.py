"""Storage credentials from Prefect Secret blocks: `storage.credentials_block` names one whose JSON
value holds fsspec options (for s3: {"key": …, "secret": …}). Registered with the store when flows/
is imported (flows/__init__.py), so storage/ never imports Prefect; a process given the config
pickled gets the resolved options with it (storage.store.fsspec_options)."""

from __future__ import annotations

import functools
from typing import Any


@functools.lru_cache(maxsize=8)
def secret_block_credentials(name: str) -> dict[str, Any]:
    # Prefect loads only when a block is named: `precast` sets its settings first (flows/cli.py)
    from prefect.blocks.system import Secret

    try:
        return Secret.load(name).get()  # storage.store checks that it is a JSON object
    except ValueError as error:
        raise ValueError(f"storage.credentials_block {name!r}: no such Prefect Secret block") from error
